"""Add a LoRA update into the base layer's output in place: ``base += scaling * xa @ B^T``.

Why it exists: ``torch.addmm(base, xa, B^T)`` computes the sum in the matmul's epilogue, but out
of place: cuBLAS first copies ``base`` into the new output. Compiled, Inductor emits exactly that
(``extern_kernels.addmm(buf0, ..., out=buf2)``), and in a profile the copies show as a
``Memcpy DtoD`` every step, twice as long with checkpointing (the recompute runs the forward
twice): at 8B, 8 x 1024 the LoRA-layer outputs of one decoder layer are 8192 tokens x 43008
bf16 features, 672 MiB, each copied once. The base output is read by nothing else, so the
update can go into it.

:func:`add_lora_` does that. It is an autograd Function (its backward is the sum's: the base
gets the output gradient, ``xa`` gets ``scaling * g @ B`` and ``B`` gets ``scaling * g^T @ xa``)
around the mutable custom op ``qlora_nb::lora_addmm_``: Inductor sees an op that writes into its
first argument and, since nothing reads the base output afterwards, runs it in place (no copy;
``tests/test_lora_update.py`` reads the generated code). The Function marks the base dirty, so
an autograd graph that still needed the old value would refuse at backward time, not compute
with a changed tensor.

:func:`nf4_lora_linear` goes one step further for an NF4 base layer: the whole LoRA linear
``x @ W^T + s * (x @ A^T) @ B^T`` in one autograd Function, the order of its matmuls turned
around. The small LoRA product is computed first and the big base matmul adds into it
(``qlora_nb::lora_addmm_`` with the dequantized ``W``), so the output-sized buffer is written
by a rank-``r`` matmul (memory-bound) and read back only by the base matmul's epilogue, which
a compute-bound GEMM hides. The plain update above reads and writes it again after the base
matmul. The backward does the same for the input gradient: ``(s * g @ B) @ A`` first, then
``g @ W`` added into it, one tensor where autograd would sum two (the base's and the LoRA's)
in the next elementwise kernel. ``W`` is dequantized again in the backward, never saved.

``wide`` (:func:`nf4_lora_linears`, a group of layers reading one ``x``) removes the update
tensor altogether: ``x @ W_i^T + (s x A^T) B_i^T = [x | s x A^T] @ [W_i | B_i]^T``, one GEMM
whose K grows by the group's ranks (4096 to 4128 for gate and up). ``x`` is written once into a
buffer with room for ``s x A^T`` beside it (``torch.cat`` with zeros, which Inductor computes in
the kernel that produces ``x``; ``lora_xa_into_`` then fills the columns), and the NF4 kernel
dequantizes each ``W_i`` into a buffer whose last columns hold ``B_i``
(:func:`~qlora_nb_utils.ops.nf4_triton.dequantize_wide`). For gate and up at 8B, 8 x 1024 that
spares two 8192 x 14336 update tensors (written by a rank-r matmul, read back by the base GEMM's
epilogue) per layer, which makes the pair's forward faster; with ``x`` copied into the wide
buffer instead the copy eats the gain (the lab's LoRA-concat benchmark compares both). The
backward is the narrow one's; it keeps ``x`` (recomputable) and the small ``s x A^T`` columns,
not the wide buffer. Only groups
run wide: a lone ``down_proj`` run wide too (its input also an elementwise result) made the
step slower in the lab's A/B comparison.
"""

from __future__ import annotations

import torch

__all__ = ["lora_addmm_", "lora_xa_into_", "add_lora_", "nf4_lora_linear", "nf4_lora_linears"]


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


@torch.library.custom_op("qlora_nb::lora_xa_into_", mutates_args=("wide",))
def lora_xa_into_(wide: torch.Tensor, a: torch.Tensor, ranks: list[int], scales: list[float]) -> None:
    """``wide[:, k:] = (wide[:, :k] @ a^T)``, each member's ``ranks[i]`` columns times ``scales[i]``.

    ``wide`` is ``(N, k + sum(ranks))``, its first ``k`` columns the layer input; ``a`` the
    members' ``A`` stacked, ``(sum(ranks), k)``. A mutable op, so that Inductor writes ``x @ A^T``
    into the columns beside ``x`` (no copy of ``x``; ``tests/test_lora_update.py``).
    """
    k = wide.shape[1] - a.shape[0]
    xa = wide[:, k:]
    torch.mm(wide[:, :k], a.t(), out=xa)
    if len(set(scales)) == 1:
        if scales[0] != 1.0:
            xa.mul_(scales[0])
        return
    at = 0
    for r, s in zip(ranks, scales):
        xa[:, at:at + r].mul_(s)
        at += r


