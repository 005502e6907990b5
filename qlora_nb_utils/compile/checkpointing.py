"""Gradient checkpointing for compiled training: which variant, which recompute policy, undoably.

Why this module exists: checkpointing is the one decision of ``prepare_for_compile`` that
changes both the number of compilations and the memory of the compiled step. The variant
decides the first (reentrant checkpointing around a compiled layer compiles it twice, under
``no_grad`` and under grad, and needs an input that requires grad); the recompute policy
decides the second (the compiler may override plain checkpointing's ``PREFER_RECOMPUTE`` and
keep more activations than eager, but must obey ``MUST_RECOMPUTE``, see
:func:`must_recompute_context`). :func:`configure_checkpointing` sets both the way
``gradient_checkpointing_enable`` does, recording every change on a
:class:`~qlora_nb_utils.reversible.PatchHandle` so that ``undo()`` puts the model back. The
decoder layers it finds (:func:`decoder_layers`) are also what regional compilation compiles.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch

from ..reversible import PatchHandle, set_attribute
from .patches import input_require_grads

__all__ = ["decoder_layers", "must_recompute_context", "configure_checkpointing", "has_traceable_hook"]


# ----------------------------------------------------------------------------- model surgery
def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks of a transformers model (PEFT-wrapped or not).

    Returns:
        Every ``transformers.modeling_layers.GradientCheckpointingLayer`` in ``model``
        (``LlamaDecoderLayer`` and its kin), in order.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_RECOMPUTE


def must_recompute_context() -> Any:
    """A ``context_fn`` for ``torch.utils.checkpoint``: recompute every op, compiled or not.

    Plain checkpointing tags the region ``PREFER_RECOMPUTE``, which AOTAutograd's
    partitioner may override with its own save-or-recompute heuristics; in exploratory GPU
    runs (torch 2.11, 1B-shape NF4 QLoRA; no results file kept) it did, keeping MLP- and
    attention-width activations besides each layer's input. ``MUST_RECOMPUTE`` (selective activation checkpointing with one policy for
    every op) is documented as not overridable by ``torch.compile``, and with it the compiled
    step kept what eager keeps. Reentrant checkpointing takes no ``context_fn``.
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_recompute_everything)


def _checkpoint_function(reentrant: bool, scope: str) -> Callable:
    if reentrant:
        return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    if scope == "whole":  # traced by Dynamo: pin the recompute policy (see must_recompute_context)
        return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False,
                                 context_fn=must_recompute_context)
    # Regional: checkpointing runs eagerly around compiled layers; eager recomputes everything.
    return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def configure_checkpointing(model: torch.nn.Module, grad_ckpt, scope: str = "whole") -> PatchHandle:
    """Set gradient checkpointing reversibly, the way ``gradient_checkpointing_enable`` does."""
    handle = PatchHandle("gradient_checkpointing", {"grad_ckpt": grad_ckpt})
    if grad_ckpt is None:
        layers = decoder_layers(model)
        if scope == "whole" and any(m.gradient_checkpointing for m in layers):
            warnings.warn(
                "grad_ckpt=None keeps the model's checkpoint function, whose recompute policy the "
                "compiler may override (it can then save more activations than eager does); pass "
                "grad_ckpt=True to pin it (see qlora_nb_utils.compile.must_recompute_context)",
                UserWarning, stacklevel=3)
        return handle
    owners = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    if grad_ckpt is False:
        for m in owners:
            if m.gradient_checkpointing:
                set_attribute(handle, m, "gradient_checkpointing", False)
        return handle
    if not owners:
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing "
                         "(no module has a 'gradient_checkpointing' attribute)")
    reentrant = grad_ckpt == "reentrant"
    func = _checkpoint_function(reentrant, scope)
    for m in owners:
        set_attribute(handle, m, "_gradient_checkpointing_func", func)
        set_attribute(handle, m, "gradient_checkpointing", True)
    if reentrant and not input_require_grads.find_hooks(model) and not has_traceable_hook(model):
        # Eager reentrant checkpointing needs an input that requires grad (see the patch).
        hook = model.get_input_embeddings().register_forward_hook(
            input_require_grads.requires_grad_unless_compiling)
        handle.add_undo(hook.remove)
    return handle


def has_traceable_hook(model: torch.nn.Module) -> bool:
    """Whether ``model`` already has the input-grad hook that is skipped while Dynamo traces."""
    target = input_require_grads.requires_grad_unless_compiling
    return any(h is target for m in model.modules() for h in m._forward_hooks.values())
