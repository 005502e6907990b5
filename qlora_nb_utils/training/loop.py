"""One explicit training loop, run the same way eager or compiled.

Why not `transformers.Trainer`? Because the question every notebook asks is "what does
`torch.compile` change?", and that is only answerable when the two runs differ in nothing
else: same model weights, same batches in the same order, same optimizer, same seed, same
timers. A loop of forty lines that we can read end to end makes that easy to see. (Notebook
users of `Trainer`/TRL are covered elsewhere; this loop is the measuring instrument.)

What it records per optimizer step, into a pandas DataFrame: the loss, the wall time of the
step (with a device sync before the clock is read, so asynchronous GPU work is counted),
real (non-padding) tokens and tokens/s, and peak memory, twice: `peak_mem_gib` is the peak
since the run started and `step_peak_mem_gib` the peak within that step alone. The two differ
where the first steps hold something later steps do not: a compiled step's first call compiles
(and, where autotuning is on, Inductor benchmarks its kernels on real buffers), so "the compiled
run peaked higher" and "each compiled training step peaks higher" are different claims, and
`summarize` reports both.
On CUDA both come from `torch.cuda.max_memory_allocated`, reset at the start of each step; on
a CPU no allocator tracks peaks, so both are the process's resident set size after the step,
which includes the Python heap and everything loaded before the run: compare CPU figures only
with care.

Ctrl-C (a notebook's "interrupt kernel") loses no trained adapter: the loop catches the
interrupt, saves the LoRA adapter, and re-raises `TrainingInterrupted`, which carries the
partial history and the folder the adapter went to.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch

from ..data.packing import real_tokens
from .device import peak_mem_gib, reset_peak, sync
from .gpulock import step_lock

if TYPE_CHECKING:  # pandas is imported when a history is built: not before a run's first step
    import pandas as pd

__all__ = [
    "TrainConfig",
    "TrainingInterrupted",
    "train",
    "summarize",
    "save_adapter",
    "trainable_state",
    "load_trainable_state",
    "warmup_schedule",
]


@dataclasses.dataclass
class TrainConfig:
    """Options of one training run.

    Attributes:
        steps: optimizer steps to run.
        lr: AdamW learning rate (constant after `warmup_steps` of linear warm-up).
        weight_decay: AdamW weight decay.
        grad_accum: micro-batches per optimizer step.
        max_grad_norm: clip the gradient norm to this; None disables clipping.
        warmup_steps: linear learning-rate warm-up steps.
        seed: seeds torch before the first step (dropout, if any, is then reproducible).
        progress: show a tqdm progress bar.
        adapter_dir: where to save the LoRA adapter at the end (and on Ctrl-C). When None,
            nothing is saved at the end, and an interrupt saves to `interrupt_dir`.
        interrupt_dir: where an interrupted run saves its adapter when `adapter_dir` is None.
    """

    steps: int = 30
    lr: float = 2e-4
    weight_decay: float = 0.0
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    seed: int = 0
    progress: bool = True
    adapter_dir: str | Path | None = None
    interrupt_dir: str | Path = "runs/interrupted"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


class TrainingInterrupted(KeyboardInterrupt):
    """Raised when a run is interrupted; the adapter trained so far has been saved.

    Attributes:
        history: the DataFrame of the steps completed before the interrupt.
        adapter_dir: the folder the adapter was saved to (None if the model has no adapter).
    """

    def __init__(self, history: pd.DataFrame, adapter_dir: Path | None):
        super().__init__(f"training interrupted after {len(history)} steps; adapter saved to {adapter_dir}")
        self.history = history
        self.adapter_dir = adapter_dir


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the trainable parameters (the LoRA weights in a PEFT model).

    Args:
        model: the model.

    Returns:
        name -> cloned tensor, for `load_trainable_state` to restore, so that an eager and a
        compiled run can start from exactly the same adapter.
    """
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (from `trainable_state`) back into the model's trainable parameters.

    Raises:
        KeyError: when the model's trainable parameters do not match the state's names.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if params.keys() != state.keys():
        missing = sorted(set(state) ^ set(params))[:5]
        raise KeyError(f"trainable parameters do not match the saved state, e.g. {missing}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "_orig_mod", model)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(_unwrap(model).parameters()).device


def save_adapter(model: torch.nn.Module, folder: str | Path) -> Path | None:
    """Save the PEFT adapter of `model` (compiled or not) to `folder`.

    Returns:
        The folder, or None when the model carries no adapter (nothing to save).
    """
    inner = _unwrap(model)
    if not hasattr(inner, "peft_config"):
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    inner.save_pretrained(folder)
    return folder


def _micro_batches(batches: Iterable[dict]) -> Callable[[], dict]:
    """Cycle over `batches` forever (a finite list is reused, epoch after epoch)."""
    source = list(batches) if isinstance(batches, Sequence) else None
    if source is not None and not source:
        raise ValueError("batches is empty: nothing to train on")
    state = {"it": iter(source if source is not None else batches)}

    def nxt() -> dict:
        try:
            return next(state["it"])
        except StopIteration:
            if source is None:
                raise ValueError("the batch iterator ran out before the last step; pass a list to cycle it") from None
            state["it"] = iter(source)
            return next(state["it"])

    return nxt


def _rotate(batches: Iterable[dict], start: int) -> Iterable[dict]:
    """A list cycled from item ``start mod len`` on (anything else as it is: it cannot be resumed)."""
    if start and isinstance(batches, Sequence) and len(batches):
        k = start % len(batches)
        return list(batches[k:]) + list(batches[:k])
    if start and not isinstance(batches, Sequence):
        raise ValueError("start_step > 0 needs batches as a list (a step's batch is found by its index)")
    return batches


def trainable_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the loop's optimizer steps; a model without any is refused, with the likely reason."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameter (did you forget LoRA, or freeze everything?)")
    return params


def adamw(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """The loop's optimizer when none is given: AdamW at ``cfg.lr`` and ``cfg.weight_decay``."""
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The loop's LR schedule: linear warm-up over `warmup_steps`, then constant."""
    warm = max(warmup_steps, 1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def train(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    cfg: TrainConfig | None = None,
    *,
    forward: Callable[..., Any] | None = None,
    label: str = "eager",
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    start_step: int = 0,
    on_step: Callable[[int, dict], None] | None = None,
    step_graph: Callable[..., dict] | bool | None = None,
) -> pd.DataFrame:
    """Train `model` for `cfg.steps` optimizer steps and return the per-step history.

    Args:
        model: a causal LM whose forward takes the batch's keys and returns `.loss`
            (a PEFT model, or any HF model). Its trainable parameters are optimized.
        batches: micro-batches (dicts of tensors with `input_ids`, `attention_mask`,
            `labels`); a list is cycled when the run needs more.
        cfg: run options; defaults to `TrainConfig()`.
        forward: the callable to run the forward pass with, e.g. `torch.compile(model)`;
            defaults to `model` itself (eager). This is the only thing that differs between
            an eager and a compiled run.
        label: a name stored in the history's `run` column ("eager", "compiled", ...).
        optimizer: an optimizer to use instead of a fresh AdamW over the trainable params.
        scheduler: an LR scheduler of `optimizer` to step after each optimizer step, instead of
            the linear warm-up over `cfg.warmup_steps` (pass both to save and restore them).
        start_step: resume at this step: the run does steps `start_step .. cfg.steps - 1`, and
            step `i` trains on micro-batch `i mod len(batches)` of a list (with `grad_accum`
            1), as the uninterrupted run did. torch is not reseeded: the caller restores the
            RNG state it saved at that step.
        on_step: called as `on_step(step, row)` after each step, outside its timer (evaluate,
            checkpoint or stop there: an exception it raises ends the run as an interrupt does
            when it is a KeyboardInterrupt, and propagates as it is otherwise).
        step_graph: capture each batch shape's whole step (forward, backward, clipping, the
            optimizer's update) as a CUDA graph and replay it (:class:`~.step_graph.StepGraphs`;
            CUDA only, ``grad_accum`` 1; the optimizer is made capturable): None (the default) does
            where ``forward`` is an optimized step that chose it (``optimize()``'s ``step_graph``:
            the step's ``prepare_step`` rides on ``opt.forward``); True, or the batch preparation to
            run outside the graph (``Optimized.prepare_step``), asks for it; False: every step runs as code.

    Returns:
        A DataFrame with one row per optimizer step of this call: `run`, `step`, `loss`, `step_ms`,
        `tokens`, `tokens_per_s`, `step_peak_mem_gib` (this step's peak), `peak_mem_gib` (the
        peak so far), `lr`, `grad_norm`.

    Raises:
        ValueError: when the model has no trainable parameter or `batches` is empty.
        TrainingInterrupted: on Ctrl-C, after saving the adapter.
    """
    cfg = cfg or TrainConfig()
    forward = model if forward is None else forward
    device = _device_of(model)
    params = trainable_params(model)
    if not 0 <= start_step < cfg.steps:
        raise ValueError(f"start_step must be in [0, steps={cfg.steps}), got {start_step}")
    if start_step == 0:
        torch.manual_seed(cfg.seed)
    opt = optimizer or adamw(params, cfg)
    sched = scheduler if scheduler is not None else warmup_schedule(opt, cfg.warmup_steps)
    next_batch = _micro_batches(_rotate(batches, start_step * cfg.grad_accum))
    graphs = None
    if step_graph is None and cfg.grad_accum == 1 and device.type == "cuda":
        step_graph = getattr(forward, "prepare_step", None)  # what optimize() chose, if it did
    if step_graph:
        if cfg.grad_accum != 1:
            raise ValueError(f"step_graph captures one micro-batch a step: grad_accum must be 1, got {cfg.grad_accum}")
        from .step_graph import StepGraphs

        graphs = StepGraphs(forward, params, opt, max_grad_norm=cfg.max_grad_norm,
                            prepare=step_graph if callable(step_graph) else None)
    rows: list[dict] = []
    model.train()
    # Garbage first: tensors that earlier work left in reference cycles (Dynamo's explain and
    # fullgraph checks leave whole forward passes so) stay allocated until the
    # collector runs, and would count in this run's peak.
    gc.collect()
    bar = _progress(cfg.steps, label, cfg.progress, start_step)
    try:
        for step in range(start_step, cfg.steps):
            with step_lock():  # a no-op unless $QLORA_NB_GPU_LOCK shares the GPU (gpulock.py)
                reset_peak(device)
                row = (_graph_step(graphs, opt, sched, next_batch, device, label, step) if graphs is not None
                       else _one_step(forward, opt, sched, params, next_batch, cfg, device, label, step))
            row["peak_mem_gib"] = max(row["step_peak_mem_gib"], rows[-1]["peak_mem_gib"] if rows else 0.0)
            rows.append(row)
            bar.update(1)
            # a first step's rate holds its warm-up (a compiled step's compile): not shown as the speed
            bar.set_postfix(loss=f"{row['loss']:.4f}", **({"tok_s": f"{row['tokens_per_s']:.0f}"} if rows[1:] else {}))
            if on_step is not None:
                on_step(step, row)
    except KeyboardInterrupt:
        bar.close()
        import pandas as pd

        history = pd.DataFrame(rows)
        saved = save_adapter(model, cfg.adapter_dir or cfg.interrupt_dir)
        raise TrainingInterrupted(history, saved) from None
    bar.close()
    if cfg.adapter_dir is not None:
        save_adapter(model, cfg.adapter_dir)
    import pandas as pd

    return pd.DataFrame(rows)


def _one_step(forward, opt, sched, params, next_batch, cfg, device, label, step) -> dict:
    # The first micro-batch reaches the device before the timer starts (as every peer's loop does:
    # the host-to-device copy of the batch is not the step's), and nothing in the step waits for the
    # device before its end: tokens are counted on the batch as given, before its copy (counted on
    # the device, the count waited for the whole backward before the optimizer could be launched,
    # a sync in the middle of every step), and the gradient norm stays a tensor until the closing
    # sync.
    host = next_batch()
    batch = _to_device(host, device)
    sync(device)
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    tokens = 0
    for i in range(cfg.grad_accum):
        if i:
            host = next_batch()
            batch = _to_device(host, device)
        tokens += real_tokens(host)
        loss = forward(**batch).loss
        (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach()
    norm = None
    if cfg.max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    lr = float(opt.param_groups[0]["lr"])  # a tensor under a compiled optimizer: copy its value now
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    loss_value = float(loss_sum) / cfg.grad_accum  # float() syncs; the timer reads after it
    return _row(label, step, loss_value, t0, tokens, lr, norm, device, peak_mem_gib(device))


def _row(label, step, loss_value, t0, tokens, lr, norm, device, step_peak_gib) -> dict:
    """A step's history row, its timer read after the device's work (refused: a loss not finite)."""
    sync(device)
    elapsed = time.perf_counter() - t0
    grad_norm = float(norm) if norm is not None else float("nan")
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"{label}: loss is {loss_value} at step {step}")
    return {
        "run": label,
        "step": step,
        "loss": loss_value,
        "step_ms": elapsed * 1e3,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "step_peak_mem_gib": step_peak_gib,
        "lr": lr,
        "grad_norm": grad_norm,
    }


def _graph_step(graphs, opt, sched, next_batch, device, label, step) -> dict:
    # _one_step's timing, with the step captured (StepGraphs): the batch is prepared inside the
    # timer, as the optimized forward prepares it there; the scheduler fills the device learning rate.
    host = next_batch()
    batch = _to_device(host, device)
    sync(device)
    t0 = time.perf_counter()
    tokens = real_tokens(host)
    lr = float(opt.param_groups[0]["lr"])
    loss, norm = graphs.step(batch)
    sched.step()
    return _row(label, step, float(loss), t0, tokens, lr, norm, device,
                max(peak_mem_gib(device), graphs.replayed_peak_gib))


def _progress(total: int, label: str, enabled: bool, initial: int = 0):
    if not enabled:
        return _NullBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=label, unit="step", leave=True)


class _NullBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kw) -> None:
        pass

    def close(self) -> None:
        pass


def summarize(history: pd.DataFrame, warmup: int = 3) -> dict[str, Any]:
    """Steady-state figures of one run: medians after `warmup` steps.

    Args:
        history: the DataFrame `train` returned.
        warmup: steps left out of the medians (compilation happens in the first ones).

    Returns:
        `median_step_ms`, `tokens_per_s` (median), `peak_mem_gib` (max over the run, compile
        steps included), `steady_peak_mem_gib` (max over the steps after `warmup`; None for a
        history without per-step peaks), `first_step_s`, `losses` (list), `steps`.

    Raises:
        ValueError: when there are no steps left after `warmup`.
    """
    steady = history.iloc[warmup:]
    if steady.empty:
        raise ValueError(f"no steps left after {warmup} warm-up steps (ran {len(history)}); run more steps")
    return {
        "steps": int(len(history)),
        "median_step_ms": float(steady["step_ms"].median()),
        "tokens_per_s": float(steady["tokens_per_s"].median()),
        "peak_mem_gib": float(history["peak_mem_gib"].max()),
        "steady_peak_mem_gib": (float(steady["step_peak_mem_gib"].max())
                                if "step_peak_mem_gib" in steady else None),
        "first_step_s": float(history["step_ms"].iloc[0] / 1e3),
        "losses": [float(x) for x in history["loss"]],
    }
