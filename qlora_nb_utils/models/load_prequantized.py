"""Reading an NF4 checkpoint as it was saved: its compute dtype set to the run's, nothing quantized again.

Why a module of its own: :func:`~.load.load_model` reads every checkpoint through
:func:`nf4_config`, a pre-quantized one (ours from :func:`~.prequantized.save_nf4`, or one from
the hub, e.g. a ``*-bnb-4bit`` repository) like any other name, and :mod:`.prequantized` saves
one by loading it first; the reading half lives here so that loading never imports the saving
(which imports loading).

* :func:`nf4_config` reads such a checkpoint's quantization and sets the compute dtype the run
  asks for: a checkpoint saved on a CPU (float32 compute) and loaded on a GPU would otherwise
  keep float32 matmuls, because ``from_pretrained`` takes the checkpoint's config as it is.
  Anything but a bitsandbytes NF4 checkpoint is refused with the reason.
* :func:`dequantize_to` makes every 4-bit weight dequantize to the run's dtype. The quant state
  keeps the dtype the weights had before they were quantized; a weight that dequantizes to
  another dtype than the layer's input is cast on every call, and ``optimize()``'s one-pass NF4
  route (which needs them equal) is not taken. A checkpoint saved in the run's dtype is then the
  very same model as quantizing while loading (``tests/test_models.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["nf4_config", "dequantize_to", "is_4bit_weight"]


def is_4bit_weight(param: torch.Tensor) -> bool:
    """True for a bitsandbytes 4-bit weight (``Params4bit``): its data are packed codes (two per byte of its
    storage dtype), not values. By type name, so that asking does not import bitsandbytes."""
    kind = type(param)
    return kind.__name__ == "Params4bit" and kind.__module__.startswith("bitsandbytes")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nf4_config(source: str, dtype: torch.dtype, quant: str, double_quant: bool) -> Any | None:
    """The checkpoint's config with its NF4 compute dtype set to ``dtype``, or None when it is not quantized.

    Args:
        source: a local folder or a hub id (what ``from_pretrained`` reads).
        dtype: the run's compute dtype.
        quant: what the run asked for (``"nf4"`` or ``"none"``).
        double_quant: what the run asked for; a checkpoint is what it is, so a difference is a warning.

    Raises:
        ValueError: a quantized checkpoint with ``quant="none"``, or one that is not bitsandbytes NF4.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = dict(qc) if isinstance(qc, dict) else qc.to_dict()
    what = f"{qc.get('quant_method')} {qc.get('bnb_4bit_quant_type') or ''}".strip()
    if quant == "none":
        raise ValueError(f"{source} is a quantized checkpoint ({what}): load it with quant='nf4', or load the "
                         "checkpoint it was quantized from")
    if qc.get("quant_method") != "bitsandbytes" or not qc.get("load_in_4bit") or qc.get("bnb_4bit_quant_type") != "nf4":
        raise ValueError(f"{source} is quantized as {what or qc}: only bitsandbytes NF4 checkpoints are supported "
                         "(or an unquantized one, quantized while it loads)")
    if bool(qc.get("bnb_4bit_use_double_quant")) != bool(double_quant):
        warnings.warn(f"{source} was saved with double_quant={bool(qc.get('bnb_4bit_use_double_quant'))}; "
                      f"double_quant={double_quant} is ignored for a pre-quantized checkpoint", stacklevel=3)
    config.quantization_config = {**qc, "bnb_4bit_compute_dtype": _dtype_name(dtype)}
    return config


def dequantize_to(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Set every 4-bit weight's quant state to dequantize to ``dtype``; returns how many were changed."""
    changed = 0
    for param in model.parameters():
        qs = getattr(param, "quant_state", None)
        if is_4bit_weight(param) and qs is not None and qs.dtype != dtype:
            qs.dtype = dtype
            changed += 1
    return changed
