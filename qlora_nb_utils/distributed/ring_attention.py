"""Ring attention over sequence shards: PyTorch's own context-parallel kernels as one opaque operator.

Why this module exists: context parallelism splits one long row over the ranks, each holding a
shard of the positions, and every query must still attend to every earlier key of the whole row.
PyTorch ships the algorithm (``torch.distributed.tensor.experimental``'s context parallelism:
``_templated_ring_attention`` and its backward, which pass K/V around the ranks and merge each
block's output by its log-sum-exp, with the head-tail load balance of the causal mask). Its public
entry, ``context_parallel(mesh, buffers=...)``, reaches it by replacing
``torch.nn.functional.scaled_dot_product_attention`` with a wrapper that turns q, k and v into
``DTensor`` s and dispatches SDPA's CUDA kernels to the ring. That route does not fit the fast
path:

* it dispatches only the CUDA kernels (flash, memory-efficient, cuDNN): on a CPU (gloo) SDPA
  takes the CPU flash kernel, which it does not map, so it cannot be run where CI runs;
* each entry into the context installs a new wrapper function, and a compiled decoder layer is
  guarded on the function it traced: a recompilation per step;
* the ``DTensor`` s would be traced into every compiled layer.

Here the same ring functions are called directly, inside two ``torch.library`` custom operators
(forward and backward): the compiled layer holds one opaque call, Dynamo never traces the
collectives (``fullgraph=True`` holds), and the kernel under the ring is the device's flash
kernel: ``_scaled_dot_product_flash_attention`` on CUDA, ``_scaled_dot_product_flash_attention_for_cpu``
on a CPU, both with grouped K/V heads taken natively (no repeated K/V). The ring's options are
torch's (``_cp_options``): the block outputs merged in float32, K/V all-gathered once per call. Long
shards run the heads in groups of whole K/V heads (:data:`GROUP_ELEMENTS` says why).

:func:`use_ring_attention` switches a model from the fast path's causal-only SDPA to this
attention, registered with transformers' ``AttentionInterface`` (no monkey-patching); the
sharding of the batch that must go with it is in :mod:`.context_parallel`. Causal attention over
one document per row only: no padding mask, no per-document mask, no sliding window.
"""

from __future__ import annotations

import contextlib

import torch

from ..reversible import PatchHandle

__all__ = ["RING_SDPA", "GROUP_ELEMENTS", "ring_attention", "head_groups", "use_ring_attention", "ring_functions"]

#: The name the ring attention is registered under in transformers' interfaces.
RING_SDPA = "qlora_ring_sdpa"

#: the attribute of a model's config that holds ``(process group name, load balance)`` while switched
_RING_ATTR = "_qlora_ring_attention"


def ring_functions():
    """torch's ring attention ``(forward, backward, options)``; raises where this torch lacks them."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _cp_options,
            _templated_ring_attention,
            _templated_ring_attention_backward,
        )
    except ImportError:
        try:  # older layout (torch < 2.9)
            from torch.distributed.tensor.experimental._attention import (
                _cp_options,
                _templated_ring_attention,
                _templated_ring_attention_backward,
            )
        except ImportError as exc:
            raise RuntimeError(f"torch {torch.__version__} has no context-parallel ring attention "
                               "(torch.distributed.tensor.experimental)") from exc
    return _templated_ring_attention, _templated_ring_attention_backward, _cp_options


@contextlib.contextmanager
def _ring_options(load_balance: bool):
    """torch's ring reads its options from a module-level object: set ours for one call, then restore."""
    _, _, options = ring_functions()
    old = (options.enable_load_balance, options.convert_to_f32)
    options.enable_load_balance, options.convert_to_f32 = load_balance, True
    try:
        yield
    finally:
        options.enable_load_balance, options.convert_to_f32 = old


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _forward_kernel(device_type: str):
    aten = torch.ops.aten
    if device_type == "cuda":
        return aten._scaled_dot_product_flash_attention, {"dropout_p": 0.0}
    if device_type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu, {"dropout_p": 0.0}
    raise ValueError(f"ring attention runs on CUDA or a CPU, not {device_type!r}")


#: the most query elements (batch x heads x positions x head size) one ring call takes; more heads are run
#: in groups of whole K/V heads. torch's ring merges each block's output in float32 through a few
#: temporaries the size of the queries (and its backward accumulates the query gradient in float32), so
#: at 100k+ positions a whole layer's heads at once added several GiB at the attention; in groups of
#: about 0.5 GiB of float32 each, the transient stays that size, for a few more (smaller) collectives.
GROUP_ELEMENTS = 2**27


def head_groups(heads: int, kv_heads: int, elements: int, most: int = GROUP_ELEMENTS) -> int:
    """How many groups of whole K/V heads the ring runs a call in: the fewest that divide ``kv_heads``
    and keep each group's query elements at most ``most`` (``kv_heads`` at most)."""
    for groups in range(1, kv_heads + 1):
        if kv_heads % groups == 0 and elements // groups <= most:
            return groups
    return kv_heads


def _slices(query: torch.Tensor, key: torch.Tensor):
    h, hk = query.shape[1], key.shape[1]
    g = head_groups(h, hk, query.numel(), GROUP_ELEMENTS)  # read when called: a test may lower it
    qs, ks = h // g, hk // g
    return [(slice(i * qs, (i + 1) * qs), slice(i * ks, (i + 1) * ks)) for i in range(g)]


