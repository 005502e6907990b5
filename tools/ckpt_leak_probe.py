"""Which part of the matrix's break check leaves CUDA memory allocated (tiny model, one process).

Why: results/ckpt_mem_snapshot_h200.json found that the break check (Dynamo's explain and a
fullgraph check, backend "eager", forward only) leaves 0.133 GiB allocated on the 1B shape with
checkpointing, memory gc.collect() does not free. This runs each piece on its own, with and
without the recompute-everything policy (selective activation checkpointing, SAC; else the
model's own checkpoint function, as loaded), and prints
what memory_allocated() gained, after gc.collect(), for each.

Usage (GPU machine): python3 tools/ckpt_leak_probe.py [--model tiny] [--out leak.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import shlex
import sys

import torch

from qlora_nb_utils import diagnostics
from qlora_nb_utils.bench import matrix
from qlora_nb_utils.compile import prepare_for_compile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--config", default="lora")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    model, tok, wrap, _ = matrix.load_cell_model(a.model, a.config, torch.bfloat16, dev, grad_ckpt=True)
    batch = {k: v.to(dev) for k, v in matrix._batches(tok, "fixed", 4, 256, 1, 0)[0].items()}
    loss_fn = wrap(lambda **b: model(**b).loss)
    pieces = {
        "eager_forward": lambda: loss_fn(**batch),
        "compiled_eager_backend_forward": lambda: torch.compile(loss_fn, backend="eager")(**batch),
        "explain": lambda: diagnostics.graph_breaks(loss_fn, **batch),
        "fullgraph_check": lambda: diagnostics.check_fullgraph(loss_fn, **batch),
    }
    rows = []
    for policy in ("sac_must_recompute", "model_default"):
        for name, piece in pieces.items():
            prepared = prepare_for_compile(model, scope="whole", backend="eager", fullgraph=False,
                                           grad_ckpt=True if policy == "sac_must_recompute" else None)
            gc.collect()
            before = torch.cuda.memory_allocated()
            try:
                piece()
            finally:
                prepared.undo()
                torch.compiler.reset()
            gc.collect()
            left = (torch.cuda.memory_allocated() - before) / 2**20
            rows.append({"policy": policy, "piece": name, "left_allocated_mib": left})
            print(f"{policy:20s} {name:32s} left {left:9.3f} MiB allocated", flush=True)
    if a.out:
        from qlora_nb_utils import env

        with open(a.out, "w") as f:  # the fields every results file carries (tests/test_readme.py)
            json.dump({"device": env.device_info(dev), "versions": env.versions(), "command": shlex.join(sys.argv),
                       "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                       "model": a.model, "config": a.config, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
