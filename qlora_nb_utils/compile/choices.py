"""``optimize()``'s decision table: each choice a small function that says what and why.

Why this module exists: ``optimize()`` turns every ``"auto"`` of its options
(:class:`~qlora_nb_utils.compile.options.OptimizeOptions`) into a decision from the device, the
dtype, the torch it runs on and the batches it is shown, and it says why
(:attr:`~qlora_nb_utils.compile.optimized.Optimized.description`). Each decision is one function
here, of plain values, returning a :class:`Choice` (the value and its reason, the text the
description shows), or a ``(value, reason)`` pair; the facts (the device, what this torch has,
the model's head and attention read on a probe) are gathered by the caller or by the probes of
:mod:`qlora_nb_utils.ops` these functions call, so each rule reads, and is tested, on its own.
:func:`~qlora_nb_utils.compile.plan.decide` runs them in order, before the model changes; the
modules that apply a choice (the ops, :mod:`.recipe`, :mod:`.model_patches`) decide nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..ops.attention import (
    CAUSAL_SDPA,
    CAUSAL_SDPA_CUDNN,
    CUDNN_FIRST_CAPABILITIES,
    CUDNN_MIN_POSITIONS,
    SDPA_KERNELS,
    check_right_padded,
    longest_document,
    model_configs,
    sliding_window,
)
from ..ops.doc_attention import varlen_available
from ..ops.lm_head import LMHead, read_head
from ..ops.losses import labelled_rows
from .compile_cache import default_folder
from .packed import DOC_ATTENTION
from .prepare import regional_pays_until
from .step_inputs import pad_batch

__all__ = ["Choice", "choose_dtype", "choose_scope", "choose_recompute",
           "choose_warm_cache", "choose_head_choice", "choose_packing", "choose_dynamic",
           "choose_pad_multiple", "choose_autocast", "choose_loss", "choose_loss_rows_scope",
           "choose_eager_numerics", "choose_cast", "choose_keep_attention", "KEEP_HOST_SHARE",
           "LORA_OUT_OF_PLACE_WHY", "LORA_NO_GROUP_WHY", "show", "choose_sdpa_kernel", "choose_attention",
           "choose_head", "choose_loss_rows", "LOSS_ROWS_WHEN_IGNORED_OVER", "choose_compile_cache",
           "choose_doc_kernel", "choose_bnb_cpu_layout", "choose_nf4_dequant", "choose_lora_addmm"]

#: Why the LoRA update is out of place when every saving is taken and the target is still not met.
LORA_OUT_OF_PLACE_WHY = "the memory target is not met with every layer checkpointed: one tensor fewer"
#: Why a LoRA group is not formed in whole scope with checkpointing.
LORA_NO_GROUP_WHY = ("whole scope with checkpointing: a checkpointed region is traced without side effects, "
                     "and the group's state is one")


class Choice(NamedTuple):
    """One decision: its value and the reason ``optimize()``'s description gives for it."""

    value: Any
    why: str


def show(value: Any) -> str:
    """A value as the description writes it (``float32``, not ``torch.float32``; ``none``)."""
    return str(value).replace("torch.", "") if value is not None else "none"


def choose_dtype(asked: torch.dtype | None, model_dtype: torch.dtype) -> Choice:
    """The compute dtype: the one asked for, else the model's."""
    dtype = asked or model_dtype
    return Choice(dtype, "the model's compute dtype" if dtype == model_dtype else "asked for")


