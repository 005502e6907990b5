"""The bf16 noise floor of a 30-step training run: eager against eager.

The compile matrix compares eager and compiled losses over 30 steps in bf16. How far apart may
two *correct* runs of the same batches drift? This runs each config (base, LoRA, QLoRA) eagerly
three times from the same weights on the same batches as the matrix (fixed lengths): twice as
is (same kernels: expected identical) and once with cuBLAS' reduced-precision bf16 reductions
flipped (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction), an equally valid
matmul accumulation order. The max |loss difference| of that pair is the floor a compiled run
(other fusion, other rounding) cannot be expected to beat.

Usage (GPU machine, environment as tools/gpu_matrix.sh):
    python3 tools/bf16_noise.py --out noise.json [--configs lora,qlora,base] [--steps 30]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys

import torch

from qlora_nb_utils import env, models
from qlora_nb_utils.matrix import CONFIGS, _batches
from qlora_nb_utils.train import TrainConfig, load_trainable_state, train, trainable_state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--configs", default="lora,qlora,base")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda", help="cpu only to try the script (no cuBLAS flag there)")
    a = p.parse_args()
    dev = torch.device(a.device)
    res = {"device": env.device_info(dev), "versions": env.versions(), "command": shlex.join(sys.argv),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "options": {"model": a.model, "steps": a.steps, "batch_size": 4, "max_len": 256, "lengths": "fixed",
                       "dtype": "bfloat16", "lr": 2e-4, "seed": 0},
           "cells": []}
    cfg = TrainConfig(steps=a.steps, lr=2e-4, seed=0, progress=False)
    flag = torch.backends.cuda.matmul
    default = flag.allow_bf16_reduced_precision_reduction
    for name in a.configs.split(","):
        quant, lora = CONFIGS[name]
        model, tok = models.load_model(a.model, quant=quant, lora=lora, dtype=torch.bfloat16, device=dev, seed=0)
        model.train()
        start = trainable_state(model)
        batches = _batches(tok, "fixed", 4, 256, a.steps, 0)
        runs = {}
        for label, reduced in (("eager", default), ("eager_again", default), ("eager_flipped", not default)):
            load_trainable_state(model, start)
            flag.allow_bf16_reduced_precision_reduction = reduced
            try:
                runs[label] = [float(x) for x in train(model, batches, cfg, label=label)["loss"]]
            finally:
                flag.allow_bf16_reduced_precision_reduction = default
        diff = lambda x, y: max(abs(u - v) for u, v in zip(runs[x], runs[y]))  # noqa: E731
        cell = {"config": name, "quant": quant, "lora": lora, "losses": runs,
                "max_abs_loss_diff_repeat": diff("eager", "eager_again"),
                "max_abs_loss_diff_flipped": diff("eager", "eager_flipped"),
                "first_step_loss_diff_flipped": abs(runs["eager"][0] - runs["eager_flipped"][0])}
        print(name, {k: v for k, v in cell.items() if k != "losses"}, flush=True)
        res["cells"].append(cell)
        del model
        torch.cuda.empty_cache()
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
