"""compile.patches.kept_attention: a checkpointed layer's recompute takes the attention output its
forward kept instead of running the attention kernel again.

On a CPU the kernel is the CPU flash kernel and its backward; the loss and gradients must equal the
fast path's without the patch (fp32), the kernel must run once per layer per step (not twice), with
the kept outputs in host buffers or on the device, through ``optimize()``'s regional compile with
``fullgraph=True``. A forward whose backward never ran leaves nothing behind for the next step, and
``undo()`` restores the attention implementation and the checkpoint functions.
"""

from __future__ import annotations

import pytest
import torch
from tiny_lora import batch, build, loss_and_grads, save_tiny_llama

from qlora_nb_utils import optimize
from qlora_nb_utils.compile.offload import CpuOffloader
from qlora_nb_utils.compile.patches import kept_attention

LAYERS = 2
#: fp32 on a CPU; the patch's kernel (CPU flash) is not the one SDPA picks there (math), so the
#: sums run in another order
TOL = {"rtol": 2e-5, "atol": 2e-6}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_kept"), layers=LAYERS)


def _close(got, want):
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert got[1].keys() == want[1].keys() and got[1]
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **TOL, msg=name)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Real (not fake) runs of the attention kernel."""
    from torch._subclasses.fake_tensor import FakeTensor

    calls = []
    real = kept_attention._compute

    def counted(q, k, v, scale):
        if not isinstance(q, FakeTensor):
            calls.append(tuple(q.shape))
        return real(q, k, v, scale)

    monkeypatch.setattr(kept_attention, "_compute", counted)
    return calls


@pytest.mark.parametrize("where", ["device", "host"])
def test_the_recompute_takes_the_kept_output_with_the_same_loss_and_grads(tiny_dir, kernel_calls, where):
    model = build(tiny_dir, quant=True, how="kbit")
    b = batch(seq=64)
    opt = optimize(model, batches=[b], backend="aot_eager", scope="regional", grad_ckpt=True, offload=False)
    try:
        want = loss_and_grads(model, opt.forward, b)
        configs = {m.config._attn_implementation for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                                      "_attn_implementation")}
        funcs = [layer._gradient_checkpointing_func for layer in model.base_model.model.model.layers]
        offloader = CpuOffloader(exact_host_buffers=True) if where == "host" else None
        handle = kept_attention.apply(model, offloader=offloader)
        try:
            got = loss_and_grads(model, opt.forward, b)  # fullgraph=True: a graph break would raise
            assert kernel_calls == [(2, 4, 64, 16)] * LAYERS  # the forward's; none in the recompute
            store = handle.store
            assert (store.kept, store.reused, store.stack) == (LAYERS, LAYERS, [])
            if offloader is not None:
                assert offloader.stats.packed == LAYERS and offloader.stats.unpacked == LAYERS
            again = loss_and_grads(model, opt.forward, b)
            assert store.reused == 2 * LAYERS and len(kernel_calls) == 2 * LAYERS
        finally:
            handle.undo()
        assert {m.config._attn_implementation for m in model.modules()
                if hasattr(getattr(m, "config", None), "_attn_implementation")} == configs
        assert [layer._gradient_checkpointing_func for layer in model.base_model.model.model.layers] == funcs
    finally:
        opt.undo()
    _close(got, want)
    _close(again, want)


def test_a_forward_without_its_backward_leaves_nothing_for_the_next_step(tiny_dir, kernel_calls):
    model = build(tiny_dir, quant=False, how=None)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    from qlora_nb_utils.ops.attention import use_causal_sdpa

    causal = use_causal_sdpa(model)
    b = batch(seq=32)
    want = loss_and_grads(model, model, b)
    handle = kept_attention.apply(model)
    try:
        model(**b)  # grad on, no backward: both layers keep an output
        assert len(handle.store.stack) == LAYERS
        with torch.no_grad():
            model(**b)  # the next forward clears them; without grad nothing is kept
        assert handle.store.stack == [] and handle.store.dropped == LAYERS
        got = loss_and_grads(model, model, b)
        assert handle.store.reused == LAYERS
    finally:
        handle.undo()
        causal.undo()
    _close(got, want)


def test_a_recompute_of_another_shape_is_refused_not_given_a_wrong_output():
    store = kept_attention.KeptStore()
    q = torch.zeros(1, 2, 8, 4)
    store.keep(q, q, torch.zeros(1, 2, 8))
    with pytest.raises(RuntimeError, match="ran out of order"):
        store.take(torch.zeros(1, 2, 9, 4))
    with pytest.raises(RuntimeError, match="found no kept output"):
        store.take(q)


def test_a_model_it_cannot_serve_is_refused_with_the_reason(tiny_dir):
    model = build(tiny_dir, quant=False, how=None)
    with pytest.raises(ValueError, match="no decoder layer checkpoints"):
        kept_attention.apply(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match="not the causal-only SDPA"):
        kept_attention.apply(model)  # still the padding-masked "sdpa"


def test_optimize_keeps_attention_when_asked_and_says_so(tiny_dir, kernel_calls):
    model = build(tiny_dir, quant=True, how="kbit")
    b = batch(seq=64)
    kw = dict(batches=[b], backend="aot_eager", scope="regional", grad_ckpt=True)
    plain = optimize(model, **kw)
    try:
        want = loss_and_grads(model, plain.forward, b)
        # on a CPU "auto" keeps nothing: it keeps outputs only with cuDNN's kernel, where that was measured
        assert plain.choices["keep_attention"] is False and "cuDNN" in plain.reasons["keep_attention"]
        assert kernel_calls == []  # SDPA's own kernel ran, not the kept operator
    finally:
        plain.undo()
    opt = optimize(model, keep_attention=True, offload=True, **kw)
    try:
        got = loss_and_grads(model, opt.forward, b)
        assert opt.choices["keep_attention"] == "host" and "host memory" in opt.reasons["keep_attention"]
        assert len(kernel_calls) == LAYERS  # none in the recompute
    finally:
        opt.undo()
    assert {m.config._attn_implementation for m in model.modules()
            if hasattr(getattr(m, "config", None), "_attn_implementation")} == {"sdpa"}
    _close(got, want)
    with pytest.raises(ValueError, match="keep_attention=True: the scope is whole"):
        optimize(model, batches=[b], backend="aot_eager", grad_ckpt=True, keep_attention=True)
    assert {m.config._attn_implementation for m in model.modules()
            if hasattr(getattr(m, "config", None), "_attn_implementation")} == {"sdpa"}
    with pytest.raises(ValueError, match="keep_attention must be one of"):
        optimize(model, batches=[b], keep_attention="yes")


def _keep(asked="auto", **kw):
    from qlora_nb_utils.compile.choices import choose_keep_attention

    args = dict(cudnn=True, scope="regional", ckpt_layers=32, unsupported=None, offload=False, tiled=False, planned=19.8,
                estimate=15.0, kept_gib=4.0, transient_gib=0.3, host_gib=4.0, host_free_gib=100.0)
    return choose_keep_attention(asked, **(args | kw))


@pytest.mark.parametrize("kw, want, why", [
    ({}, "device", "kept on the device"),  # room for every output under the target
    ({"estimate": 19.5}, "host", "kept in host memory"),  # room only for the copies in flight
    ({"offload": True, "estimate": 10.0}, "host", "host memory"),  # beside the offloaded inputs
    ({"estimate": 19.6}, False, "no room under the target"),
    ({"estimate": 19.5, "host_gib": 60.0}, False, "the host memory"),  # over half of what the host has free
    ({"estimate": 19.5, "host_free_gib": None}, "host", "host memory"),  # unknown (not Linux): not refused
    ({"cudnn": False}, False, "cuDNN"),
    # the MLP in pieces: the target's edge, where the estimate counted less than the step held (the 24 GB
    # runs near 127k tokens: estimate 17.96 GiB, peak 20.33) and the outputs in flight would not fit
    ({"offload": True, "tiled": True, "estimate": 17.96, "transient_gib": 1.45}, False, "pieces"),
    ({"planned": None, "estimate": None}, False, "no memory target"),
    ({"scope": "whole"}, False, "scope is whole"),
    ({"unsupported": "the model soft-caps its attention scores"}, False, "soft-caps"),
])
def test_auto_keeps_outputs_where_the_target_and_the_host_have_room(kw, want, why):
    choice = _keep(**kw)
    assert choice.value == want and why in choice.why


def test_asked_for_it_keeps_or_refuses_with_the_reason():
    assert _keep(False).value is False
    assert _keep(True, cudnn=False, planned=None, estimate=None).value == "device"  # asked: no target needed
    assert _keep(True, offload=True).value == "host"
    assert _keep("auto", ckpt_layers=0) is None  # nothing is recomputed: nothing to say
    with pytest.raises(ValueError, match="no layer is checkpointed"):
        _keep(True, ckpt_layers=0)
    with pytest.raises(ValueError, match="not the causal-only SDPA"):
        _keep(True, unsupported="the model's attention is not the causal-only SDPA")


def test_the_plan_sizes_the_kept_outputs_from_the_batch_and_the_attention(tiny_dir, monkeypatch):
    """What the plan hands the choice: one output (rows x positions x query heads x head dim, in the
    compute dtype) and one fp32 log-sum-exp per checkpointed layer; the host's free memory only on a GPU."""
    from qlora_nb_utils.compile import plan as plan_mod
    from qlora_nb_utils.compile.options import OptimizeOptions

    seen = {}
    real = plan_mod.table.choose_keep_attention

    def spy(asked, **kw):
        seen.update(kw, asked=asked)
        return real(asked, **kw)

    monkeypatch.setattr(plan_mod.table, "choose_keep_attention", spy)
    model = build(tiny_dir, quant=True, how="kbit")
    b = batch(seq=64)
    opts = OptimizeOptions(backend="aot_eager", scope="regional", grad_ckpt=True, offload=True, max_memory_gib=50.0)
    p = plan_mod.decide(model, opts, [b], recompute_available=False, cache_available=False)
    cfg = model.config
    rows, positions = b["input_ids"].shape
    out = rows * positions * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # fp32
    lse = rows * cfg.num_attention_heads * positions * 4
    assert seen["asked"] == "auto" and seen["ckpt_layers"] == p.ckpt_layers == LAYERS and seen["offload"] is True
    assert seen["kept_gib"] * 2**30 == pytest.approx(LAYERS * (out + lse))
    assert seen["transient_gib"] * 2**30 == pytest.approx(out + LAYERS * lse)
    assert seen["host_gib"] * 2**30 == pytest.approx(LAYERS * (rows * positions * cfg.hidden_size * 4 + out))
    assert seen["host_free_gib"] is None  # a CPU model: nothing page-locked to weigh
    assert seen["planned"] == pytest.approx(50.0 * (1 - plan_mod.MEMORY_HEADROOM)) and seen["estimate"] > 0
    assert p.keep_attention is False and "cuDNN" in p.reasons["keep_attention"]


def test_undo_releases_the_host_buffers_of_the_kept_outputs(tiny_dir, monkeypatch):
    """Kept outputs in host memory take page-locked buffers from the offloader's pool; ``undo()`` must
    unregister them, else a later buffer at a freed address fails to register (a second ``optimize()``
    in the same process, as a memory search does)."""
    from qlora_nb_utils.compile.offload import HostPool

    released = []
    monkeypatch.setattr(HostPool, "release", lambda self: released.append(self))
    model = build(tiny_dir, quant=True, how="kbit")
    opt = optimize(model, batches=[batch(seq=64)], backend="aot_eager", scope="regional", grad_ckpt=True, offload=False)
    try:
        offloader = CpuOffloader(exact_host_buffers=True)
        handle = kept_attention.apply(model, offloader=offloader)
        assert released == []
        handle.undo()
        assert released == [offloader.pool]
    finally:
        opt.undo()
