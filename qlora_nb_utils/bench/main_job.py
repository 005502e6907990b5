"""Eager vs compiled, side by side in one process: the main job.

A speed-up is only honest when both sides see the same things, so `run_bench` loads the
model once, snapshots its LoRA weights, trains eagerly, restores the snapshot, and trains
the compiled model on the very same list of batches with the same seed. Compilation is
counted and timed by `diagnostics.CompileCounter` and reported apart from the steady state;
step times are medians after warm-up steps. Everything lands in one JSON-ready dict with
the device, library versions, command and date, so that a figure quoted anywhere can be
traced to the run that produced it.

Batches are padded to a fixed length by default: one shape, one compilation. Variable
lengths and what they cost are the subject of notebook 04.
"""

from __future__ import annotations

import datetime as _dt
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from .. import data as qdata
from .. import diagnostics, env, models
from ..env import default_dtype, resolve_device_dtype  # re-exported: bench.resolve_device_dtype
from ..report.markdown import table_header
from ..training.device import sync
from ..training.loop import TrainConfig, load_trainable_state, summarize, train, trainable_state

__all__ = [
    "DEFAULTS",
    "compare",
    "compiled_run",
    "mark_dynamic",
    "default_dtype",
    "resolve_device_dtype",
    "make_bench_batches",
    "run_bench",
    "warm_shapes",
    "side_by_side",
    "write_results",
]

PADDING_POLICIES = ("fixed", "multiple", "longest")


DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    "quant": "nf4",
    "steps": 30,
    "batch_size": 4,
    "seq_len": 128,
    "padding": "fixed",
    "device": "auto",
    "dtype": "auto",
    "lora_r": 16,
    "lora_alpha": 32,
    "lr": 2e-4,
    "warmup": 3,
    "seed": 0,
    "mode": None,
    "backend": "inductor",
    "data": None,
    "attn_implementation": "sdpa",
}