def choose_scope(scope: str, *, steps: int | None = None, device_type: str = "cpu", layers: int = 0,
                 cuda_graphs: bool = False) -> Choice:
    """What is compiled: the whole model as one graph, or one decoder layer's graph that every layer
    reuses (offload may make it regional later: :func:`.offload.plan`).

    ``"auto"`` weighs what pays over the job. One layer compiles in a fraction of the whole stack's
    time, and its step is as fast wherever the whole graph would not take CUDA graphs (a CPU, batch
    shapes too many for them): regional there. On a GPU with CUDA graphs the whole graph's step is
    faster (one replay instead of each layer's launches), which repays its longer compile only over a
    long job (:func:`~.prepare.regional_pays_until`): regional for ``steps`` below that, whole above it. Without
    ``steps`` the job is not known: whole, as ``optimize()`` always compiled. ``cuda_graphs``: whether
    the whole graph would take CUDA graphs (:func:`.launch_choices.choose_mode` in whole scope).
    """
    if scope != "auto":
        return Choice(scope, "one graph" if scope == "whole" else "one decoder layer's graph, shared")
    if steps is None:
        return Choice("whole", "the job's steps not given: one graph (pass steps to weigh its compile)")
    if layers < 2:
        return Choice("whole", f"one graph ({layers} decoder layer(s): nothing for a layer's graph to be shared with)")
    shared = f"one decoder layer's graph, compiled once for all {layers}"
    if not cuda_graphs:
        why = f"no CUDA graphs on {device_type}" if device_type != "cuda" else "no CUDA graphs for these shapes"
        return Choice("regional", f"{shared}: {why}, so the step is as fast as the whole graph's")
    until = regional_pays_until(layers)
    if steps < until:
        return Choice("regional", f"{shared}: over {steps} steps its shorter compile outweighs the whole graph's "
                                  f"faster steps (CUDA graphs), which would pay only after about {until}")
    return Choice("whole", f"one graph, CUDA graphs: over {steps} steps its faster step repays its longer compile "
                           f"(from about {until})")


def choose_recompute(asked: bool | str, available: bool) -> Choice:
    """What the backward recomputes (``"elementwise"`` or ``"torch's default"``); ``available``: whether
    this torch's partitioner has the setting. Refused here, not at the first step, when asked for
    where it is not."""
    if asked is True and not available:
        raise ValueError(f"recompute=True: torch {torch.__version__}'s partitioner has no setting for it "
                         "(torch._functorch.config.ban_recompute_materialized_backward); use 'auto' or False")
    rec = asked is True or (asked == "auto" and available)
    return Choice("elementwise" if rec else "torch's default",
                  "asked for" if asked is not True and asked != "auto" else
                  "SwiGLU product and norm outputs recomputed in the backward, not saved" if rec
                  else "this torch's partitioner has no such setting")


def choose_warm_cache(asked: bool | str, backend: Any, available: bool) -> Choice:
    """Whether AOTAutograd's cache takes graphs holding autograd Functions; ``available``: whether this
    torch has the setting. Refused here, not at the first step, when asked for where it is not."""
    if asked is True and not available:
        raise ValueError(f"warm_cache=True: torch {torch.__version__}'s AOTAutograd cache has no setting for it "
                         "(torch._functorch.config.autograd_cache_allow_custom_autograd_functions); use 'auto' or False")
    on = asked is True or (asked == "auto" and backend == "inductor" and available)
    return Choice(on, "asked for" if asked != "auto" else
                  "AOTAutograd's cache takes the graphs with autograd Functions (a warm start skips "
                  "tracing and partitioning)" if on else
                  f"backend {backend!r}" if backend != "inductor" else "this torch has no such setting")


def choose_head_choice(head: Any) -> Choice | None:
    """The head the chunked loss computes (:func:`choose_head` read and checked it); None: no
    chunked loss asked for."""
    if head is None:
        return None
    return Choice(head.describe() if head.reproduced else "model's own", head.why)


def choose_packing(packed: bool, batches: Sequence[dict] | None) -> Choice:
    """Whether the batches are packed (they carry ``document_ids``)."""
    return Choice(packed, "batches carry document_ids: one fixed shape, per-document attention" if packed
                  else "batches are padded" if batches else "no batches shown")


def choose_dynamic(asked: bool | str, shapes: Sequence[tuple[int, int]] | None) -> Choice:
    """Lengths dynamic from the first call when the batches shown have more than one: one compilation
    instead of a static one followed by a dynamic one."""
    if asked != "auto":
        return Choice(bool(asked), "asked for")
    lengths = sorted({s for _, s in shapes}) if shapes else None
    if lengths is None:
        return Choice(False, "lengths not shown: torch's default (at most static + dynamic)")
    if len(lengths) > 1:
        return Choice(True, f"{len(lengths)} lengths: dynamic from the first call")
    return Choice(False, "one length: static")


