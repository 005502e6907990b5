"""The compile matrix: every configuration a user runs, eager vs compiled, counted.

"Zero graph breaks" is a claim about *every* cell of {base, LoRA, QLoRA} x {gradient
checkpointing off, on} x {fixed, variable lengths} x {whole model, regional}, not about the
one configuration a demo happens to use. `run_matrix` builds each cell the way a user does
(`models.load_model`, checkpointing enabled as transformers enables it), prepares it with
`compile.prepare_for_compile` (the recommended setting: patches as needed, `fullgraph=True`,
the sequence dimension marked dynamic for variable lengths), and measures, on the same
batches and from the same starting weights as an eager run of that cell: graph breaks,
whether `fullgraph=True` held, compilations, max |loss difference| (and both runs' per-step
losses), peak memory (over the run, compile steps included, and "steady", over the steps after
warm-up: the first compiled step compiles and autotunes on real buffers) and median step time.
Each finished cell is written out at once, so a run cut short keeps its cells.

This module runs the matrix (``python -m qlora_nb_utils.bench.matrix``, which also merges part
files); reading its results (merging parts, a folder's fullest file, the summary, parity and
Markdown tables, and the matrix's axes) is :mod:`qlora_nb_utils.bench.matrix_results`, whose
names are re-exported here.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .. import data as qdata
from .. import diagnostics, env, models
from ..compile import prepare_for_compile
from ..env import resolve_device_dtype
from ..training.gpulock import lock_path
from ..training.loop import TrainConfig, load_trainable_state, summarize, train, trainable_state
from .main_job import mark_dynamic, warm_shapes
from .matrix_results import (
    CONFIGS,
    LENGTHS,
    SCOPES,
    cell_lr,
    config_lr,
    largest_matrix,
    markdown_table,
    merge_results,
    parity_table,
    summary_frame,
)

__all__ = ["CONFIGS", "LENGTHS", "SCOPES", "cell_lr", "config_lr", "largest_matrix", "markdown_table",
           "merge_results", "parity_table", "run_matrix", "summary_frame"]

SEQ_DIMS = {"input_ids": 1, "attention_mask": 1, "labels": 1}


def _batches(tokenizer, lengths: str, batch_size: int, max_len: int, steps: int, seed: int):
    """A cell's batches: ``"fixed"`` pads every batch to ``max_len``, ``"variable"`` to its longest row."""
    return qdata.build_batches(tokenizer, batch_size=batch_size, steps=steps, max_len=max_len,
                               padding={"fixed": "fixed", "variable": "longest"}[lengths],
                               limit=max(512, 4 * batch_size * steps), seed=seed)


def _autocast(forward: Callable[..., Any], device: torch.device, dtype: torch.dtype) -> Callable[..., Any]:
    """`forward` under `torch.autocast(dtype)`: mixed precision for the fp32-weight full fine-tune.

    Why: training bf16 weights in place rounds every AdamW update to bf16 (a weight near 0.02
    moves in steps of about 1e-4, the size of an update at lr 2e-4), so a rounding difference in
    any gradient, eager or compiled, decides whether a weight moves at all, and the runs drift
    apart step by step. fp32 master weights keep the update; the matmuls still run in bf16.
    Without it, eager against eager with another SDPA kernel drifts as far as eager against
    compiled, so the full fine-tune's parity says nothing about the compiler; with it both
    differences shrink together, the more at full fine-tuning's usual lower learning rate
    (`base_lr`). The lab's compile matrix and bf16-noise runs record the figures.
    The context is entered outside the compiled callable, so Dynamo traces under it.
    """

    def run(**batch):
        with torch.autocast(device.type, dtype=dtype):
            return forward(**batch)

    return run


def load_cell_model(model_name: str, config: str, dtype: torch.dtype, device: torch.device, *, seed: int = 0,
                    grad_ckpt: bool = False, base_fp32_master: bool = False):
    """Load one of `CONFIGS` as a matrix cell trains it, in train mode.

    Returns:
        (model, tokenizer, wrap, weights_dtype): `wrap(forward)` is the forward to train with
        (`_autocast` for the fp32-master full fine-tune, else `forward` itself);
        `weights_dtype` names the weights' precision for the results.
    """
    quant, lora = CONFIGS[config]
    mixed = base_fp32_master and not lora and dtype != torch.float32
    model, tok = models.load_model(model_name, quant=quant, lora=lora, dtype=torch.float32 if mixed else dtype,
                                   device=device, seed=seed, gradient_checkpointing=grad_ckpt)
    model.train()
    if mixed:
        return model, tok, lambda f: _autocast(f, device, dtype), "float32 (autocast)"
    return model, tok, lambda f: f, str(dtype).replace("torch.", "")


