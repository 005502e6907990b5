"""Why FSDP2 changed sharded NF4 bytes on CUDA, and the precision plan that keeps them exact.

Why this module exists: on two GPUs (torch 2.11, NCCL) sharding the packed NF4 weights stored
as bf16 changed a small share of the 16-bit words, every one a bf16 NaN pattern rewritten to
0x7FFF, and the loss moved visibly (the lab's FSDP2 diagnosis records the counts). The cause,
read from the torch source, is one copy, not NCCL and not a dtype cast:

1. FSDP2's ``foreach_all_gather`` copies each rank's shards into the all-gather buffer with
   ``torch.ops.fsdp.all_gather_copy_in``, which is ``torch._foreach_copy_(dsts, srcs)``. The
   buffer's dtype is the unit's common all-gather dtype: the ``param_dtype`` of the
   ``MixedPrecisionPolicy`` for cast parameters and the own dtype of the others, or ``uint8``
   when they differ (``_get_all_gather_input_metadatas``).
2. On CUDA, ``_foreach_copy_`` between tensors of the *same* dtype runs the element-wise
   ``UnaryOpFunctor`` with ``Copy<opmath_t, opmath_t>`` (``ForeachBinaryOpList.cu``): every
   bf16 or fp16 element is widened to float and narrowed back. Widening is exact, but the
   narrowing (``c10::BFloat16(float)`` -> ``__float2bfloat16`` on sm80+) returns the canonical
   NaN 0x7FFF for every NaN, dropping its sign and payload. Packed 4-bit codes are not numbers;
   a few of them read as a bf16 NaN (all exponent bits set, a non-zero mantissa), and exactly
   those words changed, to 0x7FFF.
3. On a CPU the same call takes ``foreach_tensor_copy_list_kernel_slow_``, a ``copy_`` per
   tensor (a memcpy for equal dtypes): gloo runs were bit-exact, which is why CI never saw it.

NCCL itself moves bytes; the 32-bit float copy and the integer copy are bit-exact on every
device. So the rule is: **the all-gather dtype of a unit that holds packed words must not be a
16-bit float.** :func:`sharded_nf4_precision` keeps it (no ``param_dtype`` cast, so the LoRA
weights are all-gathered in their fp32 and the unit's dtype is float32, or uint8 when the unit
also holds bf16 norms; packed words stored as float32), :func:`unsafe_units` predicts each
unit's all-gather dtype before anything is sharded, and
:func:`qlora_nb_utils.distributed.fsdp.apply_fsdp2` refuses a plan that breaks the rule off
the CPU. :func:`snapshot_packed` / :func:`compare_packed` check the bytes after the first
all-gather, bit for bit. The upstream report is bitsandbytes issue 1945 (same 0x7FFF
signature); ``docs/fsdp2.md`` has the minimal reproducer.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..models.load_prequantized import is_4bit_weight

__all__ = ["ROUNDTRIP_UNSAFE", "allgather_dtype", "unsafe_units", "sharded_nf4_precision",
           "snapshot_packed", "compare_packed", "nan_words"]

#: dtypes whose same-dtype CUDA ``_foreach_copy_`` goes through float and canonicalises NaNs.
ROUNDTRIP_UNSAFE = (torch.bfloat16, torch.float16)


def allgather_dtype(dtypes: Iterable[torch.dtype], param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of one FSDP2 unit's all-gather buffer (torch 2.4-2.13 rule, module docstring).

    Args:
        dtypes: the stored dtypes of the unit's sharded parameters.
        param_dtype: the unit's ``MixedPrecisionPolicy.param_dtype`` (None: no cast).

    Returns:
        The common all-gather dtype, or ``torch.uint8`` when the parameters' differ.
    """
    out = [param_dtype if (param_dtype is not None and d.is_floating_point and d != param_dtype) else d
           for d in dtypes]
    if not out:
        raise ValueError("a unit without parameters has no all-gather")
    return out[0] if all(d == out[0] for d in out) else torch.uint8


def unsafe_units(model: nn.Module, layers: list[nn.Module], param_dtype: torch.dtype | None,
                 ignored: set | None = None) -> dict[str, str]:
    """The units that would all-gather packed 4-bit words in a 16-bit float, before sharding.

    Args:
        model: the model as :func:`qlora_nb_utils.distributed.fsdp.apply_fsdp2` receives it.
        layers: its decoder layers (one ``fully_shard`` unit each; the root holds the rest).
        param_dtype: the policy's ``param_dtype``.
        ignored: parameters left out of sharding (``ignored_params``).

    Returns:
        ``{unit name: all-gather dtype}`` for each unsafe unit (empty: the plan is safe).
    """
    ignored_ids = {id(p) for p in (ignored or ())}
    names = {id(m): n for n, m in model.named_modules()}
    seen: set[int] = set()
    units: list[tuple[str, list[nn.Parameter]]] = []
    for layer in layers:
        params = [p for p in layer.parameters() if id(p) not in ignored_ids]
        seen |= {id(p) for p in layer.parameters()}
        units.append((names.get(id(layer), "layer"), params))
    units.append(("<root>", [p for p in model.parameters() if id(p) not in seen and id(p) not in ignored_ids]))
    bad = {}
    for name, params in units:
        if any(is_4bit_weight(p) for p in params):
            dtype = allgather_dtype([p.dtype for p in params], param_dtype)
            if dtype in ROUNDTRIP_UNSAFE:
                bad[name] = str(dtype).replace("torch.", "")
    return bad