def choose_pad_multiple(pad_multiple: int) -> Choice:
    """Lengths padded to a multiple (unaligned lengths added a compilation on a GPU: a ``% 8`` guard)."""
    return Choice(pad_multiple, "lengths aligned (no % 8 guard)" if pad_multiple > 1 else "asked for")


def choose_autocast(asked: bool | str, dtype: torch.dtype) -> Choice:
    """Autocast for bf16/fp16 (the LoRA matmuls in the compute dtype, fp32 master weights); nothing for fp32."""
    low = dtype in (torch.bfloat16, torch.float16)
    return Choice(low and asked is not False, "asked for" if asked is False else
                  "LoRA matmuls in the compute dtype" if low else f"{show(dtype)}: nothing to autocast")


def choose_loss(ce_chunks: int, head_asked: bool, rows: int) -> Choice:
    """The chunked loss (no full fp32 logits) or the model's own; ``head_asked``: the chunked loss was
    asked for (its head read); ``rows``: :func:`.plan.chunk_rows`."""
    if ce_chunks:
        return Choice(f"chunked CE x{ce_chunks}", "no full fp32 logits" + (
            f"; fewer chunks while one would hold under {rows} rows" if rows else ""))
    return Choice("model's own", "the chunked loss would not compute this model's loss (see head)" if head_asked
                  else "asked for")


def choose_loss_rows_scope(rows: tuple[str, str], scope: str, step_graph: bool = False) -> Choice:
    """The labelled rows (:func:`choose_loss_rows`), per batch where the loss runs outside the
    graph (regional scope: each batch its own count, in multiples of 64 rows); inside it, or with the
    step captured (``step_graph``), one count (the most a batch shown needs: one compilation, one
    CUDA graph)."""
    value, why = rows
    if value == "labelled" and step_graph:
        why += "; one count for every batch, the most a batch shown needs (one captured step)"
    elif value == "labelled" and scope == "regional":
        why += "; each batch its own count, in multiples of 64 rows (the loss runs outside the graph)"
    return Choice(value, why)


def choose_eager_numerics(asked: bool | str, dtype: torch.dtype, backend: Any) -> Choice:
    """Eager's rounding for bf16/fp16 under Inductor: its fused kernels keep intermediates in fp32 where
    eager rounds every op, and over a bf16 residual stream the difference grew well past the
    eager-vs-eager floor; ``emulate_precision_casts`` rounds where eager does."""
    if asked != "auto":
        return Choice(bool(asked), "asked for")
    low = dtype in (torch.bfloat16, torch.float16)
    on = low and backend == "inductor"
    return Choice(on, "compiled rounds where eager does (loss within the eager floor)" if on
                  else f"{show(dtype)}: nothing to round" if not low else f"backend {backend!r}")


def choose_cast(cast: int) -> Choice:
    """How many non-LoRA weights the recipe cast (kbit prep's fp32 upcast undone; planned 0, filled in)."""
    return Choice(cast, "non-LoRA weights cast to the compute dtype")


def choose_bnb_cpu_layout(device_type: str, layers: int) -> Choice | None:
    """On a CPU, bitsandbytes' ``layers`` 4-bit layers kept in their training layout (an eval pass would
    repack them for inference and lose the LoRA gradients); None: nothing to say (no CPU or none)."""
    if device_type != "cpu" or not layers:
        return None
    return Choice("training", "an eval pass cannot repack NF4 for CPU inference (lost LoRA gradients)")


def choose_nf4_dequant(asked: bool | str, device_type: str, layers: int, has_triton: bool) -> Choice:
    """The ``layers`` NF4 weights dequantized in one Triton kernel (``"auto"``: on CUDA with Triton,
    where it pays; elsewhere the op's torch body, the same values, only when asked for)."""
    if asked is False or not layers:
        return Choice(False, "asked for" if asked is False else "no NF4 layer")
    if asked == "auto" and (device_type != "cuda" or not has_triton):
        return Choice(False, f"measured on CUDA only; off on {device_type}" if device_type != "cuda"
                      else "no Triton here: bitsandbytes' own dequantize")
    return Choice(True, f"{layers} NF4 layers: dequantize in one Triton kernel, not bitsandbytes' two "
                        "(process-wide patch, shared)" if device_type == "cuda" and has_triton
                  else f"{layers} NF4 layers: dequantize through the op's torch body (asked for)")


