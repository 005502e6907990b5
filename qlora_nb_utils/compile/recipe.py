"""Our fastest QLoRA training step, as plain functions on a loaded PEFT model.

Why this module exists: the peer benchmark found a recipe that trains a bitsandbytes NF4 +
LoRA model much faster than the HF default (``docs/fast_recipe.md`` quotes the figures and
the runs they come from). A user should be able to train with it without importing the
benchmark, so the steps that change the model live here, in the product. Each step fixes one
thing the default setup gets wrong under ``torch.compile``, and each can be undone:

* **Cast back.** ``prepare_model_for_kbit_training`` upcasts the embeddings, the tied head and
  the norms to fp32, which turns the whole residual stream fp32. :func:`cast_non_lora` casts
  every non-LoRA float weight back to the compute dtype (the LoRA weights stay fp32).
* **Chunked loss.** The model is wrapped in :class:`~qlora_nb_utils.ops.losses.ChunkedLossLM`,
  whose loss never holds the full fp32 logits of a 128k vocabulary; it computes what the
  model's own head does after ``hidden @ W^T`` (bias, scale, soft cap: :mod:`~qlora_nb_utils.ops.lm_head`). In regional scope, where
  the head and the loss stay eager, each chunk's softmax arithmetic is compiled on CUDA
  (``compiled_math``).
* **Causal-only attention.** While Dynamo traces, transformers always builds a 4-D mask, so
  the compiled model never takes SDPA's flash kernel and repeats K/V over the query groups.
  On right-padded batches the causal flag alone gives real tokens the same attention
  (:func:`~qlora_nb_utils.ops.attention.use_causal_sdpa`; the batches are checked first).
* **Partial checkpointing.** Gradient checkpointing with the package's must-recompute policy
  (:func:`~qlora_nb_utils.compile.prepare_for_compile` with ``grad_ckpt=True``), limited to
  the first N decoder layers: enough to bring peak memory down, without paying the recompute
  of every layer.
* **Autocast.** PEFT keeps the LoRA weights fp32 and casts every LoRA input to fp32 unless
  autocast is on; under ``torch.autocast`` the LoRA matmuls run in bf16 and the fp32 master
  weights stay.
* **Offload.** With checkpointing in regional scope, the checkpointed layers' saved inputs can
  live in pinned CPU memory, copied out and back on a side stream (:mod:`.offload`).
* **Activation memory budget.** Inductor's ``activation_memory_budget`` (0..1) makes the
  compiled backward recompute more and save less (:func:`activation_memory_budget`).
* **Recompute elementwise results the backward's matmuls read.** The partitioner saves every
  elementwise result that a backward matmul reads (``ban_recompute_materialized_backward``):
  the SwiGLU product (the down projection's LoRA input), the two RMSNorm outputs and the
  attention output in token-major layout (the other LoRA inputs). Each is one cheap pass over
  tensors the backward keeps anyway (the gate and up outputs, the layer input and its norm
  statistics), and together they are four of a layer's saved tensors, one of them
  intermediate-sized (:func:`partitioner_settings`; counted on the CPU with
  :func:`~qlora_nb_utils.diagnostics.saved_for_backward`).
* **A warm start that skips AOTAutograd.** Its on-disk cache refuses any graph that holds an
  autograd Function (``Unsupported call_function target autograd_function_apply``), and every
  graph of the recipe holds one (the chunked loss, the fused LoRA linear, bitsandbytes' own).
  So a second process traced and partitioned the joint graph again, from a warm cache too
  (the cache's counter ``autograd_cache_bypass``). Dynamo traces a Function's
  forward and backward into the graph, so the cache key covers both; torch's setting
  ``autograd_cache_allow_custom_autograd_functions`` (off by default) lets the cache take them
  (:func:`partitioner_settings` with ``cache_functions``).

:func:`prepare_fast` applies them in that order and hands back a :class:`FastPrepared`: the
forward to train with, the compile counter, what was done (for a run's notes) and ``undo()``.
This module never imports the lab (``bench``, ``report``), the CLI or ``training``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from ..models.load_prequantized import is_4bit_weight
from ..ops.attention import check_right_padded, use_causal_sdpa
from ..ops.losses import ChunkedLossLM
from ..reversible import PatchHandle, set_attribute
from . import offload as host_offload
from .checkpointing import decoder_layers
from .options import RecipeOptions
from .prepare import Prepared, prepare_for_compile

if TYPE_CHECKING:
    from .counting import CompileCounter

__all__ = [
    "FastPrepared",
    "cast_non_lora",
    "is_quantized_weight",
    "checkpoint_first_layers",
    "autocast_forward",
    "activation_memory_budget",
    "partitioner_settings",
    "can_recompute_elementwise",
    "can_cache_functions",
    "RECOMPUTE_KNOB",
    "prepare_fast",
]


def is_quantized_weight(param: torch.Tensor) -> bool:
    """True for a bitsandbytes quantized weight (``Params4bit``, ``Int8Params``): its data are packed codes
    in whatever storage dtype was asked for, not values (by type name: bitsandbytes is not imported)."""
    kind = type(param)
    return is_4bit_weight(param) or (kind.__name__ == "Int8Params" and kind.__module__.startswith("bitsandbytes"))


def cast_non_lora(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Cast every floating, non-LoRA parameter to ``dtype`` (undoing kbit-prep's fp32 upcast).

    LoRA weights (names with ``lora_``) keep their dtype (PEFT keeps them fp32), and nothing
    changes ``requires_grad``. bitsandbytes' quantized weights are untouched whatever their
    storage: with ``bnb_4bit_quant_storage`` a float dtype (as FSDP loads them) the packed 4-bit
    codes sit in float words, and a numeric cast would rewrite those bytes (and change how many
    there are), leaving the dequantization to read codes that are no longer there.

    Returns:
        How many parameters were cast.
    """
    cast = 0
    for name, param in model.named_parameters():
        if "lora_" in name or not param.is_floating_point() or param.dtype == dtype or is_quantized_weight(param):
            continue
        param.data = param.data.to(dtype)
        cast += 1
    return cast


