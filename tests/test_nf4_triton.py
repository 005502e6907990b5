"""Tests for the one-pass NF4 op (ops.nf4_triton) and the patch that routes bitsandbytes to it.

The op: ``opcheck`` (schema, fake kernel, AOT tracing), bit-equality with bitsandbytes'
``dequantize_4bit`` on CPU (plain and double-quantized scales, several shapes and block sizes,
three dtypes), bad inputs refused, and, where Triton is importable, the Triton kernel itself run
by Triton's interpreter on the CPU (a subprocess: the interpreter is chosen at import). The patch:
on the tiny NF4 + LoRA model it routes every Linear4bit's forward and backward dequantize to the
op, leaves loss and LoRA gradients equal to bitsandbytes' own, compiles with ``fullgraph=True`` in
one compilation with no bitsandbytes dequantize left in the graphs, hands what it does not
handle back to bitsandbytes, refuses other bitsandbytes versions, and undoes exactly.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qlora_nb_utils.compile.patches import nf4_dequant
from qlora_nb_utils.diagnostics import CompileCounter
from qlora_nb_utils.ops import nf4_triton

bnb = pytest.importorskip("bitsandbytes")
bnbF = pytest.importorskip("bitsandbytes.functional")

OP = torch.ops.qlora_nb.dequantize_nf4_fused
OP_NAME = "qlora_nb.dequantize_nf4_fused.default"
SHAPES = [((64, 64), 64), ((256, 128), 64), ((96, 256), 128), ((48, 512), 256), ((64, 64), 32),
          ((8, 4096), 4096), ((7, 9), 64), ((1000,), 64)]


def quantize(shape, blocksize=64, nested=False, dtype=torch.float32, device="cpu", quant_type="nf4", seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return bnbF.quantize_4bit(weight, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)


class OpCounter(TorchDispatchMode):
    """Counts our dequantizes (eager code calls the op's body, not the op: ``nf4_triton.dequantize``)
    and bitsandbytes' dequantize ops (dispatched)."""

    def __init__(self):
        super().__init__()
        self.ours = self.theirs = 0
        self._original = nf4_triton.dequantize

    def _ours(self, *args):
        self.ours += 1
        return self._original(*args)

    def __enter__(self):
        nf4_triton.dequantize = self._ours
        return super().__enter__()

    def __exit__(self, *exc):
        nf4_triton.dequantize = self._original
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ours += name.startswith("qlora_nb.dequantize_nf4_fused")
        self.theirs += name.startswith(("bitsandbytes.dequantize_4bit", "bitsandbytes.gemm_4bit"))
        return func(*args, **(kwargs or {}))


class Dispatched(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_dispatcher_and_traced_calls_keep_the_op():
    packed, state = quantize((64, 64), nested=True)
    args = nf4_triton.op_args(packed, state)
    with Dispatched() as seen:
        eager = nf4_triton.dequantize(*args)
    assert seen.names and OP_NAME not in seen.names  # the body's ops ran, the op was not dispatched
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm

    traced = torch.compile(lambda p: nf4_triton.dequantize(p, *args[1:]), backend=keep, fullgraph=True)(packed)
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert len(calls) == 1 and calls[0].startswith("qlora_nb.dequantize_nf4_fused")
    torch.testing.assert_close(traced, eager, rtol=0, atol=0)


# ----------------------------------------------------------------------------- the op
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "double-quant"])
@pytest.mark.parametrize("shape,blocksize", [((64, 64), 64), ((7, 9), 64), ((96, 256), 128)])
def test_opcheck(nested, shape, blocksize):
    packed, state = quantize(shape, blocksize, nested=nested)
    torch.library.opcheck(OP.default, nf4_triton.op_args(packed, state, torch.bfloat16))


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "double-quant"])
def test_wide_op_is_the_weight_then_the_tail_and_passes_opcheck(nested):
    """dequantize_nf4_wide: [W | tail] in one buffer (the LoRA group's [W_i | B_i]); bad tails refused."""
    packed, state = quantize((48, 64), 64, nested=nested)
    args = nf4_triton.op_args(packed, state, torch.bfloat16)
    tail = torch.randn(48, 6).to(torch.bfloat16)
    wide = nf4_triton.dequantize_wide(*args, tail)
    assert wide.shape == (48, 70) and wide.is_contiguous()
    assert torch.equal(wide[:, :64], nf4_triton.dequantize(*args)) and torch.equal(wide[:, 64:], tail)
    torch.library.opcheck(torch.ops.qlora_nb.dequantize_nf4_wide.default, (*args, tail))
    for bad, match in ((tail[:5], "tail must be"), (tail.float(), "tail must be")):
        with pytest.raises(RuntimeError, match=match):
            nf4_triton.dequantize_wide(*args, bad)


