"""The torchao NF4 QLoRA peer: torchtune's way of doing QLoRA, on the same HF checkpoint.

Why it exists: torchtune does not use bitsandbytes. Its QLoRA keeps each frozen projection as
a torchao ``NF4Tensor`` (block size 64, double-quantized scales in blocks of 256) and calls
``linear_nf4`` (an autograd function: dequantize, ``F.linear``; backward: the input gradient
only) beside a LoRA pair in the model dtype; everything else (embeddings, norms, LM head)
stays bf16, nothing is upcast, and the model is compiled. A published comparison found that
recipe far lighter in memory than PEFT + bitsandbytes; this module rebuilds it on top of
``from_pretrained`` so it trains the very checkpoint, batches and seed the other peers do.

torchao is optional: :func:`torchao_status` says whether it can be imported and why not. Its
NF4 API moved in 0.18 (``torchao.quantization``); older releases kept it in
``torchao.dtypes.nf4tensor``; both are tried. A weight whose block count is not a multiple of
256 (only the tiny test model has such) gets the largest scaler block that divides it, noted
in the run's notes. ``_peer_torchao`` is the peer itself: it builds that model, turns on
non-reentrant checkpointing when the comparison asks for it, trains it under
``torch.compile(model)`` and records the run.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn

from lab.peers.common import _model_dir, _train_cfg
from lab.peers.results import _from_history, error_run
from qlora_nb_utils.bench.flops import LINEARS
from qlora_nb_utils.env import resolve_device_dtype as _resolve_device_dtype

__all__ = ["torchao_status", "NF4LoRALinear", "build_torchao_qlora"]


def _nf4_api():
    try:
        from torchao.quantization import to_nf4
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import linear_nf4, to_nf4  # torchao < 0.18
    return to_nf4, linear_nf4


def torchao_status() -> tuple[bool, str]:
    """Whether torchao's NF4 API can be imported here.

    Returns:
        ``(True, "torchao X.Y.Z")`` or ``(False, reason)`` with the import error.
    """
    try:
        import torchao

        _nf4_api()
    except Exception as exc:  # ImportError, or an incompatible build failing at import
        return False, f"torchao's NF4 API cannot be imported: {type(exc).__name__}: {exc}"
    return True, f"torchao {getattr(torchao, '__version__', '?')}"


class NF4LoRALinear(nn.Module):
    """A frozen NF4 projection plus a trainable LoRA pair (torchtune's ``LoRALinear``).

    ``y = linear_nf4(x, W_nf4) + (alpha / r) * B(A(x))``; A is Kaiming-uniform, B starts at 0.

    Args:
        linear: the ``nn.Linear`` to replace (bias-free, as in Llama).
        rank: LoRA rank.
        alpha: LoRA alpha.
        block_size: NF4 block size.
        scaler_block_size: block size of the double-quantized scales (reduced to a divisor of
            the block count when needed).
    """

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, block_size: int = 64,
                 scaler_block_size: int = 256) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("NF4LoRALinear supports bias-free linears (Llama's projections)")
        to_nf4, self._linear_nf4 = _nf4_api()
        blocks = linear.weight.numel() // block_size
        self.scaler_block_size = math.gcd(scaler_block_size, blocks)
        weight = to_nf4(linear.weight.detach(), block_size, self.scaler_block_size)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dtype, device = linear.weight.dtype, linear.weight.device
        self.lora_a = nn.Linear(self.in_features, rank, bias=False, dtype=dtype, device=device)
        self.lora_b = nn.Linear(rank, self.out_features, bias=False, dtype=dtype, device=device)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x)) * self.scaling


def build_torchao_qlora(source: str, *, dtype: torch.dtype, device: torch.device, lora_r: int = 16,
                        lora_alpha: float = 32, seed: int = 0, targets: Iterable[str] = LINEARS,
                        attn_implementation: str = "sdpa") -> tuple[nn.Module, dict[str, Any]]:
    """Load ``source`` with ``from_pretrained`` and turn it into a torchao NF4 QLoRA model.

    Args:
        source: a local checkpoint folder.
        dtype: model dtype (bf16 on a GPU, as torchtune runs it).
        device: where to put it.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        seed: seeds the LoRA initialisation (the global RNG is left as it was).
        targets: projection names to quantize and adapt.
        attn_implementation: transformers attention backend.

    Returns:
        ``(model, info)``: the model (only LoRA weights trainable) and facts for the notes
        (``quantized`` layers, smallest ``scaler_block_size`` used).

    Raises:
        RuntimeError: torchao's NF4 API is missing (the message says why).
    """
    ok, why = torchao_status()
    if not ok:
        raise RuntimeError(why)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
    model.config.use_cache = False
    model.to(device).requires_grad_(False)
    targets = set(targets)
    replaced, scaler = 0, 256
    cuda_rng = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_rng):
        torch.manual_seed(seed)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if name in targets and isinstance(child, nn.Linear):
                    new = NF4LoRALinear(child, lora_r, lora_alpha)
                    scaler = min(scaler, new.scaler_block_size)
                    setattr(parent, name, new)
                    replaced += 1
    if not replaced:
        raise ValueError(f"no projection named {sorted(targets)} found in {type(model).__name__}")
    return model, {"quantized": replaced, "scaler_block_size": scaler}


def _peer_torchao(ctx: dict, batches: list) -> dict[str, Any]:
    from qlora_nb_utils.training.loop import train

    ok, why = torchao_status()
    if not ok:
        return error_run(ctx["name"], why, batch_size=ctx["batch_size"], seq_len=ctx["seq_len"])
    device, dtype = _resolve_device_dtype(ctx["device"], ctx["dtype"])
    model, info = build_torchao_qlora(_model_dir(ctx["model"]), dtype=dtype, device=device,
                                      lora_r=ctx["lora_r"], lora_alpha=ctx["lora_alpha"], seed=ctx["seed"])
    if ctx["grad_ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hist = train(model, batches, _train_cfg(ctx), forward=torch.compile(model), label=ctx["name"])
    notes = (f"{why}; {info['quantized']} projections as NF4Tensor (block 64, scaler block "
             f"{info['scaler_block_size']}) + LoRA in {str(dtype).replace('torch.', '')}; HF loss; torch.compile(model)")
    return _from_history(ctx["name"], hist, ctx, notes, {"compiled": True})
