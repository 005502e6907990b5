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
* **Attention masks built outside the graph**: a packed batch's per-document mask
  (``ops.doc_attention``; under CUDA graphs its document ids read from one buffer, so that the
  graphs are not recorded again) or flex attention's causal block masks by sliding window
  (``ops.model_attention``).

Everything the step needs for that is one :class:`StepInputs`, made by ``optimize()``'s plan
(``Plan.step_inputs``) with what the recipe applied to the model (:class:`RecipeOptions`) inside
it; the same object goes to :func:`step_forward` (the compiled step) and to ``Optimized``
(``Optimized.inputs``: its ``prepare`` and ``eager`` reference, :meth:`StepInputs.uncompiled`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..ops.doc_attention import with_document_mask
from ..ops.losses import ROW_BUCKETS, labelled_rows
from ..ops.model_attention import with_block_masks
from .options import RecipeOptions
from .recipe import partitioner_settings

__all__ = ["StepInputs", "to_device", "pad_batch", "batch_shapes", "prepare_batch", "with_masks", "step_forward",
           "SEQ_KEYS"]

#: The per-token keys padding extends and the dynamic marks cover.
SEQ_KEYS = ("input_ids", "attention_mask", "labels", "position_ids", "document_ids", "shift_labels")
_PAD_FILL = {"attention_mask": 0, "labels": -100, "document_ids": -1, "shift_labels": -100}


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything the optimized step needs besides the batch: how each batch is prepared outside the
    graph, the settings the compile runs under, and what the recipe applied to the model.

    ``optimize()`` builds one (``Plan.step_inputs``) and hands the same object to the compiled step
    (:func:`step_forward`) and to ``Optimized`` (``Optimized.inputs``), so that the step and its
    uncompiled reference cannot drift apart. The defaults prepare nothing: a step built by hand
    names what it needs.

    Attributes:
        pad_multiple: right-pad every batch's length to a multiple of this (1: never).
        pad_id: the token padding puts in ``input_ids`` (the model's ``pad_token_id``).
        device: the model's; batch tensors elsewhere are moved there first (None: the recipe's
            device, else left where they are).
        mark_dynamic: mark the sequence dimension dynamic (lengths vary, whole scope).
        row_chunks: labelled rows for the loss, in lengths divisible by this (0: every row).
        min_rows: ... padded to at least this many (the most a batch shown needed): one length.
        fine_rows: ... or each batch its own count, in multiples of 64 (a loss outside the graph).
        cuda_graphs: the step runs under CUDA graphs: the row count static (a batch needing more
            rows than any shown takes every row) and a packed batch's document ids in one buffer.
        doc_attention: a packed batch's attention kernel (``"flex_attention"`` or ``"sdpa"``;
            None: the batches are not packed).
        block_windows: flex attention's causal block masks, by sliding window (None: not flex).
        memory_budget: Inductor's ``activation_memory_budget`` for the compile (None: torch's).
        recompute_elementwise: the backward recomputes the elementwise results its matmuls read.
        cache_functions: AOTAutograd's cache takes graphs holding autograd Functions.
        recipe: what :func:`~qlora_nb_utils.compile.recipe.prepare_fast` applied to the model
            (None: a step built by hand around a model prepared elsewhere).
    """

    pad_multiple: int = 1
    pad_id: int = 0
    device: Any = None
    mark_dynamic: bool = False
    row_chunks: int = 0
    min_rows: int = 0
    fine_rows: bool = False
    cuda_graphs: bool = False
    doc_attention: str | None = None
    block_windows: tuple[int, ...] | None = None
    memory_budget: float | None = None
    recompute_elementwise: bool = False
    cache_functions: bool = False
    recipe: RecipeOptions | None = None

    def __post_init__(self) -> None:
        if self.device is None and self.recipe is not None and self.recipe.device is not None:
            object.__setattr__(self, "device", self.recipe.device)

    @property
    def dynamic_rows(self) -> bool:
        """The labelled-row count marked dynamic (not under CUDA graphs, where it overshot a held run's target)."""
        return not self.cuda_graphs

    @property
    def settings(self) -> bool:
        """Whether the compile runs under any AOTAutograd setting (:func:`~.recipe.partitioner_settings`)."""
        return self.memory_budget is not None or self.recompute_elementwise or self.cache_functions

    def uncompiled(self) -> StepInputs:
        """The same preparation for the uncompiled reference (``Optimized.eager``): the same padding,
        rows and masks, but no mark a compiled graph reads (lengths not marked dynamic) and nothing
        kept for CUDA graphs (the row count bucketed as without them, the document ids not in one
        buffer): the reference records no graph."""
        return dataclasses.replace(self, mark_dynamic=False, cuda_graphs=False)


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


def prepare_batch(batch: dict, inputs: StepInputs) -> dict:
    """One batch as the compiled recipe takes it (``inputs`` says how): on ``inputs.device``,
    padded to ``inputs.pad_multiple``, optionally marked dynamic, with its labelled rows.

    The labelled rows (``loss_rows``, when ``inputs.row_chunks`` is not 0) are added when the batch
    has ``labels`` and is not a per-token call (``token_stats``), which needs every row: their
    length a multiple of ``row_chunks``, at least ``min_rows``, marked dynamic unless under CUDA
    graphs; a batch that carries ``loss_rows`` already (prepared before) keeps them, so preparing
    twice reads the labels once. ``fine_rows``: the count rounded up to a multiple of 64 rows only, not of a sixteenth
    of the rows (a loss outside the compiled graph meets any count without compiling again).
    Tensors on another device than ``inputs.device`` are moved there first (:func:`to_device`).
    """
    batch = to_device(batch, inputs.device)
    if inputs.pad_multiple > 1:
        batch = pad_batch(batch, inputs.pad_multiple, inputs.pad_id)
    if inputs.mark_dynamic:
        for key in SEQ_KEYS:
            value = batch.get(key)
            if torch.is_tensor(value) and value.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(value, value.dim() - 1)
    shifted = torch.is_tensor(batch.get("shift_labels"))  # targets already shifted (a row split by position)
    labels = batch.get("shift_labels" if shifted else "labels")
    if (inputs.row_chunks and torch.is_tensor(labels) and labels.dim() == 2 and not batch.get("token_stats")
            and "loss_rows" not in batch):  # a batch prepared already keeps its rows
        targets = labels.numel() if shifted else labels[:, 1:].numel()
        rows = labelled_rows(labels, buckets=targets if inputs.fine_rows else ROW_BUCKETS, multiple=inputs.row_chunks,
                             at_least=inputs.min_rows, overflow_to_all=not inputs.dynamic_rows, shifted=shifted)
        if inputs.dynamic_rows:
            torch._dynamo.maybe_mark_dynamic(rows, 0)
        else:  # never made dynamic by torch's automatic dynamic shapes either
            torch._dynamo.mark_static(rows, 0)
        batch = {**batch, "loss_rows": rows}
    return batch


def with_masks(forward: Callable[..., Any], inputs: StepInputs) -> Callable[..., Any]:
    """``forward`` (the recipe, compiled or not) taking its attention masks from outside the graph:
    a packed batch's per-document mask (``inputs.doc_attention``) or flex attention's causal block
    masks (``inputs.block_windows``); ``forward`` itself where neither applies."""
    if inputs.doc_attention is not None:
        return with_document_mask(forward, inputs.doc_attention, required=False, stable_ids=inputs.cuda_graphs)
    if inputs.block_windows is not None:
        return with_block_masks(forward, inputs.block_windows)
    return forward


def step_forward(compiled: Callable[..., Any], inputs: StepInputs) -> Callable[..., Any]:
    """``forward(**batch)``: :func:`prepare_batch`, then the compiled recipe with its masks
    (:func:`with_masks`), under AOTAutograd's settings if any
    (:func:`~qlora_nb_utils.compile.recipe.partitioner_settings`)."""
    masked = with_masks(compiled, inputs)

    def forward(**batch: Any) -> Any:
        batch = prepare_batch(batch, inputs)
        if not inputs.settings:
            return masked(**batch)  # nothing to set: keep the per-step path bare
        with partitioner_settings(inputs.memory_budget, inputs.recompute_elementwise, inputs.cache_functions):
            return masked(**batch)

    return forward