def test_schema():
    schema = str(OP.default._schema)
    assert schema.startswith("qlora_nb::dequantize_nf4_fused(Tensor packed, Tensor absmax, Tensor code, "
                             "Tensor? nested_code, Tensor? nested_absmax, Tensor? offset")
    assert schema.endswith("-> Tensor")


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "double-quant"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,blocksize", SHAPES)
def test_equals_bitsandbytes_bitwise(nested, dtype, shape, blocksize):
    packed, state = quantize(shape, blocksize, nested=nested, dtype=dtype)
    ours = nf4_triton.dequantize_state(packed, state)
    theirs = bnbF.dequantize_4bit(packed, state)
    assert ours.dtype == theirs.dtype == dtype and ours.shape == shape
    torch.testing.assert_close(ours, theirs.reshape(shape), rtol=0, atol=0)  # 1-D comes back (1, n), bnb#2047


@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, 1: a[1].float()}, "nested absmax must be uint8"),
    (lambda a: {**a, 2: a[2][:8]}, "code must be the 16 float32 values"),
    (lambda a: {**a, 4: a[4][:0]}, "nested_absmax must hold 1 float32"),
    (lambda a: {**a, 0: a[0][:-1]}, "packed holds"),
    (lambda a: {**a, 6: 48}, "blocksize must be a power of two"),
    (lambda a: {**a, 3: None}, "only for double quantization"),
])
def test_bad_inputs_are_refused(change, match):
    packed, state = quantize((64, 64), 64, nested=True)
    args = dict(enumerate(nf4_triton.op_args(packed.reshape(-1), state)))
    with pytest.raises(RuntimeError, match=match):
        OP(*change(args).values())


