"""How much GPU memory a fast-path training step will need, before it runs: an upper bound.

Why this module exists: ``optimize(max_memory_gib=...)`` has to choose checkpointing, offload, the
MLP pieces and the kept attention outputs *before* the first step, so it needs a peak it can
compute from the model and the batch shape; and a plan placed under a target is only as good as
that peak is an upper bound of what the step allocates. So the estimate is counted, not fitted:
every term below is a tensor of the step, named, sized from the model's config (hidden size,
intermediate size, attention heads, key/value heads, head size, vocabulary) and the batch shape,
and the step's peak is the largest of the moments at which those tensors are alive together.

Between steps, and all through the step (``static``): the weights at their size after the
recipe's cast, the LoRA weights with their fp32 gradients and AdamW's two moments.

Per token, in bytes (``h`` a hidden-size activation, ``i`` an intermediate-size one, ``q`` the
queries' or the attention output's size, ``kv`` the keys' or values', all in the compute dtype):

* an **un-checkpointed layer** saves its input (``h``), the queries, keys, values and attention
  output (``2 q + 2 kv``) with the attention's log-sum-exp (fp32, one per head), the residual
  after the attention (``h``) and the MLP's gate and up projections (``2 i``); without the
  elementwise recompute (``optimize(recompute=...)``) also both norms' outputs, the attention
  output in token-major layout and the SwiGLU product (``3 h + i``, :data:`_ACT_RECOMPUTED`);
* a **checkpointed layer** keeps its input (``h``); offloaded, the GPU holds at most two inputs
  copied back (the one in use and the one fetched ahead) and the embedding output;
* the **backward of one layer** adds, at its MLP, the gradient coming in and the one being formed
  (``2 h``), the SwiGLU product recomputed, its gradient and the gate's and up's gradients
  (``4 i``; one ``i`` more with the LoRA update added into the base output in place); at its
  attention, the gradient coming in and the residual's (``2 h``), the attention output's gradient
  (``q``), the query, key and value gradients (``q + 2 kv``) and the fused attention backward's
  fp32 workspace (two query-sized fp32 buffers and one value per head). A checkpointed layer
  recomputes what an un-checkpointed one saved, so its backward holds that as well;
* with each **MLP in pieces** (:mod:`.patches.tiled_mlp`) every intermediate-sized term above
  shrinks to one piece's share, and the MLP's input is saved instead;
* the **loss** (chunked, its gradient formed in the forward) holds the last hidden state, its
  norm, the hidden-state gradient's pieces and their concatenation (``4 h``) and one piece's
  logits: in the compute dtype, twice in fp32 inside the compiled arithmetic (the log-softmax and
  the gradient before its cast), and their gradient in the compute dtype (``2 b + 8`` bytes a
  logit; the eager arithmetic keeps four fp32 copies); the LoRA gradients are not formed yet;
* the rotary tables (cosine and sine, ``2 x head size``) and the step's integer inputs.

Kept attention outputs (:mod:`.patches.kept_attention`) add each checkpointed layer's output and
log-sum-exp on the device, or one output in flight and the log-sum-exps with the outputs in host
memory. A fixed allowance (:data:`OVERHEAD_GIB`: the CUDA libraries' workspaces, which the
caching allocator holds, and its rounding of each block) and two dequantized copies of the largest
group of NF4 weights (the recompute's and the backward's) complete it.

Spread over several GPUs (:func:`estimate_layout`, which the distributed layouts enter around
their ``optimize()``): with the weights sharded over ``N`` ranks (FSDP2) each rank holds ``1/N`` of
every parameter and of the LoRA state, plus what it gathers while a unit runs (two decoder
layers, the one in use and the one fetched ahead, and the largest weights outside the layers,
the embedding or the LM head). Under ring attention (context parallelism) the attention's
backward is the ring's over groups of whole key/value heads: one group's float32 accumulators
(the query's, key's and value's gradients) and the new ones each update makes beside them, the
flash kernel's own float32 query-gradient workspace, its outputs, the contiguous copies of the
group's inputs, the key/value blocks in flight between the ranks (sent and received, their
gradients in float32) and the group's gradients cast back to the compute dtype; the ring's forward
holds the group's keys and values gathered from every rank and its float32 output merge. Where a
layer is recomputed, the larger of the two counts.

The estimate is of the memory the allocator hands out (``torch.cuda.max_memory_allocated``); the
allocator reserves somewhat more (blocks it cannot split), which the plan's headroom
(:data:`.plan.MEMORY_HEADROOM`) leaves room for. The counts were checked against the lab's
per-allocation account of long steps (which tensors are alive at the peak), and the estimate
against every measured peak of the lab's long-context runs: at or above each, and not far above.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import torch

from .checkpointing import decoder_layers

__all__ = ["Shape", "Layout", "estimate_layout", "current_layout", "model_shape", "terms_of", "estimate_terms",
           "peak_from_terms", "estimate_peak_gib", "longest_fitting", "OVERHEAD_GIB", "config_of", "ring_workspace"]

_GIB = 2**30
#: The CUDA libraries' workspaces the caching allocator holds (cuBLAS, cuDNN), the step's small
#: tensors (norm statistics, masks) and the allocator's rounding of each block, in GiB.
OVERHEAD_GIB = 0.5
#: Saved per token by an un-checkpointed layer without the elementwise recompute, and recomputed with it:
#: hidden-sized tensors (both norms' outputs, the attention output token-major), intermediate-sized (the
#: SwiGLU product). Counted on the CPU (``diagnostics.saved_for_backward``: ``tests/test_recompute.py``).
_ACT_RECOMPUTED = (3, 1)
_OFFLOAD_RELOADED = 2  # offloaded inputs back on the GPU at once: the one in use, the one prefetched
_LOSS_HIDDEN = 4  # x h per token at the loss: the last hidden state, its norm, the gradient's pieces, their concatenation
_INT_INPUTS = 4  # int64 values per token: input ids, labels, positions, the loss's targets


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a step is spread over GPUs, as far as one GPU's memory goes (:func:`estimate_layout`).

    ``weight_shards``: the ranks every parameter and its LoRA state are sharded over (1: whole on
    this GPU). ``ring_groups``: under ring attention, ``ring_groups(heads, kv_heads, query_elements)``
    is the number of head groups the ring runs a call in (:func:`.distributed.ring_attention.head_groups`),
    None without the ring; ``ring_world``: the ranks of the ring."""

    weight_shards: int = 1
    ring_groups: Callable[[int, int, int], int] | None = None
    ring_world: int = 1


