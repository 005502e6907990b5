"""The patches ``optimize()`` applies to the model itself, each with its choice and reason.

Why this module exists: besides compiling, ``optimize()`` changes a few things on the model
that are not part of the recipe's compile (:mod:`.recipe`): bitsandbytes' CPU layout kept for
training, PEFT's LoRA forward replaced by a one-``addmm`` forward, and bitsandbytes' NF4
dequantize done in one kernel (process-wide, so shared by every ``optimize()`` of the process and
undone when the last of them is; see :func:`use_nf4_dequant`). Each is a reversible
patch of :mod:`.patches`, decided with every other choice before the model changes
(:func:`~qlora_nb_utils.compile.plan.decide`, :mod:`.choices`); here they are applied, what
applying found (how many layers fused, a patch refused on versions) filled in the plan
(:meth:`~qlora_nb_utils.compile.plan.Plan.applied`), and the handles returned for ``undo()``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..reversible import PatchHandle

__all__ = ["keep_bnb_training_layout", "use_lora_addmm", "lora_addmm_expected", "use_nf4_dequant", "nf4_layers"]


def _apply_or_refuse(name: str, apply: Callable[[], PatchHandle], asked: bool | str, plan: Any,
                     refused: Any = False) -> PatchHandle | None:
    """``apply()``; a version or target refusal (``RuntimeError``) is raised when the patch was asked
    for (``asked is True``), else stated in the plan as the choice ``refused`` and its reason (None returned)."""
    try:
        return apply()
    except RuntimeError as err:  # versions or targets outside what the patch was verified on
        if asked is True:
            raise
        plan.applied(name, refused, f"patch refused: {err}")
        return None


def keep_bnb_training_layout(model: torch.nn.Module, plan: Any) -> list[PatchHandle]:
    """On a CPU, keep NF4 weights out of bitsandbytes' inference repack where the plan says so (an eval
    pass would break the LoRA gradients: :mod:`~qlora_nb_utils.compile.patches.bnb_cpu_packing`)."""
    if plan.choices.get("bnb_cpu_layout") != "training":
        return []
    from .patches import bnb_cpu_packing

    handle = _apply_or_refuse("bnb_cpu_layout", lambda: bnb_cpu_packing.apply(model), "auto", plan,
                              refused="untouched")
    return [] if handle is None else [handle]


def lora_addmm_expected(model: torch.nn.Module, asked: bool | str) -> bool:
    """Whether :func:`use_lora_addmm` will patch ``model`` (for the memory estimate, decided before:
    a refusal on versions makes the estimate high by one tensor, never low)."""
    from .patches import lora_addmm as patch

    return asked is not False and bool(patch.find_layers(model))


def _past_rows(past: int, call_rows: tuple[int, int] | None) -> str:
    """What the fused route's row threshold leaves to bitsandbytes, said beside the batches shown."""
    if not past:
        return ""
    text = f", in calls of more than {past} rows (fewer: bitsandbytes' own kernels, the update added after them)"
    if call_rows is None:
        return text
    fewest, most = call_rows
    if most <= past:
        return f"{text}; the batches shown have at most {most} rows a call: none fused at them (lora_min_rows)"
    if fewest <= past:
        return f"{text}; the batches shown have {fewest} to {most} rows a call: fused in the larger only"
    return text


def use_lora_addmm(model: torch.nn.Module, plan: Any, nf4: list[PatchHandle] | None = None) -> list[PatchHandle]:
    """The plan's ``lora_addmm`` (:func:`~qlora_nb_utils.compile.choices.choose_lora_addmm`) applied: the
    patch's handle (a list: empty when not applied), the out-of-place update where the plan is over its
    target. ``nf4``: the handles :func:`use_nf4_dequant` returned; when it was applied, the layers over
    NF4 weights run as one LoRA linear whose base matmul adds into the update
    (:func:`~qlora_nb_utils.ops.lora_update.nf4_lora_linear`; in place or not is then moot: no base
    output is written apart), unless ``lora_addmm="unfused"``: the choice ``nf4_lora_linear`` gets
    how many do. Those that read one input (a layer's q, k, v; gate, up) run as one group
    (:func:`~qlora_nb_utils.ops.lora_update.nf4_lora_linears`) unless ``"ungrouped"`` or the plan
    forms none (:attr:`~qlora_nb_utils.compile.plan.Plan.lora_groups`): the choice ``lora_groups``
    gets how many groups. A group's outputs are each one GEMM over ``[x | s x A^T]`` (the choice
    ``lora_wide``) unless ``"narrow"``."""
    from .choices import LORA_NO_GROUP_WHY
    from .patches import lora_addmm as patch

    asked = plan.options.lora_addmm
    if not plan.choices["lora_addmm"]:
        return []
    if not nf4 and asked != "unfused":  # the nf4_dequant patch planned but refused when applied
        plan.applied("nf4_lora_linear", 0, "needs lora_addmm and the nf4_dequant patch")
    rows = nf4[0].details.get("forward_min_rows") if nf4 and asked != "unfused" else None
    if rows is not None and plan.options.lora_min_rows != "auto":  # the LoRA route's own threshold, this model only
        rows = {"cuda": int(plan.options.lora_min_rows), "cpu": int(plan.options.lora_min_rows)}
    grouped = plan.lora_groups and asked != "ungrouped"
    wide = grouped and asked != "narrow"
    handle = _apply_or_refuse("lora_addmm", lambda: patch.apply(model, not plan.over_target, rows, grouped, wide),
                              True if asked in ("unfused", "ungrouped", "narrow") else asked, plan)
    if handle is None:
        return []
    fused = handle.details["nf4_layers"]
    if fused:
        plan.applied("nf4_lora_linear", fused, f"{fused} LoRA layers over NF4 weights: the base matmul adds into "
                                               "the update, forward and backward (one input gradient)"
                                               + _past_rows((rows or {}).get(plan.device.type, 0), plan.call_rows))
        n_groups = handle.details["groups"]
        plan.applied("lora_groups", n_groups, (
            f"{n_groups} groups of LoRA layers reading one input (q, k, v; gate, up): x read once, one input gradient"
            if n_groups else "asked for (lora_addmm='ungrouped')" if asked == "ungrouped"
            else LORA_NO_GROUP_WHY if not plan.lora_groups else "no sibling LoRA layers reading one input"))
        wide = bool(handle.details.get("wide"))
        plan.applied("lora_wide", wide, (
            "each group member one GEMM over [x | s x A^T] and [W | B]: no update tensor written and read back"
            if wide else "asked for (lora_addmm='narrow')" if asked == "narrow" and n_groups
            else "needs groups of LoRA layers"))
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


def use_nf4_dequant(model: torch.nn.Module, plan: Any) -> list[PatchHandle]:
    """The plan's ``nf4_dequant`` (:func:`~qlora_nb_utils.compile.choices.choose_nf4_dequant`) applied:
    the NF4 layers' dequantize routed through one Triton kernel (on a CPU, when asked for, the op's
    torch body). The patch replaces two bitsandbytes module attributes for the whole process
    (:mod:`~qlora_nb_utils.compile.patches.nf4_dequant`); every ``optimize()`` that takes it shares
    one application, undone with the last of them. Refused on versions: raised when asked for
    (``nf4_dequant=True``), else stated in the plan.
    """
    if not plan.choices["nf4_dequant"]:
        return []
    handle = _apply_or_refuse("nf4_dequant", _acquire_nf4, plan.options.nf4_dequant, plan)
    return [] if handle is None else [handle]
