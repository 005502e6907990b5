"""Eager against compiled on the very same batches: the building blocks of the notebooks' runs.

Why it exists: a speed-up is only honest when both sides see the same things. `side_by_side`
trains a model eagerly, restores its trainable weights and trains it compiled on the same list
of batches with the same seed; `compare` turns the two histories into the figures (medians after
warm-up, compile time apart, loss parity, compile counts). `compiled_run` (`CompiledRun` when a
run is advanced a compilation at a time), `mark_dynamic` and
`warm_shapes` are what the recompilation studies (notebook 04, the compile matrix) build on. The
main job (`main_job.run_bench`) compares three runs instead (HF eager, plain compile and the
fast path) and keeps these for the notebooks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .. import diagnostics
from ..training.device import sync
from ..training.loop import (
    TrainConfig,
    adamw,
    load_trainable_state,
    summarize,
    train,
    trainable_params,
    trainable_state,
    warmup_schedule,
)

__all__ = ["side_by_side", "mark_dynamic", "warm_shapes", "CompiledRun", "compiled_run", "compare"]


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

    Why: on a GPU the first step at a batch length the process has not run before costs much
    more than later steps at that length, eager and compiled alike. It is paid once per length
    per process, outside the compiler: a compiled run after an eager pass over the same lengths
    steps at its steady pace from its first new length. So when runs are compared on variable lengths, whichever runs first
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


class CompiledRun:
    """One compiled training run, counted, that can be advanced a compilation at a time.

    Why: a notebook cell that trains through several compilations waits for all of them, and the
    recompilation studies are about exactly those. ``advance()`` trains up to the end of the next
    step that compiled, so each cell waits for one compile and shows what made it; ``finish()``
    trains the rest. The optimizer, the learning-rate schedule, the batches and the seeding are those
    of one uninterrupted :func:`~qlora_nb_utils.training.train` call (``start_step`` resumes it), so
    the history is the same however the run is cut.

    Args:
        model: the model (its trainable weights are reset to `start` first, when given).
        batches: the micro-batches to train on.
        cfg: training options.
        start: a `trainable_state` snapshot to restore before the run.
        dynamic_dims: batch key -> dimension to `torch._dynamo.mark_dynamic` on every batch
            (e.g. `{"input_ids": 1, "attention_mask": 1, "labels": 1}` for the sequence).
        label: the history's `run` name.
        **compile_kwargs: `backend`, `mode`, `dynamic`, `fullgraph`, `options`.
    """

    def __init__(self, model, batches, cfg: TrainConfig, *, start: dict | None = None,
                 dynamic_dims: dict[str, int] | None = None, label: str = "compiled", **compile_kwargs: Any):
        if not batches:
            raise ValueError("CompiledRun needs at least one batch")
        self.optimizer = adamw(trainable_params(model), cfg)  # refused before anything is compiled
        torch.compiler.reset()
        if start is not None:
            load_trainable_state(model, start)
        self.model, self.batches, self.cfg, self.label = model, batches, cfg, label
        self.counter = diagnostics.CompileCounter(backend=compile_kwargs.pop("backend", "inductor"))
        compiled = self.counter.compile(model, **compile_kwargs)
        self.forward = mark_dynamic(compiled, dynamic_dims) if dynamic_dims else compiled
        self.scheduler = warmup_schedule(self.optimizer, cfg.warmup_steps)
        self.step = 0  # the next step to run
        self._parts: list = []

    @property
    def done(self) -> bool:
        """Whether every step of ``cfg.steps`` has run."""
        return self.step >= self.cfg.steps

    def _train(self, until: int, progress: bool):
        part = train(self.model, self.batches, dataclasses.replace(self.cfg, steps=until, progress=progress),
                     forward=self.forward, label=self.label, optimizer=self.optimizer,
                     scheduler=self.scheduler, start_step=self.step)
        self.step = until
        self._parts.append(part)
        return part

    def advance(self) -> str:
        """Train up to the end of the next step that compiles (or to the last step); one line on what ran."""
        if self.done:
            return f"{self.label}: all {self.cfg.steps} steps already ran"
        first, before = self.step, self.counter.compilations
        while not self.done and self.counter.compilations == before:
            self._train(self.step + 1, progress=False)
        steps = f"step {first}" if self.step - 1 == first else f"steps {first}-{self.step - 1}"
        if self.counter.compilations == before:
            return f"{self.label}: {steps}, no compilation; the run is complete"
        why = (self.counter.recompile_reasons or ["-"])[-1] if self.counter.compilations > 1 else "the first call"
        return (f"{self.label}: {steps}; compilation {self.counter.compilations} at step {self.step - 1} "
                f"({self.counter.compile_s:.1f} s of compiling so far), because of: {why}")

    def finish(self):
        """Train the steps left (with ``cfg``'s progress bar) and return the whole run's history."""
        if not self.done:
            self._train(self.cfg.steps, progress=self.cfg.progress)
        return self.history()

    def history(self):
        """The history of the steps run so far, as one ``train`` call returns it."""
        import pandas as pd

        frame = pd.concat(self._parts, ignore_index=True) if self._parts else pd.DataFrame()
        if len(frame):
            frame["peak_mem_gib"] = frame["step_peak_mem_gib"].cummax()
        return frame


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

    The whole of a :class:`CompiledRun` in one call (its arguments are these).

    Returns:
        (history DataFrame, CompileCounter).
    """
    run = CompiledRun(model, batches, cfg, start=start, dynamic_dims=dynamic_dims, label=label, **compile_kwargs)
    return run.finish(), run.counter


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
