"""A sharded run's state, taken out whole: the LoRA adapter and resumable checkpoints.

Why this module exists: after :func:`qlora_nb_utils.distributed.fsdp.apply_fsdp2` no rank holds
a whole trainable weight, yet two things must come out of a run as one piece. The adapter is
gathered to rank 0 and saved as a plain PEFT folder, so that it loads into a single-process
``PeftModel`` like any other. A checkpoint is the opposite: every rank writes its own shards of
the LoRA weights and optimizer state with ``torch.distributed.checkpoint`` (plus step,
scheduler and RNG), into a ``*.partial`` folder that rank 0 renames only when all ranks are
done, so a run killed mid-save never leaves a checkpoint that looks complete, and ``--resume``
continues with the same losses bit for bit. The frozen 4-bit weights are never written: they
come back from the base checkpoint.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from .setup import DistInfo

__all__ = [
    "gather_trainable_state",
    "save_adapter",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
]

_CKPT_PREFIX = "step_"
_PARTIAL = ".partial"


def gather_trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) trainable parameters, on the CPU of rank 0 (empty on other ranks).

    A collective: every rank must call it. Uses
    ``get_model_state_dict(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(model, options=options)


def save_adapter(model: nn.Module, folder: str | Path, *, is_main: bool) -> Path | None:
    """Save the LoRA adapter of a sharded PEFT model as a normal PEFT adapter folder.

    The folder loads with ``PeftModel.from_pretrained(base, folder)`` into a single-process
    model. A collective (every rank calls it); only rank 0 writes.

    Returns:
        The folder on rank 0, None elsewhere.

    Raises:
        ValueError: the model carries no PEFT adapter.
    """
    if not hasattr(model, "peft_config"):
        raise ValueError("the model has no PEFT adapter to save")
    state = gather_trainable_state(model)
    if not is_main:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, state_dict=state)
    return folder


def _step_dir(root: Path, step: int) -> Path:
    return root / f"{_CKPT_PREFIX}{step:06d}"


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` (``step_NNNNNN`` with a ``meta.json``).

    A save killed half-way leaves only a ``*.partial`` folder, which is never chosen.

    Returns:
        ``(step, folder)`` or None when there is none.
    """
    root = Path(root)
    found = []
    for path in root.glob(f"{_CKPT_PREFIX}*"):
        if path.name.endswith(_PARTIAL) or not (path / "meta.json").is_file():
            continue
        try:
            found.append((int(path.name[len(_CKPT_PREFIX):]), path))
        except ValueError:
            continue
    return max(found) if found else None


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    *, scheduler=None, info: DistInfo, extra: dict | None = None, keep: int = 2) -> Path:
    """Save a resumable checkpoint: sharded LoRA weights + optimizer state (DCP), step, RNG.

    Every rank writes its own shards with ``torch.distributed.checkpoint`` into
    ``step_NNNNNN.partial``; rank 0 adds ``meta.json`` and renames the folder when all ranks
    are done, so a kill during the save never leaves a checkpoint that looks complete. Frozen
    (4-bit) weights are not saved: they come back from the base checkpoint.

    Args:
        root: the checkpoints folder.
        step: optimizer steps done so far (the step to resume at).
        model, optimizer, scheduler: what to save (the scheduler's state goes into meta.json).
        info: this rank's :class:`DistInfo`.
        extra: more JSON-ready facts for meta.json (e.g. the run's options).
        keep: how many complete checkpoints to keep (older ones are deleted).

    Returns:
        The checkpoint folder.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    root = Path(root)
    final = _step_dir(root, step)
    partial = final.with_name(final.name + _PARTIAL)
    if info.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(partial))
    rng = {"cpu": torch.get_rng_state()}
    if info.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(info.device)
    torch.save(rng, partial / f"rng_rank{info.rank}.pt")
    dist.barrier()
    if info.is_main:
        meta = {"step": step, "world_size": info.world_size, "trainable_tensors": len(msd),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(), **(extra or {})}
        (partial / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.rename(partial, final)
        complete = sorted(p for p in root.glob(f"{_CKPT_PREFIX}*")
                          if not p.name.endswith(_PARTIAL) and p != final)
        for old in complete[:max(0, len(complete) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    *, scheduler=None, info: DistInfo) -> dict:
    """Restore what :func:`save_checkpoint` wrote into the sharded model and its optimizer.

    Returns:
        The checkpoint's meta.json (``step`` is the step to resume at).

    Raises:
        FileNotFoundError: no meta.json in ``folder``.
        RuntimeError: the checkpoint's trainable tensors do not match the model's.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"not a complete checkpoint (no meta.json): {folder}")
    meta = json.loads(meta_path.read_text())
    options = StateDictOptions(ignore_frozen_params=True)
    msd, osd = get_state_dict(model, optimizer, options=options)
    if len(msd) != meta["trainable_tensors"]:
        raise RuntimeError(f"{folder} holds {meta['trainable_tensors']} trainable tensors; the "
                           f"model has {len(msd)} (another model or LoRA configuration?)")
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(folder))
    # strict=False: the frozen weights are deliberately absent (they come from the base);
    # the trainable ones were counted above and dcp.load fails on any key the files lack.
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    rng_file = folder / f"rng_rank{info.rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and info.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], info.device)
    return meta
