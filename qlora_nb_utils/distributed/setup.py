"""What every rank does before anything is sharded: join the group, pick the precision, load.

Why this module exists: a sharded run is N processes started by ``torchrun``, and each of them
must first join the process group (gloo on CPU, nccl on CUDA, one GPU per local rank), agree
on the FSDP2 mixed-precision policy, and load the same QLoRA model with the 4-bit packed
weights stored in a dtype that policy will not cast. These steps come before
:func:`qlora_nb_utils.distributed.fsdp.apply_fsdp2` and do not depend on how the model is then
sharded, so they live apart from the sharding. ``quant_storage="auto"``
(:func:`resolve_quant_storage`) is the half of the mixed-precision rule that is decided at load
time; the reason for it is in the docstring of :mod:`qlora_nb_utils.distributed.fsdp`.
``--nf4 auto`` (:func:`resolve_nf4_mode`) is decided here too, before the load, by both the
explicit loop (:mod:`.fsdp_train`) and the Trainer run (:mod:`.trainer`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os

import torch

__all__ = [
    "QUANT_STORAGE_CHOICES",
    "DistInfo",
    "init_distributed",
    "mixed_precision",
    "resolve_quant_storage",
    "resolve_nf4_mode",
    "resolve_frozen_mode",
    "load_qlora",
]

QUANT_STORAGE_CHOICES = ("auto", "uint8", "bfloat16", "float16", "float32")


# ----------------------------------------------------------------------------- process group
@dataclasses.dataclass
class DistInfo:
    """Where this process sits: rank, world size, its device and the process-group backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the one that writes logs, adapters and summaries)."""
        return self.rank == 0


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group ``torchrun`` set up: gloo on CPU, nccl on CUDA.

    Args:
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.

    Returns:
        A :class:`DistInfo`; the group is initialised (once) and, on CUDA, the rank's GPU is
        made current.

    Raises:
        ValueError: an unknown device, or ``"cuda"`` without a GPU for this local rank.
        RuntimeError: not launched by ``torchrun`` (no ``RANK``/``WORLD_SIZE`` in the env).
    """
    import torch.distributed as dist

    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("not launched by torchrun: run `torchrun --nproc-per-node N -m "
                           "qlora_nb_utils.distributed.fsdp_train ...` (RANK/WORLD_SIZE are unset)")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible)")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=_dt.timedelta(minutes=10))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