def _break_check(model, batch, device, ckpt: bool, wrap: Callable = lambda f: f) -> dict[str, Any]:
    """Breaks and the fullgraph verdict of the patched model's forward + loss (under `wrap`)."""
    prepared = prepare_for_compile(model, scope="whole", backend="eager", fullgraph=False, grad_ckpt=True if ckpt else None)
    try:
        first = {k: v.to(device) for k, v in batch.items()}
        loss_fn = wrap(lambda **b: model(**b).loss)
        breaks = diagnostics.graph_breaks(loss_fn, **first)
        full = diagnostics.check_fullgraph(loss_fn, **first)
    finally:
        prepared.undo()
        torch.compiler.reset()
        gc.collect()  # frees what the checks left in reference cycles (not all they leave: see run_matrix)
    return {"graph_breaks": breaks.graph_break_count, "break_reasons": breaks.break_reasons,
            "fullgraph_ok": full.ok, "fullgraph_error": full.error, "patches": prepared.patches}


def _compiled_cell(model, batches, cfg, start, scope, lengths, backend, mode, ckpt,
                   eager_numerics: bool = False, wrap: Callable = lambda f: f,
                   train_fn: Callable | None = None) -> tuple[Any, dict[str, Any]]:
    """Prepare `model` as the cell says, train it with `train_fn` (default `train`), undo."""
    torch.compiler.reset()
    load_trainable_state(model, start)
    # Regional: prepare_for_compile makes the first layer's input require grad like the others'
    # (one compilation). Variable lengths cannot be marked on the layers' inputs from outside, so
    # the layers are compiled dynamic (floats kept constant: see ops.static_floats.with_static_floats,
    # which removed a restarted trace per cell).
    dynamic = True if (scope == "regional" and lengths == "variable") else None
    # With checkpointing on, grad_ckpt=True gives the whole graph the recompute-everything policy
    # (compiled peak memory at eager's; see compile/prepare.py).
    prepared = prepare_for_compile(model, scope=scope, backend=backend, mode=mode, fullgraph=True, dynamic=dynamic,
                                   grad_ckpt=True if ckpt else None, eager_numerics=eager_numerics)
    forward = mark_dynamic(prepared.forward, SEQ_DIMS) if lengths == "variable" and scope == "whole" else prepared.forward
    try:
        hist = (train_fn or train)(model, batches, cfg, forward=wrap(forward), label=f"compiled-{scope}")
        error = None
    except Exception as err:  # a fullgraph failure is a result of the cell, not a crash of the run
        hist, error = None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        stats = prepared.counter.to_dict()
        prepared.undo()
        torch.compiler.reset()
    return hist, {"compilations": stats["compilations"], "recompilations": stats["recompilations"],
                  "recompile_reasons": stats["recompile_reasons"], "restarts": stats["restarts"],
                  "restart_reasons": stats["restart_reasons"], "compile_s": stats["compile_s"],
                  "compiled_error": error}


def _out_of_time(t0: float, budget: float | None, result: dict, log) -> bool:
    if budget is None or time.perf_counter() - t0 <= budget:
        return False
    log(f"==> time budget of {budget:.0f} s reached; {len(result['cells'])} cells done")
    return True


