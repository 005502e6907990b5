"""What the peers share: the checkpoint folder, the HF recipe's model, the training config.

Why it exists: the comparison holds only if every peer trains the very same checkpoint, the
HF-recipe peers build their model the same way, and the peers that use
:func:`qlora_nb_utils.training.train` run it with the same steps, learning rate and seed. These
helpers are the one place each of those is made, for every peer module and the runner.
"""

from __future__ import annotations

from pathlib import Path

from qlora_nb_utils import models


def _model_dir(model: str) -> str:
    """A local checkpoint folder for ``model`` (built into the cache for a named model)."""
    if model in models.MODEL_NAMES:
        return str(models.materialize(model))
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    raise ValueError(f"peers need a local checkpoint: use one of {list(models.MODEL_NAMES)} or a folder; "
                     f"got {model!r}")


def _hf_model(ctx: dict):
    model, tok = models.load_model(
        ctx["model"], quant="nf4", lora=True, lora_r=ctx["lora_r"], lora_alpha=ctx["lora_alpha"],
        dtype=ctx["dtype"], device=ctx["device"], prepare_kbit=True,
        gradient_checkpointing=ctx["grad_ckpt"], seed=ctx["seed"])
    return model, tok


def _train_cfg(ctx: dict):
    from qlora_nb_utils.training.loop import TrainConfig

    return TrainConfig(steps=ctx["steps"], lr=ctx["lr"], seed=ctx["seed"], progress=ctx.get("progress", False))
