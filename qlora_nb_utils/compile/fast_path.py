"""``optimize(model)``: the one fast path, with the choices it can make itself made for you.

Why this module exists: the fastest recipe this project has measured (:mod:`.recipe`) has a
dozen knobs, and a user should not have to know which of them pay on their device and their
shapes. :func:`optimize` applies the whole recipe to a PEFT QLoRA model and decides what can
be decided from the device, the dtype and the batches it is shown, and it says what it chose
and why (:attr:`Optimized.description`). Every place in the package that trains compiled goes
through it: ``qlora-nb train``, ``qlora-nb bench``, the ``ours`` peer, the notebooks and the
HF ``Trainer`` / TRL ``SFTTrainer`` route (:meth:`Optimized.install`).

The choices, each overridable by passing it explicitly:

* **CUDA graphs** (``mode="reduce-overhead"``) on a CUDA device when the batches show at most
  :data:`MAX_CUDAGRAPH_SHAPES` shapes (fixed or bucketed lengths): the LoRA step is many small
  kernels, so it is launch-bound, and one graph per shape removes the launches. With more
  shapes, or shapes not shown, the default mode (a CUDA graph per shape would cost memory).
  Under CUDA graphs the labelled-row count is static and the flex mask reads its document ids
  from one buffer: otherwise the graphs were recorded again and a held run overshot its target
  (``results/cudagraph_rerecord_h100.json``; :mod:`.step_inputs`, ``ops.doc_attention``).
* **Lengths padded to a multiple of 8** (``pad_multiple``), on the right, masked and ignored by
  the loss. Unaligned lengths made a third compilation on a GPU (static, then dynamic, then a
  ``% 8`` alignment guard), and tensor cores prefer the alignment anyway.
* **Dynamic lengths from the first call** when the batches shown have more than one length:
  one compilation instead of a static one followed by a dynamic one. Unknown shapes: torch's
  default (static, then dynamic on the first change), so at most two.
* **Attention**: causal-only SDPA (flash kernel, grouped K/V) when every batch shown is
  right-padded, else SDPA with the padding mask. **Packed batches** (with ``document_ids``, from
  :func:`~qlora_nb_utils.data.pack_examples`): a per-document causal mask built outside the
  graph, flex attention's ``BlockMask`` on CUDA, SDPA's dense mask elsewhere (:mod:`.packed`).
* **Checkpointing**: off without a memory target; with ``max_memory_gib``, on the fewest first
  decoder layers whose estimated peak (:func:`estimate_peak_gib`) fits the target; if even every
  layer does not fit, their saved inputs offloaded to CPU memory (:mod:`.offload`, regional scope).
* **The model's own head in the chunked loss** (``head``): a bias, logit scale or soft cap is read
  from the model, checked on a probe forward and applied (:mod:`~qlora_nb_utils.ops.lm_head`); a
  head the chunked loss would not reproduce keeps the model's own head and loss.
* **The LM head and loss over labelled rows only** (``loss_rows``) when the batches shown
  ignore at least 10% of their target rows: on padded batches most of the head's work was on
  padding (:mod:`qlora_nb_utils.ops.losses`; the rows are counted per step, outside the graph,
  in :mod:`.step_inputs`).
* **Recompute, not save, what is cheap** (``recompute``): the partitioner's default saves every
  elementwise result a backward matmul reads; the SwiGLU product and the LoRA inputs of hidden
  size are recomputed instead, one intermediate-sized and three hidden-sized tensors per token
  and layer fewer (:func:`~qlora_nb_utils.compile.recipe.partitioner_settings`).
* **LoRA added into the base output in place** (``lora_addmm``), not a matmul and a sum beside
  a defensive copy (:mod:`~qlora_nb_utils.compile.patches.lora_addmm`).
* **NF4 dequantized in one kernel** (``nf4_dequant``, on CUDA): bitsandbytes' two kernels per
  weight and step replaced by one Triton kernel (:mod:`~qlora_nb_utils.compile.patches.nf4_dequant`).
* **Autocast** for bf16/fp16 compute (the LoRA matmuls in bf16, fp32 master weights); nothing
  for fp32.
* **A warm start that skips AOTAutograd** (``warm_cache``): its on-disk cache refused every
  graph of the recipe (each holds an autograd Function), so a second process traced and
  partitioned them again; torch's setting for it lets the cache take them
  (:func:`~qlora_nb_utils.compile.recipe.partitioner_settings`).
* **Eager's rounding** (``eager_numerics``) for bf16/fp16: Inductor keeps a fused kernel's
  intermediates in fp32 where eager rounds every op to bf16. Once the non-LoRA weights are cast
  back to bf16, the whole residual stream is bf16 and that difference grew to 2e-2 in the loss
  on an H100 (1B shape, 4 x 512), ten times the eager-vs-eager floor; with Inductor's
  ``emulate_precision_casts`` the compiled step rounds where eager does.

The model is put in training mode first (Inductor's training graph asserts on an eval-mode
model). On a CPU, bitsandbytes' NF4 layers are kept in their training layout
(:mod:`~qlora_nb_utils.compile.patches.bnb_cpu_packing`), so that an evaluation between
training steps (a Trainer's ``eval_steps``) cannot repack them and lose LoRA gradients. ``undo()`` reverts everything but the cast of the non-LoRA weights (see
:class:`~qlora_nb_utils.compile.recipe.FastPrepared`).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch

from ..ops.attention import choose_attention
from ..ops.doc_attention import with_document_mask
from ..ops.lm_head import choose_head
from ..ops.losses import CHUNK_MIN_ROWS
from .checkpointing import decoder_layers
from .memory_estimate import _config_of, estimate_peak_gib, estimate_terms, peak_from_terms
from .model_patches import keep_bnb_training_layout, lora_addmm_expected, use_lora_addmm, use_nf4_dequant
from .offload import plan
from .optimized import Optimized, _show
from .packed import DOC_ATTENTION, choose_doc_kernel, packed_batches
from .recipe import can_cache_functions, can_recompute_elementwise, prepare_fast
from .step_inputs import (
    LOSS_ROWS_WHEN_IGNORED_OVER,
    batch_shapes,
    choose_loss_rows,
    pad_batch,
    step_forward,
)

__all__ = ["Optimized", "optimize", "estimate_peak_gib", "pad_batch", "MAX_CUDAGRAPH_SHAPES", "MODES",
           "LOSS_ROWS_WHEN_IGNORED_OVER"]

#: At most this many distinct batch shapes get CUDA graphs (one graph each) under ``mode="auto"``.
MAX_CUDAGRAPH_SHAPES = 4
#: What ``mode`` accepts: ``"auto"`` or an Inductor mode (None and ``"default"`` mean the default).
MODES = ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _compute_dtype(model: torch.nn.Module, device: torch.device) -> torch.dtype:
    for module in model.modules():  # bitsandbytes Linear4bit keeps the dtype it computes in
        dtype = getattr(module, "compute_dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    config = getattr(model, "config", None)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):  # a config built in memory may name it
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if isinstance(dtype, torch.dtype):
        return dtype
    from ..env import default_dtype, resolve_dtype

    return resolve_dtype(default_dtype(device), device)


def _check(name: str, value: Any, valid: Iterable[Any]) -> None:
    valid = tuple(valid)
    if value not in valid:
        raise ValueError(f"{name} must be one of {list(valid)}, got {value!r}")


def _note_unfused_numerics(model: torch.nn.Module, dtype: torch.dtype, autocast: bool, choices: dict[str, Any],
                           reasons: dict[str, str]) -> None:
    """Say so when the fused NF4 LoRA route was set up but will not run: without autocast, LoRA
    weights in another dtype than the compute dtype (k-bit prep's fp32 ones, with ``autocast=False``:
    HF eager's numerics) make every call take PEFT's own path, which casts (``lora_addmm``'s docstring)."""
    if autocast or not choices.get("nf4_lora_linear"):
        return
    other = {p.dtype for n, p in model.named_parameters() if "lora_" in n and p.dtype != dtype}
    if other:
        reasons["nf4_lora_linear"] += (f"; set up, but not taken at run time: LoRA weights in {_show(min(other, key=str))} "
                                       f"without autocast (HF eager's numerics) take PEFT's own path")


def optimize(model: torch.nn.Module, *, batches: Iterable[dict] | None = None, grad_ckpt: bool | str = "auto",
             max_memory_gib: float | None = None, mode: str | None = "auto", attention: str = "auto",
             ckpt_layers: int | None = None, dtype: torch.dtype | None = None, backend: Any = "inductor",
             ce_chunks: int = 4, cast: bool = True, autocast: bool | str = "auto", pad_multiple: int = 8,
             dynamic: bool | str = "auto", memory_budget: float | None = None,
             eager_numerics: bool | str = "auto", scope: str = "whole", doc_attention: str = "auto",
             offload: bool | str = "auto", loss_rows: bool | str = "auto",
             recompute: bool | str = "auto", lora_addmm: bool | str = "auto",
             nf4_dequant: bool | str = "auto", warm_cache: bool | str = "auto",
             ce_min_rows: int | str = "auto") -> Optimized:
    """Apply the fast recipe to a PEFT QLoRA model, making the choices it can from device and shapes.

    Args:
        model: a PEFT causal LM (e.g. ``load_model(..., prepare_kbit=True)`` or without kbit prep).
        batches: the training batches, or a sample of them; their shapes decide CUDA graphs,
            dynamic lengths and the attention path (None: decided without them, conservatively).
        grad_ckpt: ``"auto"`` (off, or the fewest layers that fit ``max_memory_gib``), True or False.
        max_memory_gib: a peak-memory target in GiB for ``grad_ckpt="auto"`` (needs ``batches``).
        mode: ``"auto"``, or an Inductor mode (``"default"``/None, ``"reduce-overhead"``, ...).
        attention: ``"auto"``, ``"causal"`` (causal-only SDPA; right-padded batches) or ``"mask"``;
            packed batches (with ``document_ids``) always get the per-document mask.
        ckpt_layers: with checkpointing, how many first decoder layers checkpoint (None: decided).
        dtype: the compute dtype (None: the model's).
        backend: the Dynamo backend.
        ce_chunks: the chunked cross-entropy's pieces; 0 keeps the model's own loss (and logits),
            as does a model whose head the chunked loss would not reproduce (the choice ``head``).
        ce_min_rows: fewer pieces while one would hold fewer rows than this, for a loss computed
            outside the compiled graph (regional scope): ``"auto"`` (512,
            :data:`~qlora_nb_utils.ops.losses.CHUNK_MIN_ROWS`) or an integer >= 0 (0: always
            ``ce_chunks`` pieces, the least memory at the loss).
        cast: cast the non-LoRA float weights to ``dtype`` (undoing kbit-prep's fp32 upcast).
        autocast: ``"auto"`` (on for bf16/fp16), True or False.
        pad_multiple: right-pad every batch's length to a multiple of this (1: never).
        dynamic: ``"auto"``, True (lengths dynamic from the first call) or False (torch's default).
        memory_budget: Inductor's ``activation_memory_budget`` (0..1) for the compile; None leaves it.
        eager_numerics: ``"auto"`` (on for bf16/fp16 with Inductor), True or False: the compiled
            step rounds where eager does (Inductor's ``emulate_precision_casts``).
        scope: ``"whole"`` (one graph: the fastest step) or ``"regional"`` (each decoder layer
            compiled once for all of them, the rest eager: the shortest cold compile, see
            notebook 06); regional never uses CUDA graphs under ``mode="auto"``.
        doc_attention: for packed batches, ``"auto"`` (flex attention on CUDA, SDPA elsewhere),
            ``"flex_attention"`` or ``"sdpa"``.
        offload: keep checkpointed layers' inputs in pinned CPU memory (:mod:`.offload`):
            ``"auto"`` (only when ``max_memory_gib`` is not met by checkpointing every layer),
            True or False. Offloading compiles in regional scope.
        loss_rows: the LM head and the chunked loss over the labelled target rows only
            (:func:`~qlora_nb_utils.ops.losses.labelled_rows`, counted before each step):
            ``"auto"`` (when the batches shown ignore at least
            :data:`LOSS_ROWS_WHEN_IGNORED_OVER` of their rows, or are not shown), True or False.
        recompute: the compiled backward recomputes the elementwise results its matmuls read (the
            SwiGLU product, the norm outputs) instead of saving them
            (:func:`~qlora_nb_utils.compile.recipe.partitioner_settings`): ``"auto"`` (on where
            this torch's partitioner has the setting; backends without that partitioner ignore
            it), True (refused where torch lacks it) or False.
        lora_addmm: add each LoRA update into its base output in place, one matmul
            (:mod:`~qlora_nb_utils.compile.patches.lora_addmm`): ``"auto"`` (on where PEFT's
            version is supported), True, False, ``"unfused"``, ``"ungrouped"`` or ``"narrow"``. With the ``nf4_dequant`` patch on,
            a layer over an NF4 weight runs as one LoRA linear whose base matmul adds into the
            update, forward and backward (:func:`~qlora_nb_utils.ops.lora_update.nf4_lora_linear`);
            ``"unfused"`` keeps the update after bitsandbytes' base matmul. Fused layers that read
            one input (a decoder layer's q, k, v; gate, up) run as one group that reads it once
            (:func:`~qlora_nb_utils.ops.lora_update.nf4_lora_linears`; the choice ``lora_groups``),
            except in whole scope with checkpointing (the group's state is a side effect a
            checkpointed region may not have while traced) and with ``"ungrouped"``. A group's
            members are each one GEMM over ``[x | s x A^T]`` and ``[W | B]`` (the choice
            ``lora_wide``), except with ``"narrow"`` (the update written, the base GEMM adding into
            it). When ``max_memory_gib``
            is not met even with every layer checkpointed (and offloaded), the update is the
            out-of-place ``addmm``, one tensor fewer at the peak.
        nf4_dequant: the NF4 weights dequantized in one Triton kernel, not bitsandbytes' two
            (:func:`~qlora_nb_utils.compile.model_patches.use_nf4_dequant`: a process-wide patch,
            shared): ``"auto"`` (on CUDA with Triton), True or False.
        warm_cache: let AOTAutograd's on-disk cache store and reuse the recipe's graphs, which
            hold autograd Functions (:func:`~qlora_nb_utils.compile.recipe.can_cache_functions`):
            ``"auto"`` (on where this torch has the setting and the backend is Inductor), True
            (refused where torch lacks it) or False.

    Returns:
        An :class:`Optimized`; train with ``opt.forward(**batch).loss``; ``opt.undo()`` when done.

    Raises:
        ValueError: an unknown choice (the message lists the valid ones), ``max_memory_gib``
            without ``batches``, ``attention="causal"`` on batches that are not right-padded,
            packed and padded batches mixed, a packed batch with an ``attention_mask``,
            ``loss_rows=True`` for a model whose head the chunked loss does not reproduce.
    """
    _check("mode", mode, MODES + (None,))
    _check("grad_ckpt", grad_ckpt, ("auto", True, False))
    _check("attention", attention, ("auto", "causal", "mask"))
    _check("autocast", autocast, ("auto", True, False))
    _check("dynamic", dynamic, ("auto", True, False))
    _check("eager_numerics", eager_numerics, ("auto", True, False))
    _check("scope", scope, ("whole", "regional"))
    _check("doc_attention", doc_attention, DOC_ATTENTION)
    _check("loss_rows", loss_rows, ("auto", True, False))
    _check("recompute", recompute, ("auto", True, False))
    _check("lora_addmm", lora_addmm, ("auto", True, False, "unfused", "ungrouped", "narrow"))
    _check("nf4_dequant", nf4_dequant, ("auto", True, False))
    _check("warm_cache", warm_cache, ("auto", True, False))
    if ce_min_rows != "auto" and (isinstance(ce_min_rows, bool) or not isinstance(ce_min_rows, int)
                                  or ce_min_rows < 0):
        raise ValueError(f"ce_min_rows must be 'auto' or an integer >= 0, got {ce_min_rows!r}")
    if loss_rows is True and not ce_chunks:
        raise ValueError("loss_rows=True needs the chunked loss (ce_chunks > 0); the model's own loss takes every row")
    if not isinstance(pad_multiple, int) or isinstance(pad_multiple, bool) or pad_multiple < 1:
        raise ValueError(f"pad_multiple must be an integer >= 1, got {pad_multiple!r}")
    if max_memory_gib is not None and not (isinstance(max_memory_gib, (int, float)) and max_memory_gib > 0):
        raise ValueError(f"max_memory_gib must be None or a number > 0, got {max_memory_gib!r}")
    if ckpt_layers is not None and (isinstance(ckpt_layers, bool) or not isinstance(ckpt_layers, int)
                                    or ckpt_layers < 0):
        raise ValueError(f"ckpt_layers must be None or an integer >= 0, got {ckpt_layers!r}")
    if ckpt_layers is not None and grad_ckpt is False:
        raise ValueError("ckpt_layers picks which layers checkpoint; it needs grad_ckpt=True or 'auto'")
    batches = list(batches) if batches is not None else None
    if max_memory_gib is not None and not batches:
        raise ValueError("max_memory_gib needs batches: the estimate depends on the batch shape")
    if mode not in ("auto", None, "default") and backend != "inductor":
        raise ValueError(f"mode {mode!r} is an Inductor option; with backend={backend!r} pass mode='auto'")

    device = next(model.parameters()).device
    model_dtype = _compute_dtype(model, device)
    dtype = dtype or model_dtype
    shapes = batch_shapes(batches, pad_multiple)
    choices: dict[str, Any] = {"device": device.type, "dtype": dtype, "scope": scope}
    reasons: dict[str, str] = {"device": "where the model is", "dtype": "the model's compute dtype"
                               if dtype == model_dtype else "asked for",
                               "scope": "one graph" if scope == "whole" else "one decoder layer's graph, shared"}

    # what the backward recomputes: decided first, the memory estimate counts it
    if recompute is True and not can_recompute_elementwise():  # refused here, not at the first step
        raise ValueError(f"recompute=True: torch {torch.__version__}'s partitioner has no setting for it "
                         "(torch._functorch.config.ban_recompute_materialized_backward); use 'auto' or False")
    rec = recompute is True or (recompute == "auto" and can_recompute_elementwise())
    choices["recompute"] = "elementwise" if rec else "torch's default"
    reasons["recompute"] = ("asked for" if recompute is not True and recompute != "auto" else
                            "SwiGLU product and norm outputs recomputed in the backward, not saved" if rec
                            else "this torch's partitioner has no such setting")

    # AOTAutograd's cache for graphs holding autograd Functions: refused here, not at the first step
    if warm_cache is True and not can_cache_functions():
        raise ValueError(f"warm_cache=True: torch {torch.__version__}'s AOTAutograd cache has no setting for it "
                         "(torch._functorch.config.autograd_cache_allow_custom_autograd_functions); use 'auto' or False")
    cache_fns = warm_cache is True or (warm_cache == "auto" and backend == "inductor" and can_cache_functions())
    choices["warm_cache"] = cache_fns
    reasons["warm_cache"] = ("asked for" if warm_cache != "auto" else
                             "AOTAutograd's cache takes the graphs with autograd Functions (a warm start skips "
                             "tracing and partitioning)" if cache_fns else
                             f"backend {backend!r}" if backend != "inductor" else "this torch has no such setting")

    # the LM head: the chunked loss computes the model's own (bias, scale, soft cap) or is not used
    head, ce_chunks = choose_head(model, ce_chunks, loss_rows, batches)
    if head is not None:
        choices["head"], reasons["head"] = head.describe() if head.reproduced else "model's own", head.why

    # checkpointing and offload (offload.plan): decided first, offloading makes the scope regional
    n_layers = len(decoder_layers(model))
    *rows_choice, head_rows = choose_loss_rows(loss_rows, ce_chunks, batches, pad_multiple)
    est, at = None, ""
    if max_memory_gib is not None:
        b, s = max(shapes, key=lambda x: x[0] * x[1])
        terms = estimate_terms(model, b, s, ce_chunks=ce_chunks, act_bytes=torch.finfo(dtype).bits // 8,
                               cast_dtype=dtype if cast else None, head_rows=head_rows, recompute=rec,
                               lora_in_place=lora_addmm_expected(model, lora_addmm))
        est, at = functools.partial(peak_from_terms, terms), f"{b} x {s}"
    ck = plan(n_layers, grad_ckpt=grad_ckpt, ckpt_layers=ckpt_layers, max_memory_gib=max_memory_gib,
              offload=offload, scope=scope, estimate=est, shape=at)
    ckpt, scope = ck.ckpt_layers, ck.scope
    # every saving taken and still over the target: the LoRA update out of place (one tensor fewer)
    over_target = est is not None and est(ckpt, ck.offload) > max_memory_gib
    choices["ckpt_layers"], reasons["ckpt_layers"] = f"{ckpt}/{n_layers}", ck.ckpt_why
    choices["offload"], reasons["offload"] = ck.offload, ck.offload_why
    if ck.scope_why:
        choices["scope"], reasons["scope"] = scope, ck.scope_why

    # attention
    packed = packed_batches(batches)
    choices["packing"] = packed
    reasons["packing"] = ("batches carry document_ids: one fixed shape, per-document attention" if packed
                          else "batches are padded" if batches else "no batches shown")
    if packed:
        if attention == "causal":
            raise ValueError("attention='causal' would let packed documents attend to each other; use 'auto'")
        kernel, why = choose_doc_kernel(device, doc_attention)
        choices["doc_attention"], reasons["doc_attention"] = kernel, why
    attention, why = choose_attention(model, attention, batches, packed)
    choices["attention"], reasons["attention"] = attention, why

    # CUDA graphs
    if mode == "auto":
        if backend != "inductor":
            mode, why = None, f"backend {backend!r}"
        elif scope == "regional":
            mode, why = None, "regional scope: no CUDA graphs"
        elif device.type != "cuda":
            mode, why = None, f"no CUDA graphs on {device.type}"
        elif shapes is None:
            mode, why = None, "shapes not shown: no CUDA graphs"
        elif len(shapes) <= MAX_CUDAGRAPH_SHAPES:
            mode, why = "reduce-overhead", f"{len(shapes)} batch shape(s): CUDA graphs"
        else:
            mode, why = None, f"{len(shapes)} batch shapes > {MAX_CUDAGRAPH_SHAPES}: no CUDA graphs"
    else:
        mode, why = (None if mode == "default" else mode), "asked for"
    choices["mode"], reasons["mode"] = mode or "default", why

    # dynamic lengths
    lengths = sorted({s for _, s in shapes}) if shapes else None
    if dynamic == "auto":
        if lengths is None:
            mark, why = False, "lengths not shown: torch's default (at most static + dynamic)"
        elif len(lengths) > 1:
            mark, why = True, f"{len(lengths)} lengths: dynamic from the first call"
        else:
            mark, why = False, "one length: static"
    else:
        mark, why = bool(dynamic), "asked for"
    choices["dynamic"], reasons["dynamic"] = mark, why
    choices["pad_multiple"], reasons["pad_multiple"] = pad_multiple, (
        "lengths aligned (no % 8 guard)" if pad_multiple > 1 else "asked for")

    low = dtype in (torch.bfloat16, torch.float16)
    use_autocast = low and autocast is not False
    choices["autocast"] = use_autocast
    reasons["autocast"] = ("asked for" if autocast is False else "LoRA matmuls in the compute dtype" if low
                           else f"{_show(dtype)}: nothing to autocast")
    # a loss computed outside the graph (regional scope) takes fewer, longer chunks when few rows
    # are labelled (ops.losses.CHUNK_MIN_ROWS says why; held to Unsloth's peak at 8B, 8 x 1024 on
    # an H100 the peak stayed 7.78 GiB: it is in a layer's backward, not at the loss)
    chunk_rows = (CHUNK_MIN_ROWS if ce_min_rows == "auto" else ce_min_rows) if ce_chunks and scope == "regional" else 0
    choices["loss"], reasons["loss"] = (f"chunked CE x{ce_chunks}" if ce_chunks else "model's own",
                                        ("no full fp32 logits" + (f"; fewer chunks while one would hold under "
                                                                  f"{chunk_rows} rows" if chunk_rows else ""))
                                        if ce_chunks else "asked for" if head is None
                                        else "the chunked loss would not compute this model's loss (see head)")
    choices["loss_rows"], reasons["loss_rows"] = rows_choice
    # a loss inside the graph gets one row count (the most a batch shown needs: one compilation,
    # one CUDA graph); outside it (regional scope) each batch takes its own, in multiples of 64
    # rows: at 8B, 8 x 1024 about 450 rows where the most was 1024
    fine_rows = choices["loss_rows"] == "labelled" and scope == "regional"
    if fine_rows:
        reasons["loss_rows"] += "; each batch its own count, in multiples of 64 rows (the loss runs outside the graph)"
    if eager_numerics == "auto":
        numerics = low and backend == "inductor"
        why = ("compiled rounds where eager does (loss within the eager floor)" if numerics
               else f"{_show(dtype)}: nothing to round" if not low else f"backend {backend!r}")
    else:
        numerics, why = bool(eager_numerics), "asked for"
    choices["eager_numerics"], reasons["eager_numerics"] = numerics, why
    if memory_budget is not None:
        choices["memory_budget"], reasons["memory_budget"] = memory_budget, "asked for"

    model.train()
    doc_handle = None
    if packed:
        from ..ops.doc_attention import use_document_attention

        doc_handle = use_document_attention(model, choices["doc_attention"])
    try:
        fast = prepare_fast(model, dtype=dtype, device=device, batches=batches, cast_bf16=cast, ce_chunks=ce_chunks,
                            grad_ckpt=ckpt > 0, ckpt_layers=ckpt if ckpt > 0 else None,
                            autocast=use_autocast, causal_attn=attention == "causal", mode=mode, backend=backend,
                            eager_numerics=numerics, scope=scope, offload=ck.offload, ce_min_rows=chunk_rows,
                            head=head,
                            # regional: the layers' inputs cannot be marked dynamic from outside
                            dynamic=True if scope == "regional" and mark else None)
    except BaseException:  # leave the model as it was given, but for the cast
        if doc_handle is not None:
            doc_handle.undo()
        raise
    choices["cast"], reasons["cast"] = fast.cast, "non-LoRA weights cast to the compute dtype"
    extra = keep_bnb_training_layout(model, device, choices, reasons)
    if doc_handle is not None:
        extra.insert(0, doc_handle)  # configs only: undone in any order
    try:
        nf4 = use_nf4_dequant(model, nf4_dequant, device, choices, reasons)
        extra += nf4
        extra += use_lora_addmm(model, lora_addmm, choices, reasons, not over_target,
                                "the memory target is not met with every layer checkpointed: one tensor fewer", nf4,
                                group=not (scope == "whole" and ckpt > 0),
                                no_group_why="whole scope with checkpointing: a checkpointed region is traced "
                                             "without side effects, and the group's state is one")
    except BaseException:  # refused when asked for: leave the model as it was given, but for the cast
        for handle in [*extra, fast]:
            handle.undo()
        raise
    _note_unfused_numerics(model, dtype, use_autocast, choices, reasons)
    pad_id = int(getattr(_config_of(model), "pad_token_id", None) or 0)
    min_rows = (head_rows or 0) if choices["loss_rows"] == "labelled" and not fine_rows else 0
    compiled = fast.forward
    graphs = mode in ("reduce-overhead", "max-autotune")  # CUDA graphs: static inputs at one address
    if packed:
        compiled = with_document_mask(compiled, choices["doc_attention"], required=False, stable_ids=graphs)
    forward = step_forward(compiled, multiple=pad_multiple, pad_id=pad_id, mark_dynamic=mark and scope == "whole",
                           loss_rows=ce_chunks if choices["loss_rows"] == "labelled" else 0,
                           memory_budget=memory_budget, recompute_elementwise=rec, min_loss_rows=min_rows,
                           dynamic_rows=not graphs,  # a dynamic count cost 3.8 GiB (step_inputs' docstring)
                           cache_functions=cache_fns, fine_rows=fine_rows)
    module = fast.prepared.model
    return Optimized(forward=forward, module=module, counter=fast.counter, choices=choices, reasons=reasons,
                     fast=fast, _pad_id=pad_id, _extra=extra,
                     _row_chunks=ce_chunks if choices["loss_rows"] == "labelled" else 0, _min_rows=min_rows,
                     _fine_rows=fine_rows)
