"""For users of HF `Trainer` / TRL `SFTTrainer` with `torch_compile=True`.

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
from typing import Iterator

import torch

from ..compile.patches import input_require_grads, use_cache_warning

__all__ = ["BreakCount", "count_graph_breaks", "trainer_patches"]


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
