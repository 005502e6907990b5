"""The run dict of one peer: built from per-step records, or an error; and which ``ours`` wins.

Why it exists: every peer, whatever library trains it and in whichever process, must come back
as the same record, so that one table and one set of plots compare them; and a peer that fails
must come back as a row that says why, never as a missing row. Each run dict: ``name``,
``batch_size``, ``seq_len``, ``steps``, ``warmup``, ``median_step_ms``, ``tokens_per_s`` and its
twin ``real_tokens_per_s`` (the median over the steps after warm-up of each step's real,
non-padding tokens, :func:`qlora_nb_utils.data.packing.real_tokens` of the batch as written,
over that step's time: the same count for every peer, Unsloth's child included), ``mfu`` (model FLOPs of
:func:`qlora_nb_utils.bench.flops.train_step_flops`, the same for every peer, over the measured
matmul rate), ``peak_mem_gib``, ``compile_s`` (first step minus the median step: compilation
and first-call costs), ``losses``, ``step_ms``, ``notes``, ``options``; or ``error``.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

__all__ = ["summarize_run", "error_run", "pick_ours"]


def summarize_run(name: str, *, losses: Sequence[float], step_ms: Sequence[float], tokens: Sequence[int],
                  peak_mem_gib: float, batch_size: int, seq_len: int, warmup: int,
                  flops_per_step: float | None = None, peak_tflops: float | None = None,
                  notes: str = "", options: dict | None = None) -> dict[str, Any]:
    """Build the run dict of the schema from per-step records.

    Raises:
        ValueError: no step after ``warmup`` or lists of different lengths.
    """
    if not len(losses) == len(step_ms) == len(tokens):
        raise ValueError(f"per-step lists differ in length: {len(losses)}, {len(step_ms)}, {len(tokens)}")
    steady_ms = list(step_ms)[warmup:]
    if not steady_ms:
        raise ValueError(f"no step left after warmup={warmup} (ran {len(step_ms)})")
    median_ms = statistics.median(steady_ms)
    tps = statistics.median(t / (ms / 1e3) for t, ms in list(zip(tokens, step_ms))[warmup:])
    mfu = None
    if flops_per_step and peak_tflops:
        from qlora_nb_utils.bench.flops import mfu as _mfu

        mfu = _mfu(flops_per_step, median_ms / 1e3, peak_tflops * 1e12)
    return {
        "name": name, "batch_size": batch_size, "seq_len": seq_len, "steps": len(step_ms),
        "warmup": warmup, "median_step_ms": median_ms, "tokens_per_s": tps, "real_tokens_per_s": tps, "mfu": mfu,
        "peak_mem_gib": float(peak_mem_gib), "compile_s": max(0.0, (step_ms[0] - median_ms) / 1e3),
        "first_step_s": step_ms[0] / 1e3, "losses": [float(x) for x in losses],
        "step_ms": [float(x) for x in step_ms], "notes": notes, "options": options or {},
    }


def error_run(name: str, error: str, *, batch_size: int, seq_len: int, notes: str = "") -> dict[str, Any]:
    """The run dict of a peer that could not run: ``error`` says why."""
    return {"name": name, "batch_size": batch_size, "seq_len": seq_len, "error": error, "notes": notes}


def _from_history(name: str, hist, ctx: dict, notes: str, options: dict) -> dict[str, Any]:
    return summarize_run(name, losses=list(hist["loss"]), step_ms=list(hist["step_ms"]),
                         tokens=list(hist["tokens"]), peak_mem_gib=float(hist["peak_mem_gib"].max()),
                         batch_size=ctx["batch_size"], seq_len=ctx["seq_len"], warmup=ctx["warmup"],
                         flops_per_step=ctx.get("flops_per_step"), peak_tflops=ctx.get("peak_tflops"),
                         notes=notes, options=options)


def pick_ours(runs: list[dict]) -> list[dict]:
    """Name the best ``ours`` variant ``ours`` at each shape; the others ``ours-<variant>``.

    The best is the fastest (median step) whose peak memory is at or below Unsloth's at the
    same shape when Unsloth ran; else the fastest. Runs with an error never win. The winner
    gets ``memory_cap_gib`` (the cap it was held to, or None).

    Args:
        runs: run dicts; variants carry ``variant``.

    Returns:
        The same runs (modified in place), in the same order.
    """
    shapes = {(r["batch_size"], r["seq_len"]) for r in runs}
    for shape in shapes:
        here = [r for r in runs if (r["batch_size"], r["seq_len"]) == shape]
        ours = [r for r in here if r.get("variant") and (r["name"] == "ours" or r["name"].startswith("ours-"))]
        for r in ours:
            r["name"] = f"ours-{r['variant']}"
        unsloth = next((r for r in here if r["name"] == "unsloth" and "error" not in r), None)
        cap = unsloth["peak_mem_gib"] if unsloth else None
        ok = [r for r in ours if "error" not in r]
        within = [r for r in ok if cap is None or r["peak_mem_gib"] <= cap]
        pool = within or ok
        if pool:
            best = min(pool, key=lambda r: r["median_step_ms"])
            best["name"] = "ours"
            best["memory_cap_gib"] = cap
            best["within_memory_cap"] = bool(within)
    return runs


def _one_line(run: dict) -> str:
    """A run in one log line (an error, or speed, memory and compile time when there was one)."""
    if "error" in run:
        return f"ERROR {run['error']}"
    compiled = "no compile" if run.get("compile_s") is None else f"compile {run['compile_s']:.1f} s"
    return f"{run['median_step_ms']:.1f} ms/step, {run['peak_mem_gib']:.2f} GiB, {compiled}"
