"""A one-pass NF4 dequantize: double-quantized scales and the 4-bit lookup in ONE Triton kernel.

Why this module exists. A QLoRA step dequantizes every frozen NF4 weight twice (forward and
backward): 448 weights per step on a Llama-3.1-8B shape. bitsandbytes 0.50 does each in two
CUDA kernels: first the 8-bit block scales ("double quantization": uint8 codes, a 256-entry
float32 code book, one float32 scale per 256 codes and a float32 offset) back to float32 in a
scratch tensor, then the NF4 codes times those scales. Those kernels are a visible share of an
8B step in the lab's profiles, more than Unsloth's one-kernel ``fast_dequantize`` spends, and
our pure-torch body (:mod:`.nf4`) compiled by Inductor was slower than Unsloth's too. A
dequantize is memory bound (0.5 byte read, 2 bytes written per value), so the one
thing to win is traffic and launches: the scratch float32 scales (written, then read back)
and the second launch go away when each program computes its blocks' scales itself.

The kernel. One program owns ``ROWS`` consecutive quantization blocks (``ROWS * blocksize``
outputs, 4096 by default). It loads each block's uint8 scale code, looks it up in the 256-entry
code book, multiplies by the block's second-level float32 scale and adds the offset; then it
loads the block's packed bytes as a ``[ROWS, blocksize / 2]`` tile, looks both nibbles up in the
16-entry code table (high nibble first, bitsandbytes' layout), scales them, rounds them to the
output dtype and stores each byte's two values as one little-endian word (first value in the low
half), so a thread writes whole 16-byte vectors: the output is written once, in place.
The arithmetic is bitsandbytes', in its order: ``code2[q] * absmax2`` rounded to float32 (a
``mul.rn``, so the compiler cannot fuse it with the offset add into an FMA, which would round
once instead of twice), ``+ offset``, ``table[c] * scale`` in float32, rounded once to the
output dtype. So the result is meant to be bit-identical to ``dequantize_4bit``; the tests and
the GPU check compare exactly.

How the compiler sees it. ``torch.ops.qlora_nb.dequantize_nf4_fused`` is declared with
:func:`torch.library.triton_op` when Triton imports: Dynamo records one op, AOTAutograd
decomposes it into the kernel call (:func:`torch.library.wrap_triton`), and Inductor launches
the kernel itself inside its generated code (no opaque custom-op boundary, output buffers in
its memory plan; CUDA graphs keep working). Every non-CUDA tensor, and a weight of an odd number
of values (its last byte holds one), takes the pure-torch body (the same arithmetic, no
Triton), which is what the CPU tests run. Without Triton (a CPU-only
install) the op is a :func:`torch.library.custom_op` with the same schema and a fake kernel, so
code and tests do not change. Nothing is launched or patched at import; routing bitsandbytes'
own calls here is :mod:`qlora_nb_utils.compile.patches.nf4_dequant`'s job.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

import torch
from torch.library import wrap_triton

try:  # Triton is optional: a CPU-only torch does not ship it
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = libdevice = None

__all__ = ["OP", "WIDE_OP", "HAS_TRITON", "ELEMS_PER_PROGRAM", "dequantize_nf4_fused", "dequantize_nf4_wide",
           "dequantize_reference", "dequantize", "dequantize_wide", "op_args", "dequantize_state", "launch"]

#: The op's qualified name (``torch.ops.qlora_nb.dequantize_nf4_fused``).
OP = "qlora_nb::dequantize_nf4_fused"

#: Whether the Triton kernel exists in this process (CUDA tensors need it).
HAS_TRITON = triton is not None

#: Output values per program (a power of two; one program covers at least one block).
ELEMS_PER_PROGRAM = 4096

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- reference (any device)
def _scales(absmax: torch.Tensor, nested_code: Optional[torch.Tensor], nested_absmax: Optional[torch.Tensor],
            offset: Optional[torch.Tensor], nested_blocksize: int) -> torch.Tensor:
    """The float32 block scales: ``absmax`` itself, or ``nested_code[absmax] * nested_absmax + offset``."""
    if nested_code is None:
        return absmax.reshape(-1).to(torch.float32)
    blocks = absmax.numel()
    second = nested_absmax.reshape(-1).to(torch.float32)
    which = torch.arange(blocks, device=absmax.device) // nested_blocksize
    return nested_code.to(torch.float32)[absmax.reshape(-1).long()] * second[which] + offset.to(torch.float32)


def dequantize_reference(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                         nested_code: Optional[torch.Tensor], nested_absmax: Optional[torch.Tensor],
                         offset: Optional[torch.Tensor], blocksize: int, nested_blocksize: int,
                         shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The op's arithmetic in plain torch (the CPU kernel; also the check for the Triton one).

    Args: as :func:`dequantize_nf4_fused`.

    Returns:
        A new tensor of ``shape`` and ``dtype``: ``code[c] * scale`` in float32, rounded once.
    """
    n = math.prod(shape)
    blocks = -(-n // blocksize)
    flat = packed.reshape(-1)
    codes = torch.stack(((flat >> 4) & 0xF, flat & 0xF), dim=-1).reshape(-1)[:n]
    values = code.to(torch.float32)[codes.long()]
    if blocks * blocksize != n:
        values = torch.nn.functional.pad(values, (0, blocks * blocksize - n))
    scales = _scales(absmax, nested_code, nested_absmax, offset, nested_blocksize)
    scaled = values.view(blocks, blocksize) * scales.view(blocks, 1)
    return scaled.reshape(-1)[:n].reshape(tuple(shape)).to(dtype)


# ----------------------------------------------------------------------------- the Triton kernel
if HAS_TRITON:
    @triton.jit
    def _mul_rn(a, b, EXACT: tl.constexpr):
        """``a * b`` rounded to float32 on its own (never contracted into an FMA with an add)."""
        if EXACT:
            return libdevice.mul_rn(a, b)  # __nv_fmul_rn: PTX mul.rn.f32, which ptxas never contracts
        else:
            return a * b  # Triton's interpreter (numpy) does not contract either

    @triton.jit
    def _nf4_dequant_kernel(packed_ptr, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, offset_ptr, out_ptr,
                            n_bytes, n_blocks, row_words, stride_words, tail_ptr, tail_cols,
                            HALF: tl.constexpr, ROWS: tl.constexpr, NESTED: tl.constexpr,
                            NESTED_BLOCK: tl.constexpr, EXACT: tl.constexpr, WIDE: tl.constexpr,
                            STRIDED: tl.constexpr, TAIL: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # the blocks of this program
        live = rows < n_blocks
        if NESTED:
            q = tl.load(absmax_ptr + rows, mask=live, other=0).to(tl.int32)
            second = tl.load(nabsmax_ptr + rows // NESTED_BLOCK, mask=live, other=0.0)
            scale = _mul_rn(tl.load(ncode_ptr + q), second, EXACT) + tl.load(offset_ptr)
        else:
            scale = tl.load(absmax_ptr + rows, mask=live, other=0.0)
        byte = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
        keep = byte < n_bytes
        bits = tl.load(packed_ptr + byte, mask=keep, other=0).to(tl.int32)
        kind = out_ptr.dtype.element_ty
        first = (tl.load(code_ptr + (bits >> 4)) * scale[:, None]).to(kind)  # high nibble: the first value
        then = (tl.load(code_ptr + (bits & 15)) * scale[:, None]).to(kind)
        # Both values of a byte leave as one little-endian word (first value in the low half), so
        # each thread stores whole 16-byte vectors of consecutive words.
        # STRIDED: the weight's rows (row_words words each) go into a wider buffer whose rows are
        # stride_words words apart, each followed by its row of the tail (dequantize_wide).
        dest = (byte // row_words) * stride_words + byte % row_words if STRIDED else byte
        if WIDE:
            word = (then.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | first.to(tl.uint32, bitcast=True)
            tl.store(out_ptr.to(tl.pointer_type(tl.uint64)) + dest, word, mask=keep)
        else:
            word = (then.to(tl.uint16, bitcast=True).to(tl.uint32) << 16) | first.to(tl.uint16, bitcast=True)
            tl.store(out_ptr.to(tl.pointer_type(tl.uint32)) + dest, word, mask=keep)
        if STRIDED:  # the program whose words end a weight row also writes that row's tail
            end = (tl.program_id(0).to(tl.int64) + 1) * ROWS * HALF
            if end % row_words == 0:
                if end <= n_bytes:
                    row = end // row_words - 1
                    cols = tl.arange(0, TAIL)
                    live_cols = cols < tail_cols
                    values = tl.load(tail_ptr + row * tail_cols + cols, mask=live_cols, other=0.0)
                    tl.store(out_ptr + row * stride_words * 2 + row_words * 2 + cols, values, mask=live_cols)


def launch(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, nested_code: Optional[torch.Tensor],
           nested_absmax: Optional[torch.Tensor], offset: Optional[torch.Tensor], blocksize: int,
           nested_blocksize: int, out: torch.Tensor, *, elems: int = ELEMS_PER_PROGRAM, num_warps: int | None = None,
           wrapped: bool = False, tail: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel into ``out`` (CUDA tensors, Triton required); returns ``out``.

    Args:
        packed, absmax, code, nested_code, nested_absmax, offset, blocksize, nested_blocksize:
            as :func:`dequantize_nf4_fused`.
        out: the contiguous output, ``prod(shape)`` values of the wanted dtype; an even count
            (each byte's two values are stored as one word).
        elems: outputs per program (a power of two); the benchmark tries several.
        num_warps: Triton's launch option (None: Triton's default, 4).
        wrapped: True inside the op (the launch goes through ``torch.library.wrap_triton``, so the
            compiler sees the kernel; the AOTAutograd cache finds it in this source), False
            for a plain launch.
        tail: None, or ``(rows, t)`` values of ``out``'s dtype: ``out`` is then ``(rows, k + t)``
            (contiguous), the weight ``(rows, k)`` goes into its first ``k`` columns and ``tail``
            into the last ``t`` (:func:`dequantize_wide`; ``k`` even and a multiple of the
            values per program).

    Returns:
        ``out``.
    """
    if not HAS_TRITON:
        raise RuntimeError("the fused NF4 dequantize needs Triton for CUDA tensors; it is not importable here")
    rows = max(1, elems // blocksize)
    width = k = t = 0
    if tail is not None:
        t = tail.shape[1]
        width = out.shape[1]
        k = width - t
        if width % 2 or k % (rows * blocksize) or tail.shape[0] != out.shape[0] or not out.is_contiguous():
            raise ValueError(f"a wide output needs an even width and a weight width that is a multiple of "
                             f"{rows * blocksize} values, and a (rows, t) tail; got out {tuple(out.shape)}, "
                             f"tail {tuple(tail.shape)}")
    n = out.shape[0] * k if tail is not None else out.numel()
    if n % 2:
        raise ValueError(f"the kernel stores a byte's two values together: {n} values is odd")
    blocks = -(-n // blocksize)
    nested = nested_code is not None
    kernel = wrap_triton(_nf4_dequant_kernel) if wrapped else _nf4_dequant_kernel
    grid = (triton.cdiv(blocks, rows),)
    extra = {} if num_warps is None else {"num_warps": num_warps}
    kernel[grid](packed, absmax, code,
                 nested_code if nested else absmax, nested_absmax if nested else absmax,
                 offset if nested else absmax, out, n // 2, blocks, max(k // 2, 1), max(width // 2, 1),
                 tail if tail is not None else out, t,
                 HALF=blocksize // 2, ROWS=rows, NESTED=nested, NESTED_BLOCK=max(nested_blocksize, 1),
                 EXACT=os.environ.get("TRITON_INTERPRET") != "1", WIDE=out.dtype == torch.float32,
                 STRIDED=tail is not None, TAIL=max(triton.next_power_of_2(max(t, 1)), 16), **extra)
    return out


# ----------------------------------------------------------------------------- the op
def _check_args(packed, absmax, code, nested_code, nested_absmax, offset, blocksize, nested_blocksize,
                shape, dtype) -> None:
    """Input checks shared by every kernel (``torch._check`` raises at trace time too)."""
    nested = nested_code is not None
    torch._check(packed.dtype == torch.uint8, lambda: f"packed must be uint8, got {packed.dtype}")
    torch._check(code.dtype == torch.float32 and code.numel() == 16,
                 lambda: f"code must be the 16 float32 values of the 4-bit type, got {code.numel()} {code.dtype}")
    torch._check(blocksize >= 2 and blocksize & (blocksize - 1) == 0,
                 lambda: f"blocksize must be a power of two >= 2, got {blocksize}")
    torch._check(len(shape) > 0 and all(s >= 0 for s in shape),
                 lambda: f"shape must be a non-empty list of sizes >= 0, got {list(shape)}")
    torch._check(dtype in _DTYPES, lambda: f"dtype must be one of {_DTYPES}, got {dtype}")
    n = math.prod(shape)
    blocks = -(-n // blocksize)
    torch._check(packed.numel() == (n + 1) // 2,
                 lambda: f"packed holds {packed.numel()} bytes; shape {list(shape)} needs {(n + 1) // 2}")
    torch._check(absmax.numel() == blocks,
                 lambda: f"absmax holds {absmax.numel()} scales; {n} values in blocks of {blocksize} need {blocks}")
    tensors = [packed, absmax, code]
    if nested:
        torch._check(nested_absmax is not None and offset is not None,
                     lambda: "double quantization needs nested_code, nested_absmax and offset together")
        torch._check(absmax.dtype == torch.uint8, lambda: f"nested absmax must be uint8 codes, got {absmax.dtype}")
        torch._check(nested_code.dtype == torch.float32 and nested_code.numel() == 256,
                     lambda: f"nested_code must be 256 float32 values, got {nested_code.numel()} {nested_code.dtype}")
        torch._check(nested_blocksize > 0, lambda: f"nested_blocksize must be positive, got {nested_blocksize}")
        need = -(-blocks // nested_blocksize)
        torch._check(nested_absmax.dtype == torch.float32 and nested_absmax.numel() == need,
                     lambda: f"nested_absmax must hold {need} float32 scales, got {nested_absmax.numel()} "
                             f"{nested_absmax.dtype}")
        torch._check(offset.dtype == torch.float32 and offset.numel() == 1,
                     lambda: f"offset must be one float32 value, got {offset.numel()} {offset.dtype}")
        tensors += [nested_code, nested_absmax, offset]
    else:
        torch._check(nested_absmax is None and offset is None,
                     lambda: "nested_absmax and offset are only for double quantization (pass nested_code)")
        torch._check(absmax.dtype == torch.float32, lambda: f"absmax must be float32, got {absmax.dtype}")
    torch._check(all(t.device == packed.device for t in tensors),
                 lambda: f"all tensors must be on {packed.device}, got {[str(t.device) for t in tensors]}")


def _body(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, nested_code: Optional[torch.Tensor],
          nested_absmax: Optional[torch.Tensor], offset: Optional[torch.Tensor], blocksize: int,
          nested_blocksize: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.ops.qlora_nb.dequantize_nf4_fused``: NF4 (or any 16-value 4-bit table) to ``dtype``.

    Args:
        packed: uint8, ``ceil(n / 2)`` bytes of any shape, two codes per byte, the first value in
            the high nibble (bitsandbytes' layout), ``n = prod(shape)``.
        absmax: one scale per block of ``blocksize`` values: float32, or with double quantization
            uint8 codes into ``nested_code``.
        code: the 16 float32 values the 4-bit codes index (``quant_state.code``).
        nested_code: None, or the 256 float32 values of the scales' 8-bit code book
            (``quant_state.state2.code``).
        nested_absmax: None, or one float32 scale per ``nested_blocksize`` block scales
            (``quant_state.state2.absmax``).
        offset: None, or the one float32 value added to every dequantized block scale
            (``quant_state.offset``).
        blocksize: values per block (a power of two; bitsandbytes uses 32 to 4096).
        nested_blocksize: block scales per second-level scale (bitsandbytes: 256); ignored
            without double quantization.
        shape: the result's shape.
        dtype: float32, float16 or bfloat16.

    Returns:
        A new contiguous tensor of ``shape`` and ``dtype`` on ``packed``'s device.
    """
    _check_args(packed, absmax, code, nested_code, nested_absmax, offset, blocksize, nested_blocksize, shape, dtype)
    if packed.device.type == "cuda" and HAS_TRITON and math.prod(shape) % 2 == 0:
        out = torch.empty(tuple(shape), dtype=dtype, device=packed.device)
        return launch(packed, absmax, code, nested_code, nested_absmax, offset, blocksize, nested_blocksize, out,
                      wrapped=True)
    return dequantize_reference(packed, absmax, code, nested_code, nested_absmax, offset, blocksize,
                                nested_blocksize, shape, dtype)


if HAS_TRITON:
    dequantize_nf4_fused = torch.library.triton_op(OP, _body, mutates_args=())
else:
    dequantize_nf4_fused = torch.library.custom_op(OP, _body, mutates_args=())

    @dequantize_nf4_fused.register_fake
    def _(packed, absmax, code, nested_code, nested_absmax, offset, blocksize, nested_blocksize, shape, dtype):
        _check_args(packed, absmax, code, nested_code, nested_absmax, offset, blocksize, nested_blocksize,
                    shape, dtype)
        return packed.new_empty(tuple(shape), dtype=dtype)


# ----------------------------------------------------------------------------- the wide op
#: The wide op's qualified name (``torch.ops.qlora_nb.dequantize_nf4_wide``).
WIDE_OP = "qlora_nb::dequantize_nf4_wide"


def _check_tail(shape, dtype, tail) -> None:
    torch._check(len(shape) == 2, lambda: f"a wide dequantize needs a 2-D weight, got shape {list(shape)}")
    torch._check(tail.dim() == 2 and tail.shape[0] == shape[0] and tail.dtype == dtype,
                 lambda: f"tail must be ({shape[0]}, t) {dtype}, got {tuple(tail.shape)} {tail.dtype}")


def _wide_body(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, nested_code: Optional[torch.Tensor],
               nested_absmax: Optional[torch.Tensor], offset: Optional[torch.Tensor], blocksize: int,
               nested_blocksize: int, shape: Sequence[int], dtype: torch.dtype, tail: torch.Tensor) -> torch.Tensor:
    """``torch.ops.qlora_nb.dequantize_nf4_wide``: ``[W | tail]``, the weight and ``tail`` side by side.

    The weight is written straight into the first columns of the wide buffer (one kernel, which
    also copies ``tail``'s rows): no dequantized copy of ``W`` exists. A LoRA group multiplies
    ``[x | s * x @ A^T]`` by it (:mod:`qlora_nb_utils.ops.lora_update`), base and update in one GEMM.

    Args: as :func:`dequantize_nf4_fused`, ``shape`` 2-D ``(out, k)``, and ``tail`` ``(out, t)`` of ``dtype``.

    Returns:
        A new contiguous ``(out, k + t)`` tensor.
    """
    _check_args(packed, absmax, code, nested_code, nested_absmax, offset, blocksize, nested_blocksize, shape, dtype)
    _check_tail(shape, dtype, tail)
    rows, k = shape
    elems = min(ELEMS_PER_PROGRAM, k & -k)  # a program's values: a power of two that divides a row
    if packed.device.type == "cuda" and HAS_TRITON and elems >= max(blocksize, 2) and tail.shape[1] % 2 == 0:
        out = torch.empty((rows, k + tail.shape[1]), dtype=dtype, device=packed.device)
        return launch(packed, absmax, code, nested_code, nested_absmax, offset, blocksize, nested_blocksize, out,
                      elems=elems, wrapped=True, tail=tail.contiguous())
    weight = dequantize_reference(packed, absmax, code, nested_code, nested_absmax, offset, blocksize,
                                  nested_blocksize, shape, dtype)
    return torch.cat([weight, tail], dim=1)


if HAS_TRITON:
    dequantize_nf4_wide = torch.library.triton_op(WIDE_OP, _wide_body, mutates_args=())
else:
    dequantize_nf4_wide = torch.library.custom_op(WIDE_OP, _wide_body, mutates_args=())

    @dequantize_nf4_wide.register_fake
    def _(packed, absmax, code, nested_code, nested_absmax, offset, blocksize, nested_blocksize, shape, dtype, tail):
        _check_args(packed, absmax, code, nested_code, nested_absmax, offset, blocksize, nested_blocksize,
                    shape, dtype)
        _check_tail(shape, dtype, tail)
        return packed.new_empty((shape[0], shape[1] + tail.shape[1]), dtype=dtype)


def dequantize_wide(*args: Any) -> torch.Tensor:
    """:data:`WIDE_OP` where a compiler traces, its body straight away in eager code (as :func:`dequantize`).

    Args: the ten of :data:`OP`, then ``tail``.
    """
    if torch.compiler.is_compiling():
        return torch.ops.qlora_nb.dequantize_nf4_wide(*args)
    return _wide_body(*args)


# ----------------------------------------------------------------------------- bitsandbytes' QuantState
def op_args(packed: torch.Tensor, quant_state: Any, dtype: torch.dtype | None = None) -> tuple:
    """The op's arguments for a bitsandbytes weight: ``op(*op_args(weight, weight.quant_state))``.

    Args:
        packed: the packed uint8 weight (``Params4bit`` data, any shape).
        quant_state: its bitsandbytes ``QuantState`` (plain or nested).
        dtype: the result's dtype; None for ``quant_state.dtype``.

    Returns:
        The ten positional arguments of :data:`OP`.
    """
    qs = quant_state
    if qs.nested:
        s2 = qs.state2
        return (packed, qs.absmax, qs.code, s2.code, s2.absmax, qs.offset, qs.blocksize, s2.blocksize,
                list(qs.shape), dtype or qs.dtype)
    return (packed, qs.absmax, qs.code, None, None, None, qs.blocksize, 0, list(qs.shape), dtype or qs.dtype)


def dequantize(*args: Any) -> torch.Tensor:
    """The op where a compiler traces (one node in its graph), its body straight away in eager code.

    An eager call of the op goes through the dispatcher, whose cost exceeds the bare kernel
    launch on a weight such as 4096 x 4096 and is pure overhead when nothing traces. Same
    arguments as :data:`OP`.
    """
    if torch.compiler.is_compiling():
        return torch.ops.qlora_nb.dequantize_nf4_fused(*args)
    return _body(*args)


def dequantize_state(packed: torch.Tensor, quant_state: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize a bitsandbytes NF4 weight with the op (what the patch routes to); see :func:`dequantize`."""
    return dequantize(*op_args(packed, quant_state, dtype))