def choose_lora_addmm(asked: bool | str, layers: int, nf4: bool, in_place: bool) -> dict[str, Choice]:
    """``lora_addmm`` over the model's ``layers`` PEFT LoRA linears and the choices that follow it
    (``nf4_lora_linear``, ``lora_groups``, ``lora_wide``; their counts filled in when applied, by
    :func:`.model_patches.use_lora_addmm`); ``nf4``: the NF4 dequantize planned; ``in_place`` False
    when every saving is taken and the target is still not met."""
    fused_why = ("asked for (lora_addmm='unfused')" if asked == "unfused" else
                 "needs lora_addmm and the nf4_dequant patch" if not nf4 or asked is False else
                 "no LoRA layer over an NF4 weight")
    rows = {"lora_addmm": Choice(False, "asked for" if asked is False else "no PEFT LoRA linear layer"),
            "nf4_lora_linear": Choice(0, fused_why), "lora_groups": Choice(0, "needs the fused NF4 LoRA linear"),
            "lora_wide": Choice(False, "needs groups of LoRA layers")}
    if asked is not False and layers:
        rows["lora_addmm"] = Choice(True, f"{layers} LoRA layers: update added into the base output in place"
                                    if in_place else f"{layers} LoRA layers: out-of-place addmm ({LORA_OUT_OF_PLACE_WHY})")
    return rows


#: The most of the host memory available that ``keep_attention="auto"`` lets the offloaded inputs and the
#: kept attention outputs take together. Both are page-locked (never swapped out), and the process
#: needs host memory of its own (data, compile workers); keeping the outputs is a speed choice, so it
#: stays well clear of the limit that :func:`.offload.check_host_memory` refuses at.
KEEP_HOST_SHARE = 0.5


