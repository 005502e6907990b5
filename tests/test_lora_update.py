"""ops.lora_update: base += scaling * xa @ B^T in place. The custom op passes torch's opcheck, the
Function gives the sum's values and gradients, Inductor runs it without copying the base output
(the copy an out-of-place addmm costs), and bad input is refused."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from qlora_nb_utils.ops.lora_update import add_lora_, lora_addmm_


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(10, 8, generator=g, dtype=dtype, requires_grad=True)
    a = torch.randn(4, 8, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(10, 4, generator=g, dtype=dtype, requires_grad=True)
    return x, w, a, b


def _ours(x, w, a, b):
    return add_lora_(x @ w.t(), x @ a.t(), b, 2.0)


def _reference(x, w, a, b):
    return x @ w.t() + 2.0 * (x @ a.t()) @ b.t()


def _grads(fn, inputs):
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.square().sum().backward()
    return out.detach(), [t.grad.clone() for t in inputs]


def test_the_custom_op_passes_opcheck():
    base, xa, b_t = torch.randn(6, 5), torch.randn(6, 3), torch.randn(3, 5)
    torch.library.opcheck(lora_addmm_, (base, xa, b_t, 0.5))


@pytest.mark.parametrize("compiled", [False, True])
def test_values_and_gradients_are_the_sums(compiled):
    inputs = _inputs()
    fn = torch.compile(_ours, backend="aot_eager", fullgraph=True) if compiled else _ours
    out, grads = _grads(fn, inputs)
    ref, ref_grads = _grads(_reference, inputs)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for name, got, want in zip("xwab", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


def test_inductor_adds_into_the_base_output_without_a_copy():
    torch.compiler.reset()
    inputs = _inputs(torch.float32)
    fn = torch.compile(_ours, fullgraph=True)
    _, codes = run_and_get_code(lambda: fn(*inputs).square().sum().backward())
    forward = codes[0]
    calls = [ln.strip() for ln in forward.splitlines() if "lora_addmm_" in ln and "torch.ops" in ln]
    assert len(calls) == 1, forward
    base = calls[0].split("(", 1)[1].split(",")[0]  # the op writes into the base matmul's own buffer ...
    assert f"out={base})" in forward  # ... which an extern mm wrote just before
    assert "extern_kernels.addmm" not in forward and "clone" not in calls[0]
    for t in inputs:
        t.grad = None
    got = [t.grad for t in inputs]
    assert all(g is None for g in got)


def test_leading_dimensions_are_kept_and_a_strided_base_is_refused():
    x, w, a, b = (t.detach() for t in _inputs())
    x3 = x.view(3, 4, 8)
    out = add_lora_(x3 @ w.t(), x3 @ a.t(), b, 2.0)
    torch.testing.assert_close(out, _reference(x, w, a, b).view(3, 4, 10))
    with pytest.raises(ValueError, match="contiguous"):
        add_lora_((x @ w.t()).t().contiguous().t(), x @ a.t(), b, 1.0)


def test_a_graph_that_still_needs_the_base_output_refuses_at_backward():
    x, w, a, b = _inputs()
    base = x @ w.t()
    kept = base.sin()  # sin saves its input: the old value of the base
    add_lora_(base, x @ a.t(), b, 1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        kept.sum().backward()


@pytest.mark.parametrize("shapes, dtypes, message", [
    (((4,), (6, 2), (4, 2)), None, "2-D b"),
    (((2, 3, 4), (6, 2), (4, 2)), None, "do not make"),
    (((6, 4), (5, 2), (4, 2)), None, "do not make"),
    (((6, 4), (6, 2), (4, 3)), None, "do not make"),
    (((6, 4), (6, 2), (4, 2)), (torch.float32, torch.float64, torch.float32), "one dtype"),
])
def test_bad_input_is_refused(shapes, dtypes, message):
    dtypes = dtypes or (torch.float32,) * 3
    tensors = [torch.randn(s, dtype=d) for s, d in zip(shapes, dtypes)]
    with pytest.raises(ValueError, match=message):
        add_lora_(*tensors, 1.0)
