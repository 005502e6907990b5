"""``qlora-nb export``: a trained run as one ordinary Hugging Face checkpoint, the adapter merged in.

Why it exists: a run leaves a LoRA adapter over an NF4-quantized base, and using it needs PEFT,
bitsandbytes and the knowledge of how the base was quantized. Most tools that serve or convert
models want one plain checkpoint instead. Decisions, and why:

* **The base is the NF4 base dequantized** (``base="nf4"``, the default): the adapter learned to
  correct *those* weights, not the original ones, so the merged model computes what the trained
  model computed (to rounding). The NF4 base is loaded exactly as the run loaded it (same dtype,
  so the same quantization), each ``Linear4bit`` is replaced by a plain ``Linear`` holding its
  dequantized weight (``model.dequantize()``: bitsandbytes' ``dequantize_4bit``), and PEFT's
  ``merge_and_unload`` adds the LoRA update into those weights.
* ``base="original"`` merges into the 16/32-bit base instead: closer to the base's quality where
  NF4 lost some, but not the model that was trained; a warning says so.
* **What is written** is what ``AutoModelForCausalLM.from_pretrained`` reads with neither PEFT nor
  bitsandbytes: safetensors, a config without ``quantization_config`` (and ``use_cache`` back on,
  which training turned off), the tokenizer with its chat template, a generation config, and
  ``export_info.json`` (which base, which run). No ``adapter_config.json``.
* **Bad input fails first**: the run folder (:mod:`.run_folder`) and ``out`` are checked before any
  model loads; ``out`` must not exist or be empty, so an export never mixes with other files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from .._paths import check_out_dir
from .run_folder import TrainedRun, read_run

__all__ = ["BASES", "check_export", "export_run"]

#: what ``base`` accepts
BASES = ("nf4", "original")

ORIGINAL_WARNING = ("warning: --base original merges the adapter into the original (unquantized) weights, but it "
                    "was trained against their NF4-quantized values: this is not the model that was trained, and "
                    "its outputs differ from the trained model's")


def check_export(run_dir: str | Path, out: str | Path, *, base: str = "nf4") -> TrainedRun:
    """Check an export's input before any model loads; return the run.

    Raises:
        ValueError: an unknown ``base``, a folder that is not a run (:func:`.run_folder.read_run`),
            an ``out`` that is a file or a non-empty folder, or ``base="original"`` for a run whose
            base was saved already quantized (there are no original weights to merge into).
    """
    if base not in BASES:
        raise ValueError(f"base must be one of {list(BASES)}, got {base!r}")
    run = read_run(run_dir)
    out_path = Path(out).expanduser()
    if out_path.exists() and not out_path.is_dir():
        raise ValueError(f"--out {out_path} is a file, not a folder: name a new folder to write into")
    if out_path.is_dir() and any(out_path.iterdir()):
        raise ValueError(f"--out {out_path} exists and is not empty: name a new or empty folder")
    check_out_dir(str(out_path))
    if out_path.resolve() == run.folder.resolve() or run.folder.resolve() in out_path.resolve().parents:
        raise ValueError(f"--out {out_path} is inside the run folder {run.folder}: write the export elsewhere")
    if base == "original" and _saved_quantized(run.model):
        raise ValueError(f"--base original: the run's base {run.model} was saved already quantized, so there are "
                         "no original weights to merge into; export with --base nf4")
    return run


def _saved_quantized(model: str) -> bool:
    config = Path(model).expanduser() / "config.json"
    return config.is_file() and "quantization_config" in json.loads(config.read_text())


def export_run(run_dir: str | Path, out: str | Path, *, base: str = "nf4", dtype: str = "auto",
               device: str = "cpu", gguf: str | None = None, log: Callable[[str], None] = print) -> Path:
    """Write the run's model, adapter merged, as a plain Hugging Face checkpoint in ``out``.

    Args:
        run_dir: a ``qlora-nb train`` output folder.
        out: the folder to write (must not exist, or be empty).
        base: ``"nf4"``: the NF4 base dequantized, what the adapter was trained against;
            ``"original"``: the unquantized base (warned: not the trained model).
        dtype: the saved weights' dtype; ``"auto"``: the run's compute dtype. The base is always
            read (and NF4-quantized) in the run's dtype, as the run read it, then cast.
        device: where the model is loaded and merged (``"cpu"`` needs no GPU memory).
        gguf: ``"f16"`` or ``"q8_0"``: write one GGUF file ``out/<run>-<gguf>.gguf`` (:mod:`.gguf_export`)
            instead of the checkpoint folder, which is written to a temporary folder beside ``out`` and removed.
        log: where status lines (and the ``original`` warning) go.

    Returns:
        ``out``.
    """
    if gguf is not None:
        return _export_gguf(run_dir, out, base=base, dtype=dtype, device=device, qtype=gguf, log=log)
    run = check_export(run_dir, out, base=base)
    return _merge_and_save(run, Path(out).expanduser(), base=base, dtype=dtype, device=device, log=log)


def _merge_and_save(run: TrainedRun, out: Path, *, base: str, dtype: str, device: str,
                    log: Callable[[str], None]) -> Path:
    """The merge and save of :func:`export_run`, for a run and ``out`` already checked."""
    import torch

    from .. import env, models

    dev, run_dtype = env.resolve_device_dtype(device, run.dtype)
    save_dtype = run_dtype if dtype in (None, "auto") else env.resolve_dtype(dtype, dev)
    if base == "original":
        log(ORIGINAL_WARNING)
    log(f"==> loading {run.model} ({'NF4, dequantized' if base == 'nf4' else 'original weights'}, "
        f"{str(run_dtype).replace('torch.', '')}) on {dev}")
    model, tok = models.load_model(run.model, quant="nf4" if base == "nf4" else "none", lora=False, dtype=run_dtype,
                                   device=dev)
    if base == "nf4":
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its note that the weights are "dequantized and casted" to their own dtype
        try:
            model = model.dequantize(dtype=run_dtype)  # each Linear4bit a Linear with its dequantized weight
        finally:
            hf_logging.set_verbosity(level)
    log(f"==> merging the adapter from {run.adapter}")
    from peft import PeftModel  # after load_model, which imports bitsandbytes first (env.import_bitsandbytes)

    merged = PeftModel.from_pretrained(model, run.adapter).merge_and_unload()
    if save_dtype != run_dtype:
        merged = merged.to(save_dtype)
    _ready_to_generate(merged, tok)
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        merged.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    info = export_info(run, base=base, dtype=save_dtype)
    (out / "export_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"wrote {out}/ (load it with AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return out


def _export_gguf(run_dir: str | Path, out: str | Path, *, base: str, dtype: str, device: str, qtype: str,
                 log: Callable[[str], None]) -> Path:
    import shutil
    import tempfile

    from .gguf_export import GGUF_TYPES, write_gguf

    if qtype not in GGUF_TYPES:  # before any model loads
        raise ValueError(f"gguf must be one of {list(GGUF_TYPES)}, got {qtype!r}")
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ValueError("GGUF export needs the gguf package: pip install 'qlora-nb-utils[smollm2]' (it pins gguf)")
    run = check_export(run_dir, out, base=base)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    merged = Path(tempfile.mkdtemp(prefix=".merging-", dir=out))
    try:
        _merge_and_save(run, merged, base=base, dtype=dtype, device=device, log=log)
        return write_gguf(merged, out / f"{run.folder.name}-{qtype}.gguf", qtype=qtype, name=run.folder.name,
                          log=log).parent
    finally:
        shutil.rmtree(merged, ignore_errors=True)


def _ready_to_generate(model: Any, tok: Any) -> None:
    """Generation defaults a loader expects: the KV cache on, the tokenizer's pad and eos ids."""
    model.config.use_cache = True
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.pad_token_id = tok.pad_token_id
        if tok.eos_token_id is not None:
            gen.eos_token_id = tok.eos_token_id
        if tok.bos_token_id is not None and gen.bos_token_id is None:
            gen.bos_token_id = tok.bos_token_id


def export_info(run: TrainedRun, *, base: str, dtype: Any) -> dict[str, Any]:
    """What ``export_info.json`` says: which base, from which run and step."""
    m = run.metrics
    return {
        "run": str(run.folder.resolve()), "base_model": run.model,
        "base": "nf4-dequantized" if base == "nf4" else "original",
        "trained_against": "nf4", "is_trained_model": base == "nf4",
        "dtype": str(dtype).replace("torch.", ""), "run_dtype": run.dtype,
        "steps_done": m.get("steps_done"), "final_eval_loss": m.get("final_eval_loss"),
        "interrupted": bool(m.get("interrupted", False)), "run_date": m.get("date"),
        "lora": {k: (m.get("options") or {}).get(k) for k in ("lora_r", "lora_alpha")},
    }