def choose_keep_attention(asked: bool | str, *, cudnn: bool, scope: str, ckpt_layers: int, unsupported: str | None,
                          offload: bool, tiled: bool, planned: float | None, estimate: float | None, kept_gib: float,
                          transient_gib: float, host_gib: float | None, host_free_gib: float | None) -> Choice | None:
    """Whether each checkpointed layer's recompute takes the attention output its forward kept, and where
    it is kept: ``"device"``, ``"host"`` (page-locked memory, copied there and back on a side stream) or False.

    ``cudnn``: the plan runs cuDNN's causal kernel (the kept operator's kernel on a GPU); ``unsupported``:
    why the model's attention cannot be kept (:func:`.patches.kept_attention.supported`), or None;
    ``tiled``: the plan runs the MLPs in pieces (every other saving fell short of the target);
    ``planned``: the memory target less its headroom, and ``estimate`` the plan's peak estimate, both
    GiB (None: no target); ``kept_gib``: the outputs of every checkpointed layer; ``transient_gib``:
    what keeping them in host memory adds on the device (an output on its way out or fetched ahead,
    and the log-sum-exps); ``host_gib``: what the offloaded inputs and the kept outputs take in host
    memory together; ``host_free_gib``: the host memory available (None: unknown).

    ``"auto"`` keeps them only where that was measured faster: cuDNN's kernel (Hopper, long rows),
    checkpointed layers run eagerly around the compiled ones (regional scope), and a memory target to
    place them under, short of the MLP pieces (where the step is at the target's edge and the estimate,
    fitted on shorter sequences, counts less than the step holds): on the device when the estimate has
    room for all of them, else in host memory when the estimate has room for the transient and the
    host for :data:`KEEP_HOST_SHARE` of what it has free. True keeps them (in host memory beside offloaded inputs, else on the device). None:
    nothing to say (``"auto"`` and no layer checkpointed).

    Raises:
        ValueError: True where they cannot be kept (no checkpointed layer, whole scope, an attention
            that is not the causal-only SDPA).
    """
    if asked is False:
        return Choice(False, "asked for")
    if asked == "auto" and ckpt_layers == 0:
        return None
    cannot = ("no layer is checkpointed (nothing is recomputed)" if ckpt_layers == 0 else
              "the scope is whole (the checkpoints must run eagerly around each compiled layer: scope='regional')"
              if scope != "regional" else unsupported)
    if asked is True:
        if cannot:
            raise ValueError(f"keep_attention=True: {cannot}")
        where = "host" if offload else "device"
        return Choice(where, "asked for")
    if cannot:
        return Choice(False, cannot)
    if not cudnn:
        return Choice(False, "measured faster only with cuDNN's kernel (sdpa_kernel=cudnn: Hopper, long rows)")
    if planned is None or estimate is None:
        return Choice(False, "no memory target to place the kept outputs under (keep_attention=True keeps them)")
    if tiled:
        return Choice(False, "the MLP runs in pieces: the step is at the target's edge, where the estimate is "
                             "least sure, and the kept outputs would add to it")
    if not offload and estimate + kept_gib <= planned:
        return Choice("device", f"the recompute skips the attention kernel; {kept_gib:.2f} GiB kept on the device: "
                                f"estimated peak {estimate + kept_gib:.2f} <= {planned:.4g} GiB")
    if estimate + transient_gib > planned:
        return Choice(False, f"no room under the target: even kept in host memory the estimate would be "
                             f"{estimate + transient_gib:.2f} > {planned:.4g} GiB")
    if host_free_gib is not None and host_gib > KEEP_HOST_SHARE * host_free_gib:
        return Choice(False, f"the host memory: {host_gib:.1f} GiB with the offloaded inputs, over "
                             f"{KEEP_HOST_SHARE:.0%} of the {host_free_gib:.1f} GiB available")
    return Choice("host", f"the recompute skips the attention kernel; {kept_gib:.2f} GiB kept in host memory "
                          f"({host_gib:.1f} GiB with the offloaded inputs), {transient_gib:.2f} GiB more on the device")


def choose_sdpa_kernel(asked: str, attention: str, device: torch.device, capability: tuple[int, int] | None,
                       works: Callable[[], tuple[bool, str]], longest: int = 0,
                       cuda_graphs: bool = False) -> tuple[str, str]:
    """``optimize(sdpa_kernel=...)``'s choice and its reason: ``"cudnn"`` or ``"default"``.

    ``"auto"`` takes cuDNN's kernel for causal-only SDPA on a GPU of :data:`~qlora_nb_utils.ops.attention.CUDNN_FIRST_CAPABILITIES`,
    for rows (``longest`` positions) of at least :data:`~qlora_nb_utils.ops.attention.CUDNN_MIN_POSITIONS`, without CUDA graphs
    (where it was measured), and where ``works()`` (:func:`~qlora_nb_utils.ops.attention.cudnn_attention_works` on the model's
    shape) passes: the same attention (its loss within bf16 noise of the flash kernel's), faster
    there. Elsewhere SDPA chooses as it does by default.

    Raises:
        ValueError: ``asked`` is not in :data:`~qlora_nb_utils.ops.attention.SDPA_KERNELS`; ``"cudnn"`` without causal-only SDPA
            (a mask or packed documents) or where ``works()`` fails.
    """
    if asked not in SDPA_KERNELS:
        raise ValueError(f"sdpa_kernel must be one of {list(SDPA_KERNELS)}, got {asked!r}")
    if asked == "default":
        return "default", "asked for"
    if attention != "causal":
        if asked == "cudnn":
            raise ValueError(f"sdpa_kernel='cudnn' needs causal-only SDPA; the attention is {attention!r}")
        if attention in ("flex", "eager"):
            return "default", f"no SDPA: {attention} attention"
        return "default", "not causal-only SDPA: SDPA's own order"
    if asked == "auto" and device.type != "cuda":
        return "default", "SDPA's own order (cuDNN's kernel is a CUDA kernel)"
    if asked == "auto" and capability not in CUDNN_FIRST_CAPABILITIES:
        return "default", "SDPA's own order: cuDNN first only on Hopper GPUs (sm_90), where it was measured faster"
    if asked == "auto" and longest < CUDNN_MIN_POSITIONS:
        return "default", (f"SDPA's own order: cuDNN first only for rows of at least {CUDNN_MIN_POSITIONS} "
                           "positions, where it was measured faster")
    if asked == "auto" and cuda_graphs:
        return "default", "SDPA's own order: CUDA graphs (cuDNN's kernel was measured without them)"
    ok, why = works()
    if not ok:
        if asked == "cudnn":
            raise ValueError(f"sdpa_kernel='cudnn': {why}")
        return "default", why
    return "cudnn", "asked for" if asked == "cudnn" else "causal SDPA on Hopper: cuDNN's kernel first (then flash)"