def run_matrix(
    model_name: str = "tiny",
    *,
    configs: Iterable[str] = tuple(CONFIGS),
    grad_ckpts: Iterable[bool] = (False, True),
    lengths: Iterable[str] = LENGTHS,
    scopes: Iterable[str] = SCOPES,
    steps: int = 30,
    batch_size: int = 4,
    max_len: int = 256,
    dtype: str = "auto",
    device: str = "auto",
    backend: str = "inductor",
    mode: str | None = None,
    lr: float = 2e-4,
    warmup: int = 3,
    seed: int = 0,
    out: str | Path | None = None,
    time_budget_s: float | None = None,
    log: Callable[[str], Any] = print,
    command: str | None = None,
    eager_numerics: bool = False,
    base_fp32_master: bool = False,
    base_lr: float | None = None,
) -> dict[str, Any]:
    """Run the matrix and return `{"device", "versions", "command", "date", "options", "cells": [...]}`.

    Args:
        model_name: the model every cell uses.
        configs: names from `CONFIGS` ("base" trains every weight; "lora"/"qlora" the adapters).
        grad_ckpts: gradient checkpointing settings.
        lengths: "fixed" (padded to `max_len`) and/or "variable" (padded to each batch's longest).
        scopes: "whole" and/or "regional".
        steps: optimizer steps of each run (eager and compiled).
        batch_size: examples per batch.
        max_len: longest tokenized example (and the fixed length).
        dtype: "auto" (bf16 on SM80+, fp16 below, fp32 on CPU) or a dtype name.
        device: "auto", "cpu" or "cuda".
        backend: the compiled runs' backend.
        mode: the compiled runs' inductor mode.
        lr: learning rate.
        warmup: steps left out of the step-time medians.
        seed: seeds LoRA init, batches and training.
        out: a JSON path rewritten after every cell.
        time_budget_s: start no new cell after this many seconds (cells not run are omitted).
        log: status messages.
        command: the command line to record (defaults to `sys.argv`).
        eager_numerics: compile with Inductor's `emulate_precision_casts` (bf16/fp16 rounded
            after every op, as eager does; see `prepare_for_compile`).
        base_fp32_master: full fine-tuning ("base") keeps fp32 weights and computes under
            `torch.autocast(dtype)` (mixed precision), instead of training bf16 weights in place.
            LoRA configs are unchanged (their adapters are fp32 already). See `_autocast`.
        base_lr: learning rate of the full fine-tune ("base") cells; None means `lr`. Full
            fine-tuning is usually run about 10x below LoRA's rate (the adapters start at zero and
            need the larger steps); every cell records the `lr` it trained with.

    Each cell also keeps both runs' per-step losses (`eager_losses`, `losses`; `losses` is None
    when the compiled run failed) and `first_step_loss_diff`, |compiled - eager| at step 0, where
    both start from the same weights (None when the compiled run failed).

    Raises:
        ValueError: for unknown configs, lengths or scopes, a non-bool `eager_numerics` or
            `base_fp32_master`, or a learning rate that is not a positive number.
    """
    configs, lengths, scopes, grad_ckpts = list(configs), list(lengths), list(scopes), list(grad_ckpts)
    for what, given, valid in (("configs", configs, CONFIGS), ("lengths", lengths, LENGTHS), ("scopes", scopes, SCOPES)):
        bad = [g for g in given if g not in valid]
        if bad:
            raise ValueError(f"unknown {what} {bad}; valid: {list(valid)}")
    for flag, value in (("eager_numerics", eager_numerics), ("base_fp32_master", base_fp32_master)):
        if not isinstance(value, bool):
            raise ValueError(f"{flag} must be True or False, got {value!r}")
    for what, value in (("lr", lr), ("base_lr", lr if base_lr is None else base_lr)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{what} must be a positive number, got {value!r}")
    dev, torch_dtype = resolve_device_dtype(device, dtype)
    result = {
        "device": env.device_info(dev), "versions": env.versions(),
        "command": command or shlex.join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "options": {"model": model_name, "steps": steps, "batch_size": batch_size, "max_len": max_len,
                    "dtype": str(torch_dtype).replace("torch.", ""), "backend": backend, "mode": mode, "lr": lr,
                    "warmup": warmup, "seed": seed, "eager_numerics": eager_numerics,
                    "base_fp32_master": base_fp32_master, "base_lr": base_lr,
                    "gpu_lock": lock_path() is not None,
                    "recommended": "prepare_for_compile(fullgraph=True); variable lengths: mark_dynamic on the "
                                   "sequence dimension (whole), dynamic=True (regional); regional: the "
                                   "embedding output requires grad (prepare_for_compile's eager hook)"},
        "cells": [],
    }
    t0 = time.perf_counter()
    for name in configs:
        quant, lora = CONFIGS[name]
        run_lr = config_lr(name, lr, base_lr)
        cfg = TrainConfig(steps=steps, lr=run_lr, seed=seed, progress=False)
        for ckpt in grad_ckpts:
            if _out_of_time(t0, time_budget_s, result, log):
                return result
            model, tok, wrap, weights_dtype = load_cell_model(model_name, name, torch_dtype, dev, seed=seed,
                                                              grad_ckpt=ckpt, base_fp32_master=base_fp32_master)
            start = trainable_state(model)
            for kind in lengths:
                batches = _batches(tok, kind, batch_size, max_len, steps, seed)
                # Every new length's first step costs more on a GPU, eager or compiled, once per
                # process (bench.warm_shapes): warmed here, neither run pays it for the other.
                warm_shapes(model, batches, forward=wrap(model))
                load_trainable_state(model, start)
                eager = train(model, batches, cfg, forward=wrap(model), label="eager")
                done, stopped = [], False
                for scope in scopes:
                    if _out_of_time(t0, time_budget_s, result, log):
                        stopped = True
                        break
                    log(f"==> {name} grad_ckpt={ckpt} {kind} {scope}")
                    hist, counts = _compiled_cell(model, batches, cfg, start, scope, kind, backend, mode, ckpt,
                                                  eager_numerics, wrap)
                    cell = {"model": model_name, "quant": quant, "lora": lora, "config": name, "grad_ckpt": ckpt,
                            "weights_dtype": weights_dtype, "lr": run_lr, "lengths": kind, "scope": scope, **counts,
                            "distinct_lengths": len({b["input_ids"].shape[1] for b in batches}),
                            "eager_median_step_ms": summarize(eager, warmup)["median_step_ms"],
                            "eager_peak_mem_gib": float(eager["peak_mem_gib"].max()),
                            "eager_steady_peak_mem_gib": summarize(eager, warmup)["steady_peak_mem_gib"],
                            "eager_losses": [float(x) for x in eager["loss"]]}
                    if hist is not None:
                        s = summarize(hist, warmup)
                        diff = (hist["loss"] - eager["loss"]).abs()
                        cell.update(median_step_ms=s["median_step_ms"], peak_mem_gib=s["peak_mem_gib"],
                                    steady_peak_mem_gib=s["steady_peak_mem_gib"],
                                    max_abs_loss_diff=float(diff.max()), first_step_loss_diff=float(diff.iloc[0]),
                                    losses=[float(x) for x in hist["loss"]])
                    else:
                        cell.update(median_step_ms=None, peak_mem_gib=None, steady_peak_mem_gib=None,
                                    max_abs_loss_diff=None, first_step_loss_diff=None, losses=None)
                    done.append(cell)
                # The break check runs after this length kind's runs, never between eager and
                # compiled: it leaves memory allocated that gc.collect() does not free (seen on the
                # 1B shape with checkpointing, in the lab's memory snapshots), which would count in
                # every later peak of this process.
                if done:
                    checked = _break_check(model, batches[0], dev, ckpt, wrap)
                    for cell in done:
                        failed = cell["losses"] is None  # the compiled run itself failed
                        cell.update(checked)
                        if failed:
                            cell["fullgraph_ok"] = False
                    result["cells"].extend(done)
                    if out is not None:
                        Path(out).parent.mkdir(parents=True, exist_ok=True)
                        Path(out).write_text(json.dumps(result, indent=1, default=str) + "\n")
                if stopped:
                    return result
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m qlora_nb_utils.bench.matrix`: run part of the matrix (or all of it) into a JSON file,
    or merge part files into one (`--merge PART.json ... --out ALL.json`)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m qlora_nb_utils.bench.matrix", description=main.__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--grad-ckpt", default="off,on", help="comma-separated: off, on")
    p.add_argument("--lengths", default=",".join(LENGTHS), help=f"comma-separated, from {list(LENGTHS)}")
    p.add_argument("--scopes", default=",".join(SCOPES), help=f"comma-separated, from {list(SCOPES)}")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--time-budget-s", type=float, default=None)
    p.add_argument("--eager-numerics", action="store_true",
                   help="compile with inductor's emulate_precision_casts (bf16 rounded after every op, as in eager)")
    p.add_argument("--base-fp32-master", action="store_true",
                   help="full fine-tuning keeps fp32 weights under torch.autocast (mixed precision)")
    p.add_argument("--lr", type=float, default=2e-4, help="learning rate (default 2e-4)")
    p.add_argument("--base-lr", type=float, default=None,
                   help="learning rate of the full fine-tune (base) cells (default: --lr)")
    p.add_argument("--command", default=None, help="the command line to record (defaults to this one)")
    p.add_argument("--merge", nargs="+", default=None, metavar="PART", help="merge these part files instead of running")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    if a.merge:
        merged = merge_results([json.loads(Path(f).read_text()) for f in a.merge], command=a.command)
        Path(a.out).write_text(json.dumps(merged, indent=1, default=str) + "\n")
        print(summary_frame(merged).to_string())
        return 0
    ckpts = {"off": False, "on": True}
    bad = [c for c in split(a.grad_ckpt) if c not in ckpts]
    if bad:
        p.error(f"--grad-ckpt takes off/on, not {bad}")
    try:
        res = run_matrix(a.model, configs=split(a.configs), grad_ckpts=[ckpts[c] for c in split(a.grad_ckpt)],
                         lengths=split(a.lengths), scopes=split(a.scopes), steps=a.steps, batch_size=a.batch_size,
                         max_len=a.max_len, warmup=a.warmup, device=a.device, backend=a.backend, out=a.out,
                         time_budget_s=a.time_budget_s, command=a.command, eager_numerics=a.eager_numerics,
                         base_fp32_master=a.base_fp32_master, lr=a.lr, base_lr=a.base_lr)
    except ValueError as err:
        p.error(str(err))
    print(summary_frame(res).to_string() if res["cells"] else "no cells finished")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
