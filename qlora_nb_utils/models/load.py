"""Load a model the way a real QLoRA run does, and count what it holds.

The graph breaks that matter live in the code path a real QLoRA run takes: a checkpoint read
by ``AutoModelForCausalLM.from_pretrained`` with a ``BitsAndBytesConfig``, then wrapped by
``peft.get_peft_model``. So even the toy models of this project are real checkpoints on disk
rather than modules built in memory, and every model is loaded through that path: what a CPU
test compiles is what a GPU run compiles. A named model is built into the cache on first use;
any other name is passed to ``from_pretrained`` as a hub id or a local path.
"""

import os
from pathlib import Path
from typing import List, Sequence, Union

import torch
from torch import nn

from .. import env
from .build import materialize, tokenizer_dir
from .load_prequantized import is_4bit_weight
from .registry import (
    ATTN_CHOICES,
    HUB_ID,
    MODEL_NAMES,
    QUANT_CHOICES,
    check_choice,
    default_cache_dir,
    unknown_name_error,
)

#: What :func:`load_model` takes as ``attn_implementation``: ``"auto"`` or one of ``ATTN_CHOICES``.
LOAD_ATTN_CHOICES = ("auto",) + ATTN_CHOICES


def _source(name: Union[str, os.PathLike], cache_dir) -> str:
    """What to hand to ``from_pretrained`` for ``name``: a built folder, a path or a hub id."""
    if not isinstance(name, (str, os.PathLike)) or not str(name).strip():
        raise unknown_name_error(name)
    if name in MODEL_NAMES:
        return str(materialize(name, cache_dir))
    path = Path(name).expanduser()
    if path.exists():
        return str(path)
    if isinstance(name, str) and HUB_ID.fullmatch(name):
        return name
    raise unknown_name_error(name)


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
        source = str(tokenizer_dir(cache))
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

    from .load_prequantized import dequantize_to, nf4_config

    saved = nf4_config(source, dtype, quant, double_quant)
    if saved is not None:  # a pre-quantized NF4 checkpoint: read as it is, in the run's compute dtype
        model = AutoModelForCausalLM.from_pretrained(source, config=saved, dtype=dtype, attn_implementation=attn,
                                                     device_map={"": device})
        dequantize_to(model, dtype)
        return model
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


def _keep_own_attention(model) -> None:
    """Switch a model loaded with SDPA to its eager attention where SDPA drops what its attention does."""
    from .attention_scores import read_attention

    if read_attention(model).sdpa_drops:
        model.set_attn_implementation("eager")


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
    dtype: Union[str, torch.dtype] = "auto",
    attn_implementation: str = "auto",
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
            checkpoint folder, or a Hugging Face model id. A checkpoint saved already in NF4
            (:func:`~qlora_nb_utils.models.prequantized.save_nf4`, or a ``*-bnb-4bit`` one) is
            read as it is (:mod:`.load_prequantized`), with ``dtype`` as its compute dtype: the fastest start.
        quant: ``"nf4"`` (bitsandbytes 4-bit base) or ``"none"`` (plain ``dtype`` weights).
        lora: wrap the model with LoRA adapters (only they are trainable).
        lora_r: LoRA rank.
        lora_alpha: LoRA scaling numerator.
        lora_dropout: dropout on the LoRA input; 0 keeps runs deterministic.
        lora_targets: ``"all-linear"`` or module names as a list or comma-separated string.
        dtype: compute dtype (see :func:`qlora_nb_utils.env.resolve_dtype`); ``"auto"``: what
            ``qlora-nb train`` computes in on the device (:func:`qlora_nb_utils.env.default_dtype`:
            fp32 on a CPU, bf16 on an SM80+ GPU), so that a base loaded to evaluate a run's
            adapter computes what the run did.
        attn_implementation: ``"auto"``, ``"sdpa"``, ``"eager"`` or ``"flex_attention"`` (torch
            has no CPU backward for flex attention, so it trains only on CUDA). ``"auto"``: SDPA,
            unless the model's attention changes its scores in a way SDPA drops (Gemma-2's soft
            cap, read on a probe forward: :func:`.attention_scores.read_attention`); then its own
            eager attention, so that evaluation and generation compute the model's attention
            (``optimize()`` trains it compiled with flex attention on CUDA).
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
        ValueError: for invalid options or names (the message lists the valid choices), and
            for a quantized checkpoint with ``quant="none"`` or in another format than NF4.
        RuntimeError: for ``quant="nf4"`` where bitsandbytes cannot run NF4 on the device.
    """
    check_choice("quant", quant, QUANT_CHOICES)
    check_choice("attn_implementation", attn_implementation, LOAD_ATTN_CHOICES)
    targets = _parse_targets(lora_targets) if lora else None
    if lora:
        _check_lora_numbers(lora_r, lora_alpha, lora_dropout)
    dev, torch_dtype = env.resolve_device_dtype(device, dtype)
    # first, so bitsandbytes' import-time note about its optional CPU kernel is said in plain words
    # (PEFT imports bitsandbytes too, whatever the quant)
    env.import_bitsandbytes(required=False)
    if quant == "nf4":
        env.require_bnb(dev)
    source = _source(name, cache_dir)
    tokenizer = load_tokenizer(name, cache_dir)
    auto = attn_implementation == "auto"
    model = _load_base(source, quant, torch_dtype, "sdpa" if auto else attn_implementation, dev, double_quant)
    if auto:
        _keep_own_attention(model)
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
        if is_4bit_weight(param):
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