def _attention_keeping_scores(scores, drops: list[str], attention: str, batches: list[dict] | None,
                    device: torch.device) -> tuple[str, str]:
    """The attention for padded rows of a model whose attention changes its scores in a way SDPA drops:
    ``"flex"`` (:data:`~qlora_nb_utils.ops.model_attention.FLEX_SCORES`) where it can train, else ``"eager"``."""
    own = f"the model's attention {' and '.join(drops)}, which SDPA drops"
    eager = "the model's own eager attention with its mask"
    if attention == "mask":
        return "eager", f"asked for the model's own mask; {own}: {eager}"
    if (cannot := scores.flex_cannot(device)) is not None:
        return "eager", f"{own}; flex attention, which keeps it, cannot train here ({cannot}): {eager}"
    if batches is None:
        return "eager", f"{own}; no batches shown to check right padding for flex attention's causal masks: {eager}"
    try:
        check_right_padded(batches)
    except ValueError:
        return "eager", f"{own}; some batch is not right-padded (flex attention's masks here are causal only): {eager}"
    windows = ", ".join(str(w) for w in scores.windows)
    return "flex", (f"{own}: flex attention with it in the score modification, causal block masks built outside "
                    "the graph" + (f" (sliding window {windows} on the layers that have one)" if windows else ""))


def choose_attention(model: torch.nn.Module, attention: str, batches: list[dict] | None,
                     packed: bool, scores: Any = None, device: torch.device | None = None) -> tuple[str, str]:
    """``optimize(attention=...)``'s choice and its reason: ``"document"``, ``"causal"``, ``"mask"``,
    ``"flex"`` or ``"eager"``.

    Causal-only SDPA (:func:`~qlora_nb_utils.ops.attention.use_causal_sdpa`) drops a sliding window, and the per-document mask of
    packed rows applies none: where a window is shorter than the longest row shown, ``"auto"``
    keeps the model's own mask, and packing (or ``"causal"``) is refused.

    SDPA also drops what some models do to their attention scores (a soft cap, sinks, a position
    bias: ``scores``, :func:`~qlora_nb_utils.ops.model_attention.read_attention`): for those,
    padded rows take ``"flex"`` (flex attention with the change in its score modification, on
    ``device`` CUDA, right-padded batches) or else ``"eager"`` (the model's own eager attention),
    and ``"causal"`` is refused. A model loaded with another attention than SDPA keeps its own
    (``"mask"``) under ``"auto"``: causal-only SDPA replaces SDPA only.

    Raises:
        ValueError: packed rows, or ``attention="causal"`` on rows, longer than the model's sliding window;
            ``attention="causal"`` for a model whose score changes SDPA drops.
    """
    window = sliding_window(model)
    longest = max(int(b["input_ids"].shape[-1]) for b in batches) if batches else 0
    longer = window is not None and longest > window
    if packed:
        if longer and (doc := longest_document(batches)) > window:
            raise ValueError(f"a packed document of {doc} tokens is longer than the model's sliding window "
                             f"({window}), which the per-document mask does not apply: pack to at most {window} "
                             "tokens (--seq-len) or train on padded batches (--packing off)")
        return "document", "packed rows: each token attends to its own document only"
    drops = scores.sdpa_drops if scores is not None else []
    if drops:
        if attention == "causal":
            raise ValueError(f"attention='causal' (causal-only SDPA) would drop what the model's attention does: it "
                             f"{' and '.join(drops)}; use attention='auto'")
        return _attention_keeping_scores(scores, drops, attention, batches, device or next(model.parameters()).device)
    if attention == "causal" and longer:
        raise ValueError(f"attention='causal' drops the model's sliding window ({window} tokens), and the batches "
                         f"hold {longest}; use attention='auto' or 'mask'")
    if attention != "auto":
        return attention, "asked for"
    if batches is None:
        return "mask", "no batches shown to check right padding"
    try:
        check_right_padded(batches)
    except ValueError:
        return "mask", "some batch is not right-padded"
    if longer:
        return "mask", (f"the model's sliding window ({window} tokens) is shorter than the longest batch "
                        f"({longest}): its own mask (causal-only SDPA would drop the window)")
    loaded = {cfg._attn_implementation for cfg in model_configs(model)} - {"sdpa", CAUSAL_SDPA, CAUSAL_SDPA_CUDNN}
    if loaded:
        return "mask", (f"the model attends with {', '.join(sorted(map(str, loaded)))}: its own, with its mask "
                        "(causal-only SDPA replaces SDPA only)")
    return "causal", "every batch is right-padded: causal-only SDPA (flash, GQA)"


