"""Run each decoder layer's MLP in tiles along the sequence, so that its intermediates exist one tile at a time.

Why: at a long sequence with every layer checkpointed (and its input offloaded), what a step holds
beside the weights is one layer's recompute and backward at a time, and in that layer the MLP's
intermediates are the largest tensors: the gate and up projections and their product are each
``positions x intermediate_size`` (3.5 times the hidden size at Llama's shapes), and their gradients
as many again. Their size grows with the sequence, so they set how long a sequence fits. Computed
tile by tile, only one tile's intermediates are alive: the same arithmetic, since the MLP acts on
each position alone.

How: :func:`apply` replaces the ``forward`` of each decoder layer's ``mlp`` (on the instance,
reversibly) with one that splits its input along the sequence into pieces of at most
``tile_rows`` positions and runs the MLP's own forward on each under non-reentrant activation
checkpointing, then joins the outputs. The forward keeps each piece's input only; the backward
recomputes one piece's intermediates at a time. Inputs no longer than ``tile_rows`` take the
MLP's forward unchanged. The result equals the untiled MLP's; the LoRA weight gradients are sums
over the pieces, so they differ from the untiled ones by summation order only. Under
``torch.compile`` the pieces are traced as checkpointed regions of the layer's graph (no graph
break); the number of pieces follows the length, so each length is its own graph, as it is
without tiling.

Apply it after ``optimize()`` (whose LoRA patches the MLP's projections keep) and before the first
step; ``undo()`` restores each MLP's forward. Where ``optimize()`` grouped the MLP's gate and up
projections into one fused call (the first call leaves the second one's output on the group), the
tiles run them apart: inside a checkpointed piece that hand-over is a side effect Dynamo refuses
(a graph break). ``undo()`` groups them again.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from ...reversible import PatchHandle, set_attribute
from .lora_addmm import GROUP_ATTR

__all__ = ["apply", "find_mlps", "tiled"]

NAME = "tiled_mlp"
#: The projections of a gated MLP, by name.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def find_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each decoder layer's ``mlp``: a submodule named ``mlp`` with ``gate_proj``, ``up_proj`` and
    ``down_proj`` (found by name, so that this patch imports nothing of ``compile`` above it)."""
    return [m for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] == "mlp" and all(hasattr(m, n) for n in PROJECTIONS)]


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
    handle = PatchHandle(NAME, {"mlps": len(mlps), "tile_rows": tile_rows, "ungrouped": 0})
    try:
        for mlp in mlps:
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
