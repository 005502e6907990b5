"""The patches ``optimize()`` applies to the model itself, each with its choice and reason.

Why this module exists: besides compiling, ``optimize()`` changes a few things on the model
that are not part of the recipe's compile (:mod:`.recipe`): bitsandbytes' CPU layout kept for
training, PEFT's LoRA forward replaced by a one-``addmm`` forward, and bitsandbytes' NF4
dequantize done in one kernel (process-wide, so shared by every ``optimize()`` of the process and
undone when the last of them is; see :func:`use_nf4_dequant`). Each is a reversible
patch of :mod:`.patches`; here they are decided, applied and described the way ``optimize()``
describes every choice, and the handles are returned for its ``undo()``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..reversible import PatchHandle

__all__ = ["keep_bnb_training_layout", "use_lora_addmm", "lora_addmm_expected", "use_nf4_dequant", "nf4_layers"]


def _apply_or_refuse(name: str, apply: Callable[[], PatchHandle], asked: bool | str, choices: dict[str, Any],
                     reasons: dict[str, str], refused: Any = False) -> PatchHandle | None:
    """``apply()``; a version or target refusal (``RuntimeError``) is raised when the patch was asked
    for (``asked is True``), else stated as the choice ``refused`` and its reason (None returned)."""
    try:
        return apply()
    except RuntimeError as err:  # versions or targets outside what the patch was verified on
        if asked is True:
            raise
        choices[name], reasons[name] = refused, f"patch refused: {err}"
        return None


def keep_bnb_training_layout(model: torch.nn.Module, device: torch.device, choices: dict[str, Any],
                              reasons: dict[str, str]) -> list[PatchHandle]:
    """On a CPU, keep NF4 weights out of bitsandbytes' inference repack (an eval pass would break
    the LoRA gradients: :mod:`~qlora_nb_utils.compile.patches.bnb_cpu_packing`)."""
    if device.type != "cpu":
        return []
    from .patches import bnb_cpu_packing

    if not bnb_cpu_packing.find_layers(model):
        return []
    handle = _apply_or_refuse("bnb_cpu_layout", lambda: bnb_cpu_packing.apply(model), "auto", choices, reasons,
                              refused="untouched")
    if handle is None:
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
                    reasons: dict[str, str], in_place: bool = True, why: str = "",
                    nf4: list[PatchHandle] | None = None, group: bool = True,
                    no_group_why: str = "") -> list[PatchHandle]:
    """``optimize(lora_addmm=...)``: the patch's handle (a list: empty when not applied);
    ``in_place=False`` (with ``why``) for the out-of-place update. ``nf4``: the handles
    :func:`use_nf4_dequant` returned; when it was applied, the layers over NF4 weights run as one
    LoRA linear whose base matmul adds into the update
    (:func:`~qlora_nb_utils.ops.lora_update.nf4_lora_linear`; in place or not is then moot: no
    base output is written apart), unless ``asked == "unfused"``: the choice ``nf4_lora_linear``
    says how many do. Those that read one input (a layer's q, k, v; gate, up) run as one group
    (:func:`~qlora_nb_utils.ops.lora_update.nf4_lora_linears`) unless ``asked == "ungrouped"`` or
    ``group`` is False (with ``no_group_why``): the choice ``lora_groups`` says how many groups.
    A group's outputs are each one GEMM over ``[x | s x A^T]`` (``wide``, the choice ``lora_wide``)
    unless ``asked == "narrow"``."""
    from .patches import lora_addmm as patch

    choices["lora_addmm"], choices["nf4_lora_linear"], choices["lora_groups"] = False, 0, 0
    choices["lora_wide"] = False
    reasons["lora_groups"] = "needs the fused NF4 LoRA linear"
    reasons["lora_wide"] = "needs groups of LoRA layers"
    reasons["nf4_lora_linear"] = ("asked for (lora_addmm='unfused')" if asked == "unfused" else
                                  "needs lora_addmm and the nf4_dequant patch" if not nf4 or asked is False else
                                  "no LoRA layer over an NF4 weight")
    if asked is False or not patch.find_layers(model):
        reasons["lora_addmm"] = "asked for" if asked is False else "no PEFT LoRA linear layer"
        return []
    rows = nf4[0].details.get("forward_min_rows") if nf4 and asked != "unfused" else None
    grouped = group and asked != "ungrouped"
    wide = grouped and asked != "narrow"
    handle = _apply_or_refuse("lora_addmm", lambda: patch.apply(model, in_place, rows, grouped, wide),
                              True if asked in ("unfused", "ungrouped", "narrow") else asked, choices, reasons)
    if handle is None:
        return []
    choices["lora_addmm"] = True
    n, fused = handle.details["layers"], handle.details["nf4_layers"]
    reasons["lora_addmm"] = (f"{n} LoRA layers: update added into the base output in place" if in_place
                             else f"{n} LoRA layers: out-of-place addmm ({why})")
    if fused:
        choices["nf4_lora_linear"] = fused
        reasons["nf4_lora_linear"] = (f"{fused} LoRA layers over NF4 weights: the base matmul adds into the update, "
                                      "forward and backward (one input gradient)")
        n_groups = handle.details["groups"]
        choices["lora_groups"] = n_groups
        reasons["lora_groups"] = (
            f"{n_groups} groups of LoRA layers reading one input (q, k, v; gate, up): x read once, one input gradient"
            if n_groups else "asked for (lora_addmm='ungrouped')" if asked == "ungrouped"
            else no_group_why if not group else "no sibling LoRA layers reading one input")
        choices["lora_wide"] = bool(handle.details.get("wide"))
        reasons["lora_wide"] = (
            "each group member one GEMM over [x | s x A^T] and [W | B]: no update tensor written and read back"
            if choices["lora_wide"] else "asked for (lora_addmm='narrow')" if asked == "narrow" and n_groups
            else "needs groups of LoRA layers")
    return [handle]


#: The process-wide nf4_dequant patch while some optimize() uses it, and how many do.
_NF4_SHARED: dict[str, Any] = {"handle": None, "users": 0}


def nf4_layers(model: torch.nn.Module) -> int:
    """How many bitsandbytes 4-bit layers of ``model`` hold an NF4 weight (without importing bitsandbytes)."""
    from .patches.bnb_cpu_packing import find_layers
    from .patches.nf4_dequant import holds_nf4

    return sum(holds_nf4(m) for m in find_layers(model))


def _acquire_nf4() -> PatchHandle:
    """A user's handle on the one shared patch: applied by the first user, undone by the last."""
    from .patches import nf4_dequant as patch

    if _NF4_SHARED["handle"] is None:
        _NF4_SHARED["handle"] = patch.apply()
    _NF4_SHARED["users"] += 1
    shared = _NF4_SHARED["handle"]
    user = PatchHandle("nf4_dequant.user", dict(shared.details))

    def release() -> None:
        _NF4_SHARED["users"] -= 1
        if _NF4_SHARED["users"] == 0:
            _NF4_SHARED["handle"] = None
            shared.undo()

    user.add_undo(release)
    return user


def use_nf4_dequant(model: torch.nn.Module, asked: bool | str, device: torch.device, choices: dict[str, Any],
                    reasons: dict[str, str]) -> list[PatchHandle]:
    """``optimize(nf4_dequant=...)``: route the NF4 layers' dequantize through one Triton kernel.

    ``"auto"``: on CUDA with Triton, where it was measured to pay (one kernel where bitsandbytes
    launches two, per weight and step); elsewhere off (on a CPU the op is its pure-torch body: the
    same values, no speed measured). True applies it on any
    device and raises where it is refused. The patch replaces two bitsandbytes module attributes
    for the whole process (:mod:`~qlora_nb_utils.compile.patches.nf4_dequant`); every
    ``optimize()`` that takes it shares one application, undone with the last of them.
    """
    from ..ops import nf4_triton

    choices["nf4_dequant"] = False
    layers = nf4_layers(model) if asked is not False else 0
    if asked is False or not layers:
        reasons["nf4_dequant"] = "asked for" if asked is False else "no NF4 layer"
        return []
    if asked == "auto" and (device.type != "cuda" or not nf4_triton.HAS_TRITON):
        reasons["nf4_dequant"] = (f"measured on CUDA only; off on {device.type}" if device.type != "cuda"
                                  else "no Triton here: bitsandbytes' own dequantize")
        return []
    handle = _apply_or_refuse("nf4_dequant", _acquire_nf4, asked, choices, reasons)
    if handle is None:
        return []
    choices["nf4_dequant"] = True
    reasons["nf4_dequant"] = (f"{layers} NF4 layers: dequantize in one Triton kernel, not bitsandbytes' two "
                              "(process-wide patch, shared)" if device.type == "cuda" and nf4_triton.HAS_TRITON
                              else f"{layers} NF4 layers: dequantize through the op's torch body (asked for)")
    return [handle]
