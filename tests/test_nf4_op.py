"""Tests for qlora_nb_utils.ops.nf4: the op's registration, its values, and compiling through it.

``torch.library.opcheck`` checks the schema, the fake kernel against the real one, and tracing
through AOTAutograd. The values are checked twice, independently: against bitsandbytes' own
``dequantize_4bit`` (plain and double-quantized scales) and against the NF4 rounding bound
(a dequantized value lies within half the widest gap of the NF4 table, times its block's
absmax, of the original). Compiling a function that calls the op must give one graph.
"""

import pytest
import torch

from qlora_nb_utils.diagnostics import CompileCounter, check_fullgraph, graph_breaks
from qlora_nb_utils.ops import nf4 as nf4_op

bnbF = pytest.importorskip("bitsandbytes.functional")

OP = torch.ops.qlora_nb.dequantize_nf4
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
#: Half the widest gap between neighbouring NF4 values: the worst rounding error per unit absmax.
HALF_GAP = max(b - a for a, b in zip(nf4_op.NF4_CODE, nf4_op.NF4_CODE[1:])) / 2


def quantize(shape, blocksize=64, nested=False, dtype=torch.float32, device="cpu", seed=0):
    """A random weight, NF4-quantized by bitsandbytes: (weight, packed, quant_state)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    packed, state = bnbF.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4",
                                       compress_statistics=nested)
    return weight, packed, state


def op_args(packed, state):
    return (packed, nf4_op.absmax_of(state), state.blocksize, list(state.shape), state.dtype)


# ----------------------------------------------------------------------------- registration
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,blocksize", [((64, 64), 64), ((32, 128), 128), ((7, 9), 64), ((300,), 64)])
def test_opcheck(device, shape, blocksize):
    _, packed, state = quantize(shape, blocksize, device=device)
    torch.library.opcheck(OP.default, op_args(packed, state))


def test_op_is_registered_with_a_schema():
    schema = str(OP.default._schema)
    assert schema.startswith("qlora_nb::dequantize_nf4(Tensor packed, Tensor absmax")
    assert schema.endswith("-> Tensor")


def test_fake_kernel_gives_shape_and_dtype_without_computing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        packed = torch.empty(96 * 64 // 2, 1, dtype=torch.uint8)
        absmax = torch.empty(96, dtype=torch.float32)
        out = OP(packed, absmax, 64, [96, 64], torch.bfloat16)
    assert out.shape == (96, 64) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("bad,match", [
    ({"absmax": torch.ones(3)}, "absmax holds 3 scales"),
    ({"packed": torch.zeros(10, dtype=torch.uint8)}, "packed holds 10 bytes"),
    ({"packed": torch.zeros(2048, 1, dtype=torch.int8)}, "packed must be uint8"),
    ({"absmax": torch.ones(64, dtype=torch.float16)}, "absmax must be float32"),
    ({"dtype": torch.int32}, "dtype must be one of"),
])
def test_bad_inputs_are_rejected_by_real_and_fake_kernels(bad, match):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = {"packed": torch.zeros(2048, 1, dtype=torch.uint8), "absmax": torch.ones(64),
            "blocksize": 64, "shape": [64, 64], "dtype": torch.float32}
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        OP(**args)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError, match=match):
        OP(**args)


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "double-quant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,blocksize", [((64, 64), 64), ((256, 128), 64), ((96, 256), 128),
                                             ((48, 512), 256), ((7, 9), 64), ((1000,), 64)])
def test_equals_bitsandbytes(device, nested, dtype, shape, blocksize):
    _, packed, state = quantize(shape, blocksize, nested=nested, dtype=dtype, device=device)
    ours = OP(*op_args(packed, state))
    theirs = bnbF.dequantize_4bit(packed, state)
    assert ours.dtype == theirs.dtype == dtype
    # The CPU kernels round code * absmax (float32) to dtype once, as we do: bit-equal. The CUDA
    # kernel should too, but it is only held to the dtype's default tolerance here.
    exact = {"rtol": 0, "atol": 0} if device == "cpu" else {}
    torch.testing.assert_close(ours, theirs.reshape(ours.shape), **exact)  # CPU: 1-D comes back (1, n), bnb#2047


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,blocksize", [((64, 32), 64), ((64, 96), 64), ((8, 64), 128), ((7, 9), 64),
                                             ((33, 17), 64), ((256, 64), 64)])
def test_round_trip_within_nf4_rounding(device, shape, blocksize):
    weight, packed, state = quantize(shape, blocksize, device=device)
    ours = OP(*op_args(packed, state))
    scale = nf4_op.absmax_of(state).repeat_interleave(blocksize)[: weight.numel()].reshape(shape)
    assert ((ours - weight).abs() <= HALF_GAP * scale + 1e-6).all()


def test_bitsandbytes_cpu_kernel_when_blocks_span_rows():
    """A row length that is not a multiple of the block size: blocks span rows.

    bitsandbytes' native CPU dequantize_4bit kernel gave such blocks the wrong scale on one
    machine (an AVX2 CPU, bitsandbytes 0.50.2) and the right one on others, so the outcome depends
    on the machine: its own torch fallback, and this op, must always be right; where the native
    kernel is not, the test records it as an expected failure with the size of the error.
    """
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    weight, packed, state = quantize((64, 96), 64)
    scale = state.absmax.repeat_interleave(64)[: weight.numel()].reshape(weight.shape)
    fallback = _dequantize_4bit_compute(packed.view(torch.uint8).reshape(-1), state.absmax,
                                        _get_4bit_code("nf4", packed.device), 64, state.shape, state.dtype)
    assert ((fallback.reshape(weight.shape) - weight).abs() <= HALF_GAP * scale + 1e-6).all()
    torch.testing.assert_close(OP(*op_args(packed, state)), fallback.reshape(weight.shape), rtol=0, atol=0)
    theirs = bnbF.dequantize_4bit(packed, state)
    wrong = (theirs - weight).abs() > HALF_GAP * scale + 1e-6
    if wrong.any():
        pytest.xfail(f"bitsandbytes' CPU kernel on this machine ({torch.backends.cpu.get_cpu_capability()}): "
                     f"{int(wrong.sum())} of {wrong.numel()} values off the NF4 grid of their block")


# ----------------------------------------------------------------------------- compile
def nf4_linear(x, packed, absmax, blocksize, shape):
    weight = OP(packed, absmax, blocksize, shape, x.dtype)
    return torch.nn.functional.silu(torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_fullgraph_compile_matches_eager(device, backend):
    _, packed, state = quantize((128, 64), 64, nested=True, device=device)
    args = op_args(packed, state)[:4]
    x = torch.randn(4, 64, device=device, requires_grad=True)
    out_eager = nf4_linear(x, *args)
    (grad_eager,) = torch.autograd.grad(out_eager.sum(), x)
    counter = CompileCounter(backend=backend)
    compiled = counter.compile(nf4_linear, fullgraph=True)
    out = compiled(x, *args)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert counter.compilations == 1
    torch.testing.assert_close(out, out_eager)
    torch.testing.assert_close(grad, grad_eager)


def test_no_graph_break_where_an_opaque_call_breaks():
    import ctypes

    def opaque(packed, absmax, blocksize, shape, dtype):
        host = packed.contiguous().cpu()
        raw = ctypes.string_at(host.data_ptr(), host.numel())
        codes = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return nf4_op.dequantize_nf4_reference(codes, absmax, blocksize, shape, dtype)

    def opaque_linear(x, packed, absmax, blocksize, shape):
        return torch.nn.functional.linear(x, opaque(packed, absmax, blocksize, shape, x.dtype))

    _, packed, state = quantize((64, 64), 64)
    args = (torch.randn(2, 64), *op_args(packed, state)[:4])
    assert graph_breaks(opaque_linear, *args).graph_break_count > 0
    assert not check_fullgraph(opaque_linear, *args).ok
    report = graph_breaks(nf4_linear, *args)
    assert report.graph_break_count == 0 and report.graph_count == 1
    assert check_fullgraph(nf4_linear, *args).ok


def test_dynamic_batch_compiles_once():
    _, packed, state = quantize((64, 64), 64)
    args = op_args(packed, state)[:4]
    counter = CompileCounter(backend="aot_eager")
    compiled = counter.compile(nf4_linear, fullgraph=True, dynamic=True)
    for rows in (2, 3, 5):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x, *args), nf4_linear(x, *args))
    assert counter.compilations == 1