# ----------------------------------------------------------------------------- precision, loading
def mixed_precision(dtype: torch.dtype | str | None):
    """The FSDP2 mixed-precision policy of a QLoRA run.

    Args:
        dtype: the compute dtype. ``None`` or ``float32``: no casting (exact parity runs).
            bf16/fp16: LoRA weights all-gathered and computed in ``dtype``, gradients
            reduced in fp32 into fp32 LoRA master weights (what torchtune does).

    Returns:
        A ``torch.distributed.fsdp.MixedPrecisionPolicy``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype is None or dtype == torch.float32:
        return MixedPrecisionPolicy()
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"mixed precision dtype must be float32, bfloat16 or float16; got {dtype}")
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def resolve_quant_storage(storage: str, param_dtype: torch.dtype | None,
                          compute_dtype: torch.dtype | None = None) -> torch.dtype:
    """The ``bnb_4bit_quant_storage`` dtype: ``"auto"`` is the policy's ``param_dtype`` when it
    casts (so FSDP2 never converts the packed bytes), else the floating ``compute_dtype`` when
    given, else uint8 (bitsandbytes' default).

    Why a floating storage even without casting: FSDP2 in torch 2.11 wraps each shard in
    ``nn.Parameter(dtensor)``, which raises "only Tensors of floating point dtype can require
    gradients" for uint8 (seen on the GPU machine in a float32 run; torch 2.13 on CPU accepts it).

    Raises:
        ValueError: an unknown storage name.
    """
    if storage not in QUANT_STORAGE_CHOICES:
        raise ValueError(f"quant_storage must be one of {list(QUANT_STORAGE_CHOICES)}; got {storage!r}")
    if storage == "auto":
        if param_dtype is not None:
            return param_dtype
        if compute_dtype is not None and compute_dtype.is_floating_point:
            return compute_dtype
        return torch.uint8
    return getattr(torch, storage)


def resolve_nf4_mode(mode: str, backend: str) -> str:
    """``--nf4``: ``"auto"`` is ``"shard"`` on every backend; ``"shard"`` and ``"replicate"`` stay.

    ``"shard"`` splits the packed 4-bit weights over the ranks like every other parameter, so
    each GPU holds ``1/N`` of the base model; ``"replicate"`` keeps them whole on every rank
    (no all-gather traffic for them, no memory saved). Sharding is the default because the
    4-bit base is most of a QLoRA model's memory, and it is exact: the run stores the packed
    words so that no 16-bit float copy touches them
    (:func:`qlora_nb_utils.distributed.packed_words.sharded_nf4_precision`; a bf16 all-gather
    on CUDA rewrites the words that read as NaNs), and
    :func:`qlora_nb_utils.distributed.fsdp.apply_fsdp2` refuses a plan that would all-gather
    them in a 16-bit float off the CPU and checksums them after the first all-gather
    (``--check-bytes`` compares every byte). ``backend`` is kept for callers that pass it; the
    choice no longer depends on it.

    Raises:
        ValueError: a mode other than ``"auto"``, ``"shard"`` or ``"replicate"``.
    """
    if mode not in ("auto", "shard", "replicate"):
        raise ValueError(f"nf4 mode must be 'auto', 'shard' or 'replicate'; got {mode!r}")
    return "shard" if mode == "auto" else mode


def resolve_frozen_mode(mode: str, backend: str) -> str:
    """``--frozen``: ``"auto"`` replicates the other frozen weights on NCCL (no all-gather traffic
    for them) and shards them on gloo; ``"shard"`` and ``"replicate"`` stay."""
    return mode if mode != "auto" else ("replicate" if backend == "nccl" else "shard")


def load_qlora(name: str, *, quant: str = "nf4", dtype: str | torch.dtype = "bfloat16",
               device: torch.device | str = "cpu", quant_storage: torch.dtype = torch.uint8,
               lora_r: int = 16, lora_alpha: float = 32, lora_targets: str = "all-linear",
               attn_implementation: str = "sdpa", seed: int = 0):
    """Load a model like :func:`qlora_nb_utils.models.load_model`, with a chosen quant storage.

    ``models.load_model`` fixes ``bnb_4bit_quant_storage`` to bitsandbytes' default (uint8);
    FSDP2 with a casting mixed-precision policy needs it to be the policy's dtype (see the
    docstring of :mod:`qlora_nb_utils.distributed.fsdp`). Everything else (named models built
    once into the cache, the SmolLM2 tokenizer, seeded LoRA on all linear layers, fp32
    adapters) is the same path.

    Returns:
        ``(model, tokenizer)``; ``config.use_cache`` is False.

    Raises:
        ValueError: for bad options (see ``models.load_model``).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from .. import env, models

    if quant == "none" or quant_storage == torch.uint8:
        return models.load_model(name, quant=quant, dtype=dtype, device=device, lora_r=lora_r,
                                 lora_alpha=lora_alpha, lora_targets=lora_targets,
                                 attn_implementation=attn_implementation, seed=seed)
    if quant != "nf4":
        raise ValueError(f"quant must be one of {list(models.QUANT_CHOICES)}; got {quant!r}")
    dev = env.resolve_device(device)
    torch_dtype = env.resolve_dtype(dtype, dev)
    env.require_bnb(dev)
    source = str(models.materialize(name)) if name in models.MODEL_NAMES else str(name)
    tok = models.load_tokenizer(name)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch_dtype,
                             bnb_4bit_quant_storage=quant_storage)
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, quantization_config=bnb,
                                                attn_implementation=attn_implementation,
                                                device_map={"": dev})
    base.config.use_cache = False
    config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0,
                        target_modules=lora_targets, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        return get_peft_model(base, config), tok
