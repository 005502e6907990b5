"""A merged checkpoint as one GGUF file, the format llama.cpp, Ollama and LM Studio load.

Why it exists: after ``qlora-nb export`` the user holds a plain Hugging Face checkpoint; to run it
on a laptop or in Ollama they need GGUF. Writing it here, from the pinned ``gguf`` package's writer
(``GGUFWriter``, its tensor-name map and its ``Q8_0`` quantizer), keeps the whole path in one tool and
checked by one test suite. Decisions, and why:

* **Architectures**: the Llama family (SmolLM2 is one), Qwen2 and Qwen3, whose GGUF layouts the
  writer's tensor-name map knows. Anything else fails before any file is written, naming the merged
  folder so the user can convert it with llama.cpp's own converter.
* **Q and K of the Llama architecture are permuted** to the pair-interleaved rotary layout GGUF's
  ``llama`` architecture expects (Hugging Face stores the rotate-half layout); Qwen2 and Qwen3 use
  the rotate-half (NeoX) layout in GGUF too and are written as they are.
* **Types**: ``f16`` writes every matrix in float16; ``q8_0`` quantizes every matrix whose rows are a
  multiple of 32 values to 8 bits per value with one scale per 32 (the rest stay float16); vectors
  (norms, biases) stay float32 in both, as llama.cpp expects.
* **Llama 3 rope scaling** is written as llama.cpp reads it: a ``rope_freqs`` vector of per-frequency
  divisors, computed from the config's ``rope_scaling`` (or ``rope_parameters``) the way Llama 3
  defines it. Other scaling types fail with a clear error.
* **Tokenizer**: byte-level BPE tokenizers (``tokenizer.json`` of type BPE: SmolLM2, Llama 3, Qwen)
  as GGUF's ``gpt2`` tokenizer model, with merges, special-token ids and the chat template.
  SentencePiece tokenizers fail with a clear error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUF_TYPES", "SUPPORTED_ARCHS", "check_gguf_source", "llama3_rope_factors", "write_gguf"]

#: what ``qtype`` accepts
GGUF_TYPES = ("f16", "q8_0")
#: Hugging Face ``model_type`` -> GGUF architecture name
SUPPORTED_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
#: GGUF's name for the pre-tokenizer of each model family (llama.cpp picks its regex by it)
_PRE_TOKENIZER = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: write a merged checkpoint first (qlora-nb export)")
    return json.loads(path.read_text())


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, the scaling parameters or None), from either config layout of transformers."""
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling


def check_gguf_source(folder: str | Path, qtype: str = "f16") -> dict[str, Any]:
    """Check that ``folder`` (a merged checkpoint) can be written as GGUF; return its config.

    Raises:
        ValueError: an unknown ``qtype``, an architecture or rope scaling GGUF export does not write,
            or a tokenizer that is not byte-level BPE.
        FileNotFoundError: no config.json or tokenizer.json in ``folder``.
    """
    if qtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type must be one of {list(GGUF_TYPES)}, got {qtype!r}")
    folder = Path(folder)
    config = _config(folder)
    kind = config.get("model_type")
    if kind not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF export writes {sorted(SUPPORTED_ARCHS)} models, not {kind!r}; the merged checkpoint "
                         f"in {folder} can be converted with llama.cpp's convert_hf_to_gguf.py")
    _, scaling = _rope(config)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"GGUF export writes no rope scaling but Llama 3's, and {folder} has {scaling}")
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json: GGUF export needs a fast (tokenizers) tokenizer")
    spec = json.loads(tok_file.read_text())
    kind, pre = spec.get("model", {}).get("type"), json.dumps(spec.get("pre_tokenizer"))
    if kind != "BPE" or '"ByteLevel"' not in pre:
        raise ValueError(f"GGUF export writes byte-level BPE tokenizers; {folder}'s is {kind!r} with pre-tokenizer "
                         f"{pre[:80]} (SentencePiece-style tokenizers are not written)")
    return config


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """The divisor of each rotary frequency under Llama 3's scaling (what GGUF stores as ``rope_freqs``):
    1 for short wavelengths, ``factor`` for long ones, a smooth blend between."""
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_context / low, old_context / high
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _permute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rotate-half rows (Hugging Face) -> pair-interleaved rows (GGUF ``llama``), per head."""
    rows = weight.shape[0]
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _tensors(folder: Path):
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).float().numpy()


def _vocab(folder: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = {i: t for i, t in tok.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def write_gguf(folder: str | Path, out_file: str | Path, *, qtype: str = "f16", name: str | None = None,
               log=print) -> Path:
    """Write the merged checkpoint in ``folder`` as one GGUF file ``out_file`` of type ``qtype``."""
    import gguf

    folder, out_file = Path(folder), Path(out_file)
    config = check_gguf_source(folder, qtype)
    arch_name = SUPPORTED_ARCHS[config["model_type"]]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    theta, scaling = _rope(config)
    names = gguf.get_tensor_name_map(arch, layers)
    quant = gguf.GGMLQuantizationType.Q8_0 if qtype == "q8_0" else None

    writer = gguf.GGUFWriter(str(out_file), arch_name, use_temp_file=True)  # tensors wait on disk, not in memory
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or folder.name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quant else gguf.LlamaFileType.MOSTLY_F16)
    if scaling is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                          llama3_rope_factors(head_dim, theta, scaling))

    tokens, types = _vocab(folder, int(config["vocab_size"]))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_PRE_TOKENIZER[config["model_type"]])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    if special.chat_template is None and (folder / "chat_template.jinja").is_file():
        special.chat_template = (folder / "chat_template.jinja").read_text()
    special.add_to_gguf(writer, quiet=True)

    tied = bool(config.get("tie_word_embeddings", False))
    count = 0
    for hf_name, array in _tensors(folder):
        if hf_name == "lm_head.weight" and tied:
            continue  # GGUF reads a missing output matrix as the token embedding
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        gg_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gg_name is None:
            raise ValueError(f"{hf_name} has no GGUF name for the {arch_name} architecture")
        if arch_name == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
            array = _permute_rotary(array, heads)
        elif arch_name == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
            array = _permute_rotary(array, kv_heads)
        if array.ndim == 1:
            writer.add_tensor(gg_name, array.astype(np.float32))
        elif quant is not None and array.shape[-1] % 32 == 0:
            writer.add_tensor(gg_name, gguf.quants.quantize(array.astype(np.float32), quant), raw_dtype=quant)
        else:
            writer.add_tensor(gg_name, array.astype(np.float16))
        count += 1

    out_file.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log(f"wrote {out_file} ({arch_name}, {qtype}, {count} tensors, {out_file.stat().st_size / 2**20:.1f} MiB)")
    return out_file