def checkpoint_first_layers(model: torch.nn.Module, n: int, handle: PatchHandle | None = None) -> int:
    """Keep gradient checkpointing on the first ``n`` decoder layers only; turn it off on the rest.

    Call it after ``prepare_for_compile(..., grad_ckpt=True)``, which turned checkpointing on in
    every layer. Pass a ``handle`` to make the change undoable: undo it *before* the prepared
    model's ``undo()``, which leaves alone a flag changed since it set it.

    Returns:
        How many decoder layers keep checkpointing (``n``, or fewer when the model has fewer).
    """
    layers = decoder_layers(model)
    n_ckpt = min(n, len(layers))
    for layer in layers[n_ckpt:]:
        if handle is None:
            layer.gradient_checkpointing = False
        else:
            set_attribute(handle, layer, "gradient_checkpointing", False)
    return n_ckpt


def autocast_forward(forward: Callable[..., Any], device_type: str, dtype: torch.dtype) -> Callable[..., Any]:
    """``forward(**batch)`` run under ``torch.autocast(device_type, dtype=dtype)``.

    The context is entered outside the compiled callable, so Dynamo traces under it.
    """

    def run(**batch):
        with torch.autocast(device_type, dtype=dtype):
            return forward(**batch)

    return run


@contextlib.contextmanager
def activation_memory_budget(budget: float | None) -> Iterator[None]:
    """Inductor's ``activation_memory_budget`` (0..1) inside the block; None leaves the default.

    Compile (run the first step) inside the block: the partitioner reads the setting when it
    splits the forward from the backward.
    """
    with partitioner_settings(memory_budget=budget):
        yield


#: The partitioner's setting that keeps it from recomputing what a backward matmul reads.
RECOMPUTE_KNOB = "ban_recompute_materialized_backward"


def can_recompute_elementwise() -> bool:
    """Whether this torch's partitioner has :data:`RECOMPUTE_KNOB` (torch 2.11 and 2.13 do)."""
    return hasattr(torch._functorch.config, RECOMPUTE_KNOB)


#: AOTAutograd's setting that lets its on-disk cache take graphs holding autograd Functions.
CACHE_FUNCTIONS_KNOB = "autograd_cache_allow_custom_autograd_functions"


def can_cache_functions() -> bool:
    """Whether this torch's AOTAutograd cache has :data:`CACHE_FUNCTIONS_KNOB` (torch 2.13 does)."""
    return hasattr(torch._functorch.config, CACHE_FUNCTIONS_KNOB)


@contextlib.contextmanager
def partitioner_settings(memory_budget: float | None = None, recompute_elementwise: bool = False,
                         cache_functions: bool = False) -> Iterator[None]:
    """AOTAutograd's settings for a compile inside the block; the defaults leave torch's.

    Args:
        memory_budget: the partitioner's ``activation_memory_budget`` (0..1); None leaves it.
        recompute_elementwise: let the backward recompute elementwise results that its matmuls
            read (the SwiGLU product, the norm outputs) instead of saving them.
        cache_functions: let AOTAutograd's on-disk cache store and reuse graphs that hold
            autograd Functions (:data:`CACHE_FUNCTIONS_KNOB`): a warm process skips tracing and
            partitioning the joint graph.

    Raises:
        RuntimeError: ``recompute_elementwise`` on a torch without :data:`RECOMPUTE_KNOB`, or
            ``cache_functions`` on one without :data:`CACHE_FUNCTIONS_KNOB`.

    Compile (run the first step) inside the block: the partitioner and the cache read the
    settings when AOTAutograd runs.
    """
    patch: dict[str, Any] = {} if memory_budget is None else {"activation_memory_budget": float(memory_budget)}
    if recompute_elementwise:
        if not can_recompute_elementwise():
            raise RuntimeError(f"this torch ({torch.__version__}) has no torch._functorch.config.{RECOMPUTE_KNOB}")
        patch[RECOMPUTE_KNOB] = False
    if cache_functions:
        if not can_cache_functions():
            raise RuntimeError(f"this torch ({torch.__version__}) has no torch._functorch.config.{CACHE_FUNCTIONS_KNOB}")
        patch[CACHE_FUNCTIONS_KNOB] = True
    with torch._functorch.config.patch(**patch):
        yield


