"""What the optimized step does to each batch before the compiled graph sees it.

Why this module exists: some of the fast path's choices cannot be made inside the graph,
because they depend on a batch's *values* or must hold for every batch whatever its length.
They run here, on each call, in plain Python, and hand the graph only shapes it has seen:

* **Padding** the length up to a multiple (:func:`pad_batch`), so that unaligned lengths never
  add a compilation (an alignment guard did, on a GPU).
* **Dynamic marks** on the sequence dimension when the batches vary in length, so that the
  first compilation is already the dynamic one.
* **Labelled rows** (:func:`~qlora_nb_utils.ops.losses.labelled_rows`): the indices of the
  target rows that carry a label, so that the LM head and the loss skip padding and masked
  prompts. Reading labels is a data-dependent step that would break a ``fullgraph`` trace, so
  it happens here; the index's length is bucketed and padded to at least the most any batch
  shown to ``optimize`` needs, so the batches like those shown share one length. Without CUDA
  graphs it is marked dynamic: one compilation for every count. Under CUDA graphs it is static
  (``mark_static``), and a batch that needs more rows than any shown takes every row's length
  (``overflow_to_all``): two lengths, two compilations at most. Why static: with the count
  dynamic under CUDA graphs, the graphs were recorded again and a run held to a memory target
  (whole scope, long-tail packed rows) overshot it on its first step; static, it stayed under.
  (Its erratic steps had another cause: the document ids the flex mask captures,
  ``ops.doc_attention.document_block_mask(stable_ids=)``.)

:func:`step_forward` puts them around the compiled recipe; ``fast_path.optimize`` calls it and
``Optimized.eager`` applies the same preparation uncompiled (:func:`prepare_batch`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..ops.losses import ROW_BUCKETS, labelled_rows
from .recipe import partitioner_settings

__all__ = ["to_device", "pad_batch", "batch_shapes", "prepare_batch", "step_forward", "SEQ_KEYS"]

#: The per-token keys padding extends and the dynamic marks cover.
SEQ_KEYS = ("input_ids", "attention_mask", "labels", "position_ids", "document_ids", "shift_labels")
_PAD_FILL = {"attention_mask": 0, "labels": -100, "document_ids": -1, "shift_labels": -100}


def pad_batch(batch: dict, multiple: int, pad_token_id: int = 0) -> dict:
    """``batch`` with its sequence dimension padded on the right up to a multiple of ``multiple``.

    The new positions are masked (``attention_mask`` 0) and ignored by the loss (``labels`` -100);
    ``input_ids`` get ``pad_token_id``; ``position_ids`` continue counting; ``document_ids`` get
    the padding's document (-1). Other keys pass.
    """
    ids = batch["input_ids"]
    width = ids.shape[-1]
    extra = -width % multiple
    if extra == 0:
        return batch
    out = dict(batch)
    for key in SEQ_KEYS:
        value = batch.get(key)
        if not torch.is_tensor(value) or value.dim() < 2 or value.shape[-1] != width:
            continue
        if key == "position_ids":
            tail = value[..., -1:] + torch.arange(1, extra + 1, device=value.device, dtype=value.dtype)
            out[key] = torch.cat([value, tail], dim=-1)
        else:
            fill = _PAD_FILL.get(key, pad_token_id)
            out[key] = torch.nn.functional.pad(value, (0, extra), value=fill)
    return out


def batch_shapes(batches: list[dict] | None, multiple: int) -> list[tuple[int, int]] | None:
    """The distinct ``(batch, padded length)`` shapes of ``batches`` in order of appearance (None: unknown)."""
    if batches is None:
        return None
    seen = []
    for batch in batches:
        b, s = (int(x) for x in batch["input_ids"].shape)
        shape = (b, s + (-s % multiple if multiple > 1 else 0))
        if shape not in seen:
            seen.append(shape)
    return seen


def to_device(batch: dict, device: torch.device | str | None) -> dict:
    """``batch`` with every tensor on ``device`` (None: as it is).

    Why: a data loader hands out CPU tensors, and a compiled graph traced for a CUDA model stops
    on an input of another device (Dynamo: "found two different devices"). A ``Trainer`` moves its
    inputs before the forward; the optimized step does the same, before anything is padded.
    """
    if device is None:
        return batch
    device = torch.device(device)
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) and v.device != device else v
            for k, v in batch.items()}


def prepare_batch(batch: dict, *, multiple: int, pad_id: int, mark_dynamic: bool = False,
                  loss_rows: int = 0, min_loss_rows: int = 0, dynamic_rows: bool = True,
                  fine_rows: bool = False, device: torch.device | str | None = None) -> dict:
    """One batch as the compiled recipe takes it: on ``device``, padded, optionally marked dynamic,
    with its labelled rows.

    ``loss_rows`` (the loss's chunk count; 0: off) adds ``loss_rows`` (its length marked
    dynamic unless ``dynamic_rows`` is False, a multiple of the chunk count, at least
    ``min_loss_rows`` long) when the batch has ``labels`` and is not a per-token call
    (``token_stats``), which needs every row. ``fine_rows``: the count rounded up to a multiple
    of 64 rows only, not of a sixteenth of the rows (a loss outside the compiled graph meets any
    count without compiling again). ``device``: the model's; tensors elsewhere are moved there first
    (:func:`to_device`).
    """
    batch = to_device(batch, device)
    if multiple > 1:
        batch = pad_batch(batch, multiple, pad_id)
    if mark_dynamic:
        for key in SEQ_KEYS:
            value = batch.get(key)
            if torch.is_tensor(value) and value.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(value, value.dim() - 1)
    shifted = torch.is_tensor(batch.get("shift_labels"))  # targets already shifted (a row split by position)
    labels = batch.get("shift_labels" if shifted else "labels")
    if loss_rows and torch.is_tensor(labels) and labels.dim() == 2 and not batch.get("token_stats"):
        targets = labels.numel() if shifted else labels[:, 1:].numel()
        rows = labelled_rows(labels, buckets=targets if fine_rows else ROW_BUCKETS, multiple=loss_rows,
                             at_least=min_loss_rows, overflow_to_all=not dynamic_rows, shifted=shifted)
        if dynamic_rows:
            torch._dynamo.maybe_mark_dynamic(rows, 0)
        else:  # never made dynamic by torch's automatic dynamic shapes either
            torch._dynamo.mark_static(rows, 0)
        batch = {**batch, "loss_rows": rows}
    return batch


def step_forward(compiled: Callable[..., Any], *, multiple: int, pad_id: int, mark_dynamic: bool,
                 loss_rows: int, memory_budget: float | None, recompute_elementwise: bool = False,
                 min_loss_rows: int = 0, dynamic_rows: bool = True,
                 cache_functions: bool = False, fine_rows: bool = False,
                 device: torch.device | str | None = None) -> Callable[..., Any]:
    """``forward(**batch)``: :func:`prepare_batch` (on ``device``, the model's), then the compiled recipe (under AOTAutograd's
    settings, if any: :func:`~qlora_nb_utils.compile.recipe.partitioner_settings`)."""
    def forward(**batch: Any) -> Any:
        batch = prepare_batch(batch, multiple=multiple, pad_id=pad_id, mark_dynamic=mark_dynamic,
                              loss_rows=loss_rows, min_loss_rows=min_loss_rows, dynamic_rows=dynamic_rows,
                              fine_rows=fine_rows, device=device)
        if memory_budget is None and not recompute_elementwise and not cache_functions:
            return compiled(**batch)  # nothing to set: keep the per-step path bare
        with partitioner_settings(memory_budget, recompute_elementwise, cache_functions):
            return compiled(**batch)

    return forward


