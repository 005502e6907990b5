"""NF4 dequantization as a ``torch.library`` custom op: opaque to Dynamo, yet no graph break.

Why this module exists. A kernel that Dynamo cannot look into (a C routine reached through
``ctypes`` with raw ``data_ptr()`` pointers, a ``.tolist()``, a function under
``torch._dynamo.disable``) splits the graph wherever it is called. Before release 0.46,
bitsandbytes dequantized NF4 weights exactly that way, and the QLoRA-under-compile write-ups
of that time fought the resulting breaks (``Params4bit.t()``, ``data_ptr()``, the ctypes
calls) one by one. The cure bitsandbytes adopted, and the one shown here, is to declare the
kernel as an operator: :func:`torch.library.custom_op` gives it a schema, Dynamo puts one
``call_function`` node for it into the graph without tracing its body, and a *fake* kernel
(:func:`torch.library.register_fake`) tells the compiler the output's shape and dtype from
the inputs' metadata alone, checking them with ``torch._check`` so a bad call fails at trace
time with a message rather than deep inside the real kernel.

The op, ``torch.ops.qlora_nb.dequantize_nf4``, is our own pure-torch NF4 dequantizer (it does
not call bitsandbytes): bitsandbytes packs two 4-bit codes per byte (the first value of a pair
in the high nibble), each code indexes the 16-value NF4 table (:data:`NF4_CODE`, the quantiles
of a standard normal scaled to [-1, 1], published with QLoRA: Dettmers et al. 2023), and every
block of ``blocksize`` consecutive values is scaled by that block's absolute maximum. With
double quantization the absmax values are themselves 8-bit quantized; dequantize them first
(:func:`absmax_of` does it with bitsandbytes). No autograd formula is registered: the op takes
frozen weights (a uint8 tensor and its scales), which never need a gradient; gradients of the
activations flow through the matmul that uses the dequantized weight.

``tests/test_nf4_op.py`` runs ``torch.library.opcheck`` on the op (schema, fake kernel,
tracing), compares it with ``bitsandbytes.functional.dequantize_4bit`` on random weights, and
compiles a function using it with ``fullgraph=True``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

__all__ = ["NF4_CODE", "OP", "dequantize_nf4", "dequantize_nf4_reference", "absmax_of"]

#: The 16 NF4 code values published with QLoRA (Dettmers et al. 2023), in code order 0..15.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)

#: The op's qualified name (``torch.ops.qlora_nb.dequantize_nf4``).
OP = "qlora_nb::dequantize_nf4"

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dequantize_nf4_reference(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int,
                             shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """NF4 dequantization in plain torch: the body of the op (also callable directly).

    Args:
        packed: uint8 tensor of any shape holding ``ceil(n / 2)`` bytes, two codes per byte,
            the first of each pair in the high nibble (bitsandbytes' layout), ``n = prod(shape)``.
        absmax: float32 tensor with ``ceil(n / blocksize)`` block scales.
        blocksize: values per block (bitsandbytes uses 64 by default).
        shape: shape of the dequantized tensor.
        dtype: dtype of the result (float32, float16 or bfloat16).

    Returns:
        A new tensor of ``shape`` and ``dtype`` on ``packed``'s device. The product is formed
        in float32 and rounded to ``dtype`` once.
    """
    n = math.prod(shape)
    blocks = -(-n // blocksize)
    flat = packed.reshape(-1)
    codes = torch.stack(((flat >> 4) & 0xF, flat & 0xF), dim=-1).reshape(-1)[:n]
    table = torch.tensor(NF4_CODE, dtype=torch.float32, device=packed.device)
    values = table[codes.long()]
    pad = blocks * blocksize - n
    if pad:
        values = torch.nn.functional.pad(values, (0, pad))
    scaled = values.view(blocks, blocksize) * absmax.reshape(-1, 1).to(torch.float32)
    return scaled.reshape(-1)[:n].reshape(tuple(shape)).to(dtype)


@torch.library.custom_op(OP, mutates_args=())
def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int,
                   shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.ops.qlora_nb.dequantize_nf4``: see :func:`dequantize_nf4_reference`."""
    _check_args(packed, absmax, blocksize, shape, dtype)
    return dequantize_nf4_reference(packed, absmax, blocksize, shape, dtype)


def _check_args(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int,
                shape: Sequence[int], dtype: torch.dtype) -> None:
    """The input checks shared by the real and the fake kernel (``torch._check`` raises)."""
    torch._check(packed.dtype == torch.uint8, lambda: f"packed must be uint8, got {packed.dtype}")
    torch._check(absmax.dtype == torch.float32, lambda: f"absmax must be float32, got {absmax.dtype}")
    torch._check(blocksize > 0, lambda: f"blocksize must be positive, got {blocksize}")
    torch._check(len(shape) > 0 and all(s >= 0 for s in shape),
                 lambda: f"shape must be a non-empty list of sizes >= 0, got {list(shape)}")
    torch._check(dtype in _DTYPES, lambda: f"dtype must be one of {_DTYPES}, got {dtype}")
    torch._check(packed.device == absmax.device,
                 lambda: f"packed ({packed.device}) and absmax ({absmax.device}) must share a device")
    n = math.prod(shape)
    torch._check(packed.numel() == (n + 1) // 2,
                 lambda: f"packed holds {packed.numel()} bytes; shape {list(shape)} needs {(n + 1) // 2}")
    torch._check(absmax.numel() == -(-n // blocksize),
                 lambda: f"absmax holds {absmax.numel()} scales; {n} values in blocks of {blocksize} "
                         f"need {-(-n // blocksize)}")


@dequantize_nf4.register_fake
def _(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int,
      shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    _check_args(packed, absmax, blocksize, shape, dtype)
    return packed.new_empty(tuple(shape), dtype=dtype)


def absmax_of(quant_state: Any) -> torch.Tensor:
    """The float32 block scales of a bitsandbytes ``QuantState``, double quantization undone.

    Args:
        quant_state: ``weight.quant_state`` of a bitsandbytes ``Params4bit`` (or the state
            ``bitsandbytes.functional.quantize_4bit`` returns).

    Returns:
        ``quant_state.absmax`` as float32, or, when the state is nested (double
        quantization), ``dequantize_blockwise(absmax, state2) + offset`` computed by
        bitsandbytes, exactly as its own ``dequantize_4bit`` does first.
    """
    if getattr(quant_state, "nested", False):
        from bitsandbytes.functional import dequantize_blockwise

        absmax = dequantize_blockwise(quant_state.absmax, quant_state.state2)
        return (absmax + quant_state.offset).to(torch.float32)
    return quant_state.absmax.to(torch.float32)