def _validate(opts: dict[str, Any]) -> None:
    unknown = set(opts) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown bench option(s) {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    if opts["padding"] not in PADDING_POLICIES:
        raise ValueError(f"padding must be one of {PADDING_POLICIES}, got {opts['padding']!r}")
    for key in ("steps", "batch_size", "seq_len"):
        if int(opts[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {opts[key]}")
    if int(opts["warmup"]) >= int(opts["steps"]):
        raise ValueError(f"warmup ({opts['warmup']}) must be smaller than steps ({opts['steps']})")


def make_bench_batches(tokenizer, *, batch_size: int, seq_len: int, steps: int, padding: str = "fixed", data=None, seed: int = 0):
    """The list of micro-batches both runs train on, built once from the shipped data.

    Returns:
        (batches, padding_stats) where batches is a list of `steps` dicts of CPU tensors.
    """
    batches = qdata.build_batches(tokenizer, batch_size=batch_size, steps=steps, max_len=seq_len,
                                  padding=padding, data=data, seed=seed, require_all=True)
    return batches, qdata.padding_stats(batches)


def run_bench(progress: bool = True, log=print, command: str | None = None, **options: Any) -> dict[str, Any]:
    """Run the same QLoRA fine-tune eagerly and compiled, and compare.

    Args:
        progress: show progress bars.
        log: where one-line status messages go (`print` by default).
        command: the command line to record in the results (defaults to `sys.argv`).
        **options: any of `DEFAULTS` (model, quant, steps, batch_size, seq_len, padding,
            device, dtype, lora_r, lora_alpha, lr, warmup, seed, mode, backend, data,
            attn_implementation).

    Returns:
        The results dict (see `write_results` for the file): device, versions, command,
        date, model, options, per-run summaries under `eager` and `compiled`, and
        `graph_breaks`, `break_reasons`, `fullgraph_ok`, `compilations`, `recompilations`,
        `recompile_reasons`, `compile_s`, `speedup`, `max_abs_loss_diff`, `padding`.

    Raises:
        ValueError: for an unknown option or a bad value.
    """
    opts = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None or k in ("mode",)}}
    _validate(opts)
    device, dtype = resolve_device_dtype(opts["device"], opts["dtype"])
    log(f"==> loading {opts['model']} ({opts['quant']}, {dtype}) on {device}")
    model, tok = models.load_model(
        opts["model"], quant=opts["quant"], lora=True, lora_r=opts["lora_r"], lora_alpha=opts["lora_alpha"],
        dtype=dtype, device=device, attn_implementation=opts["attn_implementation"], seed=opts["seed"],
    )
    batches, pad_stats = make_bench_batches(
        tok, batch_size=opts["batch_size"], seq_len=opts["seq_len"], steps=opts["steps"],
        padding=opts["padding"], data=opts["data"], seed=opts["seed"],
    )
    cfg = TrainConfig(steps=opts["steps"], lr=opts["lr"], seed=opts["seed"], progress=progress)
    runs = side_by_side(model, batches, cfg, backend=opts["backend"], mode=opts["mode"], log=log)
    return _assemble(opts, device, dtype, runs, pad_stats, command)


def side_by_side(model, batches, cfg: TrainConfig, *, backend: str = "inductor", mode: str | None = None, log=print) -> dict[str, Any]:
    """Train `model` eagerly, then compiled from the same starting weights, on the same batches.

    The trainable parameters are snapshotted before the eager run and restored before the
    compiled one, so both start from the same point; the frozen (quantized) weights are
    shared, never copied. The compiled run goes through `diagnostics.CompileCounter`.

    Args:
        model: a causal LM (PEFT or plain) already on its device.
        batches: the list of micro-batches both runs use.
        cfg: the training options, shared by both runs.
        backend: torch.compile backend.
        mode: torch.compile mode (None for the default).
        log: where one-line status messages go.

    Returns:
        `eager` and `compiled` history DataFrames, `breaks` (a graph-break report),
        `fullgraph` (the fullgraph check) and `counter` (the CompileCounter).
    """
    device = next(model.parameters()).device
    start = trainable_state(model)
    log("==> eager run")
    eager = train(model, batches, cfg, label="eager")

    log("==> graph-break check (explain + fullgraph)")
    first = {k: v.to(device) for k, v in batches[0].items()}
    breaks = diagnostics.graph_breaks(model, **first)
    full = diagnostics.check_fullgraph(model, **first)
    torch.compiler.reset()

    log(f"==> compiled run (backend={backend}, mode={mode or 'default'})")
    load_trainable_state(model, start)
    counter = diagnostics.CompileCounter(backend=backend)
    compiled_fn = counter.compile(model, mode=mode)
    compiled = train(model, batches, cfg, forward=compiled_fn, label="compiled")
    return {"eager": eager, "compiled": compiled, "breaks": breaks, "fullgraph": full, "counter": counter}


def mark_dynamic(forward: Callable[..., Any], dims: dict[str, int]) -> Callable[..., Any]:
    """Wrap `forward` so that every batch has `dims` (key -> dimension) marked dynamic first.

    `torch._dynamo.mark_dynamic` marks a tensor, not a position, so it has to be applied to
    each new batch before the compiled call; keys a batch lacks are skipped.
    """
    def call(**batch):
        for key, dim in dims.items():
            if key in batch:
                torch._dynamo.mark_dynamic(batch[key], dim)
        return forward(**batch)

    return call


def warm_shapes(model, batches, forward: Callable[..., Any] | None = None) -> int:
    """One untimed forward and backward per distinct batch shape; the weights are left as they were.

    Why: on a GPU the first step at a batch length the process has not run before costs about
    100 ms more than later steps at that length, eager and compiled alike (on the H200 with the
    4-layer 1B shape: ~130-200 ms against ~20-35 ms; a since-removed probe,
    `results/default_step_probe_h200.json`). It is paid once per length per process, outside
    the compiler: a compiled run after an eager pass over the same lengths steps at 20 ms from
    its first new length. So when runs are compared on variable lengths, whichever runs first
    pays for every length, and its median step says so. Warming every shape once first makes
    each run's step times its own.

    Args:
        model: the model; its gradients are cleared afterwards (set to None) and no optimizer
            steps, so the weights do not change.
        batches: the batches that will be timed (one of each shape is run).
        forward: what to call instead of `model` (e.g. an autocast wrapper).

    Returns:
        The number of distinct shapes run.
    """
    forward = model if forward is None else forward
    device = next(model.parameters()).device
    seen = set()
    for batch in batches:
        shape = tuple(batch["input_ids"].shape)
        if shape in seen:
            continue
        seen.add(shape)
        out = forward(**{k: v.to(device) for k, v in batch.items()})
        out.loss.backward()
        del out
    model.zero_grad(set_to_none=True)
    sync(device)
    return len(seen)


def compiled_run(
    model,
    batches,
    cfg: TrainConfig,
    *,
    start: dict | None = None,
    dynamic_dims: dict[str, int] | None = None,
    label: str = "compiled",
    **compile_kwargs: Any,
):
    """One compiled training run, counted: the building block of the recompilation studies.

    Args:
        model: the model (its trainable weights are reset to `start` first, when given).
        batches: the micro-batches to train on.
        cfg: training options.
        start: a `trainable_state` snapshot to restore before the run.
        dynamic_dims: batch key -> dimension to `torch._dynamo.mark_dynamic` on every batch
            (e.g. `{"input_ids": 1, "attention_mask": 1, "labels": 1}` for the sequence).
        label: the history's `run` name.
        **compile_kwargs: `backend`, `mode`, `dynamic`, `fullgraph`, `options`.

    Returns:
        (history DataFrame, CompileCounter).
    """
    torch.compiler.reset()
    if start is not None:
        load_trainable_state(model, start)
    counter = diagnostics.CompileCounter(backend=compile_kwargs.pop("backend", "inductor"))
    compiled = counter.compile(model, **compile_kwargs)
    forward = mark_dynamic(compiled, dynamic_dims) if dynamic_dims else compiled
    return train(model, batches, cfg, forward=forward, label=label), counter


def compare(runs: dict[str, Any], warmup: int = 3) -> dict[str, Any]:
    """The figures of a `side_by_side` result: summaries, speedup, loss parity, compile counts."""
    e, c = summarize(runs["eager"], warmup), summarize(runs["compiled"], warmup)
    breaks, full, counter = runs["breaks"], runs["fullgraph"], runs["counter"]
    return {
        "eager": e,
        "compiled": c,
        "graph_breaks": int(breaks.graph_break_count),
        "break_reasons": list(breaks.break_reasons),
        "fullgraph_ok": bool(full.ok),
        "fullgraph_error": full.error,
        "compilations": int(counter.compilations),
        "recompilations": int(counter.recompilations),
        "recompile_reasons": list(counter.recompile_reasons),
        "compile_s": float(counter.compile_s),
        "speedup": e["median_step_ms"] / c["median_step_ms"],
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(e["losses"], c["losses"])),
    }


