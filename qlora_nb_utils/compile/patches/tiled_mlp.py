"""Run each decoder layer's MLP in tiles along the sequence, so that its intermediates exist one tile at a time.

Why: at a long sequence with every layer checkpointed (and its input offloaded), what a step holds
beside the weights is one layer's recompute and backward at a time, and in that layer the MLP's
intermediates are the largest tensors: the gate and up projections and their product are each
``positions x intermediate_size`` (3.5 times the hidden size at Llama's shapes), and their gradients
as many again. Their size grows with the sequence, so they set how long a sequence fits. Computed
tile by tile, only one tile's intermediates are alive: the same arithmetic, since the MLP acts on
each position alone.

How: :func:`apply` replaces the ``forward`` of each decoder layer's ``mlp`` (on the instance,
reversibly) with one that runs the MLP as one opaque operator, ``qlora_nb::tiled_mlp``, whose
inputs are the layer input and the MLP's trainable (LoRA) weights. Its forward runs the MLP's own
forward on pieces of at most ``tile_rows`` positions, each output detached, and keeps nothing but
its inputs (gradients stay on, so that each projection takes the route it takes in the recompute);
its backward (``qlora_nb::tiled_mlp_backward``) recomputes one piece at a time under autograd and
sums the pieces' weight gradients. Opaque, because traced into the layer's graph the
pieces' gate and up outputs (the fused NF4 LoRA linear writes them in place, which the compiler
will not recompute) were all saved for the backward: every piece's intermediates alive at once,
what tiling is meant to avoid. The operator runs the MLP's forward as eager code, the autocast
state of the call restored in the backward (which runs on another thread). An MLP without
trainable weights is tiled with checkpointed pieces instead (nothing of it is saved then). Inputs
no longer than ``tile_rows`` take the MLP's forward unchanged. The arithmetic is the untiled
MLP's, and the LoRA weight gradients are sums over the pieces. The pieces run as eager code where
the untiled MLP runs compiled, so the two may round differently, which shows most when a LoRA
update is far smaller than a bf16 unit of the projection it adds to (the first steps after PEFT
starts every B at zero). The forward keeps gradients on for that reason: without them the fused
NF4 LoRA route stands aside for PEFT's own path, which rounds the base output before the update
is added and so drops such an update, and the loss reported would not be of the arithmetic the
gradients (recomputed with gradients on) are of. Under ``torch.compile`` the operator is one node
(no graph break); the pieces are counted inside it, so all lengths share one graph where the
length is dynamic.

The operator finds its MLP by the address of its first trainable weight (the MLPs are registered
by :func:`apply`), so each layer's MLP has one code however the layers share a compiled graph.

Apply it after ``optimize()`` (whose LoRA patches the MLP's projections keep) and before the first
step; ``undo()`` restores each MLP's forward. Where ``optimize()`` grouped the MLP's gate and up
projections into one fused call (the first call leaves the second one's output on the group), the
operator keeps them grouped (its forward is eager code); checkpointed pieces run them apart: inside
one that hand-over is a side effect Dynamo refuses (a graph break). ``undo()`` groups them again.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from ...reversible import PatchHandle, set_attribute
from .lora_addmm import GROUP_ATTR

__all__ = ["apply", "find_mlps", "tiled"]

NAME = "tiled_mlp"
OP = "qlora_nb::tiled_mlp"
#: The projections of a gated MLP, by name.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

#: The MLPs :func:`apply` tiled with the operator, by the address of their first trainable weight.
_BY_ADDRESS: dict[int, "weakref.ref[torch.nn.Module]"] = {}
_TILED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def find_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each decoder layer's ``mlp``: a submodule named ``mlp`` with ``gate_proj``, ``up_proj`` and
    ``down_proj`` (found by name, so that this patch imports nothing of ``compile`` above it)."""
    return [m for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] == "mlp" and all(hasattr(m, n) for n in PROJECTIONS)]


def _trainable(mlp: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in mlp.parameters() if p.requires_grad]


