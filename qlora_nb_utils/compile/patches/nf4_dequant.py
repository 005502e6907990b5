"""Route bitsandbytes' NF4 dequantize, forward and backward, through the one-pass op.

Not a graph-break workaround: a speed patch. bitsandbytes 0.50's ``Linear4bit.forward`` calls
``bnb.matmul_4bit``, which in training (the input requires grad) applies ``MatMul4Bit``:

* its forward calls the opaque op ``bitsandbytes::gemm_4bit``; on CUDA, past 1536 rows
  (``backends/cuda/ops.py``, ``_gemm_4bit_custom_max_m``), that op dequantizes the whole weight
  in two kernels (the double-quantized block scales to a float32 scratch tensor, then the NF4
  codes) and calls ``F.linear``; below it, by a heuristic of its own on the device, the weight's
  shape and the row count, either that or a fused 4-bit GEMM that never materialises the weight;
* its backward calls ``bitsandbytes.functional.dequantize_4bit`` (the same two kernels, traced
  by Dynamo as ``dequantize_blockwise`` + add + ``dequantize_4bit``) and a matmul.

:func:`apply` replaces two module attributes, nothing else: ``bitsandbytes.matmul_4bit`` (what
``Linear4bit.forward`` looks up at each call) and ``bitsandbytes.functional.dequantize_4bit``
(what ``MatMul4Bit.backward``, PEFT's merge and everyone else call). Each replacement handles
what :func:`routable` accepts and hands anything else, untouched, to the function it replaced:
FP4, an ``out=`` tensor, a weight quantized in the deprecated [K, N] orientation, a CPU
inference-packed weight, other dtypes or devices, an empty input, and (on CUDA) a forward of at
most ``forward_min_rows`` rows, which bitsandbytes handles its own way (its fused kernel where its
heuristic takes one). A routed ``matmul_4bit`` is an autograd function of ours (:class:`NF4Linear`) whose
forward is ``F.linear(x, op(W))`` and whose backward dequantizes again
(``grad @ op(W)``): the dequantized weight is never saved for the backward, as with
bitsandbytes. The op is ``torch.ops.qlora_nb.dequantize_nf4_fused``
(:mod:`qlora_nb_utils.ops.nf4_triton`): one Triton kernel on CUDA, its pure-torch body elsewhere.
Its values equal ``dequantize_4bit``'s bit for bit (tests here, and on CUDA).

Apply it before compiling: Dynamo reads ``bnb.matmul_4bit`` while tracing, and guards on it.
The patch is process-wide (module attributes), so ``model`` is accepted for the common
signature and ignored. Nothing happens at import; ``undo()`` restores the two original
function objects.

Smallest check (``tests/test_nf4_triton.py``)::

    with nf4_dequant.patched():
        loss = torch.compile(step, fullgraph=True)(batch)   # 0 breaks; loss, LoRA grads as unpatched
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ...reversible import PatchHandle, check_signature, check_versions, set_attribute

__all__ = ["VERIFIED_ON", "SUPPORTED", "NF4Linear", "apply", "patched", "routable", "holds_nf4", "make_lora_route", "own_rows",
           "as_bytes"]

NAME = "nf4_dequant"

#: Versions this patch was verified on (CPU: tests here; CUDA: the repository's GPU runs of it).
VERIFIED_ON = {"torch": "2.13.0 (cpu), 2.11.0+cu130 (cuda)", "bitsandbytes": "0.50.2", "triton": "3.6.0"}

#: Versions the patch accepts; outside them it refuses.
SUPPORTED = {"bitsandbytes": ">=0.50,<0.51", "torch": ">=2.6"}

_MATMUL_PARAMS = ["A", "B", "quant_state", "out", "bias"]
_DEQUANT_PARAMS = ["A", "quant_state", "absmax", "out", "blocksize", "quant_type"]
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BNB_CUDA_MAX_M = 1536  # bitsandbytes 0.50.2's own threshold, used when it cannot be read


def _op() -> Any:
    from ...ops import nf4_triton

    return nf4_triton


def routable(packed: torch.Tensor, quant_state: Any, cuda: bool | None = None) -> bool:
    """Whether the op computes this weight's dequantize exactly as bitsandbytes would.

    Args:
        packed: the packed uint8 weight.
        quant_state: its bitsandbytes ``QuantState`` (anything else: False).
        cuda: whether CUDA tensors may be routed; None: whether Triton is importable.

    Returns:
        True for an NF4 weight of a float dtype, packed in bitsandbytes' training layout, whose
        tensors share its device, on a CPU or (with Triton) a CUDA device.
    """
    qs = quant_state
    if qs is None or getattr(qs, "quant_type", None) != "nf4" or getattr(qs, "dtype", None) not in _DTYPES:
        return False
    if getattr(qs, "packing_format_for_cpu", False):
        return False
    if packed.dtype != torch.uint8:  # a floating quant storage (FSDP2's float32 words): its bytes
        if packed.dtype not in _DTYPES or not packed.is_contiguous():
            return False
        packed = as_bytes(packed)
    if packed.device.type == "cuda":
        if not (_op().HAS_TRITON if cuda is None else cuda):
            return False
    elif packed.device.type != "cpu":
        return False
    if packed.dim() == 2 and packed.shape[0] == 1 and packed.numel() > 1:
        return False  # the transposed [1, n] form: bitsandbytes hands its result back transposed
    if packed.numel() != (math.prod(qs.shape) + 1) // 2 or qs.code.device != packed.device:
        return False
    if getattr(qs, "nested", False):
        s2 = qs.state2
        return (s2 is not None and torch.is_tensor(qs.offset) and s2.code.device == packed.device
                and qs.absmax.dtype == torch.uint8)
    return qs.absmax.dtype == torch.float32


class NF4Linear(torch.autograd.Function):
    """``F.linear(x, dequantize(W), bias)`` that dequantizes W again in the backward (never saves it).

    Inputs: ``x``, the packed weight, ``bias`` (or None), then the op's tensors (``absmax``,
    ``code``, ``nested_code``, ``nested_absmax``, ``offset``) and its constants (``blocksize``,
    ``nested_blocksize``, ``shape``) and the quant state's dtype (the backward dequantizes in it
    and casts, as ``MatMul4Bit.backward`` does).
    """

    @staticmethod
    def forward(ctx, x, packed, bias, absmax, code, nested_code, nested_absmax, offset, blocksize,
                nested_blocksize, shape, state_dtype):
        weight = _op().dequantize(packed, absmax, code, nested_code, nested_absmax, offset, blocksize,
                                  nested_blocksize, shape, x.dtype)
        ctx.save_for_backward(packed, absmax, code, nested_code, nested_absmax, offset)
        ctx.constants = (blocksize, nested_blocksize, shape, state_dtype)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            blocksize, nested_blocksize, shape, state_dtype = ctx.constants
            weight = _op().dequantize(*ctx.saved_tensors, blocksize, nested_blocksize, shape, state_dtype)
            grad_x = torch.matmul(grad, weight.to(grad.dtype))
        if ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return (grad_x, None, grad_bias) + (None,) * 9


def own_rows(device_type: str) -> int:
    """The rows a call must exceed to take this patch's route by default on ``device_type``:
    bitsandbytes' own threshold on CUDA (:func:`_cuda_rows`), 0 elsewhere."""
    return _cuda_rows() if device_type == "cuda" else 0


