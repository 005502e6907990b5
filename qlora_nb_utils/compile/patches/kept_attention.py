"""Keep each checkpointed layer's attention output for its recompute, instead of computing it twice.

Why: a checkpointed decoder layer runs its forward twice, once in the forward pass and once more
in the backward pass to rebuild what its backward needs. At long sequences attention is the
largest part of that second forward (its cost grows with the square of the length, the rest
linearly), and all the backward needs from it is its output and the log-sum-exp of each row. Both
are small beside the attention's work: the output is as large as the layer's input, the
log-sum-exp one number per head and position. Kept from the first forward (in host memory when
the layer inputs are offloaded, copied there and back on a side stream like them), the recompute
takes them instead of running the kernel again; the backward is the same kernel's backward.

How: :func:`apply` registers a causal attention implementation with transformers'
``AttentionInterface`` (the same no-mask causal attention as ``ops.attention``) whose kernel is one
opaque operator, ``qlora_nb::kept_sdpa``, and wraps each checkpointed layer's checkpoint function so
that the layer's first run (the forward pass) keeps the operator's outputs on a stack and its second
run (the recompute, which the backward does in the reverse order of the layers) takes them back.
The kernel is cuDNN's on a GPU (SDPA's fastest on Hopper for long causal rows) and the CPU flash
kernel on a CPU, both with their own backward. Keys and values are repeated over the query groups
before the operator (grouped-query attention), so the kernel sees equal head counts. A layer run
without grad, or a stack left over from a forward whose backward never ran, never hands out a wrong
output: each kept entry records the query's shape, and the stack is cleared at the start of every
forward of the decoder stack. The checkpoint must run eagerly around compiled layers (``optimize()``'s
regional scope), where each layer's two runs are two calls.

The operator's outputs are copies it owns: the compiled layer may reuse the memory of a tensor it
was handed once that tensor is dead, so what is kept is a separate copy.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ...reversible import PatchHandle, set_attribute

__all__ = ["apply", "KeptStore", "IMPLEMENTATION", "supported", "attention_unsupported", "output_bytes"]

NAME = "kept_attention"
OP = "qlora_nb::kept_sdpa"
#: The attention implementation's name in transformers' interfaces.
IMPLEMENTATION = "qlora_causal_sdpa_kept"

#: (store, mode) of the layer running now: mode "keep" (the forward pass), "reuse" (the recompute).
_RUNNING: list[tuple["KeptStore", str]] = []


class KeptStore:
    """The kept attention outputs of the checkpointed layers of one model, last layer on top.

    Args:
        offloader: a :class:`~qlora_nb_utils.compile.offload.CpuOffloader` that keeps each output in
            host memory and brings the next one back ahead of its use, or None (kept on the device).
    """

    def __init__(self, offloader: Any = None) -> None:
        self.offloader = offloader
        self.stack: list[tuple[torch.Size, Any, torch.Tensor]] = []
        self.kept = 0  # outputs kept
        self.reused = 0  # recomputes that took a kept output instead of running the kernel
        self.dropped = 0  # entries left by a forward without its backward, cleared

    def keep(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        held = self.offloader.pack(out.clone()) if self.offloader is not None else out.clone()
        self.stack.append((q.shape, held, lse.clone()))
        self.kept += 1

    def take(self, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.stack:
            raise RuntimeError("kept attention: a recompute found no kept output (a layer's forward ran "
                               "without grad, or the model changed between its forward and backward)")
        shape, held, lse = self.stack.pop()
        if shape != q.shape:
            raise RuntimeError(f"kept attention: the recompute's query is {tuple(q.shape)}, the kept output's "
                               f"{tuple(shape)}: the layers' recomputes ran out of order")
        out = self.offloader.unpack(held) if self.offloader is not None else held
        self.reused += 1
        return out, lse

    def clear(self) -> None:
        self.dropped += len(self.stack)
        self.stack.clear()


@contextlib.contextmanager
def _running(store: KeptStore, mode: str):
    _RUNNING.append((store, mode))
    try:
        yield
    finally:
        _RUNNING.pop()


def _compute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention's output and log-sum-exp (no dropout: no random state to keep), contiguous."""
    if q.device.type == "cuda":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        out, lse = res[0], res[1]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out.contiguous(), lse.contiguous()


@torch.library.custom_op(OP, mutates_args=())
def _kept_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of (batch, heads, positions, head dim) inputs with equal head counts:
    (output, log-sum-exp); a layer's recompute takes what its forward kept."""
    store, mode = _RUNNING[-1] if _RUNNING else (None, None)
    if store is not None and mode == "reuse":
        return store.take(q)
    out, lse = _compute(q, k, v, scale)
    if store is not None and mode == "keep":
        store.keep(q, out, lse)
    return out, lse


@_kept_sdpa.register_fake
def _(q, k, v, scale):
    return _compute(q, k, v, scale)  # the kernels' own fake implementations give the shapes and strides


