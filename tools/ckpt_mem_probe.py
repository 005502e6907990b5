"""Peak memory of regional compile + gradient checkpointing against eager, per activation budget.

Why: in the compile matrix (results/compile_matrix_h200.json) the whole-model compile with
checkpointing peaks below eager with checkpointing, but the regional compile peaks 0.13 GiB
above it (LoRA and QLoRA alike). There the checkpoint stays eager around each compiled layer,
so the recompute in the backward runs the compiled layer, whose partitioner chooses what the
layer's backward keeps. `torch._functorch.config.activation_memory_budget` below 1 makes
that partitioner recompute more. This runs the matrix's regional checkpointed cell (fixed
lengths) at each budget given, one cell after the other in one process, and writes the
peaks beside eager's.

Usage (GPU machine, environment as tools/gpu_matrix.sh):
    python3 tools/ckpt_mem_probe.py --out probe.json [--configs qlora,lora] [--budgets 1.0,0.5,0.1]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch._functorch.config as functorch_config

from qlora_nb_utils.matrix import run_matrix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--configs", default="qlora,lora")
    p.add_argument("--budgets", default="1.0,0.5,0.1")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="auto")
    a = p.parse_args()
    default = functorch_config.activation_memory_budget
    res = {"command": shlex.join(sys.argv), "default_budget": default, "parts": []}
    for budget in (float(b) for b in a.budgets.split(",")):
        functorch_config.activation_memory_budget = budget
        try:
            part = run_matrix(a.model, configs=a.configs.split(","), grad_ckpts=[True], lengths=["fixed"],
                              scopes=["regional"], steps=a.steps, batch_size=4, max_len=256, warmup=3,
                              device=a.device, eager_numerics=True, command=res["command"])
        finally:
            functorch_config.activation_memory_budget = default
        part["activation_memory_budget"] = budget
        res["parts"].append(part)
        for k in ("device", "versions", "date"):
            res.setdefault(k, part[k])
        for c in part["cells"]:
            print(f"budget {budget}: {c['config']} regional+ckpt peak {c['peak_mem_gib']:.3f} GiB "
                  f"(eager {c['eager_peak_mem_gib']:.3f}), step {c['median_step_ms']:.1f} ms "
                  f"(eager {c['eager_median_step_ms']:.1f}), max loss diff {c['max_abs_loss_diff']:.1e}", flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