@torch.library.custom_op("qlora_nb::ring_attention", mutates_args=())
def _ring_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group_name: str, scale: float,
                  load_balance: bool) -> tuple[torch.Tensor, torch.Tensor]:
    forward, _, _ = ring_functions()
    op, kwargs = _forward_kernel(query.device.type)
    group = _group(group_name)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    b, h, s, _ = query.shape
    lse = query.new_empty((b, h, s), dtype=torch.float32)
    with _ring_options(load_balance):
        for qh, kh in _slices(query, key):
            o, m, *_ = forward(group, 2, op, query[:, qh].contiguous(), key[:, kh].contiguous(), value[:, kh].contiguous(),
                               is_causal=True, scale=scale, **kwargs)
            out[:, qh] = o
            lse[:, qh] = m.reshape(b, -1, s)
            del o, m
    return out, lse


@_ring_forward.register_fake
def _(query, key, value, group_name, scale, load_balance):
    b, h, s, _ = query.shape
    return torch.empty_like(query, memory_format=torch.contiguous_format), query.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("qlora_nb::ring_attention_backward", mutates_args=())
def _ring_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, group_name: str, scale: float,
                   load_balance: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, backward, _ = ring_functions()
    aten = torch.ops.aten
    if query.device.type == "cuda":
        op = aten._scaled_dot_product_flash_attention_backward.default
        # what the flash forward returns for an unpadded batch without dropout: no cumulative lengths,
        # and empty RNG state (read only with dropout)
        empty = torch.empty((), dtype=torch.int64)
        kwargs = {"cum_seq_q": None, "cum_seq_k": None, "max_q": query.shape[2], "max_k": key.shape[2],
                  "dropout_p": 0.0, "philox_seed": empty, "philox_offset": empty}
    else:
        op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        kwargs = {"dropout_p": 0.0}
    group = _group(group_name)
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (query, key, value)]
    with _ring_options(load_balance):
        for qh, kh in _slices(query, key):
            dq, dk, dv, *_ = backward(group, 2, op, grad_out=grad_out[:, qh].contiguous(), grad_out_name="grad_out",
                                      query=query[:, qh].contiguous(), key=key[:, kh].contiguous(),
                                      value=value[:, kh].contiguous(), out=out[:, qh].contiguous(),
                                      logsumexp=lse[:, qh].contiguous(), is_causal=True, scale=scale, **kwargs)
            grads[0][:, qh], grads[1][:, kh], grads[2][:, kh] = dq, dk, dv
            del dq, dk, dv
    return tuple(grads)


@_ring_backward.register_fake
def _(grad_out, query, key, value, out, lse, group_name, scale, load_balance):
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(value, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    query, key, value, group_name, scale, load_balance = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse)
    ctx.ring = (group_name, scale, load_balance)


def _backward(ctx, grad_out, _grad_lse):
    query, key, value, out, lse = ctx.saved_tensors
    dq, dk, dv = _ring_backward(grad_out, query, key, value, out, lse, *ctx.ring)
    return dq, dk, dv, None, None, None


_ring_forward.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, group_name: str,
                   scale: float | None = None, load_balance: bool = True) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole row's keys, the row split over a group.

    Args:
        query: ``(B, H, S_local, D)`` this rank's shard of the queries (with ``load_balance``, its
            two head-tail chunks, :func:`.context_parallel.shard_positions`).
        key, value: ``(B, H_kv, S_local, D)`` this rank's shard; ``H`` a multiple of ``H_kv``.
        group_name: the process group's name (``group.group_name``): the ranks sharing the row, in order.
        scale: the softmax scale (None: ``1 / sqrt(D)``).
        load_balance: the shards are head-tail chunks (torch's load balance of the causal mask);
            False: contiguous shards in rank order.

    Returns:
        ``(B, H, S_local, D)``, this rank's rows of the attention output.
    """
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return _ring_forward(query, key, value, group_name, float(scale), bool(load_balance))[0]


def _ring_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: ``(B, S, H, D)`` output and no weights."""
    group_name, load_balance = getattr(module.config, _RING_ATTR)
    out = ring_attention(query, key, value, group_name=group_name, scale=scaling, load_balance=load_balance)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    return None


def use_ring_attention(model: torch.nn.Module, group, *, load_balance: bool = True) -> PatchHandle:
    """Switch ``model``'s causal-only SDPA to ring attention over ``group`` until ``undo()``.

    Call it before the first compiled step (the implementation is read when a layer is traced).

    Raises:
        ValueError: the model does not use the fast path's causal-only SDPA now (a padding mask, packed
            documents or a sliding window need a mask the ring does not apply).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ..ops.attention import CAUSAL_SDPA, CAUSAL_SDPA_CUDNN, model_configs

    AttentionInterface.register(RING_SDPA, _ring_sdpa)
    AttentionMaskInterface.register(RING_SDPA, _no_mask)
    configs = model_configs(model)
    current = {cfg._attn_implementation for cfg in configs}
    if not configs or not current <= {CAUSAL_SDPA, CAUSAL_SDPA_CUDNN, RING_SDPA}:
        raise ValueError(f"ring attention replaces causal-only SDPA; the model uses {sorted(current)} "
                         "(context parallelism takes unpadded or right-padded rows of one document each)")
    handle = PatchHandle("ring_attention", {"configs": len(configs), "group": group.group_name,
                                            "load_balance": load_balance})
    for cfg in configs:
        old = cfg._attn_implementation
        setattr(cfg, _RING_ATTR, (group.group_name, load_balance))
        cfg._attn_implementation = RING_SDPA
        handle.add_undo(lambda cfg=cfg, old=old: (setattr(cfg, "_attn_implementation", old),
                                                  cfg.__dict__.pop(_RING_ATTR, None)))
    return handle
