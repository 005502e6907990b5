"""An NF4 checkpoint saved once, so that every later start reads 4-bit weights instead of quantizing.

Why: a start that loads a bf16 checkpoint with a ``BitsAndBytesConfig`` reads every weight at two
bytes and quantizes it on the way in. At Llama-3.1-8B shape that is 16 GB read and 7 B weights
quantized, a large share of a warm start (the lab's warm-start record splits it into imports,
load and first step). Saved after quantization, the same weights are
about 5.6 GB, and loading them is a copy: the blocks, their absmax and the double-quant
statistics are read as they are, so the model is the very same bits (``tests/test_models.py``).

Transformers and bitsandbytes already serialize 4-bit models (``save_pretrained`` writes the
packed weights and the quant state; ``config.json`` keeps the ``quantization_config``). What this
module adds is the two things a run needs around that:

* :func:`save_nf4` writes model and tokenizer into a folder atomically (a temporary folder,
  renamed), so that an interrupted save never leaves a folder that looks complete.
* :func:`~.load_prequantized.nf4_config` and :func:`~.load_prequantized.dequantize_to` (in
  :mod:`.load_prequantized`, which :func:`~.load.load_model` reads every checkpoint through) set
  the compute dtype of the saved quantization to the run's, so a checkpoint saved on a CPU
  (float32) and loaded on a GPU computes in bf16 and takes ``optimize()``'s one-pass NF4 route.
  Anything but a bitsandbytes NF4 checkpoint is refused with the reason.

``load_model`` calls ``nf4_config`` for every checkpoint, so a pre-quantized folder (ours,
or one from the hub, e.g. a ``*-bnb-4bit`` repository) is loaded the same way as any other name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Union

import torch

from .load_prequantized import dequantize_to, nf4_config  # noqa: F401  (their import path before the split)

__all__ = ["save_nf4", "nf4_config", "dequantize_to"]


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
    from .load import load_model  # looked up at the call: a test's stand-in for it is seen

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
