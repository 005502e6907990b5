"""``optimize(model)``: the one fast path, with the choices it can make itself made for you.

Why this module exists: the fastest recipe this project has measured (:mod:`.recipe`) has a
dozen knobs, and a user should not have to know which of them pay on their device and their
shapes. :func:`optimize` applies the whole recipe to a PEFT QLoRA model and decides what can
be decided from the device, the dtype and the batches it is shown, and it says what it chose
and why (:attr:`Optimized.description`). Every place in the package that trains compiled goes
through it: ``qlora-nb train``, ``qlora-nb bench``, the ``ours`` peer, the notebooks and the
HF ``Trainer`` / TRL ``SFTTrainer`` route (:meth:`Optimized.install`).

The options are one validated object (:class:`~qlora_nb_utils.compile.options.OptimizeOptions`,
from keywords or a dict); each choice is a small function of :mod:`.choices`, run in order by
:func:`~qlora_nb_utils.compile.plan.decide` before the model changes. The choices, each
overridable by passing it explicitly:

* **CUDA graphs** (``mode="reduce-overhead"``) on a CUDA device when the batches show at most
  :data:`MAX_CUDAGRAPH_SHAPES` shapes (fixed or bucketed lengths): the LoRA step is many small
  kernels, so it is launch-bound, and one graph per shape removes the launches. With more
  shapes, or shapes not shown, the default mode (a CUDA graph per shape would cost memory).
  Under CUDA graphs the labelled-row count is static and the flex mask reads its document ids
  from one buffer: otherwise the graphs were recorded again and a held run overshot its target
  (:mod:`.step_inputs`, ``ops.doc_attention``).
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
  A model whose attention changes its scores in a way SDPA drops (Gemma-2's soft cap, read on a
  probe forward: :mod:`~qlora_nb_utils.ops.model_attention`) keeps it: flex attention with the
  change in its score modification on CUDA (causal block masks per sliding window, built outside
  the graph), the model's own eager attention where flex attention cannot train (a CPU).
* **Checkpointing**: off without a memory target; with ``max_memory_gib``, on the fewest first
  decoder layers whose estimated peak (:func:`estimate_peak_gib`, an upper bound counted from the
  config, stated in the description) fits the target; if even every layer does not fit, their saved
  inputs offloaded to CPU memory (:mod:`.offload`, regional scope), then the MLPs in pieces; where
  even that is estimated above the target, refused before the model changes.
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
* **The compile scope by what pays over the job** (``scope``, told ``steps``): one decoder
  layer's graph, compiled once and reused by every layer, where the whole model's graph would not
  repay its longer compile (wherever it gets no CUDA graphs, and on a GPU for jobs short of many
  thousand steps); the whole model otherwise, or when the job's length is not told
  (:func:`~qlora_nb_utils.compile.choices.choose_scope`).
* **The compiled graphs kept for the next run** (``compile_cache``): PyTorch's cache artifacts,
  loaded before the first compile and saved after the first step, in the user's cache folder
  (:mod:`.compile_cache`), so that a new runtime with empty temporary caches starts warm.
* **No autotuning unless asked** (``autotune``): the modes ``optimize()`` picks are the default
  and ``"reduce-overhead"``, and even there Inductor gives a reduction several candidate launch
  configurations, compiles each and benchmarks them at the first step. Without ``autotune=True``
  each kernel is compiled in one configuration, picked by Inductor's own heuristics, and none is
  benchmarked: a shorter first step, nothing the later steps measurably pay for at the sizes of a
  LoRA step's kernels (:mod:`.prepare`, "One configuration per kernel"). ``max-autotune`` is
  taken only when passed as ``mode``, and is asking.
* **A warm start that skips AOTAutograd** (``warm_cache``): its on-disk cache refused every
  graph of the recipe (each holds an autograd Function), so a second process traced and
  partitioned them again; torch's setting for it lets the cache take them
  (:func:`~qlora_nb_utils.compile.recipe.partitioner_settings`).
* **Eager's rounding** (``eager_numerics``) for bf16/fp16: Inductor keeps a fused kernel's
  intermediates in fp32 where eager rounds every op to bf16. Once the non-LoRA weights are cast
  back to bf16, the whole residual stream is bf16 and that difference grew well past the
  eager-vs-eager floor of the loss; with Inductor's ``emulate_precision_casts`` the compiled step
  rounds where eager does.

The model is put in training mode first (Inductor's training graph asserts on an eval-mode
model). On a CPU, bitsandbytes' NF4 layers are kept in their training layout
(:mod:`~qlora_nb_utils.compile.patches.bnb_cpu_packing`), so that an evaluation between
training steps (a Trainer's ``eval_steps``) cannot repack them and lose LoRA gradients. ``undo()`` reverts everything but the cast of the non-LoRA weights (see
:class:`~qlora_nb_utils.compile.recipe.FastPrepared`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ..ops.model_attention import MODEL_ATTENTION, use_attention
from ..reversible import PatchHandle
from .choices import (
    LOSS_ROWS_WHEN_IGNORED_OVER,
    show,
)
from .compile_cache import CompileCache, cache_key, save_after_first_step
from .launch_choices import MAX_CUDAGRAPH_SHAPES
from .memory_estimate import estimate_peak_gib
from .model_patches import keep_bnb_training_layout, use_lora_addmm, use_nf4_dequant
from .optimized import Optimized
from .options import MODES, OptimizeOptions
from .plan import decide
from .recipe import can_cache_functions, can_recompute_elementwise, prepare_fast
from .step_inputs import pad_batch, step_forward

__all__ = ["Optimized", "OptimizeOptions", "optimize", "estimate_peak_gib", "pad_batch", "MAX_CUDAGRAPH_SHAPES",
           "MODES", "LOSS_ROWS_WHEN_IGNORED_OVER"]


def _note_unfused_numerics(model: torch.nn.Module, plan: Any) -> None:
    """Say so when the fused NF4 LoRA route was set up but will not run: without autocast, LoRA
    weights in another dtype than the compute dtype (k-bit prep's fp32 ones, with ``autocast=False``:
    HF eager's numerics) make every call take PEFT's own path, which casts (``lora_addmm``'s docstring)."""
    if plan.autocast or not plan.choices.get("nf4_lora_linear"):
        return
    other = {p.dtype for n, p in model.named_parameters() if "lora_" in n and p.dtype != plan.dtype}
    if other:
        plan.applied("nf4_lora_linear", plan.choices["nf4_lora_linear"], plan.reasons["nf4_lora_linear"] + (
            f"; set up, but not taken at run time: LoRA weights in {show(min(other, key=str))} "
            f"without autocast (HF eager's numerics) take PEFT's own path"))


def _keep_attention(model: torch.nn.Module, plan: Any) -> Any:
    """:mod:`.patches.kept_attention` on the planned model, its outputs where the plan keeps them
    (``"host"``: page-locked memory, like offloaded layer inputs); the layer count added to the reason."""
    from .offload import EXACT_HOST_BUFFERS, CpuOffloader
    from .patches import kept_attention

    host = plan.keep_attention == "host"
    offloader = CpuOffloader(exact_host_buffers=EXACT_HOST_BUFFERS) if host else None
    handle = kept_attention.apply(model, offloader=offloader)
    plan.applied("keep_attention", plan.keep_attention, f"{handle.details['layers']} checkpointed layers keep their "
                 f"attention output in {'host' if host else 'device'} memory: {plan.reasons['keep_attention']}")
    return handle


def _compile_cache(model: torch.nn.Module, plan: Any, forward: Any) -> tuple[Any, list[PatchHandle]]:
    """The run's cache artifacts (:mod:`.compile_cache`) where the plan keeps them: loaded now, before
    anything compiles, and saved after the first step (by the ``forward`` returned) or at ``undo()``
    (by the handle returned). The file is keyed by every other choice."""
    folder = plan.choices["compile_cache"]
    if folder is False:
        return forward, []
    others = {k: v for k, v in plan.choices.items() if k != "compile_cache"}
    cache = CompileCache(Path(folder) / cache_key(model, plan.device, others))
    said = cache.load()
    plan.applied("compile_cache", "loaded" if cache.loaded_bytes else "kept", f"{plan.reasons['compile_cache']}: {said}")
    forward, finish = save_after_first_step(forward, cache)
    handle = PatchHandle("compile_cache", {"path": str(cache.path)})
    handle.add_undo(finish)
    return forward, [handle]


def optimize(model: torch.nn.Module, options: OptimizeOptions | Mapping[str, Any] | None = None, *,
             batches: Iterable[dict] | None = None, **knobs: Any) -> Optimized:
    """Apply the fast recipe to a PEFT QLoRA model, making the choices it can from device and shapes.

    Args:
        model: a PEFT causal LM (e.g. ``load_model(..., prepare_kbit=True)`` or without kbit prep).
        options: the knobs below as one :class:`~qlora_nb_utils.compile.options.OptimizeOptions`, or
            a dict of them (a config file); keywords passed beside it override it.
        batches: the training batches, or a sample of them; their shapes decide CUDA graphs,
            dynamic lengths and the attention path (None: decided without them, conservatively).
        grad_ckpt: ``"auto"`` (off, or the fewest layers that fit ``max_memory_gib``), True or False.
        max_memory_gib: a peak-memory target in GiB for ``grad_ckpt="auto"`` (needs ``batches``); it
            also keeps each piece of the chunked loss to at most ``plan.TARGET_CHUNK_ROWS`` rows (more
            than ``ce_chunks`` pieces at long sequences), so the loss's transient does not grow with the length.
        mode: ``"auto"``, or an Inductor mode (``"default"``/None, ``"reduce-overhead"``, ...).
        attention: ``"auto"``, ``"causal"`` (causal-only SDPA; right-padded batches) or ``"mask"``;
            packed batches (with ``document_ids``) always get the per-document mask. A model whose
            attention changes its scores in a way SDPA drops (a soft cap) keeps it: ``"auto"``
            chooses ``"flex"`` (flex attention on CUDA) or ``"eager"`` (its own eager attention),
            ``"mask"`` its eager attention, and ``"causal"`` is refused.
        sdpa_kernel: for causal-only SDPA, ``"auto"`` (cuDNN's kernel first on Hopper GPUs, for rows
            of at least 16384 positions without CUDA graphs, where a probe of the model's attention
            shape runs: :func:`~qlora_nb_utils.compile.choices.choose_sdpa_kernel`), ``"cudnn"`` or ``"default"`` (SDPA's
            own order: flash first).
        keep_attention: each checkpointed layer's recompute takes the attention output its forward
            kept instead of running the attention kernel again (:mod:`.patches.kept_attention`):
            ``"auto"`` (under ``max_memory_gib``, with cuDNN's kernel and checkpointed layers in
            regional scope, short of the MLP pieces: on the device where the estimate has room for
            every kept output, else in host memory where it has room for the copies in flight and
            the host for them:
            :func:`~qlora_nb_utils.compile.choices.choose_keep_attention`), True (in host memory
            beside offloaded inputs, else on the device; needs checkpointed layers in regional scope
            on the causal-only SDPA, refused otherwise, with the reason) or False.
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
        scope: ``"auto"`` (by what pays over ``steps``:
            :func:`~qlora_nb_utils.compile.choices.choose_scope`), ``"whole"`` (one graph: the
            fastest step on a GPU, under CUDA graphs) or ``"regional"`` (one decoder layer's graph,
            compiled once and reused by every layer, the rest eager: the shortest cold compile, see
            notebook 06); regional never uses CUDA graphs under ``mode="auto"``.
        steps: the optimizer steps the job will run (None: not known), what ``scope="auto"``
            weighs a compile against: a short job compiles one decoder layer, a long one on a GPU
            the whole model. ``train``'s callers in the package (``qlora-nb train``, ``qlora-nb
            bench``) pass it.
        step_graph: ``"auto"`` (where the step can be captured: CUDA, regional scope, at most
            :data:`~qlora_nb_utils.compile.launch_choices.MAX_STEP_GRAPHS` batch shapes, causal-only
            attention, no checkpointing and no memory target:
            :func:`~qlora_nb_utils.compile.launch_choices.choose_step_graph`), True or False: the training
            loop captures each batch shape's whole step as one CUDA graph and replays it
            (``train(..., forward=opt.forward)`` and ``qlora-nb train`` do; the labelled rows then
            take one count for every batch).
        doc_attention: for packed batches, ``"auto"`` (flex attention on CUDA, SDPA elsewhere),
            ``"flex_attention"`` or ``"sdpa"``.
        offload: keep checkpointed layers' inputs in pinned CPU memory (:mod:`.offload`):
            ``"auto"`` (only when ``max_memory_gib`` is not met by checkpointing every layer),
            True or False. Offloading compiles in regional scope.
        tile_mlp: run each decoder layer's MLP in pieces of this many positions, one opaque operator
            (:mod:`.patches.tiled_mlp`; the same arithmetic, rounded as eager code rounds it):
            ``"auto"`` (pieces of :data:`.plan.TILE_ROWS` only when ``max_memory_gib`` is not met
            with every layer checkpointed and offloaded), an integer, or False.
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
        lora_min_rows: the fused LoRA linear over an NF4 weight runs for a call of more than this many
            rows (batch x positions); at fewer, bitsandbytes' own kernels run the base layer and the update
            is added after them, which rounds an update far below a bf16 unit of the output where the
            fused route keeps it: ``"auto"`` (bitsandbytes' own threshold on CUDA, below which it picks
            its kernels; 0 on a CPU) or an integer >= 0 (0: fused at any size).
            :func:`~qlora_nb_utils.distributed.context_parallel.optimize_context_parallel` divides the
            threshold by the ranks sharing a row, so that each rank takes the route one GPU takes for
            the whole row.
        nf4_dequant: the NF4 weights dequantized in one Triton kernel, not bitsandbytes' two
            (:func:`~qlora_nb_utils.compile.model_patches.use_nf4_dequant`: a process-wide patch,
            shared): ``"auto"`` (on CUDA with Triton), True or False.
        warm_cache: let AOTAutograd's on-disk cache store and reuse the recipe's graphs, which
            hold autograd Functions (:func:`~qlora_nb_utils.compile.recipe.can_cache_functions`):
            ``"auto"`` (on where this torch has the setting and the backend is Inductor), True
            (refused where torch lacks it) or False.
        autotune: let Inductor benchmark each kernel's candidate configurations on the first step:
            ``"auto"`` (only under a max-autotune ``mode``; otherwise every kernel in one
            configuration, none benchmarked:
            :func:`~qlora_nb_utils.compile.launch_choices.choose_autotune`), True, or False (refused with a
            max-autotune mode).
        compile_cache: keep the run's compiled graphs for the next run, PyTorch's cache artifacts
            (:mod:`~qlora_nb_utils.compile.compile_cache`: loaded here before anything compiles,
            saved after the first step, one file per model shape, device, torch and choices):
            ``"auto"`` (on CUDA with Inductor, in ``<the package's cache folder>/compile``), True
            (there on any device), a folder, or False.

    Returns:
        An :class:`Optimized`; train with ``opt.forward(**batch).loss``; ``opt.undo()`` when done.

    Raises:
        TypeError: a keyword that is no option (the message lists the valid ones).
        ValueError: an unknown choice (the message lists the valid ones), ``max_memory_gib``
            without ``batches``, a ``max_memory_gib`` that even the most frugal plan the options
            allow is estimated above (the message gives the estimate and the longest length that
            fits), ``attention="causal"`` on batches that are not right-padded,
            packed and padded batches mixed, a packed batch with an ``attention_mask``,
            ``loss_rows=True`` for a model whose head the chunked loss does not reproduce.
    """
    opts = OptimizeOptions.build(options, **knobs)
    batches = list(batches) if batches is not None else None
    opts.check_batches(batches)
    # every choice made before the model changes (a refusal leaves it as it was given)
    plan = decide(model, opts, batches, recompute_available=can_recompute_elementwise(),
                  cache_available=can_cache_functions())
    choices, reasons = plan.choices, plan.reasons
    inputs = plan.step_inputs()
    model.train()
    doc_handle = None
    if plan.packed:
        from ..ops.doc_attention import use_document_attention

        doc_handle = use_document_attention(model, choices["doc_attention"])
    elif plan.attention in MODEL_ATTENTION:  # the model's score changes kept: flex attention or its eager one
        doc_handle = use_attention(model, MODEL_ATTENTION[plan.attention])
    try:
        fast = prepare_fast(model, inputs.recipe, batches=batches)
    except BaseException:  # leave the model as it was given, but for the cast
        if doc_handle is not None:
            doc_handle.undo()
        raise
    plan.applied("cast", fast.cast)
    extra = keep_bnb_training_layout(model, plan)
    if doc_handle is not None:
        extra.insert(0, doc_handle)  # configs only: undone in any order
    try:
        nf4 = use_nf4_dequant(model, plan)
        extra += nf4
        extra += use_lora_addmm(model, plan, nf4)  # out of place where the plan is over its target
        if plan.tile_rows:  # after the LoRA patches: the tiles run the MLP's grouped projections apart
            from .patches import tiled_mlp

            extra.append(tiled_mlp.apply(model, plan.tile_rows))
        if plan.keep_attention:  # after checkpointing and offload: it wraps their checkpoint functions
            extra.append(_keep_attention(model, plan))
    except BaseException:  # refused when asked for: leave the model as it was given, but for the cast
        for handle in [*extra, fast]:
            handle.undo()
        raise
    _note_unfused_numerics(model, plan)
    forward, cache_handles = _compile_cache(model, plan, step_forward(fast.forward, inputs))
    extra += cache_handles
    return Optimized(forward=forward, module=fast.prepared.model, counter=fast.counter, choices=choices,
                     reasons=reasons, fast=fast, options=opts, inputs=inputs, _extra=extra)