@lora_xa_into_.register_fake
def _(wide: torch.Tensor, a: torch.Tensor, ranks: list[int], scales: list[float]) -> None:
    return None


class _NF4LoraGroup(torch.autograd.Function):
    """``x @ W_i^T + s_i * (x @ A_i^T) @ B_i^T`` for the members ``i`` of a group sharing ``x``, each
    ``W_i`` an NF4 weight (module docstring). One member is the plain fused linear. ``wide``: each
    output is one GEMM, ``[x | s * x @ A^T] @ [W_i | B_i]^T`` (module docstring)."""

    @staticmethod
    def forward(ctx, x, consts, wide, *flat):
        from . import nf4_triton

        x2 = x.reshape(-1, x.shape[-1])
        n = len(consts)
        members = [flat[_PER * i:_PER * (i + 1)] for i in range(n)]
        ranks = [m[0].shape[0] for m in members]
        ctx.consts, ctx.wide, ctx.ranks = consts, wide, ranks
        if wide:
            rt = sum(ranks)
            xc = torch.cat([x2, x2.new_zeros(x2.shape[0], rt)], dim=1)  # x's producer writes it here
            lora_xa_into_(xc, _stacked_a(members), ranks, [c[0] for c in consts])
            outs, at = [], 0
            for m, c, r in zip(members, consts, ranks):
                tail = torch.nn.functional.pad(m[1], (at, rt - at - r))  # B_i in its own columns, zeros elsewhere
                weight = nf4_triton.dequantize_wide(*m[2:], *c[1:], tail)
                outs.append((xc @ weight.t()).view(*x.shape[:-1], weight.shape[0]))
                at += r
            # x itself and a copy of the small s x A^T columns are saved, not the wide buffer: x can
            # then be recomputed in the backward (optimize's recompute policy) where the buffer,
            # written by a mutable op, could not: at 8B, 8 x 1024 the buffers are 8192 x 4128 bf16
            # values per group, about 4 GiB over the step's layers
            ctx.save_for_backward(x2, xc[:, x2.shape[1]:].clone(), *flat)
            return tuple(outs)
        xa = x2 @ _stacked_a(members).t()  # one x @ [A_1; A_2; ...]^T: x is read once for the whole group
        xas = [p * c[0] for p, c in zip(xa.split(ranks, dim=1), consts)]  # (N, r_i): scaled on the small tensor
        outs = []
        for xa_i, m, c in zip(xas, members, consts):
            out = xa_i @ m[1].t()  # the update first: a rank-r matmul writes the output buffer ...
            weight = nf4_triton.dequantize(*m[2:], *c[1:])
            lora_addmm_(out, x2, weight.t(), 1.0)  # ... and the base matmul adds into it
            outs.append(out.view(*x.shape[:-1], out.shape[-1]))
        ctx.save_for_backward(x2, *xas, *flat)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        from . import nf4_triton

        consts = ctx.consts
        n = len(consts)
        if ctx.wide:  # every scaled x @ A_i^T in one saved tensor
            x2, xa_all, *flat = ctx.saved_tensors
            xas = list(xa_all.split(ctx.ranks, dim=1))
        else:
            x2, *rest = ctx.saved_tensors
            xas, flat = rest[:n], rest[n:]
        members = [flat[_PER * i:_PER * (i + 1)] for i in range(n)]
        need = ctx.needs_input_grad
        g2s = [g.reshape(-1, g.shape[-1]) for g in grads]
        gxas = [(g2 @ m[1]) * c[0] for g2, m, c in zip(g2s, members, consts)]  # (N, r) each
        gxa = gxas[0] if n == 1 else torch.cat(gxas, dim=1)  # (N, sum of r)
        grad_x = None
        if need[0]:
            grad_x = gxa @ _stacked_a(members)  # the LoRA parts first, then each base's g_i @ W_i added into the one buffer
            for g2, m, c in zip(g2s, members, consts):
                weight = nf4_triton.dequantize(*m[2:], *c[1:])
                lora_addmm_(grad_x, g2, weight, 1.0)
            grad_x = grad_x.view(*grads[0].shape[:-1], x2.shape[-1])
        want_a = [need[3 + _PER * i] for i in range(n)]
        grad_as = [None] * n
        if any(want_a):  # one gxa^T @ x for the group: x read once
            grad_as = list((gxa.t() @ x2).split(ctx.ranks, dim=0))
        out = [grad_x, None, None]
        for i, (g2, xa_i) in enumerate(zip(g2s, xas)):
            grad_b = g2.t() @ xa_i if need[4 + _PER * i] else None
            out += [grad_as[i] if want_a[i] else None, grad_b] + [None] * (_PER - 2)
        return tuple(out)