def _cuda_rows() -> int:
    """bitsandbytes' own CUDA threshold: past it ``gemm_4bit`` always dequantizes; below it, its heuristic
    chooses between that and a fused 4-bit GEMM."""
    try:
        from bitsandbytes.backends.cuda import ops as cuda_ops
    except Exception:  # no CUDA build here: the value only matters on CUDA
        return _BNB_CUDA_MAX_M
    return int(getattr(cuda_ops, "_gemm_4bit_custom_max_m", _BNB_CUDA_MAX_M))


def _make_matmul(original, op: Any, cuda_rows: int, cpu_rows: int):
    # Everything the traced body reads is resolved here, at apply time (no import while tracing).
    def matmul_4bit(A, B, quant_state, out=None, bias=None):
        qs = quant_state
        if (out is None and routable(B, qs, op.HAS_TRITON) and len(qs.shape) == 2 and A.dim() >= 1
                and A.numel() > 0 and A.shape[-1] == qs.shape[1] and A.dtype in _DTYPES and A.device == B.device
                and A.numel() // A.shape[-1] > (cuda_rows if A.device.type == "cuda" else cpu_rows)):
            args = op.op_args(as_bytes(B), qs)
            return NF4Linear.apply(A, args[0], bias, *args[1:9], qs.dtype)
        return original(A, B, quant_state, out, bias)

    matmul_4bit.__doc__ = f"bitsandbytes' matmul_4bit, NF4 through the one-pass op (patch {NAME!r})."
    return matmul_4bit


def as_bytes(packed: torch.Tensor) -> torch.Tensor:
    """The packed words as the uint8 bytes the op reads: a view, no copy.

    ``bnb_4bit_quant_storage`` may be a float dtype (FSDP2 shards float32 words, see
    ``qlora_nb_utils.distributed.packed_words``); the bytes are the same codes in every storage.
    """
    return packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)


def holds_nf4(layer: Any) -> bool:
    """Whether ``layer``'s weight carries an NF4 quant state (without importing bitsandbytes)."""
    return getattr(getattr(getattr(layer, "weight", None), "quant_state", None), "quant_type", None) == "nf4"


