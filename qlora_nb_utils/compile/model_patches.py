"""The patches ``optimize()`` applies to the model itself, each with its choice and reason.

Why this module exists: besides compiling, ``optimize()`` changes a few things on the model
that are not part of the recipe's compile (:mod:`.recipe`): bitsandbytes' CPU layout kept for
training, and PEFT's LoRA forward replaced by a one-``addmm`` forward. Each is a reversible
patch of :mod:`.patches`; here they are decided, applied and described the way ``optimize()``
describes every choice, and the handles are returned for its ``undo()``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..reversible import PatchHandle

__all__ = ["keep_bnb_training_layout", "use_lora_addmm", "lora_addmm_expected"]


def keep_bnb_training_layout(model: torch.nn.Module, device: torch.device, choices: dict[str, Any],
                              reasons: dict[str, str]) -> list[PatchHandle]:
    """On a CPU, keep NF4 weights out of bitsandbytes' inference repack (an eval pass would break
    the LoRA gradients: :mod:`~qlora_nb_utils.compile.patches.bnb_cpu_packing`)."""
    if device.type != "cpu":
        return []
    from .patches import bnb_cpu_packing

    if not bnb_cpu_packing.find_layers(model):
        return []
    try:
        handle = bnb_cpu_packing.apply(model)
    except RuntimeError as err:  # versions outside the verified range: say so, change nothing
        choices["bnb_cpu_layout"], reasons["bnb_cpu_layout"] = "untouched", f"patch refused: {err}"
        return []
    choices["bnb_cpu_layout"] = "training"
    reasons["bnb_cpu_layout"] = "an eval pass cannot repack NF4 for CPU inference (lost LoRA gradients)"
    return [handle]


def lora_addmm_expected(model: torch.nn.Module, asked: bool | str) -> bool:
    """Whether :func:`use_lora_addmm` will patch ``model`` (for the memory estimate, decided before:
    a refusal on versions makes the estimate high by one tensor, never low)."""
    from .patches import lora_addmm as patch

    return asked is not False and bool(patch.find_layers(model))


def use_lora_addmm(model: torch.nn.Module, asked: bool | str, choices: dict[str, Any],
                    reasons: dict[str, str], in_place: bool = True, why: str = "") -> list[PatchHandle]:
    """``optimize(lora_addmm=...)``: the patch's handle (a list: empty when not applied);
    ``in_place=False`` (with ``why``) for the out-of-place update."""
    from .patches import lora_addmm as patch

    choices["lora_addmm"] = False
    if asked is False or not patch.find_layers(model):
        reasons["lora_addmm"] = "asked for" if asked is False else "no PEFT LoRA linear layer"
        return []
    try:
        handle = patch.apply(model, in_place)
    except RuntimeError as err:  # versions outside the verified range
        if asked is True:
            raise
        reasons["lora_addmm"] = f"patch refused: {err}"
        return []
    choices["lora_addmm"] = True
    reasons["lora_addmm"] = (f"{handle.details['layers']} LoRA layers: update added into the base output in place"
                             if in_place else f"{handle.details['layers']} LoRA layers: out-of-place addmm ({why})")
    return [handle]