#: Tensors per member in :class:`_NF4LoraGroup`'s arguments: A, B and the NF4 weight's six.
_PER = 8


def _stacked_a(members: list) -> torch.Tensor:
    """The members' ``A`` weights stacked, ``(sum of r, in)`` (a lone member's as it is)."""
    return members[0][0] if len(members) == 1 else torch.cat([m[0] for m in members])


def _group_args(x: torch.Tensor, members: list) -> tuple[tuple, list]:
    """Check the members ``(a, b, scaling, weight_args)`` against ``x``; the Function's constants and tensors."""
    consts, flat = [], []
    for a, b, scaling, weight_args in members:
        shape, dtype = list(weight_args[8]), weight_args[9]
        if a.dim() != 2 or b.dim() != 2 or len(shape) != 2:
            raise ValueError(f"nf4_lora_linear takes 2-D a, b and weight, got {a.dim()}, {b.dim()} and "
                             f"{len(shape)} dims")
        if x.shape[-1] != shape[1] or a.shape != (b.shape[1], shape[1]) or b.shape[0] != shape[0]:
            raise ValueError(f"nf4_lora_linear: shapes x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} "
                             f"and weight {tuple(shape)} do not make x @ W^T + (x @ a^T) @ b^T")
        if not x.dtype == a.dtype == b.dtype == dtype:
            raise ValueError(f"nf4_lora_linear: one dtype expected, got x {x.dtype}, a {a.dtype}, b {b.dtype}, "
                             f"weight {dtype}")
        consts.append((float(scaling), weight_args[6], weight_args[7], tuple(shape), dtype))
        flat += [a, b, *weight_args[:6]]
    return tuple(consts), flat


def nf4_lora_linear(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                    weight_args: tuple) -> torch.Tensor:
    """A LoRA linear layer over an NF4 base weight, ``x @ W^T + scaling * (x @ a^T) @ b^T`` (module docstring).

    Args:
        x: ``(..., in)``.
        a: ``(r, in)``, ``lora_A``'s weight; b: ``(out, r)``, ``lora_B``'s weight; both in ``x``'s dtype.
        scaling: the adapter's ``alpha / r``.
        weight_args: the NF4 weight as the dequantize op's ten arguments
            (:func:`qlora_nb_utils.ops.nf4_triton.op_args`), dequantized to ``x``'s dtype.

    Returns:
        ``(..., out)``; differentiable in ``x``, ``a`` and ``b`` (the base weight is frozen).

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    consts, flat = _group_args(x, [(a, b, scaling, weight_args)])
    return _NF4LoraGroup.apply(x, consts, False, *flat)[0]


def nf4_lora_linears(x: torch.Tensor, members: list, wide: bool = False) -> tuple[torch.Tensor, ...]:
    """Several LoRA linear layers over NF4 weights that read the same ``x`` (a layer's q, k and v
    projections; gate and up), as one autograd Function.

    Each output is :func:`nf4_lora_linear`'s, but ``x`` is read once for the group where the
    layers would read it once each: one ``x @ [A_1; ...; A_n]^T`` in the forward, one
    ``g_A^T @ x`` for the ``A`` gradients, and one input gradient, into which every member's
    LoRA part (one matmul) and base part (its base matmul's epilogue) are added, where autograd
    would sum ``n`` separate tensors.

    Args:
        x: ``(..., in)``.
        members: ``(a, b, scaling, weight_args)`` per layer, as :func:`nf4_lora_linear` takes them.
        wide: each output as one GEMM over ``[x | s * x @ A^T]`` and ``[W_i | B_i]`` (module
            docstring): no output-sized update written and read back. Values differ by rounding
            only (the update is summed in the GEMM's fp32 accumulator, not rounded first). Compiled,
            that keeps more of an update far smaller than a bf16 unit of the output (a LoRA B in its
            first steps from zero) than the narrow route or the model's own bf16 forward do: the loss
            then sits below theirs, nearer a forward with fp32 sums.

    Returns:
        One ``(..., out_i)`` tensor per member, in order.

    Raises:
        ValueError: no member, or mismatched shapes or dtypes.
    """
    if not members:
        raise ValueError("nf4_lora_linears needs at least one member")
    consts, flat = _group_args(x, list(members))
    return _NF4LoraGroup.apply(x, consts, bool(wide), *flat)