def make_lora_route(min_rows: dict[str, int]):
    """A ``route(layer, x)`` for :mod:`.lora_addmm`: the op's arguments for ``layer``'s weight when
    ``layer`` (a bitsandbytes ``Linear4bit``) would send ``x`` down this patch's NF4 route with nothing
    else to do, else None.

    "Nothing else": an NF4 weight :func:`routable` accepts, no bias, ``x`` already in the weight's
    dtype and the layer's compute dtype, on the weight's device, gradients on, and more than
    ``min_rows[device type]`` rows (the ``forward_min_rows`` of :func:`apply`'s details: below it
    bitsandbytes chooses its own kernels). Everything it reads is resolved here, not while tracing.
    """
    from bitsandbytes.nn import Linear4bit

    op = _op()

    def route(layer: Any, x: torch.Tensor) -> tuple | None:
        if type(layer) is not Linear4bit or layer.bias is not None or not torch.is_grad_enabled():
            return None
        weight = layer.weight
        qs = getattr(weight, "quant_state", None)
        if qs is None or not routable(weight, qs, op.HAS_TRITON) or len(qs.shape) != 2:
            return None
        if x.dtype != qs.dtype or layer.compute_dtype not in (None, x.dtype) or x.device != weight.device:
            return None
        if x.dim() < 2 or x.shape[-1] != qs.shape[1] or x.numel() // x.shape[-1] <= min_rows.get(x.device.type, 0):
            return None
        return op.op_args(as_bytes(weight), qs, x.dtype)

    return route


def _make_dequantize(original, op: Any):
    def dequantize_4bit(A, quant_state=None, absmax=None, out=None, blocksize=None, quant_type="fp4"):
        if out is None and quant_state is not None and routable(A, quant_state, op.HAS_TRITON):
            return op.dequantize_state(as_bytes(A), quant_state)
        return original(A, quant_state, absmax, out, blocksize, quant_type)

    dequantize_4bit.__doc__ = f"bitsandbytes' dequantize_4bit, NF4 through the one-pass op (patch {NAME!r})."
    return dequantize_4bit


def _check_target() -> None:
    check_versions(NAME, SUPPORTED, VERIFIED_ON)
    import bitsandbytes
    import bitsandbytes.functional as bnbF
    from bitsandbytes.autograd._functions import MatMul4Bit
    from bitsandbytes.nn.modules import Linear4bit

    check_signature(NAME, bitsandbytes.matmul_4bit, _MATMUL_PARAMS)
    check_signature(NAME, bnbF.dequantize_4bit, _DEQUANT_PARAMS)
    if "matmul_4bit" not in Linear4bit.forward.__code__.co_names:
        raise RuntimeError(f"patch {NAME!r}: Linear4bit.forward no longer calls bnb.matmul_4bit; the upstream "
                           "target changed, so the patch refuses to apply")
    if "dequantize_4bit" not in MatMul4Bit.backward.__code__.co_names:
        raise RuntimeError(f"patch {NAME!r}: MatMul4Bit.backward no longer calls F.dequantize_4bit; the upstream "
                           "target changed, so the patch refuses to apply")


def apply(model: torch.nn.Module | None = None, *, forward: bool = True,
          forward_min_rows: Optional[int] = None) -> PatchHandle:
    """Send bitsandbytes' NF4 dequantizes (module docstring) to ``qlora_nb::dequantize_nf4_fused``.

    Args:
        model: Ignored (the patch is process-wide); accepted for the patches' common signature.
        forward: Also replace ``bitsandbytes.matmul_4bit`` (the forward's dequantize); False
            routes only ``dequantize_4bit`` (the backward's).
        forward_min_rows: Route a forward only past this many input rows. None: bitsandbytes'
            own threshold on CUDA (1536 in 0.50.2; below it bitsandbytes chooses), 0 on CPU.

    Returns:
        A :class:`PatchHandle`; ``details`` says what was replaced and whether CUDA tensors are
        routed (``cuda``: Triton importable).

    Raises:
        RuntimeError: Unsupported versions, or a target's signature or calls changed.
    """
    _check_target()
    import bitsandbytes
    import bitsandbytes.functional as bnbF

    op = _op()
    rows = (own_rows("cuda"), own_rows("cpu")) if forward_min_rows is None else (forward_min_rows, forward_min_rows)
    handle = PatchHandle(NAME, {"forward": forward, "backward": True, "cuda": op.HAS_TRITON,
                                "forward_min_rows": {"cuda": rows[0], "cpu": rows[1]}})
    set_attribute(handle, bnbF, "dequantize_4bit", _make_dequantize(bnbF.dequantize_4bit, op))
    if forward:
        set_attribute(handle, bitsandbytes, "matmul_4bit", _make_matmul(bitsandbytes.matmul_4bit, op, *rows))
    return handle


def patched(model: torch.nn.Module | None = None, **kwargs: Any) -> PatchHandle:
    """``with patched(): ...`` applies the patch and undoes it on exit (even on error)."""
    return apply(model, **kwargs)