def choose_head(model: torch.nn.Module, ce_chunks: int, loss_rows: bool | str,
                batches: list[dict] | None) -> tuple[LMHead | None, int]:
    """The LM head the chunked loss computes, and the chunk count that follows: ``(head, ce_chunks)``.

    With ``ce_chunks`` > 0 the model's head is read and checked on a probe forward
    (:func:`~qlora_nb_utils.ops.lm_head.read_head`); a head the chunked loss does not reproduce
    turns it off (``ce_chunks`` 0: the model's own head and loss). ``(None, 0)`` when it was off.

    Raises:
        ValueError: ``loss_rows=True`` (which needs the chunked loss) for a head it does not reproduce.
    """
    if not ce_chunks:
        return None, 0
    sample = batches[0].get("input_ids") if batches else None
    head = read_head(model, sample if torch.is_tensor(sample) else None)
    if head.reproduced:
        return head, ce_chunks
    if loss_rows is True:
        raise ValueError(f"loss_rows=True needs the chunked loss, which would not compute this model's loss: "
                         f"{head.why}; use loss_rows='auto'")
    return head, 0


#: ``optimize(loss_rows="auto")`` takes the labelled rows only when the batches shown ignore at
#: least this share of their target rows (below it, the per-step label count is not worth it).
LOSS_ROWS_WHEN_IGNORED_OVER = 0.1


def choose_loss_rows(asked: bool | str, ce_chunks: int, batches: list[dict] | None,
                      multiple: int) -> tuple[str, str, int | None]:
    """``optimize(loss_rows=...)``'s choice: (choice, reason, the most head rows a batch shown
    needs, None: every token)."""
    if not ce_chunks:
        return "all", "the model's own loss", None
    if asked is not True and not batches:
        return (("labelled", "batches not shown: labelled rows (the same loss; costs a label count per step)")
                if asked == "auto" else ("all", "asked for")) + (None,)
    ignored = total = most = 0
    for batch in batches or ():
        shifted = "shift_labels" in batch
        key = "shift_labels" if shifted else "labels"
        labels = pad_batch(batch, multiple)[key] if key in batch else None
        if torch.is_tensor(labels) and labels.dim() == 2:
            targets = labels if shifted else labels[:, 1:]
            ignored += int((targets == -100).sum())
            total += targets.numel()
            most = max(most, labelled_rows(labels, multiple=ce_chunks, shifted=shifted).numel())
    share = ignored / total if total else 0.0
    if asked != "auto":
        return ("labelled", "asked for", most or None) if asked else ("all", "asked for", None)
    if share >= LOSS_ROWS_WHEN_IGNORED_OVER:
        return "labelled", f"{share:.0%} of target rows ignored: LM head and loss skip them", most
    return "all", f"{share:.0%} of target rows ignored: every row (no per-step label count)", None