def sharded_nf4_precision(compute_dtype: torch.dtype, quant_storage: str = "auto"):
    """The FSDP2 policy and packed-word storage for sharded NF4 (the fix, module docstring).

    No ``param_dtype`` cast: the LoRA weights (fp32 in PEFT) are all-gathered and computed in
    fp32, the base's 4-bit matmuls still run in ``compute_dtype`` (bitsandbytes' compute
    dtype), gradients are reduced in fp32. ``"auto"`` stores the packed words as float32,
    which no copy on any device changes; an explicit storage is kept (the plan check in
    ``apply_fsdp2`` then decides whether it is safe).

    Returns:
        ``(MixedPrecisionPolicy, storage dtype)``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from .setup import resolve_quant_storage

    storage = torch.float32 if quant_storage == "auto" else resolve_quant_storage(quant_storage, None, compute_dtype)
    return MixedPrecisionPolicy(), storage


# ----------------------------------------------------------------------------- byte checks
def is_bnb_linear4bit(m: nn.Module) -> bool:
    """True for a bitsandbytes ``Linear4bit`` (by name: bitsandbytes is not imported for the check)."""
    return type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return getattr(t, "_local_tensor", t)


def snapshot_packed(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{module name: packed bytes (uint8, on the CPU)}`` of every 4-bit weight, before sharding."""
    return {n: _local(m.weight).contiguous().view(torch.uint8).reshape(-1).cpu().clone()
            for n, m in model.named_modules() if is_bnb_linear4bit(m)}


def nan_words(t: torch.Tensor) -> int:
    """How many 16-bit words of ``t``'s bytes read as a bf16 NaN (exponent all ones, mantissa
    not zero): the words a float round trip would rewrite."""
    b = t.contiguous().view(torch.uint8).reshape(-1)
    w = b[: b.numel() // 2 * 2].view(torch.int16).to(torch.int32) & 0xFFFF
    return int((((w & 0x7F80) == 0x7F80) & ((w & 0x007F) != 0)).sum())


def compare_packed(model: nn.Module, snapshot: dict[str, torch.Tensor], samples: int = 8,
                   only: set[str] | None = None) -> dict[str, Any]:
    """Compare the 4-bit weights as the model holds them now (FSDP2's all-gathered parameters,
    while unsharded) with :func:`snapshot_packed`, byte for byte (those named in ``only``, or all).

    Returns:
        ``equal`` (bool), ``weights``, ``bytes``, ``changed_bytes``, ``changed_weights`` (names,
        first few), ``nan_words`` (bf16-NaN words in the snapshot) and ``samples`` of changed
        16-bit words as ``"before->after"`` in hex.
    """
    changed_bytes, changed, shown, total, nans = 0, [], [], 0, 0
    for n, m in model.named_modules():
        if n not in snapshot or (only is not None and n not in only):
            continue
        before = snapshot[n]
        now = _local(m.weight).contiguous().view(torch.uint8).reshape(-1).cpu()
        total += before.numel()
        nans += nan_words(before)
        if now.numel() != before.numel():
            changed.append(n)
            changed_bytes += before.numel()
            continue
        diff = now != before
        if bool(diff.any()):
            changed.append(n)
            changed_bytes += int(diff.sum())
            if len(shown) < samples and before.numel() % 2 == 0:
                w0, w1 = before.view(torch.int16), now.view(torch.int16)
                for i in torch.nonzero(w0 != w1).flatten()[: samples - len(shown)].tolist():
                    shown.append(f"{int(w0[i]) & 0xFFFF:04x}->{int(w1[i]) & 0xFFFF:04x}")
    return {"equal": not changed and total > 0, "weights": len(snapshot) if only is None else len(only),
            "bytes": total, "changed_bytes": changed_bytes, "changed_weights": changed[:10], "nan_words": nans,
            "samples": shown}


def merge_comparisons(parts: list[dict[str, Any]], weights: int, samples: int = 8) -> dict[str, Any]:
    """One :func:`compare_packed` record from those of the units compared one at a time."""
    total = sum(p["bytes"] for p in parts)
    changed = [n for p in parts for n in p["changed_weights"]]
    return {"equal": total > 0 and all(p["equal"] for p in parts), "weights": weights, "bytes": total,
            "changed_bytes": sum(p["changed_bytes"] for p in parts), "changed_weights": changed[:10],
            "nan_words": sum(p["nan_words"] for p in parts),
            "samples": [w for p in parts for w in p["samples"]][:samples]}