@torch.library.custom_op(OP + "_backward", mutates_args=())
def _kept_sdpa_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention kernel's own backward, eagerly (an operator of its own: the compiler sees no
    kernel arguments it would have to spell), its gradients contiguous."""
    grad_out = grad_out.contiguous()  # the layout of ``out``
    if q.device.type == "cuda":
        seed, offset = (torch.zeros((), dtype=torch.int64, device=q.device) for _ in range(2))  # no dropout: unread
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse, seed, offset, None, None, None, q.shape[-2], k.shape[-2], 0.0, True,
            scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, True, scale=scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_kept_sdpa_backward.register_fake
def _(grad_out, q, k, v, out, lse, scale):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _setup(ctx, inputs, output):
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.qlora_nb.kept_sdpa_backward(grad_out, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


_kept_sdpa.register_autograd(_backward, setup_context=_setup)


def _kept_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: causal attention through ``qlora_nb::kept_sdpa``,
    the output as (batch, positions, heads, head dim), no attention weights."""
    if dropout and module.training:
        raise ValueError("kept attention has no attention dropout; the plan does not choose it for such a model")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each query head with its key/value head
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.qlora_nb.kept_sdpa(query, key, value, float(scale))[0]
    return out.transpose(1, 2), None


def attention_unsupported(model: torch.nn.Module, causal: bool | None = None) -> str | None:
    """None when ``model``'s attention can be kept, else why not. ``causal``: whether it runs (or the plan
    will run it) as the causal-only SDPA; None reads that from the model's configs."""
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    from ...ops.attention import CAUSAL_SDPA, CAUSAL_SDPA_CUDNN

    if causal is None:
        causal = bool(configs) and not ({c._attn_implementation for c in configs}
                                        - {CAUSAL_SDPA, CAUSAL_SDPA_CUDNN, IMPLEMENTATION})
    if not configs or not causal:
        return "the model's attention is not the causal-only SDPA (packed documents, a sliding window or flex)"
    if any(float(getattr(c, "attention_dropout", 0.0) or 0.0) > 0 for c in configs):
        return "the model has attention dropout"
    if any(getattr(c, "attn_logit_softcapping", None) for c in configs):
        return "the model soft-caps its attention scores"
    return None


def supported(model: torch.nn.Module) -> str | None:
    """None when :func:`apply` can keep ``model``'s attention outputs now, else why not."""
    from ..offload import offload_supported

    return offload_supported(model) or attention_unsupported(model)


def output_bytes(batch: int, positions: int, heads: int, head_dim: int, act_bytes: int) -> tuple[int, int]:
    """What one layer keeps: (its attention output's bytes, its log-sum-exp's bytes, fp32)."""
    return batch * positions * heads * head_dim * act_bytes, batch * heads * positions * 4


def _kept(checkpoint: Callable[..., Any], store: KeptStore) -> Callable[..., Any]:
    """``checkpoint(function, *args)`` whose first run of ``function`` keeps its attention output and
    whose second (the recompute) takes it back."""

    def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return checkpoint(function, *args, **kwargs)
        calls = [0]

        def body(*a: Any, **k: Any) -> Any:
            mode = "keep" if calls[0] == 0 else "reuse"
            calls[0] += 1
            with _running(store, mode):
                return function(*a, **k)

        return checkpoint(body, *args, **kwargs)

    run.inner = getattr(checkpoint, "inner", checkpoint)  # type: ignore[attr-defined]
    run.store = store  # type: ignore[attr-defined]
    return run


def apply(model: torch.nn.Module, offloader: Any = None) -> PatchHandle:
    """Keep the attention output of each checkpointed decoder layer for its recompute (module docstring).

    Call it after checkpointing (and offloading, if any) is configured and before the first step;
    ``undo()`` restores the attention implementation and the checkpoint functions.

    Args:
        model: a transformers causal LM (PEFT-wrapped or not) on the causal-only SDPA attention.
        offloader: a ``CpuOffloader`` for the kept outputs (host memory), or None (on the device).

    Returns:
        A :class:`PatchHandle`; ``handle.store`` counts what was kept and reused.

    Raises:
        ValueError: the model's checkpoints or attention do not allow it (:func:`supported`).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ...ops.attention import no_mask
    from ...ops.lm_head import causal_lm_of, decoder_of
    from ..checkpointing import decoder_layers

    why = supported(model)
    if why is not None:
        raise ValueError(f"cannot keep attention outputs: {why}")
    AttentionInterface.register(IMPLEMENTATION, _kept_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, no_mask)
    store = KeptStore(offloader)
    layers = [m for m in decoder_layers(model) if m.gradient_checkpointing]
    handle = PatchHandle(NAME, {"layers": len(layers), "where": "host" if offloader is not None else "device"})
    pool = getattr(offloader, "pool", None)
    if pool is not None:
        # the first step registered runs last: the page-locked buffers are unregistered once nothing
        # can pack into them; a buffer freed while still registered would make the next registration
        # at that address fail (and CUDA's error would then surface in an unrelated kernel)
        handle.add_undo(pool.release)
    try:
        for cfg in {id(m.config): m.config for m in model.modules()
                    if hasattr(getattr(m, "config", None), "_attn_implementation")}.values():
            old = cfg._attn_implementation
            cfg._attn_implementation = IMPLEMENTATION
            handle.add_undo(lambda cfg=cfg, old=old: setattr(cfg, "_attn_implementation", old))
        for layer in layers:
            set_attribute(handle, layer, "_gradient_checkpointing_func", _kept(layer._gradient_checkpointing_func, store))
        # the decoder stack runs once a step (a layer's pre-hook would also run in its recompute)
        hook = decoder_of(causal_lm_of(model)).register_forward_pre_hook(lambda *_: store.clear())
        handle.add_undo(hook.remove)
    except BaseException:
        handle.undo()
        raise
    handle.store = store  # type: ignore[attr-defined]
    return handle
