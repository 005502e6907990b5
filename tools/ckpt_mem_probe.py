"""Peak memory of regional compile + gradient checkpointing against eager: budgets and attribution.

Why: in the compile matrix (results/compile_matrix_h200.json) the whole-model compile with
checkpointing peaks below eager with checkpointing, but the regional compile peaks 0.13 GiB
above it (LoRA and QLoRA alike). There the checkpoint stays eager around each compiled layer,
so the recompute in the backward runs the compiled layer, whose partitioner chooses what the
layer's backward keeps.

Two modes:
* ``--budgets 1.0,0.5,0.1`` (default): `torch._functorch.config.activation_memory_budget` below
  1 makes that partitioner recompute more. Runs the matrix's regional checkpointed cell (fixed
  lengths) at each budget, one after the other in one process, and writes the peaks beside
  eager's. (Session 6: the gap stayed 0.1334 GiB at every budget.)
* ``--snapshot``: the same cell with the allocator recording (`qlora_nb_utils.diagnostics.memprof`): eager
  after warm-up, the compiled run's first steps (they compile) and its later steps, each with
  per-step peaks and the allocations alive at the window's peak, summed by allocating line.
  ``--break-check`` adds the matrix's break check between eager and compiled, recorded, with
  what it left allocated. ``--lengths variable --scope whole --base-fp32-master --lr 2e-5``
  record another matrix cell the same way (e.g. base, whose checkpointed variable-length cells
  peak a few MiB above eager), with as many steps as the matrix (``--steps 30``) so that both
  windows see its longest batches.

Usage (GPU machine, environment as tools/gpu_matrix.sh):
    python3 tools/ckpt_mem_probe.py --out probe.json [--configs qlora,lora] [--budgets 1.0,0.5,0.1]
    python3 tools/ckpt_mem_probe.py --out snap.json --snapshot [--configs qlora]
        [--lengths variable --scope whole --base-fp32-master --lr 2e-5 --steps 30]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import shlex
import sys

import pandas as pd
import torch
import torch._functorch.config as functorch_config

from qlora_nb_utils import env
from qlora_nb_utils.bench import matrix
from qlora_nb_utils.diagnostics import memprof
from qlora_nb_utils.env import resolve_device_dtype
from qlora_nb_utils.bench.matrix import run_matrix
from qlora_nb_utils.training.loop import TrainConfig, load_trainable_state, train, trainable_state


def _budgets(a, res) -> None:
    default = functorch_config.activation_memory_budget
    res["default_budget"] = default
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


def _recorded(windows: dict, name: str, model, batches, cfg, **kw) -> pd.DataFrame:
    with memprof.recording() as rec:
        hist = train(model, batches, cfg, **kw)
    windows[name] = {"step_peak_mem_gib": [float(x) for x in hist["step_peak_mem_gib"]],
                     **memprof.live_at_peak(rec["snapshot"], device=torch.cuda.current_device())}
    print(f"{name}: step peaks {['%.3f' % x for x in windows[name]['step_peak_mem_gib']]} GiB; "
          f"largest live at the peak: {[(round(b['mib'], 1), b['site']) for b in windows[name]['largest'][:6]]}",
          flush=True)
    return hist


def _snapshot(a, res) -> None:
    dev, dtype = resolve_device_dtype(a.device, "auto")
    half = max(a.steps // 2, 1)
    for config in a.configs.split(","):
        model, tok, wrap, _ = matrix.load_cell_model(a.model, config, dtype, dev, grad_ckpt=True,
                                                     base_fp32_master=a.base_fp32_master)
        start = trainable_state(model)
        batches = matrix._batches(tok, a.lengths, 4, 256, a.steps, 0)
        cfg = TrainConfig(steps=half, lr=a.lr, progress=False)
        windows: dict = {}
        load_trainable_state(model, start)
        train(model, batches[:half], cfg, forward=wrap(model), label="eager-warm")
        _recorded(windows, "eager", model, batches[half:], cfg, forward=wrap(model), label="eager")
        if a.break_check:  # what the matrix runs between its eager and compiled runs
            before = torch.cuda.memory_allocated()
            with memprof.recording() as rec:
                matrix._break_check(model, batches[0], dev, True, wrap)
            left = memprof.live_at_peak(rec["snapshot"], device=torch.cuda.current_device(), at="end")
            gc.collect()
            windows["break_check"] = {"allocated_delta_gib": (torch.cuda.memory_allocated() - before) / 2**30,
                                      "left_allocated": left}
            print(f"break check left {windows['break_check']['allocated_delta_gib']:.4f} GiB allocated: "
                  f"{[(round(b['mib'], 1), b['site']) for b in left['largest'][:8]]}", flush=True)

        def two_windows(model, batches, cfg, forward, label):
            first = _recorded(windows, "compiled_first", model, batches[:half], cfg, forward=forward, label=label)
            later = _recorded(windows, "compiled_later", model, batches[half:], cfg, forward=forward, label=label)
            return pd.concat([first, later], ignore_index=True)

        _, counts = matrix._compiled_cell(model, batches, cfg, start, a.scope, a.lengths, "inductor", None, True,
                                          eager_numerics=True, wrap=wrap, train_fn=two_windows)
        res["cells"].append({"config": config, "lengths": a.lengths, "scope": a.scope, "lr": a.lr,
                             "base_fp32_master": a.base_fp32_master, "compilations": counts["compilations"],
                             "compiled_error": counts["compiled_error"], "windows": windows})
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        del model
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--configs", default="qlora,lora")
    p.add_argument("--budgets", default="1.0,0.5,0.1")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--snapshot", action="store_true", help="record allocations instead of trying budgets")
    p.add_argument("--break-check", action="store_true",
                   help="with --snapshot: run the matrix's break check between the eager and compiled runs, recorded")
    p.add_argument("--lengths", default="fixed", choices=matrix.LENGTHS, help="with --snapshot: the cell's lengths")
    p.add_argument("--scope", default="regional", choices=matrix.SCOPES, help="with --snapshot: the cell's scope")
    p.add_argument("--base-fp32-master", action="store_true", help="with --snapshot: as the matrix's option")
    p.add_argument("--lr", type=float, default=2e-4, help="with --snapshot: learning rate (the matrix's base_lr for base)")
    a = p.parse_args()
    res = {"command": shlex.join(sys.argv), "parts": []}
    if a.snapshot:
        res = {"command": res["command"], "cells": []}
        dev = env.resolve_device(a.device)
        res.update(device=env.device_info(dev), versions=env.versions(),
                   date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        _snapshot(a, res)
    else:
        _budgets(a, res)


if __name__ == "__main__":
    main()