def test_triton_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch, bitsandbytes.functional as F
        from qlora_nb_utils.ops import nf4_triton as m
        for nested in (False, True):
            for shape, bs in [((64, 64), 64), ((7, 10), 64), ((96, 256), 128), ((8, 4096), 4096), ((1000,), 64)]:
                for dtype in (torch.float32, torch.float16):
                    p, st = F.quantize_4bit(torch.randn(shape).to(dtype), blocksize=bs, quant_type="nf4",
                                            compress_statistics=nested)
                    out = torch.empty(shape, dtype=dtype)
                    m.launch(*m.op_args(p, st)[:8], out, elems=1024)
                    assert torch.equal(out, F.dequantize_4bit(p, st).reshape(shape)), (nested, shape, dtype)
            # the wide output: each weight row in a wider buffer, followed by its row of the tail
            for rows, k, t, elems in [(6, 128, 32, 128), (5, 256, 48, 128), (2, 4096, 32, 4096)]:
                for dtype in (torch.float32, torch.float16):
                    p, st = F.quantize_4bit(torch.randn(rows, k).to(dtype), blocksize=64, quant_type="nf4",
                                            compress_statistics=nested)
                    tail = torch.randn(rows, t).to(dtype)
                    out = torch.full((rows, k + t), float("nan"), dtype=dtype)
                    m.launch(*m.op_args(p, st)[:8], out, elems=elems, tail=tail)
                    want = torch.cat([F.dequantize_4bit(p, st).reshape(rows, k), tail], 1)
                    assert torch.equal(out, want), ("wide", nested, rows, k, t, dtype)
        print("kernel ok")
    """)
    # bfloat16 is left out: the interpreter truncates to bfloat16 where the GPU rounds to nearest
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "kernel ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "double-quant"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_equals_bitsandbytes_bitwise(nested, dtype):
    for shape, blocksize in [((1024, 4096), 64), ((7, 9), 64), ((96, 256), 128)]:
        packed, state = quantize(shape, blocksize, nested=nested, dtype=dtype, device="cuda")
        ours = nf4_triton.dequantize_state(packed, state)
        torch.testing.assert_close(ours, bnbF.dequantize_4bit(packed, state).reshape(shape), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "double-quant"])
def test_cuda_wide_kernel_is_bitsandbytes_then_the_tail(nested):
    for (rows, k), t in [((1024, 4096), 32), ((96, 2048), 48), ((64, 256), 16)]:
        packed, state = quantize((rows, k), 64, nested=nested, dtype=torch.bfloat16, device="cuda")
        tail = torch.randn(rows, t, device="cuda").to(torch.bfloat16)
        wide = nf4_triton.dequantize_wide(*nf4_triton.op_args(packed, state), tail)
        want = torch.cat([bnbF.dequantize_4bit(packed, state).reshape(rows, k), tail], 1)
        torch.testing.assert_close(wide, want, rtol=0, atol=0)


# ----------------------------------------------------------------------------- the patch
@pytest.fixture(scope="module")
def model(tiny):
    model, _ = tiny
    return model.train()


def _batch():
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def _loss_and_grads(model, forward):
    model.zero_grad(set_to_none=True)
    loss = forward(**_batch()).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _layers(model):
    return [m for m in model.modules() if type(m).__module__.startswith("bitsandbytes")]


def test_patch_routes_forward_and_backward_and_keeps_loss_and_grads(model):
    ref_loss, ref_grads = _loss_and_grads(model, model)
    originals = (bnb.matmul_4bit, bnbF.dequantize_4bit)
    with nf4_dequant.patched() as handle, OpCounter() as count:
        assert (bnb.matmul_4bit, bnbF.dequantize_4bit) != originals
        loss, grads = _loss_and_grads(model, model)
    assert handle.details["forward"] and not handle.active
    # a forward each, and a backward each except layer 0's q, k, v (their input, the frozen
    # embedding's output, needs no gradient)
    assert count.ours == 2 * len(_layers(model)) - 3 and count.theirs == 0
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    assert (bnb.matmul_4bit, bnbF.dequantize_4bit) == originals
    assert bnb.matmul_4bit is originals[0] and bnbF.dequantize_4bit is originals[1]
    handle.undo()  # twice is a no-op
    assert bnb.matmul_4bit is originals[0]


def test_compiled_fullgraph_under_the_patch(model):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    ref_loss, ref_grads = _loss_and_grads(model, model)
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    targets = lambda: {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}  # noqa: E731
    with nf4_dequant.patched():
        counter = CompileCounter(backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
        compiled = counter.compile(lambda **b: model(**b), fullgraph=True)  # a graph break raises
        loss, grads = _loss_and_grads(model, compiled)
        assert counter.compilations == 1 and len(graphs) == 2  # forward and backward
    assert not any("bitsandbytes" in t for t in targets())
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # without the patch the same step has bitsandbytes' ops in its graphs (the check can fail)
    torch.compiler.reset()
    graphs.clear()
    counter = CompileCounter(backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    _loss_and_grads(model, counter.compile(lambda **b: model(**b), fullgraph=True))
    assert any("bitsandbytes" in t for t in targets())


def test_what_it_does_not_handle_goes_to_bitsandbytes(monkeypatch):
    original = bnbF.dequantize_4bit
    x = torch.randn(4, 64)
    with nf4_dequant.patched() as handle:
        assert handle.details["forward_min_rows"] == {"cuda": 1536, "cpu": 0}
        packed, state = quantize((64, 64), quant_type="fp4")
        assert not nf4_dequant.routable(packed, state) and nf4_dequant.routable(*quantize((64, 64)))
        with OpCounter() as count:
            got = bnbF.dequantize_4bit(packed, state)
            bnb.matmul_4bit(x, packed, state)
        assert count.ours == 0 and count.theirs == 2
        assert torch.equal(got, original(packed, state))
    calls = []

    def stub(A, quant_state=None, absmax=None, out=None, blocksize=None, quant_type="fp4"):
        calls.append(out)

    monkeypatch.setattr(bnbF, "dequantize_4bit", stub)  # bnb 0.50.2 has no CPU out= kernel
    with nf4_dequant.patched():
        packed, state = quantize((64, 64))
        out = torch.empty(64, 64)
        bnbF.dequantize_4bit(packed, state, None, out)
        assert calls == [out]
    monkeypatch.undo()
    with nf4_dequant.patched(forward_min_rows=4):  # a forward of 4 rows stays bitsandbytes'
        with OpCounter() as count:
            bnb.matmul_4bit(x.requires_grad_(), packed, state).sum().backward()
        assert count.theirs == 1 and count.ours == 1  # the backward's dequantize is still ours
    assert bnbF.dequantize_4bit is original


def test_refuses_other_bitsandbytes_versions(monkeypatch):
    original = bnb.matmul_4bit
    monkeypatch.setattr(bnb, "__version__", "0.51.0")
    with pytest.raises(RuntimeError, match="refuses to apply"):
        nf4_dequant.apply()
    assert bnb.matmul_4bit is original


# ----------------------------------------------------------------------------- optimize(nf4_dequant=...)
def test_optimize_auto_leaves_it_off_on_cpu_and_true_applies_it(model):
    from qlora_nb_utils import optimize
    from qlora_nb_utils.compile.model_patches import nf4_layers

    originals = (bnb.matmul_4bit, bnbF.dequantize_4bit)
    opt = optimize(model, backend="eager")
    try:
        assert opt.choices["nf4_dequant"] is False and "CUDA" in opt.reasons["nf4_dequant"]
        assert (bnb.matmul_4bit, bnbF.dequantize_4bit) == originals
    finally:
        opt.undo()
    ref_loss, ref_grads = _loss_and_grads(model, model)
    # unfused: the LoRA update after the routed base matmul, so the values stay bit-equal (the fused
    # LoRA linear sums in another order: tests/test_lora_addmm.py checks it within tolerances)
    opt = optimize(model, backend="eager", nf4_dequant=True, cast=False, lora_addmm="unfused")
    try:
        assert opt.choices["nf4_dequant"] is True and str(nf4_layers(model)) in opt.reasons["nf4_dequant"]
        assert bnb.matmul_4bit is not originals[0] and bnbF.dequantize_4bit is not originals[1]
        with OpCounter() as count:
            loss, grads = _loss_and_grads(model, model)
        assert count.ours > 0 and count.theirs == 0
    finally:
        opt.undo()
    assert bnb.matmul_4bit is originals[0] and bnbF.dequantize_4bit is originals[1]
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)


def test_optimize_shares_the_process_wide_patch_until_the_last_undo(model):
    from qlora_nb_utils import optimize

    originals = (bnb.matmul_4bit, bnbF.dequantize_4bit)
    first = optimize(model, backend="eager", nf4_dequant=True, cast=False)
    second = optimize(model, backend="eager", nf4_dequant=True, cast=False)
    patched = bnb.matmul_4bit
    first.undo()  # the other optimize() still uses it: it stays
    assert bnb.matmul_4bit is patched and bnbF.dequantize_4bit is not originals[1]
    first.undo()  # twice: still one release
    assert bnb.matmul_4bit is patched
    second.undo()
    assert bnb.matmul_4bit is originals[0] and bnbF.dequantize_4bit is originals[1]


def test_optimize_refuses_when_asked_and_skips_when_auto_on_unsupported_versions(model, monkeypatch):
    from qlora_nb_utils import optimize
    from qlora_nb_utils.compile import model_patches

    monkeypatch.setattr(nf4_dequant, "SUPPORTED", {"bitsandbytes": ">=99"})
    originals = (bnb.matmul_4bit, bnbF.dequantize_4bit)
    with pytest.raises(RuntimeError, match="nf4_dequant"):
        optimize(model, backend="eager", nf4_dequant=True, cast=False)
    assert (bnb.matmul_4bit, bnbF.dequantize_4bit) == originals and model_patches._NF4_SHARED["users"] == 0
    from qlora_nb_utils.compile.choices import choose_nf4_dequant
    from qlora_nb_utils.compile.options import OptimizeOptions
    from qlora_nb_utils.compile.plan import Plan

    cuda = torch.device("cuda")  # "auto" decides from the device only: no CUDA tensor is made
    plan = Plan(options=OptimizeOptions(), device=cuda)
    assert plan.record("nf4_dequant", choose_nf4_dequant("auto", "cuda", model_patches.nf4_layers(model), True))
    assert model_patches.use_nf4_dequant(model, plan) == []  # applying it is refused: said, not raised
    assert plan.choices["nf4_dequant"] is False and plan.reasons["nf4_dequant"].startswith("patch refused")
    with pytest.raises(ValueError, match="nf4_dequant must be one of"):
        optimize(model, backend="eager", nf4_dequant="yes")


def test_optimize_says_when_there_is_no_nf4_layer():
    from qlora_nb_utils.compile.choices import choose_nf4_dequant
    from qlora_nb_utils.compile.model_patches import nf4_layers

    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert nf4_layers(plain) == 0 and choose_nf4_dequant(True, "cpu", nf4_layers(plain), True) == (False, "no NF4 layer")
