"""The bf16 noise floor of a 30-step training run: eager against eager.

Wrote: lab/results/parity/bf16_noise_h200.json, lab/results/parity/bf16_noise_base_h200.json
Rerun: python3 lab/gpu/matrix/bf16_noise.py --out OUT/noise.json (the base floor: --configs base-fp32 --base-lr 2e-5 --perturbations sdpa_math,rows_reversed,rows_perm1,rows_perm2,rows_perm3,rows_perm4)
  (on the lent GPU machine, from the repository root; carry .whl .gpucache)

The compile matrix compares eager and compiled losses over 30 steps in bf16. How far apart may
two *correct* runs of the same batches drift? This runs each config (base, LoRA, QLoRA) eagerly
four times from the same weights on the same batches as the matrix (fixed lengths): twice as
is (same kernels: expected identical), once with cuBLAS' reduced-precision bf16 reductions
flipped (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, an equally valid
matmul accumulation order; on an H200 it changed nothing), and once with SDPA held to its math
backend (torch.nn.attention.sdpa_kernel: the reference attention instead of the fused kernel
eager picks), and once with the rows of every batch in reverse order (the same examples, so the
same loss in exact arithmetic; only the order of the sums over tokens, in the loss and in every
weight gradient, changes; rows_perm1..4 do the same with seeded random orders, to see how far
the max over 30 steps moves from one summation order to the next). The max |loss difference| of a perturbed pair is the floor that a
compiled run (other fusion, other rounding) cannot be expected to beat; the perturbations give
a range, not one number.

The pseudo-config "base-fp32" is the full fine-tune with fp32 master weights under bf16
autocast (the matrix's --base-fp32-master).

Usage (GPU machine, environment as lab/gpu/matrix/gpu_matrix.sh):
    python3 lab/gpu/matrix/bf16_noise.py --out noise.json [--configs lora,qlora,base,base-fp32] [--steps 30]
        [--perturbations flipped,sdpa_math,rows_reversed] [--lr 2e-4] [--base-lr 2e-5]

--base-lr sets the learning rate of the full fine-tune (base, base-fp32) alone, as the matrix's
--base-lr does; each cell records the lr it trained with.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shlex
import sys

import torch

from qlora_nb_utils import env
from qlora_nb_utils.bench.matrix import CONFIGS, _batches, config_lr, load_cell_model
from qlora_nb_utils.training.loop import TrainConfig, load_trainable_state, train, trainable_state
from qlora_nb_utils.training.parity import permute_rows

#: The perturbed eager runs, each compared with the plain eager run (see the module docstring).
PERTURBATIONS = ("flipped", "sdpa_math", "rows_reversed", "rows_perm1", "rows_perm2", "rows_perm3", "rows_perm4")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--configs", default="lora,qlora,base,base-fp32")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda", help="cpu only to try the script (no cuBLAS flag there)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--base-lr", type=float, default=None, help="learning rate of base/base-fp32 (default: --lr)")
    p.add_argument("--perturbations", default=",".join(PERTURBATIONS), help=f"comma-separated, from {PERTURBATIONS}")
    a = p.parse_args()
    bad = [x for x in a.perturbations.split(",") if x not in PERTURBATIONS]
    if bad:
        p.error(f"unknown perturbations {bad}; choose from {PERTURBATIONS}")
    base_lr = a.lr if a.base_lr is None else a.base_lr
    if not (a.lr > 0 and base_lr > 0):
        p.error("--lr and --base-lr must be positive")
    dev = torch.device(a.device)
    res = {"device": env.device_info(dev), "versions": env.versions(), "command": shlex.join(sys.argv),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "options": {"model": a.model, "steps": a.steps, "batch_size": 4, "max_len": 256, "lengths": "fixed",
                       "dtype": "bfloat16", "lr": a.lr, "base_lr": base_lr, "seed": 0},
           "cells": []}
    flag = torch.backends.cuda.matmul
    default = flag.allow_bf16_reduced_precision_reduction
    from torch.nn.attention import SDPBackend, sdpa_kernel

    @contextlib.contextmanager
    def perturbed(label):
        """What a run's label asks for, held around the whole run (backward included)."""
        if label == "eager_sdpa_math":
            with sdpa_kernel([SDPBackend.MATH]):
                yield
            return
        flag.allow_bf16_reduced_precision_reduction = (not default) if label == "eager_flipped" else default
        try:
            yield
        finally:
            flag.allow_bf16_reduced_precision_reduction = default

    labels = ("eager", "eager_again", *(f"eager_{x}" for x in a.perturbations.split(",")))
    for name in a.configs.split(","):
        config = "base" if name == "base-fp32" else name
        quant, lora = CONFIGS[config]
        lr = config_lr(config, a.lr, base_lr)
        cfg = TrainConfig(steps=a.steps, lr=lr, seed=0, progress=False)
        model, tok, wrap, weights_dtype = load_cell_model(a.model, config, torch.bfloat16, dev, seed=0,
                                                          base_fp32_master=name == "base-fp32")
        forward = wrap(model)
        start = trainable_state(model)
        batches = _batches(tok, "fixed", 4, 256, a.steps, 0)
        runs = {}
        reversed_rows = [{k: v.flip(0) for k, v in b.items()} for b in batches]
        for label in labels:
            load_trainable_state(model, start)
            with perturbed(label):
                data = batches
                if label == "eager_rows_reversed":
                    data = reversed_rows
                elif label.startswith("eager_rows_perm"):
                    data = permute_rows(batches, int(label.removeprefix("eager_rows_perm")))
                runs[label] = [float(x) for x in train(model, data, cfg, forward=forward, label=label)["loss"]]
        diff = lambda x, y: max(abs(u - v) for u, v in zip(runs[x], runs[y]))  # noqa: E731, B023 (used in this iteration)
        cell = {"config": name, "quant": quant, "lora": lora, "lr": lr, "losses": runs, "weights_dtype": weights_dtype,
                "max_abs_loss_diff_repeat": diff("eager", "eager_again")}
        for label in labels[2:]:
            short = label.removeprefix("eager_")
            cell[f"max_abs_loss_diff_{short}"] = diff("eager", label)
            cell[f"first_step_loss_diff_{short}"] = abs(runs["eager"][0] - runs[label][0])
        print(name, {k: v for k, v in cell.items() if k != "losses"}, flush=True)
        res["cells"].append(cell)
        del model
        torch.cuda.empty_cache()
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
