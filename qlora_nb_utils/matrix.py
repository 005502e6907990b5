"""The compile matrix: every configuration a user runs, eager vs compiled, counted.

"Zero graph breaks" is a claim about *every* cell of {base, LoRA, QLoRA} x {gradient
checkpointing off, on} x {fixed, variable lengths} x {whole model, regional}, not about the
one configuration a demo happens to use. `run_matrix` builds each cell the way a user does
(`models.load_model`, checkpointing enabled as transformers enables it), prepares it with
`compile.prepare_for_compile` (the recommended setting: patches as needed, `fullgraph=True`,
the sequence dimension marked dynamic for variable lengths), and measures, on the same
batches and from the same starting weights as an eager run of that cell: graph breaks,
whether `fullgraph=True` held, compilations, max |loss difference|, peak memory and median
step time. Each finished cell is written out at once, so a run cut short keeps its cells.
"""

from __future__ import annotations

import datetime as _dt
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from . import data as qdata
from . import diagnostics, env, models
from .bench import default_dtype, mark_dynamic
from .compile import prepare_for_compile
from .patches import input_require_grads
from .train import TrainConfig, load_trainable_state, summarize, train, trainable_state

__all__ = ["CONFIGS", "LENGTHS", "SCOPES", "markdown_table", "run_matrix", "summary_frame"]

#: name -> (quant, lora)
CONFIGS = {"base": ("none", False), "lora": ("none", True), "qlora": ("nf4", True)}
LENGTHS = ("fixed", "variable")
SCOPES = ("whole", "regional")
SEQ_DIMS = {"input_ids": 1, "attention_mask": 1, "labels": 1}


def _batches(tokenizer, lengths: str, batch_size: int, max_len: int, steps: int, seed: int):
    examples = qdata.load_examples(limit=max(512, 4 * batch_size * steps))
    tokenized = qdata.tokenize_examples(examples, tokenizer, max_len=max_len)
    policy = {"fixed": {"policy": "fixed", "max_length": max_len}, "variable": {"policy": "longest"}}[lengths]
    collator = qdata.PaddingCollator(pad_token_id=tokenizer.pad_token_id, **policy)
    loader = qdata.make_batches(tokenized, batch_size, collator, seed=seed)
    return [b for _, b in zip(range(steps), loader)]


def _break_check(model, batch, device, ckpt: bool) -> dict[str, Any]:
    """Breaks and the fullgraph verdict of the patched model's forward + loss."""
    prepared = prepare_for_compile(model, scope="whole", backend="eager", fullgraph=False, grad_ckpt=True if ckpt else None)
    try:
        first = {k: v.to(device) for k, v in batch.items()}
        loss_fn = lambda **b: model(**b).loss  # noqa: E731
        breaks = diagnostics.graph_breaks(loss_fn, **first)
        full = diagnostics.check_fullgraph(loss_fn, **first)
    finally:
        prepared.undo()
        torch.compiler.reset()
    return {"graph_breaks": breaks.graph_break_count, "break_reasons": breaks.break_reasons,
            "fullgraph_ok": full.ok, "fullgraph_error": full.error, "patches": prepared.patches}