@dataclasses.dataclass
class FastPrepared:
    """A model made ready by :func:`prepare_fast`.

    Attributes:
        forward: What to train with: ``forward(**batch).loss``.
        prepared: The :class:`~qlora_nb_utils.compile.Prepared` of ``prepare_for_compile``.
        attention: The causal-only attention handle, or None when it was not asked for.
        cast: How many non-LoRA weights were cast to ``dtype`` (0 when not asked for).
        ckpt_layers: How many decoder layers checkpoint (0 without checkpointing).
        layers: How many decoder layers the model has.
        autocast: Whether ``forward`` runs under autocast (only for a bf16/fp16 ``dtype``).
        dtype: The compute dtype.
    """

    forward: Callable[..., Any]
    prepared: Prepared
    attention: PatchHandle | None
    cast: int
    ckpt_layers: int
    layers: int
    autocast: bool
    dtype: torch.dtype
    layer_flags: PatchHandle | None = None
    offload: PatchHandle | None = None

    @property
    def counter(self) -> CompileCounter:
        """The compile counter of the prepared model (compilations, compile time)."""
        return self.prepared.counter

    def undo(self) -> None:
        """Revert ``prepare_for_compile`` (checkpointing flags included), then the attention swap.

        The cast is not undone: cast back with :func:`cast_non_lora` if the fp32 copies matter.
        """
        if self.offload is not None:
            self.offload.undo()
        if self.layer_flags is not None:
            self.layer_flags.undo()
        self.prepared.undo()
        if self.attention is not None:
            self.attention.undo()


def prepare_fast(model: torch.nn.Module, options: RecipeOptions | None = None, *,
                 batches: Iterable[dict] | None = None, **knobs: Any) -> FastPrepared:
    """Apply the fast recipe to a loaded PEFT QLoRA model (see the module docstring).

    Args:
        model: a PEFT causal LM, e.g. from ``models.load_model(..., prepare_kbit=True)``; load it
            with ``gradient_checkpointing=grad_ckpt``.
        options: what to apply, one :class:`~qlora_nb_utils.compile.options.RecipeOptions` (its
            attributes say what each does; ``dtype`` has no default); keywords passed beside it
            (``dtype=``, ``ce_chunks=``, ...) override it, or build it when it is None.
        batches: the training batches (a list); needed with ``causal_attn``, which checks that
            they are right-padded.

    Returns:
        A :class:`FastPrepared`; call ``undo()`` when done (in a ``finally``).

    Raises:
        TypeError: a keyword that is no option, or no ``dtype``.
        ValueError: ``ckpt_layers`` without ``grad_ckpt``, ``causal_attn`` without batches or with
            batches that are not right-padded, ``offload`` without checkpointing in regional scope,
            or a bad ``prepare_for_compile`` option.
    """
    opts = options if options is not None and not knobs else (
        RecipeOptions(**knobs) if options is None else dataclasses.replace(options, **knobs))
    if opts.causal_attn and batches is None:
        raise ValueError("causal_attn needs the batches, to check that they are right-padded")
    dtype = opts.dtype
    device = next(model.parameters()).device if opts.device is None else torch.device(opts.device)
    cast = cast_non_lora(model, dtype) if opts.cast_bf16 else 0
    attn = None
    if opts.causal_attn:
        check_right_padded(batches)
        attn = use_causal_sdpa(model, cudnn=opts.causal_cudnn)
    try:
        # regional scope leaves the head and the loss eager: their softmax arithmetic is compiled on CUDA
        compiled_math = opts.scope == "regional" and device.type == "cuda" and opts.backend == "inductor"
        target = (ChunkedLossLM(model, opts.ce_chunks, compiled_math, opts.ce_min_rows, opts.head) if opts.ce_chunks
                  else model)
        prepared = prepare_for_compile(target, **opts.compile_options())
    except BaseException:  # leave the model as it was given, but for the cast
        if attn is not None:
            attn.undo()
        raise
    layers = decoder_layers(model)
    n_ckpt = len(layers) if opts.grad_ckpt else 0
    layer_flags = None
    if opts.grad_ckpt and opts.ckpt_layers is not None:
        layer_flags = PatchHandle("checkpoint_first_layers", {"layers": opts.ckpt_layers})
        n_ckpt = checkpoint_first_layers(model, opts.ckpt_layers, layer_flags)
    forward = prepared.forward
    fast = FastPrepared(forward=forward, prepared=prepared, attention=attn, cast=cast, ckpt_layers=n_ckpt,
                        layers=len(layers), autocast=False, dtype=dtype, layer_flags=layer_flags)
    if opts.offload and n_ckpt:
        try:
            fast.offload = host_offload.apply(model)
        except BaseException:
            fast.undo()
            raise
    use_autocast = opts.autocast and dtype in (torch.bfloat16, torch.float16)  # fp32 runs: nothing to do
    if use_autocast:
        fast.forward, fast.autocast = autocast_forward(prepared.forward, device.type, dtype), True
    return fast