_ONE_GPU = Layout()
_LAYOUT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("qlora_nb_estimate_layout", default=None)


def current_layout() -> Layout:
    """The :class:`Layout` the estimates are counted for now (one GPU, nothing sharded, by default)."""
    return _LAYOUT.get() or _ONE_GPU


@contextlib.contextmanager
def estimate_layout(**changes: Any) -> Iterator[Layout]:
    """Count the estimates inside the block for a step spread over GPUs: ``changes`` are
    :class:`Layout`'s fields, laid over the layout already in force (a block inside another keeps
    what it does not change); the layout before is back when the block ends.

    Raises:
        ValueError: a field that is not :class:`Layout`'s, or fewer than one shard or ring rank.
    """
    names = {f.name for f in dataclasses.fields(Layout)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(f"estimate_layout: unknown field(s) {unknown}; known: {sorted(names)}")
    layout = dataclasses.replace(current_layout(), **changes)
    if layout.weight_shards < 1 or layout.ring_world < 1:
        raise ValueError(f"estimate_layout: weight_shards and ring_world must be >= 1; got {layout}")
    token = _LAYOUT.set(layout)
    try:
        yield layout
    finally:
        _LAYOUT.reset(token)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the estimate reads of a model: its config's sizes and the bytes it holds between steps.

    ``static_bytes``: the weights (at the size they will have after the recipe's cast), buffers,
    and per trainable parameter its fp32 gradient and AdamW's two moments. ``group_weight_elems``:
    the elements of the largest group of projection weights the step dequantizes at once (the
    MLP's gate and up, or the attention's query, key and value)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    static_bytes: int
    group_weight_elems: int
    grad_bytes: int = 0


def config_of(model: torch.nn.Module) -> Any:
    """The config of the model under a PEFT wrapper (the shapes every estimate is counted from)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, "config", None)


def _text_config(config: Any) -> Any:
    """The decoder's config (a multimodal config keeps it as ``text_config``)."""
    text = getattr(config, "text_config", None)
    return text if text is not None and getattr(config, "hidden_size", None) is None else config


def model_shape(model: torch.nn.Module, cast_dtype: torch.dtype | None = None) -> Shape:
    """:class:`Shape` of ``model`` (the PEFT model, as handed to ``optimize()``); ``cast_dtype``: the
    dtype the recipe casts the non-LoRA float weights to (None: as they are). Under a layout with
    the weights sharded (:func:`estimate_layout`), ``static_bytes`` is one rank's share and what it
    gathers (module docstring)."""
    config = _text_config(config_of(model))
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    kv = int(getattr(config, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(config, "head_dim", 0) or (hidden // heads if hidden else 0))
    layers = decoder_layers(model)
    in_layer = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    static, layer_bytes, outside = 0, [0] * len(layers), []
    for name, p in model.named_parameters():
        size = p.element_size()
        if cast_dtype is not None and p.is_floating_point() and "lora_" not in name:
            size = torch.finfo(cast_dtype).bits // 8
        static += p.numel() * size
        if id(p) in in_layer:
            layer_bytes[in_layer[id(p)]] += p.numel() * size
        else:
            outside.append(p.numel() * size)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    static += trainable * 12  # fp32 grad + AdamW moments
    shards = current_layout().weight_shards
    if shards > 1:  # one rank's share, and what it gathers: two layers and the largest weight outside them
        static = -(-static // shards) + 2 * max(layer_bytes, default=0) + max(outside, default=0)
    static += sum(b.numel() * b.element_size() for b in model.buffers())
    return Shape(grad_bytes=trainable * 4, layers=len(layers), hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv,
                 head_dim=head_dim, vocab=int(getattr(config, "vocab_size", 0) or 0), static_bytes=static,
                 group_weight_elems=max(2 * inter * hidden, (heads + 2 * kv) * head_dim * hidden))


def ring_workspace(shape: Shape, groups: int, world: int, act_bytes: int = 2) -> int:
    """Bytes per token of the ring attention's transient at one layer (module docstring): the larger
    of its backward's and its forward's, for one of ``groups`` head groups over ``world`` ranks."""
    g = max(1, groups)
    qg, kvg, hg = shape.heads * shape.head_dim / g, shape.kv_heads * shape.head_dim / g, shape.heads / g
    b = act_bytes
    # backward: fp32 accumulators (dq; dk, dv), flash's fp32 dq workspace and its outputs, the group's
    # contiguous inputs (grad_out, query, out; key, value), K/V sent and received, their fp32 gradients both
    # ways; each accumulator's update makes a new one beside the old (the whole and the half added: 1.5x),
    # and the group's gradients are cast back to the compute dtype before they are copied out
    backward = ((4 + 4 + b + 3 * b) * qg + (8 + 2 * b + 2 * b + 4 * b + 16) * kvg + 8 * hg
                + 6 * qg + 12 * kvg + b * (qg + 2 * kvg))
    # forward: the group's K/V from every rank, the fp32 output merge and one block's output, the log-sum-exps
    forward = (2 * b * world) * kvg + (4 + b + b) * qg + 12 * hg
    return int(max(backward, forward))


def terms_of(shape: Shape, batch_size: int, seq_len: int, *, ce_chunks: int = 4, act_bytes: int = 2,
             head_rows: int | None = None, recompute: bool = False, lora_in_place: bool = False,
             compiled_loss: bool = True, ring: tuple[int, int] | None = None) -> dict[str, Any]:
    """The estimate's terms in GiB for ``shape`` at ``batch_size x seq_len`` (see :func:`estimate_terms`);
    ``ring``: ``(head groups, ranks)`` of ring attention (None: the device's own attention kernel)."""
    b, tokens = act_bytes, batch_size * seq_len
    h, i = shape.hidden * b, shape.intermediate * b
    q, kv = shape.heads * shape.head_dim * b, shape.kv_heads * shape.head_dim * b
    lse = shape.heads * 4
    saved_attention = 2 * q + 2 * kv + lse  # queries, keys, values, the output, its log-sum-exp
    saved_layer = h + saved_attention + h + 2 * i  # + the layer's input, the residual, gate and up
    if not recompute:  # both norms' outputs and the attention output token-major; the SwiGLU product
        saved_layer += _ACT_RECOMPUTED[0] * h + _ACT_RECOMPUTED[1] * i
    workspace = 2 * shape.heads * shape.head_dim * 4 + lse  # the attention backward's fp32 buffers
    if ring is not None:  # the ring's, one head group at a time
        workspace = ring_workspace(shape, ring[0], ring[1], b)
    attention_backward = 2 * h + q + (q + 2 * kv) + workspace
    rows = tokens if head_rows is None else min(head_rows, tokens)
    logit_bytes = 2 * b + 8 if compiled_loss else b + 16
    gib = tokens / _GIB
    return {"layers": shape.layers, "tokens": tokens, "seq_len": seq_len, "hidden": shape.hidden,
            "intermediate": shape.intermediate, "vocab": shape.vocab, "act_bytes": act_bytes,
            "static_gib": shape.static_bytes / _GIB, "grads_gib": shape.grad_bytes / _GIB,
            "per_layer_gib": saved_layer * gib,  # what an un-checkpointed layer saves
            "per_layer_intermediate_gib": 2 * i * gib,  # of which the MLP's, what pieces shrink
            "saved_attention_gib": saved_attention * gib,
            "kept_per_layer_gib": h * gib,  # a checkpointed layer's input
            "offload_transient_gib": (_OFFLOAD_RELOADED + 1) * h * gib,  # two inputs back, the embedding output
            "residual_gib": h * gib,  # the residual after the attention, or the MLP input the pieces save
            "mlp_backward_gib": 2 * h * gib,  # the gradient coming in, the one being formed
            "mlp_backward_intermediate_gib": 4 * i * gib,  # the SwiGLU product again, its gradient, gate's and up's
            "attention_backward_gib": attention_backward * gib,
            "kept_output_gib": (q + lse) * gib,  # one layer's kept attention output and log-sum-exp
            "kept_lse_gib": lse * gib,
            "loss_hidden_gib": _LOSS_HIDDEN * h * gib,
            "logits_gib": rows / max(ce_chunks, 1) * shape.vocab * logit_bytes / _GIB,
            "always_gib": (2 * shape.head_dim * b + 8 * _INT_INPUTS) * gib,  # rotary tables, integer inputs
            "lora_in_place_gib": i * gib if lora_in_place else 0.0,
            "overhead_gib": OVERHEAD_GIB + 2 * shape.group_weight_elems * b / _GIB}


def estimate_terms(model: torch.nn.Module, batch_size: int, seq_len: int, *, ce_chunks: int = 4,
                   act_bytes: int = 2, cast_dtype: torch.dtype | None = None,
                   head_rows: int | None = None, recompute: bool = False,
                   lora_in_place: bool = False, compiled_loss: bool = True) -> dict[str, Any]:
    """The estimate's terms in GiB (and the shape numbers they come from).

    Args:
        model: the PEFT model, as handed to ``optimize()``.
        batch_size: rows per batch.
        seq_len: the (padded) length.
        ce_chunks: the chunked loss's pieces (0: the model's own loss, counted as one piece).
        act_bytes: bytes per element of the compute dtype.
        cast_dtype: the dtype the recipe will cast the non-LoRA float weights to (None: as they are).
        head_rows: the rows the LM head and loss run over (``optimize(loss_rows=...)``: the
            largest bucketed count of labelled rows shown); None: every token.
        recompute: the backward recomputes elementwise results (``optimize(recompute=...)``).
        lora_in_place: the LoRA updates are added into the base outputs in place
            (``optimize(lora_addmm=...)``): one more intermediate-sized tensor in the MLP's backward.
        compiled_loss: the loss's arithmetic is compiled (Inductor); False: eager (more fp32 copies).

    Counted for the :func:`current_layout` (weights sharded, ring attention).
    """
    shape = model_shape(model, cast_dtype)
    layout, ring = current_layout(), None
    if layout.ring_groups is not None:
        elements = batch_size * seq_len * shape.heads * shape.head_dim
        ring = (layout.ring_groups(shape.heads, shape.kv_heads, elements), layout.ring_world)
    return terms_of(shape, batch_size, seq_len, ce_chunks=ce_chunks, act_bytes=act_bytes,
                    head_rows=head_rows, recompute=recompute, lora_in_place=lora_in_place,
                    compiled_loss=compiled_loss, ring=ring)


def peak_from_terms(terms: dict[str, Any], ckpt_layers: int, offload: bool = False,
                    tile_rows: int | None = None, kept: str | bool = False) -> float:
    """The estimated peak (GiB) with the first ``ckpt_layers`` layers checkpointed (their inputs
    offloaded to CPU memory with ``offload``), each MLP run in pieces of ``tile_rows`` positions
    (``compile.patches.tiled_mlp``) when given, and the checkpointed layers' attention outputs
    kept (``kept``: ``"device"`` or ``"host"``, :mod:`.patches.kept_attention`).

    The largest of: the loss at the end of the forward; the backward of the top un-checkpointed
    layer (every un-checkpointed layer's saved tensors alive); the backward of a checkpointed layer
    (its recompute's tensors, the checkpointed inputs still held)."""
    layers = terms["layers"]
    n = max(0, min(ckpt_layers, layers))
    m = layers - n
    share = 1.0 if not tile_rows else min(1.0, tile_rows / max(terms["seq_len"], 1))  # pieces along the sequence
    piece_in = terms["residual_gib"] if share < 1 else 0.0  # the pieces' operator saves the MLP's input
    inter = terms["per_layer_intermediate_gib"] * share
    saved = terms["per_layer_gib"] - terms["per_layer_intermediate_gib"] * (1 - share) + piece_in
    mlp = terms["mlp_backward_gib"] + (terms["mlp_backward_intermediate_gib"] + terms["lora_in_place_gib"]) * share
    # the recompute's (or the un-checkpointed layer's) tensors at its MLP's backward and at its attention's
    at_mlp = terms["saved_attention_gib"] + terms["residual_gib"] + piece_in + inter + mlp
    at_attention = terms["saved_attention_gib"] + terms["attention_backward_gib"]
    offloaded = offload and n > 0
    held = terms["offload_transient_gib"] if offloaded else n * terms["kept_per_layer_gib"]  # the forward's end
    # the un-checkpointed layers' backward comes first: offloaded inputs are not back yet, the embedding output is
    held_top = terms["kept_per_layer_gib"] if offloaded else held
    # the loss, at the forward's end: the LoRA gradients are not formed yet (the last step's were let go)
    phases = [held + m * saved + terms["loss_hidden_gib"] + terms["logits_gib"] - terms.get("grads_gib", 0.0)]
    if m:  # the top un-checkpointed layer (its own input counted once, in the backward's tensors)
        phases.append(held_top + (m - 1) * saved + terms["kept_per_layer_gib"] + max(at_mlp, at_attention))
    if n:  # a checkpointed layer: its input is among those held
        phases.append(held + max(at_mlp, at_attention))
    extra = 0.0
    if kept == "device":
        extra = n * terms["kept_output_gib"]
    elif kept == "host":
        extra = terms["kept_output_gib"] + n * terms["kept_lse_gib"]
    return terms["static_gib"] + terms["overhead_gib"] + terms["always_gib"] + max(phases) + extra


def estimate_peak_gib(model: torch.nn.Module, batch_size: int, seq_len: int, ckpt_layers: int, *,
                      ce_chunks: int = 4, act_bytes: int = 2, cast_dtype: torch.dtype | None = None,
                      offload: bool = False, recompute: bool = False, lora_in_place: bool = False,
                      compiled_loss: bool = True) -> float:
    """A training-step peak (GiB) of the fast path on a CUDA device (see the module docstring)."""
    terms = estimate_terms(model, batch_size, seq_len, ce_chunks=ce_chunks, act_bytes=act_bytes,
                           cast_dtype=cast_dtype, recompute=recompute, lora_in_place=lora_in_place,
                           compiled_loss=compiled_loss)
    return peak_from_terms(terms, ckpt_layers, offload)


def longest_fitting(estimate: Any, limit_gib: float, longest: int, step: int = 128) -> int:
    """The longest length, a multiple of ``step`` up to ``longest``, whose ``estimate(length)`` (GiB)
    is at most ``limit_gib`` (0: none; the estimate grows with the length, so a bisection finds it)."""
    lo, hi = 0, max(longest // step, 0)  # in steps: lo fits (or is 0), hi + 1 does not
    if hi and estimate(hi * step) <= limit_gib:
        return hi * step
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(mid * step) <= limit_gib:
            lo = mid
        else:
            hi = mid - 1
    return lo * step
