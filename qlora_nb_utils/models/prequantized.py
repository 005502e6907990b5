"""An NF4 checkpoint saved once, so that every later start reads 4-bit weights instead of quantizing.

Why: a start that loads a bf16 checkpoint with a ``BitsAndBytesConfig`` reads every weight at two
bytes and quantizes it on the way in. At Llama-3.1-8B shape that is 16 GB read and 7 B weights
quantized, 5.4-7.3 s of an H200 warm start whose target is 20 s (``results/warm_start_h200.json``:
imports 12.3 s, load 5.4 s, first step 2.9 s). Saved after quantization, the same weights are
about 5.6 GB, and loading them is a copy: the blocks, their absmax and the double-quant
statistics are read as they are, so the model is the very same bits (``tests/test_models.py``).

Transformers and bitsandbytes already serialize 4-bit models (``save_pretrained`` writes the
packed weights and the quant state; ``config.json`` keeps the ``quantization_config``). What this
module adds is the two things a run needs around that:

* :func:`save_nf4` writes model and tokenizer into a folder atomically (a temporary folder,
  renamed), so that an interrupted save never leaves a folder that looks complete.
* :func:`nf4_config` reads such a checkpoint's quantization and sets the compute dtype the run
  asks for: a checkpoint saved on a CPU (float32 compute) and loaded on a GPU would otherwise
  keep float32 matmuls, because ``from_pretrained`` takes the checkpoint's config as it is.
  Anything but a bitsandbytes NF4 checkpoint is refused with the reason.
* :func:`dequantize_to` makes every 4-bit weight dequantize to the run's dtype. The quant state
  keeps the dtype the weights had before they were quantized; a weight that dequantizes to
  another dtype than the layer's input is cast on every call, and ``optimize()``'s one-pass NF4
  route (which needs them equal) is not taken. A checkpoint saved in the run's dtype is then the
  very same model as quantizing while loading (``tests/test_models.py``).

``load_model`` calls :func:`nf4_config` for every checkpoint, so a pre-quantized folder (ours,
or one from the hub, e.g. a ``*-bnb-4bit`` repository) is loaded the same way as any other name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Union

import torch

__all__ = ["save_nf4", "nf4_config", "dequantize_to"]


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
        if type(param).__name__ == "Params4bit" and qs is not None and qs.dtype != dtype:
            qs.dtype = dtype
            changed += 1
    return changed


def save_nf4(name: Union[str, os.PathLike], folder: Union[str, os.PathLike], *, dtype: Union[str, torch.dtype] = "bfloat16",
             device: Union[str, torch.device, None] = "auto", double_quant: bool = True,
             cache_dir: Union[str, Path, None] = None, overwrite: bool = False) -> Path:
    """Quantize ``name`` to NF4 once and save it, with its tokenizer, as a checkpoint ``load_model`` reads.

    Args:
        name: what :func:`~qlora_nb_utils.models.load_model` accepts (a named model, a folder, a hub id;
            an NF4 checkpoint is saved again as it is).
        folder: where the checkpoint goes; it must not exist (or be empty) unless ``overwrite``.
        dtype: the dtype the weights are read in before they are quantized (bfloat16 by default,
            what a run on an SM80+ GPU computes in); a run in this dtype loads the very same
            model as it would quantizing while loading.
        device: where to quantize (bitsandbytes quantizes on the device the weights load to).
        double_quant: also quantize the NF4 scales.
        cache_dir: the cache root for named models.
        overwrite: replace an existing non-empty ``folder``.

    Returns:
        The folder.

    Raises:
        FileExistsError: ``folder`` exists and is not empty, without ``overwrite``.
        ValueError: as :func:`~qlora_nb_utils.models.load_model`.
    """
    from .. import env
    from .load import load_model

    out = Path(folder).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: pass overwrite=True to replace it")
    dev, torch_dtype = env.resolve_device_dtype(device, dtype)
    model, tokenizer = load_model(name, quant="nf4", lora=False, dtype=torch_dtype, device=dev, cache_dir=cache_dir,
                                  double_quant=double_quant)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
