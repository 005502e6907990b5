"""Add a LoRA update into the base layer's output in place: ``base += scaling * xa @ B^T``.

Why it exists: ``torch.addmm(base, xa, B^T)`` computes the sum in the matmul's epilogue, but out
of place: cuBLAS first copies ``base`` into the new output. Compiled, Inductor emits exactly that
(``extern_kernels.addmm(buf0, ..., out=buf2)``), and on an H100 at 8B, 8 x 1024 the copies were a
``Memcpy DtoD`` of 14.4 ms a step without checkpointing and 28.7 ms with it (the recompute runs
the forward twice): 672 MiB of LoRA-layer outputs per decoder layer, copied once each
(``results/profile_8b_h100_regional.json``). The base output is read by nothing else, so the
update can go into it.

:func:`add_lora_` does that. It is an autograd Function (its backward is the sum's: the base
gets the output gradient, ``xa`` gets ``scaling * g @ B`` and ``B`` gets ``scaling * g^T @ xa``)
around the mutable custom op ``qlora_nb::lora_addmm_``: Inductor sees an op that writes into its
first argument and, since nothing reads the base output afterwards, runs it in place (no copy;
``tests/test_lora_update.py`` reads the generated code). The Function marks the base dirty, so
an autograd graph that still needed the old value would refuse at backward time, not compute
with a changed tensor.
"""

from __future__ import annotations

import torch

__all__ = ["lora_addmm_", "add_lora_"]


@torch.library.custom_op("qlora_nb::lora_addmm_", mutates_args=("base",))
def lora_addmm_(base: torch.Tensor, xa: torch.Tensor, b_t: torch.Tensor, scaling: float) -> None:
    """``base += scaling * xa @ b_t`` in place: ``base`` ``(..., out)`` contiguous, ``xa`` ``(..., r)``.

    The leading dimensions are flattened in here, where the compiler does not see the views
    (a view of the Function's input, marked dirty, confused autograd's view tracking).
    """
    base.view(-1, base.shape[-1]).addmm_(xa.reshape(-1, xa.shape[-1]), b_t, alpha=scaling)


@lora_addmm_.register_fake
def _(base: torch.Tensor, xa: torch.Tensor, b_t: torch.Tensor, scaling: float) -> None:
    return None


class _AddLora(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
        lora_addmm_(base, xa, b.t(), scaling)
        ctx.mark_dirty(base)
        ctx.save_for_backward(xa, b)
        ctx.scaling = scaling
        return base

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xa, b = ctx.saved_tensors
        s = ctx.scaling
        grad_xa = (grad @ b) * s if ctx.needs_input_grad[1] else None
        grad_b = None
        if ctx.needs_input_grad[2]:
            grad_b = (grad.reshape(-1, grad.shape[-1]).t() @ xa.reshape(-1, xa.shape[-1])) * s
        return grad, grad_xa, grad_b, None


def add_lora_(base: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * xa @ b.T``, written into ``base`` (returned), differentiable in all three.

    Args:
        base: ``(..., out)``, the base layer's output, contiguous; nothing else may read it afterwards.
        xa: ``(..., r)``, the input through ``lora_A`` (the same leading dimensions).
        b: ``(out, r)``, ``lora_B``'s weight, in ``base``'s dtype.
        scaling: the adapter's ``alpha / r``.

    Raises:
        ValueError: mismatched shapes or dtypes, a 1-D base, a base that is not contiguous.
    """
    if base.dim() < 2 or b.dim() != 2:
        raise ValueError(f"add_lora_ takes base (..., out) and a 2-D b, got {base.dim()} and {b.dim()} dims")
    if xa.shape[:-1] != base.shape[:-1] or b.shape != (base.shape[-1], xa.shape[-1]):
        raise ValueError(f"add_lora_: shapes base {tuple(base.shape)}, xa {tuple(xa.shape)}, b {tuple(b.shape)} "
                         "do not make base + xa @ b.T")
    if not base.dtype == xa.dtype == b.dtype:
        raise ValueError(f"add_lora_: one dtype expected, got {base.dtype}, {xa.dtype}, {b.dtype}")
    if not base.is_contiguous():
        raise ValueError("add_lora_: base must be contiguous (it is written in place through a 2-D view)")
    return _AddLora.apply(base, xa, b, float(scaling))