def choose_compile_cache(asked: Any, backend: Any, device_type: str) -> Choice:
    """Where the run's cache artifacts are kept: a folder, or False.

    ``"auto"``: the package's cache folder on CUDA with Inductor (its artifacts hold the generated
    kernels, which a new machine or runtime would otherwise compile again); not on a CPU, where the
    same machine's Inductor cache serves a warm start already. True: that folder anywhere; a path:
    that folder; False: none. (Asking for it with another backend is refused by the options.)
    """
    if asked is False:
        return Choice(False, "asked for")
    if backend != "inductor":
        return Choice(False, f"backend {backend!r}: nothing compiled to keep")
    if asked == "auto" and device_type != "cuda":
        return Choice(False, f"{device_type}: this machine's Inductor cache serves a warm start")
    folder = default_folder() if asked in ("auto", True) else Path(asked).expanduser()
    return Choice(folder, "asked for" if asked not in ("auto", True) else "the package's cache folder")


def _doc_keeping_scores(device: torch.device, doc_attention: str, scores: Any, drops: list[str]) -> tuple[str, str]:
    """The kernel for packed rows of a model whose attention changes its scores in a way SDPA (and varlen) drop."""
    own = f"the model's attention {' and '.join(drops)}"
    if doc_attention in ("sdpa", "varlen"):
        raise ValueError(f"doc_attention={doc_attention!r} would drop what the model's attention does: it "
                         f"{' and '.join(drops)}; use 'auto' (flex attention on CUDA, its eager attention elsewhere)")
    if doc_attention != "auto":
        return doc_attention, "asked for"
    if (cannot := scores.flex_cannot(device)) is None:
        return "flex_attention", (f"packed rows: document-causal BlockMask, blocks across documents skipped; {own}, "
                                  "which flex attention keeps in its score modification")
    return "eager", (f"packed rows: {own}, which SDPA drops, and flex attention cannot train here ({cannot}): "
                     "the model's own eager attention with the document mask added to its scores")


def choose_doc_kernel(device: torch.device, doc_attention: str, scores: Any = None) -> tuple[str, str]:
    """The attention kernel for packed batches and why: ``(kernel, reason)``.

    ``scores``: what the model's attention does beyond causal softmax
    (:func:`~qlora_nb_utils.ops.model_attention.read_attention`). Where SDPA would drop it (Gemma-2's
    score soft cap), ``"auto"`` takes flex attention on CUDA (the change in its score modification)
    and the model's eager attention with an additive document mask elsewhere.

    Raises:
        ValueError: ``doc_attention`` not in :data:`.packed.DOC_ATTENTION`, flex attention asked for
            on a CPU (no backward there), varlen on CUDA without ``torch.nn.attention.varlen``,
            or SDPA or varlen asked for where they would drop the model's score changes.
    """
    if doc_attention not in DOC_ATTENTION:
        raise ValueError(f"doc_attention must be one of {list(DOC_ATTENTION)}, got {doc_attention!r}")
    if doc_attention == "flex_attention" and device.type == "cpu":
        raise ValueError("doc_attention='flex_attention' cannot train on a CPU (torch has no flex-attention "
                         "backward there); use 'sdpa' or 'auto'")
    if doc_attention == "varlen" and device.type == "cuda" and not varlen_available():
        raise ValueError(f"doc_attention='varlen' needs torch.nn.attention.varlen (torch {torch.__version__} "
                         "has none); use 'flex_attention' or 'auto'")
    if drops := (scores.sdpa_drops if scores is not None else []):
        return _doc_keeping_scores(device, doc_attention, scores, drops)
    if doc_attention != "auto":
        why = ("asked for (on a CPU: SDPA with the dense mask of the same cuts)"
               if doc_attention == "varlen" and device.type != "cuda" else "asked for")
        return doc_attention, why
    if device.type == "cuda":
        return "flex_attention", "packed rows: document-causal BlockMask, blocks across documents skipped"
    return "sdpa", f"packed rows: dense document mask (no flex-attention backward on {device.type})"
