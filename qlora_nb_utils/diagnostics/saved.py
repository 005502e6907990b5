"""What a training step keeps for its backward: the saved tensors, by size, per token.

Why this module exists: a compiled step's activation memory is decided by the partitioner,
which splits the joint graph into a forward and a backward and picks the tensors that cross
between them. A memory snapshot on a GPU shows the sum; this shows the list, on any device,
so that a change to what is saved (``optimize(recompute=...)``) can be asserted by a test on
the CPU and explained in shapes (hidden-sized, intermediate-sized, per token) before a GPU
measures the peak.

:func:`saved_for_backward` runs one forward under ``torch.autograd.graph.saved_tensors_hooks``:
a compiled region saves its tensors through its autograd function, so the hook sees what the
partitioner chose. Tensors are counted once per storage (views of one buffer are one buffer),
and the model's own parameters, buffers and NF4 quantization state are left out: they are
alive whatever the step saves.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Callable

import torch

__all__ = ["SavedTensors", "saved_for_backward"]


@dataclasses.dataclass
class SavedTensors:
    """The tensors one forward saved for its backward (one row per storage).

    Attributes:
        tensors: ``(shape, dtype name, bytes)`` per storage, largest first.
        tokens: the tokens of the batch (for per-token figures).
    """

    tensors: list[tuple[tuple[int, ...], str, int]]
    tokens: int

    @property
    def total_bytes(self) -> int:
        return sum(n for _, _, n in self.tensors)

    @property
    def bytes_per_token(self) -> float:
        return self.total_bytes / max(self.tokens, 1)

    def count_last_dim(self, size: int) -> int:
        """How many saved storages have ``size`` as their last dimension and one row per token
        (e.g. the model's intermediate size: the MLP's saved activations)."""
        return sum(1 for shape, _, n in self.tensors
                   if shape and shape[-1] == size and math.prod(shape) == self.tokens * size)

    def table(self) -> list[dict[str, Any]]:
        """Rows of (shape, dtype, count, bytes per token), largest share first: for a DataFrame."""
        counts = Counter((shape, dt, n) for shape, dt, n in self.tensors)
        rows = [{"shape": shape, "dtype": dt, "count": c, "bytes_per_token": c * n / max(self.tokens, 1)}
                for (shape, dt, n), c in counts.items()]
        return sorted(rows, key=lambda r: -r["bytes_per_token"])


def _model_storages(model: torch.nn.Module | None) -> set[int]:
    if model is None:
        return set()
    kept = [*model.parameters(), *model.buffers()]
    for module in model.modules():  # bitsandbytes keeps NF4 scales on the weight's quant_state
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        for holder in (state, getattr(state, "state2", None)):
            kept += [t for t in (getattr(holder, "absmax", None), getattr(holder, "code", None)) if torch.is_tensor(t)]
    return {t.untyped_storage().data_ptr() for t in kept}


def saved_for_backward(step: Callable[..., Any], batch: dict, *, model: torch.nn.Module | None = None,
                       backward: bool = True) -> SavedTensors:
    """Run ``step(**batch)`` once and list what it saved for the backward.

    Args:
        step: the training forward (e.g. ``optimize(...).forward``); its result has ``.loss``.
        batch: one batch, as ``step`` takes it (``input_ids`` gives the token count).
        model: the model whose parameters, buffers and NF4 state are left out (None: none).
        backward: run the backward afterwards (frees the saved tensors; gradients accumulate).

    Returns:
        A :class:`SavedTensors`.

    Raises:
        ValueError: ``batch`` has no ``input_ids`` tensor.
    """
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids):
        raise ValueError("batch needs an input_ids tensor (the token count)")
    skip = _model_storages(model)
    seen: dict[int, tuple[tuple[int, ...], str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip and (ptr not in seen or storage.nbytes() > seen[ptr][2]):
            base = t if t._base is None else t._base
            seen[ptr] = (tuple(base.shape), str(t.dtype).replace("torch.", ""), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step(**batch)
    if backward:
        out.loss.backward()
    rows = sorted(seen.values(), key=lambda r: -r[2])
    return SavedTensors(tensors=rows, tokens=int(ids.numel()))
