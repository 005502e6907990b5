"""For users of HF `Trainer` / TRL `SFTTrainer`: through `optimize()`, or with `torch_compile=True`.

The fast route is `optimized_trainer(trainer)`: build the trainer as usual (without
`torch_compile`), then `with optimized_trainer(trainer) as opt: trainer.train()`. It shows
`optimize()` a sample of the trainer's own batches (so its choices fit the collator's shapes),
makes the model's forward the optimized step for the Trainer's calls
(`compile.hf_forward`: gradient accumulation's `num_items_in_batch`, TRL's per-token fused
head), takes over the Trainer's `gradient_checkpointing=True` (the recipe checkpoints its own
way, and the Trainer's would re-enable it on every layer at `train()`), and undoes it all.

The other route, for comparison and for users who keep `torch_compile=True`:

Most people will not write a training loop: they set `torch_compile=True` and let the
Trainer call `torch.compile(model)`. The Trainer then also enables gradient checkpointing
itself (`gradient_checkpointing=True` calls `gradient_checkpointing_enable()`, which registers
transformers' require-grad hook *after* any per-model patch could have run), so the patch must
be in place before the Trainer is built: `trainer_patches(model)` applies our patches both to
the model and globally (so hooks registered later are the traceable kind), and undoes them.

`count_graph_breaks()` measures what happened during a block of code, by reason, from Dynamo's
own `counters["graph_break"]` (as a difference, since the counters are process-wide and a
Trainer compiles in places we do not call ourselves).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from typing import Any, Iterator

import torch

from ..compile.patches import input_require_grads, use_cache_warning

__all__ = ["BreakCount", "count_graph_breaks", "trainer_patches", "optimized_trainer"]
_SEQ_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")


@dataclasses.dataclass
class BreakCount:
    """Graph breaks counted during a `count_graph_breaks` block.

    Attributes:
        by_reason: first line of each break reason -> how many times it happened.
    """

    by_reason: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        """All breaks counted."""
        return sum(self.by_reason.values())


@contextlib.contextmanager
def count_graph_breaks() -> Iterator[BreakCount]:
    """`with count_graph_breaks() as c: trainer.train()` then read `c.total`, `c.by_reason`."""
    from torch._dynamo.utils import counters

    before = dict(counters["graph_break"])
    result = BreakCount()
    try:
        yield result
    finally:
        for reason, n in counters["graph_break"].items():
            new = n - before.get(reason, 0)
            if new:
                key = reason.splitlines()[0]
                result.by_reason[key] = result.by_reason.get(key, 0) + new


@contextlib.contextmanager
def trainer_patches(model: torch.nn.Module) -> Iterator[list]:
    """Apply the package's patches for a Trainer-driven compiled run, and undo them on exit.

    Args:
        model: the (PEFT) model about to be handed to the Trainer.

    Yields:
        The patch handles (already applied).
    """
    handles = [input_require_grads.apply(), input_require_grads.apply(model), use_cache_warning.apply(model)]
    try:
        yield handles
    finally:
        for handle in reversed(handles):
            handle.undo()


def _sample_batches(trainer: Any, n: int) -> tuple[list[dict], bool]:
    """Up to ``n`` of the trainer's own training batches, leaving every RNG as it was.

    Returns:
        The batches (sequence tensors only) and whether they are all the epoch's batches.
    """
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        loader = trainer.get_train_dataloader()
        batches = [{k: v for k, v in b.items() if k in _SEQ_KEYS and torch.is_tensor(v)}
                   for b in itertools.islice(loader, n)]
        try:
            whole = len(loader) <= n
        except TypeError:  # an iterable dataset: its length is unknown
            whole = False
    random.setstate(py_state)
    np.random.set_state(np_state)
    return batches, whole


@contextlib.contextmanager
def optimized_trainer(trainer: Any, *, sample_batches: int = 64, **options: Any) -> Iterator[Any]:
    """Train a built HF ``Trainer`` / TRL ``SFTTrainer`` through :func:`qlora_nb_utils.optimize`.

    ``with optimized_trainer(trainer) as opt: trainer.train()``; ``opt.description`` says what
    was chosen. On exit everything is undone: the model's forward, the checkpointing and the
    trainer's arguments are as they were (the non-LoRA weights stay in the compute dtype).

    Args:
        trainer: a ``transformers.Trainer`` (or subclass, e.g. TRL's ``SFTTrainer``) built with
            ``torch_compile=False`` on a PEFT model, on one device.
        sample_batches: how many of the trainer's batches ``optimize()`` sees to choose from.
            When the epoch has more and they show more than one shape, CUDA graphs are not
            chosen (a later batch could add a graph per new shape).
        **options: :func:`~qlora_nb_utils.compile.fast_path.optimize`'s (``grad_ckpt``,
            ``max_memory_gib``, ``mode``, ``backend``, ...), built into one
            :class:`~qlora_nb_utils.compile.OptimizeOptions` (and so checked) before a batch is
            drawn. Without ``grad_ckpt``, the trainer's ``gradient_checkpointing=True`` becomes
            ``grad_ckpt=True``; without ``steps``, the trainer's ``max_steps`` (times its gradient
            accumulation) is the job the compile scope is weighed against.

    Yields:
        The :class:`~qlora_nb_utils.compile.fast_path.Optimized` handle.

    Raises:
        ValueError: ``torch_compile=True`` (the model would be compiled twice), more than one
            device or process, DeepSpeed/FSDP, a bad ``sample_batches`` or a bad option.
        TypeError: an option ``optimize()`` does not have.
    """
    from ..compile import OptimizeOptions
    from ..compile.fast_path import optimize

    args = trainer.args
    if getattr(args, "torch_compile", False):
        raise ValueError("optimized_trainer compiles the model through optimize(); build the trainer with "
                         "torch_compile=False (with torch_compile=True it would be compiled a second time)")
    if getattr(args, "n_gpu", 1) > 1 or getattr(args, "world_size", 1) > 1:
        raise ValueError("optimized_trainer is for one device and one process (use the FSDP2 route in "
                         "qlora_nb_utils.distributed for several)")
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError("optimized_trainer does not combine with DeepSpeed or FSDP")
    if not isinstance(sample_batches, int) or isinstance(sample_batches, bool) or sample_batches < 1:
        raise ValueError(f"sample_batches must be an integer >= 1, got {sample_batches!r}")
    model = trainer.model
    took_ckpt = bool(getattr(args, "gradient_checkpointing", False))
    if took_ckpt:
        options.setdefault("grad_ckpt", True)
    if getattr(args, "max_steps", -1) > 0:  # the job's length, for the compile scope: one compiled step a micro-batch
        options.setdefault("steps", args.max_steps * max(1, getattr(args, "gradient_accumulation_steps", 1)))
    own_loop = options.setdefault("step_graph", False) is False  # the Trainer launches each step itself
    checked = OptimizeOptions.from_dict(options)  # before the data loader runs
    batches, whole = _sample_batches(trainer, sample_batches)
    shapes = {tuple(b["input_ids"].shape) for b in batches}
    guard_graphs = checked.mode == "auto" and not whole and len(shapes) > 1
    opt = optimize(model, checked, batches=batches, **({"mode": "default"} if guard_graphs else {}))
    if own_loop:
        opt.reasons["step_graph"] = "the Trainer's loop launches each step: not captured"
    if guard_graphs:
        opt.reasons["mode"] = (f"{len(shapes)} shapes in the first {len(batches)} batches and more to come: "
                               "no CUDA graphs")
    if took_ckpt:
        opt.reasons["ckpt_layers"] += " (the Trainer's gradient_checkpointing=True, taken over)"
    own_forward = vars(model).get("forward")
    had_original = "_original_forward" in vars(model)
    try:
        opt.install(model)
        if took_ckpt:
            args.gradient_checkpointing = False
        yield opt
    finally:
        args.gradient_checkpointing = took_ckpt or args.gradient_checkpointing
        opt.undo()
        # accelerate wraps the forward it finds for mixed precision (and keeps _original_forward):
        # put back exactly what the model had before, whoever wrapped it since
        if own_forward is None:
            vars(model).pop("forward", None)
        else:
            model.forward = own_forward
        if not had_original:
            vars(model).pop("_original_forward", None)
