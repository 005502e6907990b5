"""compile.patches.lora_addmm: each LoRA update added into its base output by one addmm: the same
loss and LoRA gradients as PEFT's forward, no graph break, PEFT's own path for everything else,
and an undo that restores every layer; optimize(lora_addmm=...) applies it."""

import contextlib
import re

import pytest
import torch

from qlora_nb_utils import data as qdata
from qlora_nb_utils import diagnostics, optimize
from qlora_nb_utils.compile.patches import lora_addmm


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, batch, compiled=False):
    fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    loss = fn(**batch).loss
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.fixture(scope="module")
def batch(tiny):
    _, tok = tiny
    (b,) = qdata.build_batches(tok, batch_size=2, steps=1, max_len=64, padding="fixed")
    return b


@pytest.mark.parametrize("compiled", [False, True])
def test_patched_forward_gives_peft_loss_and_lora_grads(tiny, batch, compiled):
    model, _ = tiny
    ref_loss, ref_grads = _step(model, batch, compiled)
    torch.compiler.reset()
    with lora_addmm.patched(model) as handle:
        assert handle.details["layers"] == len(lora_addmm.find_layers(model)) == 14  # 7 projections x 2 layers
        loss, grads = _step(model, batch, compiled)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and any("lora_A" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_patched_model_traces_whole_and_undo_restores_every_layer(tiny, batch):
    model, _ = tiny
    layers = lora_addmm.find_layers(model)
    with lora_addmm.patched(model):
        assert all("forward" in vars(layer) for layer in layers)
        assert diagnostics.graph_breaks(model, **batch).graph_break_count == 0
    assert not any("forward" in vars(layer) for layer in layers)


def test_unusual_calls_go_to_peft_forward(tiny, batch):
    model, _ = tiny
    layer = lora_addmm.find_layers(model)[0]
    x = torch.randn(2, 5, layer.in_features)
    with lora_addmm.patched(model):
        with model.disable_adapter():  # adapters off: the base layer alone, as PEFT does
            torch.testing.assert_close(layer(x), layer.base_layer(x))
        names = ["default", "default"]  # a mixed-batch call (adapter_names): PEFT's own forward
        torch.testing.assert_close(layer(x, adapter_names=names), type(layer).forward(layer, x, adapter_names=names))
        bf16 = x.to(torch.bfloat16)  # the LoRA weights (fp32) differ from the input without autocast: PEFT casts
        torch.testing.assert_close(layer(bf16), type(layer).forward(layer, bf16))
        calls = []
        hook = layer.base_layer.register_forward_hook(lambda *_: calls.append(1))
        try:
            layer(bf16)
        finally:
            hook.remove()
        assert len(calls) == 1  # PEFT's path alone computes the base output: it is not computed twice
        lora_b = layer.lora_B["default"]  # PEFT's lora_bias: B with a bias, which the one-matmul update has not
        biased = torch.nn.Linear(lora_b.in_features, lora_b.out_features, bias=True)
        with torch.no_grad():
            biased.weight.copy_(lora_b.weight)
            biased.bias.fill_(0.5)
        layer.lora_B["default"] = biased
        try:
            torch.testing.assert_close(layer(x), type(layer).forward(layer, x))
        finally:
            layer.lora_B["default"] = lora_b


def test_refuses_a_model_without_lora_and_unsupported_versions(tiny, monkeypatch):
    model, _ = tiny
    with pytest.raises(ValueError, match="no PEFT LoRA linear layer"):
        lora_addmm.apply(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    monkeypatch.setattr(lora_addmm, "SUPPORTED", {"peft": "<0.1"})
    with pytest.raises(RuntimeError, match="lora_addmm"):
        lora_addmm.apply(model)
    opt = optimize(model, backend="eager")
    try:  # auto: refused, said so, nothing patched
        assert opt.choices["lora_addmm"] is False and "patch refused" in opt.reasons["lora_addmm"]
        assert not any("forward" in vars(layer) for layer in lora_addmm.find_layers(model))
    finally:
        opt.undo()
    with pytest.raises(RuntimeError, match="lora_addmm"):
        optimize(model, backend="eager", lora_addmm=True)
    assert not any("forward" in vars(layer) for layer in lora_addmm.find_layers(model))


def test_optimize_applies_it_by_default_and_undoes_it(tiny, batch):
    model, _ = tiny
    opt = optimize(model, batches=[batch], backend="eager")
    try:
        assert opt.choices["lora_addmm"] is True and "14 LoRA layers" in opt.reasons["lora_addmm"]
        assert all("forward" in vars(layer) for layer in lora_addmm.find_layers(model))
    finally:
        opt.undo()
    assert not any("forward" in vars(layer) for layer in lora_addmm.find_layers(model))
    opt = optimize(model, batches=[batch], backend="eager", lora_addmm=False)
    try:
        assert opt.choices["lora_addmm"] is False and opt.reasons["lora_addmm"] == "asked for"
    finally:
        opt.undo()


def test_inductor_adds_every_update_into_its_base_output_in_place(tiny, batch):
    """The patched model under Inductor: one in-place LoRA update per layer in the forward's code and no
    out-of-place addmm there (whose cuBLAS copy of the base output cost 14.4 ms a step at 8B on an H100)."""
    from torch._inductor.utils import run_and_get_code

    model, _ = tiny
    torch.compiler.reset()
    with lora_addmm.patched(model) as handle:
        fn = torch.compile(model, fullgraph=True)
        _, codes = run_and_get_code(lambda: fn(**batch).loss.backward())
        model.zero_grad(set_to_none=True)
    forward = codes[0]
    assert forward.count("torch.ops.qlora_nb.lora_addmm_.default(") == handle.details["layers"]
    assert "extern_kernels.addmm(" not in forward


def test_out_of_place_update_gives_the_same_values_and_optimize_takes_it_when_memory_is_short(tiny, batch):
    model, _ = tiny
    ref_loss, ref_grads = _step(model, batch)
    with lora_addmm.patched(model, in_place=False) as handle:
        assert handle.details == {"layers": 14, "in_place": False, "nf4_layers": 0, "groups": 0, "wide": False}
        loss, grads = _step(model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match=r"estimated at ([0-9.]+) GiB") as refused:  # no plan meets it
        optimize(model, batches=[batch], max_memory_gib=1e-3, backend="eager")
    frugal = float(re.search(r"estimated at ([0-9.]+) GiB", str(refused.value)).group(1))  # every saving taken
    # met with room; met only with every saving, the update out of place among them (within the target, over
    # its headroom)
    for target, in_place in ((1e6, True), (frugal + 0.01, False)):
        opt = optimize(model, batches=[batch], max_memory_gib=target, backend="eager")
        try:
            assert opt.choices["lora_addmm"] is True
            assert opt._extra[-1].details["in_place"] is in_place, opt.reasons["lora_addmm"]
            assert ("out-of-place" in opt.reasons["lora_addmm"]) is (not in_place)
        finally:
            opt.undo()


# ----------------------------------------------------------------------------- NF4 layers: one fused LoRA linear
class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the in-place update op and bitsandbytes' own ops as they are dispatched."""

    def __init__(self):
        super().__init__()
        self.updates = self.bnb = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.updates += str(func).startswith("qlora_nb.lora_addmm_")
        self.bnb += str(func).startswith("bitsandbytes.")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compiled", [False, True])
def test_nf4_layers_run_fused_with_peft_loss_and_lora_grads(tiny, batch, compiled):
    model, _ = tiny
    ref_loss, ref_grads = _step(model, batch, compiled)
    torch.compiler.reset()
    graphs, backend = _aot_graphs()
    ops = _Ops()
    with lora_addmm.patched(model, nf4_rows={"cpu": 0, "cuda": 0}) as handle:
        assert handle.details["nf4_layers"] == 14
        if compiled:  # fullgraph: no break either
            fn = torch.compile(model, backend=backend, fullgraph=True)
            loss = fn(**batch).loss
            loss.backward()
            loss, grads = loss.detach(), _grads(model)
            model.zero_grad(set_to_none=True)
        else:
            with ops:
                loss, grads = _step(model, batch)
    if compiled:  # a dispatch mode stops Dynamo: count the ops in the forward and backward graphs instead
        nodes = [n for g in graphs for n in g.graph.nodes if n.op == "call_function"]
        ops.updates = sum("qlora_nb.lora_addmm_" in str(n.target) + str(n.args[:1]) for n in nodes)  # functionalized
        ops.bnb = sum(str(n.target).startswith("bitsandbytes") for n in nodes)
    # every layer's forward and backward went through the fused Function
    assert ops.bnb == 0 and ops.updates == 14 + 14 - 3  # layer 0's q, k, v: no input gradient
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_nf4_route_is_left_below_its_rows_with_dropout_and_without_grad(tiny, batch):
    model, _ = tiny
    layers = lora_addmm.find_layers(model)
    with lora_addmm.patched(model, nf4_rows={"cpu": 10**6}), _Ops() as ops:  # below the row threshold
        _step(model, batch)
    assert ops.bnb > 0 and ops.updates == 14  # the in-place update after bitsandbytes' own matmul
    with lora_addmm.patched(model, nf4_rows={"cpu": 0}), _Ops() as ops:
        with torch.no_grad():  # inference: bitsandbytes' own path
            model(**batch)
        assert ops.bnb > 0
        ops.bnb = 0
        dropout = layers[0].lora_dropout["default"]
        layers[0].lora_dropout["default"] = torch.nn.Dropout(0.0)  # not the identity: PEFT's x for the update
        try:
            _step(model, batch)
        finally:
            layers[0].lora_dropout["default"] = dropout
    assert ops.bnb > 0
    assert not any("forward" in vars(layer) for layer in layers)


def test_optimize_fuses_nf4_layers_when_its_nf4_patch_is_on(tiny, batch):
    model, _ = tiny
    opt = optimize(model, batches=[batch], backend="eager", nf4_dequant=True)
    try:
        assert opt.choices["nf4_dequant"] is True
        assert [h for h in opt._extra if h.name == "lora_addmm"][0].details["nf4_layers"] == 14
        assert opt.choices["nf4_lora_linear"] == 14
        assert "14 LoRA layers over NF4 weights: the base matmul adds into the update" in opt.description
        loss = opt.forward(**batch).loss
        loss.backward()
        assert torch.isfinite(loss) and all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    finally:
        opt.undo()
        model.zero_grad(set_to_none=True)
    opt = optimize(model, batches=[batch], backend="eager", nf4_dequant=True, lora_addmm="unfused")
    try:
        assert opt.choices["lora_addmm"] is True and opt.choices["nf4_lora_linear"] == 0
        assert opt.choices["lora_groups"] == 0 and "needs the fused NF4 LoRA linear" in opt.description
        assert opt.choices["lora_wide"] is False and "lora_wide=False" in opt.description
        assert "asked for (lora_addmm='unfused')" in opt.reasons["nf4_lora_linear"]
        (handle,) = [h for h in opt._extra if h.name == "lora_addmm"]
        assert handle.details["nf4_layers"] == 0 and handle.details["layers"] == 14
    finally:
        opt.undo()
    opt = optimize(model, batches=[batch], backend="eager")  # nf4_dequant auto: off on a CPU, nothing fused
    try:
        assert opt.choices["nf4_dequant"] is False and opt.choices["nf4_lora_linear"] == 0
        assert "nf4_dequant" in opt.reasons["nf4_lora_linear"]
    finally:
        opt.undo()


def test_optimize_leaves_calls_below_lora_min_rows_to_bitsandbytes_and_says_so(tiny, batch, monkeypatch):
    """lora_min_rows: the fused LoRA linear only for calls of more rows; below, the base layer's own
    matmul and the update after it, and the plan's reason names the threshold and the batches it leaves out."""
    model, _ = tiny
    rows = batch["input_ids"].numel()
    fused_calls = []
    for name in ("nf4_lora_linear", "nf4_lora_linears"):  # count the fused route's calls
        real = getattr(lora_addmm, name)
        monkeypatch.setattr(lora_addmm, name, lambda *a, _real=real, **k: fused_calls.append(1) or _real(*a, **k))
    for threshold, fused in ((rows, False), (rows - 1, True), (0, True)):
        opt = optimize(model, batches=[batch], backend="eager", nf4_dequant=True, lora_min_rows=threshold)
        try:
            assert opt.choices["nf4_lora_linear"] == 14
            why = opt.reasons["nf4_lora_linear"]
            if threshold:
                assert f"in calls of more than {threshold} rows" in why
            else:
                assert "rows" not in why
            assert (f"at most {rows} rows a call: none fused at them" in why) is (not fused)
            fused_calls.clear()
            with _Ops() as ops:  # the recipe as plain code (a dispatch mode and Dynamo do not mix)
                opt.eager(**batch).loss.backward()
            assert bool(fused_calls) is fused
            if not fused:  # every layer's update added after its base matmul
                assert ops.updates == 14
        finally:
            opt.undo()
            model.zero_grad(set_to_none=True)


def _aot_graphs():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    return graphs, aot_autograd(fw_compiler=keep, bw_compiler=keep)


@pytest.mark.parametrize("compiled, ckpt", [(False, False), (False, True), (True, False)],
                         ids=["eager", "eager-ckpt", "compiled"])
def test_siblings_reading_one_input_run_as_one_group(tiny, batch, compiled, ckpt, monkeypatch):
    """q, k, v and gate, up of each decoder layer: one nf4_lora_linears call per group, narrow or wide,
    the loss and LoRA gradients of every layer on its own; eager with checkpointing (the recompute
    calls each group again), compiled whole with fullgraph (the group's state is plain Python the
    trace replays); fewer matmuls in the graph (wide: no x@A^T matmul, the mutable op writes it);
    undo puts every layer back."""
    from qlora_nb_utils.compile.patches import input_require_grads

    model, _ = tiny
    was_training, had_hook = model.training, bool(input_require_grads.find_hooks(model))
    if ckpt:  # HF checkpoints in train mode only
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    calls = []
    real = lora_addmm.nf4_lora_linears
    monkeypatch.setattr(lora_addmm, "nf4_lora_linears",
                        lambda x, m, wide: calls.append((len(m), wide)) or real(x, m, wide=wide))
    rows = {"cpu": 0, "cuda": 0}
    results, mms = {}, {}
    try:
        for group, wide in ((False, False), (True, False), ("wide", True)):
            calls.clear()
            with lora_addmm.patched(model, nf4_rows=rows, group=bool(group), wide=wide) as handle:
                assert handle.details["groups"] == (4 if group else 0) and handle.details["wide"] is wide
                if compiled:
                    torch.compiler.reset()
                    graphs, backend = _aot_graphs()
                    with input_require_grads.patched(model) if ckpt else contextlib.nullcontext():
                        loss = torch.compile(model, backend=backend, fullgraph=True)(**batch).loss
                    loss.backward()
                    mms[group] = sum(n.target is torch.ops.aten.mm.default for g in graphs for n in g.graph.nodes)
                else:
                    loss = model(**batch).loss
                    loss.backward()
                results[group] = (loss.detach(), _grads(model))
                model.zero_grad(set_to_none=True)
            if group and not compiled:  # the recompute calls each group again
                assert calls == [(3, wide), (2, wide), (3, wide), (2, wide)] * (2 if ckpt else 1)
    finally:
        if ckpt:  # the fixture as it was: no checkpointing, no input-require-grads hook it did not have
            model.gradient_checkpointing_disable()
            if not had_hook:
                model.disable_input_require_grads()
            model.train(was_training)
    ref_loss, ref_grads = results[False]
    for loss, grads in (results[True], results["wide"]):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    if compiled:  # per layer, 3 matmuls fewer each time the group reads x: x@A in the forward (3 -> 1 and
        # 2 -> 1), gA^T@x for the A gradients, gA@A for the input gradient (none for layer 0's q, k, v:
        # nothing before them needs one); with checkpointing, the recomputed forward's too
        saved = 3 * 2 + 3 * 2 + (3 * 2 - 2)
        assert mms[False] - mms[True] == saved + (3 * 2 if ckpt else 0), mms
        assert mms[True] - mms["wide"] == 4, mms  # one x@A^T matmul per group, now lora_xa_into_
    assert not any("forward" in vars(layer) for layer in lora_addmm.find_layers(model))


def test_optimize_groups_siblings_in_regional_scope_with_checkpointing_and_not_in_whole(tiny, batch):
    """Regional scope checkpoints around the compiled layer: the groups run there (one compilation, the
    loss and grads of lora_addmm='ungrouped'), wide by default, narrow when asked. Whole scope traces
    a checkpointed layer as one region that may not mutate outside state, so optimize() leaves the
    layers ungrouped there and says why."""
    model, _ = tiny
    runs = {}
    for asked in ("auto", "narrow", "ungrouped"):
        torch.compiler.reset()
        opt = optimize(model, batches=[batch], backend="aot_eager", nf4_dequant=True, scope="regional",
                       grad_ckpt=True, cast=False, autocast=False, lora_addmm=asked)
        try:
            loss = opt.forward(**batch).loss
            loss.backward()
            runs[asked] = (loss.detach(), _grads(model), opt.choices["lora_groups"], opt.counter.to_dict())
            assert opt.choices["lora_wide"] is (asked == "auto"), opt.reasons["lora_wide"]
        finally:
            opt.undo()
            model.zero_grad(set_to_none=True)
    ref_loss, ref_grads, ref_groups, _ = runs["ungrouped"]
    assert ref_groups == 0
    for asked in ("auto", "narrow"):
        loss, grads, groups, stats = runs[asked]
        assert groups == 4 and stats["compilations"] == 1
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    opt = optimize(model, batches=[batch], backend="eager", nf4_dequant=True, scope="whole", grad_ckpt=True)
    try:
        assert opt.choices["lora_groups"] == 0 and opt.choices["nf4_lora_linear"] == 14
        assert "whole scope with checkpointing" in opt.reasons["lora_groups"]
    finally:
        opt.undo()
