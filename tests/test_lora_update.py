"""ops.lora_update: base += scaling * xa @ B^T in place. The custom op passes torch's opcheck, the
Function gives the sum's values and gradients, Inductor runs it without copying the base output
(the copy an out-of-place addmm costs), and bad input is refused. nf4_lora_linear (a LoRA linear
over an NF4 weight) gives the layer and its gradients, never saves the dequantized weight, and
under Inductor its base matmul adds into the update in place, forward and backward."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from qlora_nb_utils.ops.lora_update import add_lora_, lora_addmm_, lora_xa_into_, nf4_lora_linear, nf4_lora_linears


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


# ----------------------------------------------------------------------------- nf4_lora_linear
def _nf4_inputs(out_f=48, in_f=64, r=4, rows=(3, 5), seed=0):
    bnbF = pytest.importorskip("bitsandbytes.functional")
    from qlora_nb_utils.ops import nf4_triton

    g = torch.Generator().manual_seed(seed)
    packed, state = bnbF.quantize_4bit(torch.randn(out_f, in_f, generator=g), blocksize=64, quant_type="nf4",
                                       compress_statistics=True)
    weight = bnbF.dequantize_4bit(packed, state)
    x = torch.randn(*rows, in_f, generator=g, requires_grad=True)
    a = (torch.randn(r, in_f, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(out_f, r, generator=g) * 0.3).requires_grad_()
    return x, a, b, weight, nf4_triton.op_args(packed, state, torch.float32)


@pytest.mark.parametrize("compiled", [False, True])
def test_nf4_lora_linear_gives_the_lora_linear_and_its_gradients(compiled):
    x, a, b, weight, args = _nf4_inputs()

    def ours(x, a, b):
        return nf4_lora_linear(x, a, b, 0.75, args)

    def reference(x, a, b):
        return x @ weight.t() + 0.75 * (x @ a.t()) @ b.t()

    fn = torch.compile(ours, backend="aot_eager", fullgraph=True) if compiled else ours
    out, grads = _grads(fn, (x, a, b))
    ref, ref_grads = _grads(reference, (x, a, b))
    assert out.shape == (3, 5, 48)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("xab", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_nf4_lora_linear_under_inductor_adds_the_base_matmul_into_the_update():
    """Forward and backward: the base matmul (with the weight dequantized, never saved) writes into the
    buffer a rank-r matmul wrote just before, in place: one lora_addmm_ each, no addmm, no copy."""
    torch.compiler.reset()
    x, a, b, weight, args = _nf4_inputs()
    fn = torch.compile(lambda x, a, b: nf4_lora_linear(x, a, b, 0.75, args), fullgraph=True)
    _, codes = run_and_get_code(lambda: fn(x, a, b).square().sum().backward())
    assert len(codes) == 2, "a forward and a backward"
    for code in codes:
        calls = [ln.strip() for ln in code.splitlines() if "lora_addmm_" in ln and "torch.ops" in ln]
        assert len(calls) == 1, code
        target = calls[0].split("(", 1)[1].split(",")[0]
        assert f"out={target})" in code  # an extern mm wrote the buffer the op adds into
        assert "extern_kernels.addmm" not in code and "dequantize_nf4_fused" in code


def test_nf4_lora_linear_saves_no_dequantized_weight():
    x, a, b, weight, args = _nf4_inputs()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        nf4_lora_linear(x, a, b, 1.0, args)
    shapes = [tuple(t.shape) for t in saved]
    assert (15, 64) in shapes and (15, 4) in shapes  # x and x @ A^T (scaled), for A's and B's gradients
    assert not any(t.is_floating_point() and t.shape == weight.shape for t in saved), shapes


def test_nf4_lora_linear_skips_the_input_gradient_when_nothing_needs_it():
    x, a, b, _, args = _nf4_inputs()
    x = x.detach()
    nf4_lora_linear(x, a, b, 1.0, args).sum().backward()
    assert x.grad is None and a.grad is not None and b.grad is not None


@pytest.mark.parametrize("change, message", [
    (lambda x, a, b: (x[..., :32], a, b), "do not make"),
    (lambda x, a, b: (x, a[:, :32], b), "do not make"),
    (lambda x, a, b: (x, a, b[:40]), "do not make"),
    (lambda x, a, b: (x, a[0], b), "2-D"),
    (lambda x, a, b: (x.double(), a, b), "one dtype"),
])
def test_nf4_lora_linear_refuses_bad_input(change, message):
    x, a, b, _, args = _nf4_inputs()
    with pytest.raises(ValueError, match=message):
        nf4_lora_linear(*change(x.detach(), a.detach(), b.detach()), 1.0, args)


def _nf4_group(rows=(3, 5), seed=0):
    """Three NF4 LoRA members reading one x (q, k, v-like: outputs 48, 16, 16; ranks 4, 4, 2)."""
    members, refs = [], []
    x = None
    for i, (out_f, r, s) in enumerate(((48, 4, 0.75), (16, 4, 2.0), (16, 2, 0.5))):
        xi, a, b, weight, args = _nf4_inputs(out_f=out_f, r=r, rows=rows, seed=seed + i)
        x = xi if x is None else x
        members.append((a, b, s, args))
        refs.append((a, b, s, weight))
    return x, members, refs


@pytest.mark.parametrize("compiled", [False, True])
def test_nf4_lora_linears_give_each_member_and_the_summed_gradients(compiled):
    x, members, refs = _nf4_group()
    leaves = [x] + [t for a, b, _, _ in members for t in (a, b)]

    def ours(x, *ab):
        return nf4_lora_linears(x, [(ab[2 * i], ab[2 * i + 1], s, args) for i, (_, _, s, args) in enumerate(members)])

    def reference(x, *ab):
        return tuple(x @ w.t() + s * (x @ ab[2 * i].t()) @ ab[2 * i + 1].t() for i, (_, _, s, w) in enumerate(refs))

    def run(fn):
        for t in leaves:
            t.grad = None
        outs = fn(*leaves)
        sum((o.square() * (k + 1)).sum() for k, o in enumerate(outs)).backward()
        return [o.detach() for o in outs], [t.grad.clone() for t in leaves]

    fn = torch.compile(ours, backend="aot_eager", fullgraph=True) if compiled else ours
    (outs, grads), (ref_outs, ref_grads) = run(fn), run(reference)
    assert [o.shape for o in outs] == [(3, 5, 48), (3, 5, 16), (3, 5, 16)]
    for got, want in zip(outs + grads, ref_outs + ref_grads):  # fp32, sums in another order: 1e-4
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_nf4_lora_linears_read_x_once_for_the_group():
    """Against three nf4_lora_linear calls: one x @ A^T matmul in the forward instead of three, one
    g_A^T @ x and one LoRA input-gradient matmul in the backward instead of three each."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    x, members, _ = _nf4_group()

    def count(fn):
        torch.compiler.reset()
        graphs = []

        def keep(gm, _inputs):
            graphs.append(gm)
            return make_boxed_func(gm)

        compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
        sum(o.sum() for o in compiled(x)).backward()
        assert len(graphs) == 2
        return [sum(n.target is torch.ops.aten.mm.default for n in g.graph.nodes) for g in graphs]

    grouped = count(lambda x: nf4_lora_linears(x, members))
    separate = count(lambda x: tuple(nf4_lora_linear(x, *m) for m in members))
    assert separate == [6, 12]  # forward: x@A, xa@B per member; backward: g@B, gA@A, gA^T@x, g^T@xa
    assert grouped == [1 + 3, 3 + 1 + 1 + 3]