def _dropout(mlp: torch.nn.Module) -> bool:
    """Whether the MLP draws random numbers (a LoRA dropout): its pieces then need the random state of
    their forward again in the backward, which checkpointing restores and the operator does not."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in mlp.modules())


def _owner(weights: list[torch.Tensor]) -> torch.nn.Module:
    """The tiled MLP whose first trainable weight is ``weights[0]`` (by address)."""
    address = weights[0].data_ptr()
    mlp = _BY_ADDRESS.get(address, lambda: None)()
    if mlp is None or next((w.data_ptr() for w in _trainable(mlp)), None) != address:
        _BY_ADDRESS.clear()  # weights moved (``.to()``) since apply(): look again
        _BY_ADDRESS.update({_trainable(m)[0].data_ptr(): weakref.ref(m) for m in _TILED if _trainable(m)})
        mlp = _BY_ADDRESS.get(address, lambda: None)()
    if mlp is None:
        raise RuntimeError("tiled MLP: no tiled MLP holds these weights (was its patch undone, or the model "
                           "rebuilt, after the step was compiled?)")
    return mlp


def _inner(mlp: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return mlp.forward.__wrapped__ if hasattr(mlp.forward, "__wrapped__") else mlp.forward


def _autograd_on():
    """Autograd inside an operator's implementation: the dispatcher leaves it out below an
    operator's autograd formula (where the backward operator runs); put back, the pieces can be
    differentiated (the private key guard is the one PyTorch's own leaf functions use)."""
    from torch._C import DispatchKey

    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther, DispatchKey.AutogradNestedTensor,
                DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(include, exclude)


def _autocast(device_type: str, dtype: torch.dtype | None):
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else torch.autocast(device_type,
                                                                                             enabled=False)


@torch.library.custom_op(OP, mutates_args=())
def _tiled_mlp(x: torch.Tensor, weights: list[torch.Tensor], tile_rows: int,
               autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """The MLP's output, piece by piece, nothing kept for a backward.

    With gradients on, as in the backward's recompute: the layers then take the routes they take in
    training (the fused NF4 LoRA route stands aside without gradients), so that the loss is of the
    arithmetic the gradients are of. Each piece's output is detached: what its call recorded goes with it.
    """
    forward = _inner(_owner(weights))
    out = torch.empty_like(x, dtype=_out_dtype(x, autocast_dtype))
    with torch.enable_grad(), _autocast(x.device.type, autocast_dtype):
        for lo in range(0, x.shape[-2], tile_rows):
            n = min(tile_rows, x.shape[-2] - lo)
            out.narrow(-2, lo, n).copy_(forward(x.narrow(-2, lo, n).detach()).detach())
    return out


def _out_dtype(x: torch.Tensor, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The MLP's output dtype: the autocast dtype under autocast (its last matmul's), else the input's."""
    return autocast_dtype if autocast_dtype is not None and x.is_floating_point() else x.dtype


@_tiled_mlp.register_fake
def _(x, weights, tile_rows, autocast_dtype):
    return torch.empty_like(x, dtype=_out_dtype(x, autocast_dtype))


@torch.library.custom_op(OP + "_backward", mutates_args=())
def _tiled_mlp_backward(x: torch.Tensor, grad_out: torch.Tensor, weights: list[torch.Tensor], tile_rows: int,
                        autocast_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """``[d x, d weights...]``: each piece recomputed under autograd, one at a time."""
    mlp = _owner(weights)
    forward, live = _inner(mlp), _trainable(mlp)
    grad_x = torch.empty_like(x)
    sums = [torch.zeros_like(w, dtype=torch.float32) for w in live]
    for lo in range(0, x.shape[-2], tile_rows):
        n = min(tile_rows, x.shape[-2] - lo)
        piece = x.narrow(-2, lo, n).detach().requires_grad_()
        with _autograd_on(), torch.enable_grad():
            with _autocast(x.device.type, autocast_dtype):
                y = forward(piece)
            grads = torch.autograd.grad(y, [piece, *live], grad_out.narrow(-2, lo, n).to(y.dtype),
                                        allow_unused=True)
        grad_x.narrow(-2, lo, n).copy_(grads[0])
        for total, g in zip(sums, grads[1:]):
            if g is not None:
                total += g
    return [grad_x, *(total.to(w.dtype) for total, w in zip(sums, live))]


@_tiled_mlp_backward.register_fake
def _(x, grad_out, weights, tile_rows, autocast_dtype):
    return [torch.empty_like(x), *(torch.empty_like(w) for w in weights)]


def _setup(ctx, inputs, output):
    x, weights, tile_rows, autocast_dtype = inputs
    ctx.save_for_backward(x, *weights)
    ctx.tile_rows, ctx.autocast_dtype = tile_rows, autocast_dtype


def _backward(ctx, grad_out):
    x, *weights = ctx.saved_tensors
    grad_x, *grad_w = _tiled_mlp_backward(x, grad_out, weights, ctx.tile_rows, ctx.autocast_dtype)
    return grad_x, grad_w, None, None


_tiled_mlp.register_autograd(_backward, setup_context=_setup)


def tiled(forward: Callable[[torch.Tensor], torch.Tensor], tile_rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``forward`` (position-wise, input ``[..., positions, hidden]``) run on pieces of at most
    ``tile_rows`` positions, each checkpointed."""

    def tiled_forward(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] <= tile_rows:
            return forward(x)
        return torch.cat([checkpoint(forward, piece, use_reentrant=False) for piece in x.split(tile_rows, dim=-2)],
                         dim=-2)

    tiled_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    return tiled_forward


def _as_operator(mlp: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
                 tile_rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``mlp``'s ``forward`` as ``qlora_nb::tiled_mlp`` past ``tile_rows`` positions (module docstring)."""

    checkpointed = tiled(forward, tile_rows)

    def tiled_forward(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] <= tile_rows:
            return forward(x)
        if not torch.is_grad_enabled():  # nothing is kept without autograd: the pieces as they come
            return torch.cat([forward(piece) for piece in x.split(tile_rows, dim=-2)], dim=-2)
        weights = _trainable(mlp)
        if not weights:  # frozen since apply(): the operator finds its MLP by a trainable weight
            return checkpointed(x)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return _tiled_mlp(x, weights, tile_rows, dtype)

    tiled_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    return tiled_forward


def apply(model: torch.nn.Module, tile_rows: int) -> PatchHandle:
    """Tile every decoder layer's MLP along the sequence (module docstring).

    Raises:
        ValueError: ``tile_rows`` is not a positive integer, or the model has no decoder layer with
            a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``).
    """
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
        raise ValueError(f"tile_rows must be an integer >= 1, got {tile_rows!r}")
    mlps = find_mlps(model)
    if not mlps:
        raise ValueError("no decoder layer with a gated MLP (gate_proj, up_proj, down_proj) to tile")
    handle = PatchHandle(NAME, {"mlps": len(mlps), "tile_rows": tile_rows, "ungrouped": 0, "operator": 0})
    try:
        for mlp in mlps:
            if _trainable(mlp) and not _dropout(mlp):  # one opaque operator: the projections may stay grouped
                set_attribute(handle, mlp, "forward", _as_operator(mlp, mlp.forward, tile_rows))
                _TILED.add(mlp)
                _BY_ADDRESS[_trainable(mlp)[0].data_ptr()] = weakref.ref(mlp)
                handle.add_undo(lambda m=mlp: (_TILED.discard(m), _BY_ADDRESS.clear()))
                handle.details["operator"] += 1
                continue
            set_attribute(handle, mlp, "forward", tiled(mlp.forward, tile_rows))
            for name in PROJECTIONS:  # gate and up share one group: turned off once
                group = getattr(getattr(mlp, name), GROUP_ATTR, None)
                if group is not None and group.active:
                    set_attribute(handle, group, "active", False)
                    handle.details["ungrouped"] += 1
    except BaseException:
        handle.undo()
        raise
    return handle