def _compiled_cell(model, batches, cfg, start, scope, lengths, backend, mode, ckpt) -> tuple[Any, dict[str, Any]]:
    torch.compiler.reset()
    load_trainable_state(model, start)
    # Regional: the layers are compiled, the embedding is not. Every layer but the first gets an
    # input that requires grad (the previous layer's LoRA output), so without the eager hook the
    # first layer compiles a second graph (a requires_grad guard). Variable lengths cannot be
    # marked on the layers' inputs from outside, so the layers are compiled dynamic.
    hook = None
    if scope == "regional":
        hook = model.get_input_embeddings().register_forward_hook(input_require_grads.requires_grad_unless_compiling)
    dynamic = True if (scope == "regional" and lengths == "variable") else None
    # With checkpointing on, grad_ckpt=True gives the whole graph the recompute-everything policy
    # (compiled peak memory at eager's; see compile.py).
    prepared = prepare_for_compile(model, scope=scope, backend=backend, mode=mode, fullgraph=True, dynamic=dynamic,
                                   grad_ckpt=True if ckpt else None)
    forward = mark_dynamic(prepared.forward, SEQ_DIMS) if lengths == "variable" and scope == "whole" else prepared.forward
    try:
        hist = train(model, batches, cfg, forward=forward, label=f"compiled-{scope}")
        error = None
    except Exception as err:  # a fullgraph failure is a result of the cell, not a crash of the run
        hist, error = None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        stats = prepared.counter.to_dict()
        prepared.undo()
        if hook is not None:
            hook.remove()
        torch.compiler.reset()
    return hist, {"compilations": stats["compilations"], "recompilations": stats["recompilations"],
                  "recompile_reasons": stats["recompile_reasons"], "compile_s": stats["compile_s"],
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

    Raises:
        ValueError: for unknown configs, lengths or scopes.
    """
    configs, lengths, scopes, grad_ckpts = list(configs), list(lengths), list(scopes), list(grad_ckpts)
    for what, given, valid in (("configs", configs, CONFIGS), ("lengths", lengths, LENGTHS), ("scopes", scopes, SCOPES)):
        bad = [g for g in given if g not in valid]
        if bad:
            raise ValueError(f"unknown {what} {bad}; valid: {list(valid)}")
    dev = env.resolve_device(device)
    torch_dtype = env.resolve_dtype(default_dtype(dev) if dtype == "auto" else dtype, dev)
    result = {
        "device": env.device_info(dev), "versions": env.versions(),
        "command": command or shlex.join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "options": {"model": model_name, "steps": steps, "batch_size": batch_size, "max_len": max_len,
                    "dtype": str(torch_dtype).replace("torch.", ""), "backend": backend, "mode": mode, "lr": lr,
                    "warmup": warmup, "seed": seed,
                    "recommended": "prepare_for_compile(fullgraph=True); variable lengths: mark_dynamic on the "
                                   "sequence dimension (whole), dynamic=True (regional); regional: the "
                                   "embedding output requires grad (eager hook)"},
        "cells": [],
    }
    t0 = time.perf_counter()
    cfg = TrainConfig(steps=steps, lr=lr, seed=seed, progress=False)
    for name in configs:
        quant, lora = CONFIGS[name]
        for ckpt in grad_ckpts:
            if _out_of_time(t0, time_budget_s, result, log):
                return result
            model, tok = models.load_model(model_name, quant=quant, lora=lora, dtype=torch_dtype, device=dev,
                                           seed=seed, gradient_checkpointing=ckpt)
            model.train()
            start = trainable_state(model)
            for kind in lengths:
                batches = _batches(tok, kind, batch_size, max_len, steps, seed)
                load_trainable_state(model, start)
                eager = train(model, batches, cfg, label="eager")
                checked = _break_check(model, batches[0], dev, ckpt)
                for scope in scopes:
                    if _out_of_time(t0, time_budget_s, result, log):
                        return result
                    log(f"==> {name} grad_ckpt={ckpt} {kind} {scope}")
                    hist, counts = _compiled_cell(model, batches, cfg, start, scope, kind, backend, mode, ckpt)
                    cell = {"model": model_name, "quant": quant, "lora": lora, "config": name, "grad_ckpt": ckpt,
                            "lengths": kind, "scope": scope, **checked, **counts,
                            "distinct_lengths": len({b["input_ids"].shape[1] for b in batches}),
                            "eager_median_step_ms": summarize(eager, warmup)["median_step_ms"],
                            "eager_peak_mem_gib": float(eager["peak_mem_gib"].max())}
                    if hist is not None:
                        s = summarize(hist, warmup)
                        cell.update(median_step_ms=s["median_step_ms"], peak_mem_gib=s["peak_mem_gib"],
                                    max_abs_loss_diff=float((hist["loss"] - eager["loss"]).abs().max()))
                    else:
                        cell.update(median_step_ms=None, peak_mem_gib=None, max_abs_loss_diff=None,
                                    fullgraph_ok=False)
                    result["cells"].append(cell)
                    if out is not None:
                        Path(out).parent.mkdir(parents=True, exist_ok=True)
                        Path(out).write_text(json.dumps(result, indent=1, default=str) + "\n")
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return result


def summary_frame(result: dict[str, Any]):
    """The cells as a pandas DataFrame with the columns the notebooks show."""
    import pandas as pd

    cols = ["config", "grad_ckpt", "lengths", "scope", "graph_breaks", "fullgraph_ok", "compilations",
            "max_abs_loss_diff", "peak_mem_gib", "eager_peak_mem_gib", "median_step_ms", "eager_median_step_ms"]
    return pd.DataFrame(result["cells"])[cols]


def markdown_table(path: str | Path) -> str:
    """The cells of a matrix results file as a Markdown table (what the README shows)."""
    res = json.loads(Path(path).read_text())
    head = ("| config | grad ckpt | lengths | scope | breaks | fullgraph | compilations | max loss diff "
            "| peak GiB compiled / eager | ms/step compiled / eager |")
    rows = [head, "|" + "---|" * 10]
    for c in res["cells"]:
        mem = f"{c['peak_mem_gib']:.2f} / {c['eager_peak_mem_gib']:.2f}" if c["peak_mem_gib"] is not None else "-"
        ms = f"{c['median_step_ms']:.1f} / {c['eager_median_step_ms']:.1f}" if c["median_step_ms"] is not None else "-"
        diff = f"{c['max_abs_loss_diff']:.1e}" if c["max_abs_loss_diff"] is not None else "-"
        rows.append(f"| {c['config']} | {'on' if c['grad_ckpt'] else 'off'} | {c['lengths']} | {c['scope']} "
                    f"| {c['graph_breaks']} | {'ok' if c['fullgraph_ok'] else 'FAILS'} | {c['compilations']} "
                    f"| {diff} | {mem} | {ms} |")
    return f"`{Path(path).name}`: {res['device']['name']}, torch {res['versions']['torch']}, {res['date']}, " \
           f"{res['options']['model']} {res['options']['dtype']}, batch {res['options']['batch_size']}, " \
           f"{res['options']['steps']} steps, {len(res['cells'])} cells\n\n" + "\n".join(rows) + "\n"