def test_nf4_lora_linears_refuse_an_empty_group_and_a_mismatched_member():
    x, members, _ = _nf4_group()
    with pytest.raises(ValueError, match="at least one"):
        nf4_lora_linears(x, [])
    a, b, s, args = members[1]
    with pytest.raises(ValueError, match="do not make"):
        nf4_lora_linears(x, [members[0], (a[:, :32], b, s, args)])


def test_lora_xa_into_passes_opcheck_and_scales_each_member():
    x, a = torch.randn(7, 6), torch.randn(5, 6)
    wide = torch.cat([x, torch.zeros(7, 5)], dim=1)
    torch.library.opcheck(lora_xa_into_, (wide.clone(), a, [3, 2], [0.5, 2.0]))
    lora_xa_into_(wide, a, [3, 2], [0.5, 2.0])
    torch.testing.assert_close(wide[:, :6], x, rtol=0, atol=0)
    torch.testing.assert_close(wide[:, 6:], torch.cat([(x @ a[:3].t()) * 0.5, (x @ a[3:].t()) * 2.0], 1))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_wide_group_gives_the_narrow_values_and_gradients(backend):
    """nf4_lora_linears(wide=True): [x | s x A^T] @ [W_i | B_i]^T per member, the same outputs and
    gradients as the narrow group (fp32 here; only the summation order differs)."""
    x, members, _ = _nf4_group()
    leaves = [x] + [t for a, b, _, _ in members for t in (a, b)]

    def group(wide):
        def fn(x, *ab):
            return nf4_lora_linears(x, [(ab[2 * i], ab[2 * i + 1], s, args)
                                        for i, (_, _, s, args) in enumerate(members)], wide=wide)
        return fn

    def run(fn):
        for t in leaves:
            t.grad = None
        outs = fn(*leaves)
        sum((o.square() * (k + 1)).sum() for k, o in enumerate(outs)).backward()
        return [o.detach() for o in outs] + [t.grad.clone() for t in leaves]

    torch.compiler.reset()
    wide = group(True) if backend == "eager" else torch.compile(group(True), backend=backend, fullgraph=True)
    for got, want in zip(run(wide), run(group(False))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_wide_group_under_inductor_writes_x_beside_its_update_without_a_copy():
    """The kernel that computes x (here an RMSNorm) writes it straight into the wide buffer (a fused
    cat), lora_xa_into_ fills the columns beside it in place, and each member's GEMM reads that
    buffer: no separate copy of x, no update tensor, no addmm."""
    torch.compiler.reset()
    x, members, _ = _nf4_group()
    h = x.detach().clone().requires_grad_(True)
    norm_w = torch.randn(h.shape[-1])

    def fn(h):
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
        return sum(o.sum() for o in nf4_lora_linears(x, members, wide=True))

    _, codes = run_and_get_code(lambda: torch.compile(fn, fullgraph=True)(h).backward())
    forward = codes[0]
    kernels = [ln for ln in forward.splitlines() if ln.strip().startswith(("cpp_fused", "triton_")) and "(" in ln]
    assert any("cat" in k and "rsqrt" in k for k in kernels), kernels  # x is computed into the wide buffer
    calls = [ln.strip() for ln in forward.splitlines() if "lora_xa_into_" in ln and "torch.ops" in ln]
    assert len(calls) == 1, forward
    wide = calls[0].split("(", 1)[1].split(",")[0]
    assert sum(f"extern_kernels.mm({wide}," in ln for ln in forward.splitlines()) == 3  # one GEMM per member
    assert "addmm" not in forward and "lora_addmm_" not in forward


@pytest.mark.gpu
def test_wide_group_on_cuda_in_bf16_matches_the_narrow_group():
    """On the GPU the wide weights come from the Triton kernel (W and B_i written into one buffer):
    bf16 outputs and gradients as the narrow group's, compiled, within bf16 rounding."""
    bnbF = pytest.importorskip("bitsandbytes.functional")
    from qlora_nb_utils.ops import nf4_triton

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 256, generator=g).cuda().bfloat16().requires_grad_()
    members = []
    for out_f in (512, 128, 128):
        packed, state = bnbF.quantize_4bit(torch.randn(out_f, 256, generator=g).cuda().bfloat16(), blocksize=64,
                                           quant_type="nf4", compress_statistics=True)
        a = (torch.randn(16, 256, generator=g) * 0.1).cuda().bfloat16().requires_grad_()
        b = (torch.randn(out_f, 16, generator=g) * 0.1).cuda().bfloat16().requires_grad_()
        members.append((a, b, 2.0, nf4_triton.op_args(packed, state, torch.bfloat16)))
    leaves = [x] + [t for a, b, _, _ in members for t in (a, b)]

    def run(wide):
        torch.compiler.reset()
        for t in leaves:
            t.grad = None
        outs = torch.compile(lambda x: nf4_lora_linears(x, members, wide=wide), fullgraph=True)(x)
        sum(o.float().square().sum() for o in outs).backward()
        return [o.detach().float() for o in outs] + [t.grad.float() for t in leaves]

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_wide_group_saves_x_and_the_small_columns_not_the_wide_buffer():
    """The wide buffer is written by a mutable op, so a saved buffer could not be recomputed in the
    backward (4 GiB more at 8B, 8 x 1024 on an H100): x and a copy of the s x A^T columns are saved."""
    x, members, _ = _nf4_group()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        nf4_lora_linears(x, members, wide=True)
    assert (15, 64) in saved and (15, 10) in saved and (15, 74) not in saved, saved