def _assemble(opts, device, dtype, runs, pad_stats, command) -> dict[str, Any]:
    if command is None:
        command = shlex.join(sys.argv) if sys.argv and sys.argv[0] else "run_bench()"
    return {
        "device": env.device_info(device),
        "versions": env.versions(),
        "command": command,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": opts["model"],
        "options": {**opts, "dtype": str(dtype).replace("torch.", ""), "device": str(device)},
        **compare(runs, int(opts["warmup"])),
        "padding": pad_stats,
        "history": {k: runs[k].to_dict(orient="list") for k in ("eager", "compiled")},
    }


def write_results(results: dict[str, Any], out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    """Write `results.json` (and `loss_curves.png`) into `out_dir`.

    Returns:
        name -> path of each file written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json"}
    paths["json"].write_text(json.dumps(results, indent=2, default=str) + "\n")
    if plot:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from ..report import plots

        paths["loss_png"] = out / "loss_curves.png"
        fig = plots.plot_loss_curves(results, path=paths["loss_png"])
        import matplotlib.pyplot as plt

        plt.close(fig)
    return paths


def markdown_table(paths: list[str | Path]) -> str:
    """A Markdown table of bench results files, one row each (what the README shows).

    Args:
        paths: `results.json` files written by `qlora-nb bench`.

    Returns:
        The table, ending with a newline.
    """
    rows = table_header(["file", "device", "model", "batch x len", "eager ms/step", "compiled ms/step", "speedup",
                         "peak GiB eager / compiled", "breaks", "compilations", "compile s", "max loss diff"])
    for path in paths:
        r = json.loads(Path(path).read_text())
        o, e, c = r["options"], r["eager"], r["compiled"]
        rows.append(
            f"| `{Path(path).name}` | {r['device']['name']} | {r['model']} ({o['quant']}, {o['dtype']}) "
            f"| {o['batch_size']} x {o['seq_len']} | {e['median_step_ms']:.1f} | {c['median_step_ms']:.1f} "
            f"| {r['speedup']:.2f}x | {e['peak_mem_gib']:.2f} / {c['peak_mem_gib']:.2f} | {r['graph_breaks']} "
            f"| {r['compilations']} | {r['compile_s']:.1f} | {r['max_abs_loss_diff']:.1e} |"
        )
    return "\n".join(rows) + "\n"
