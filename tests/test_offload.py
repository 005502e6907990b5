"""compile.offload: checkpointed layers' saved inputs kept in CPU memory, on a CPU.

On a CPU the "offloaded" input is a separate CPU copy, so what is checked is what the GPU run
relies on: the checkpoint's saved input goes through the hooks (one pack per checkpointed layer,
one unpack each in the backward), the tensor it was made from is freed before the backward, the
loss and LoRA gradients equal those without offload (fp32, tiny NF4 model), one compilation
with ``fullgraph=True`` in regional scope, and everything comes undone. Whole scope: Dynamo
refuses the hooks inside a graph (xfail, strict), and hooks around the compiled graph bring every
saved tensor back at the backward's start, which is why offloading switches to regional scope.
"""

import pytest
import torch
from tiny_lora import assert_same, batch, build, loss_and_grads, save_tiny_llama

from qlora_nb_utils import optimize
from qlora_nb_utils.compile import decoder_layers, offload, prepare_for_compile, recipe
from qlora_nb_utils.compile.memory_estimate import estimate_terms, peak_from_terms
from qlora_nb_utils.compile.plan import MEMORY_HEADROOM, planning_target

LAYERS = 4  # offloaded, a step holds three layer inputs on the device: fewer layers would not gain


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_offload"), layers=LAYERS)


def assert_offloaded(stats, steps):
    assert stats.packed == stats.unpacked == LAYERS * steps and stats.stored_on == {"cpu"}
    last = list(stats.unpacks)[-LAYERS:]  # backward order: the last layer's input first
    assert all(where == "cpu" for where, _ in last)
    # every layer's input but the first (the embedding output, a leaf autograd holds) was freed
    # before the backward reached it: only the CPU copy was left
    assert [freed for _, freed in last] == [True] * (LAYERS - 1) + [False]


def test_eager_offload_gives_the_same_loss_and_grads_and_frees_the_inputs(tiny_dir):
    model = build(tiny_dir, quant=True, how=None)
    b = batch()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    want = loss_and_grads(model, model, b)
    funcs = [layer._gradient_checkpointing_func for layer in decoder_layers(model)]
    handle = offload.apply(model)
    try:
        assert_same(loss_and_grads(model, model, b), want)
        assert_offloaded(handle.offloader.stats, 1)
        assert handle.offloader.stats.prefetched == LAYERS - 1  # each unpack started the one before
    finally:
        handle.undo()
    assert [layer._gradient_checkpointing_func for layer in decoder_layers(model)] == funcs
    handle.undo()  # twice is safe


def test_exact_host_buffers_are_reused_every_step_with_the_same_grads(tiny_dir, monkeypatch):
    """``exact_host_buffers``: each layer input's copy in a buffer of exactly its bytes, made in the
    first step and taken again by the next (no new buffer), with the same loss and gradients; the
    default follows ``offload.EXACT_HOST_BUFFERS``; ``undo()`` releases the pool."""
    model = build(tiny_dir, quant=True, how=None)
    b = batch()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    want = loss_and_grads(model, model, b)
    monkeypatch.setattr(offload, "EXACT_HOST_BUFFERS", True)
    handle = offload.apply(model)
    try:
        pool = handle.offloader.pool
        assert handle.details["exact_host_buffers"] is True and pool is not None and pool.pin is False  # a CPU
        assert_same(loss_and_grads(model, model, b), want)
        hidden = model.get_base_model().config.hidden_size
        per_layer = b["input_ids"].numel() * hidden * 4  # fp32 hidden states
        made = pool.buffers
        assert made >= LAYERS and pool.bytes >= LAYERS * per_layer
        assert_same(loss_and_grads(model, model, b), want)
        assert pool.buffers == made  # the second step took the first step's buffers again
        assert_offloaded(handle.offloader.stats, 2)
    finally:
        handle.undo()
    assert not pool._free
    plain = offload.apply(model, exact_host_buffers=False)
    assert plain.offloader.pool is None and plain.details["exact_host_buffers"] is False
    plain.undo()


def test_regional_fullgraph_compiles_once_with_the_same_grads(tiny_dir):
    model = build(tiny_dir, quant=True, how="kbit")
    b = batch()
    prepared = prepare_for_compile(model, scope="regional", grad_ckpt=True, backend="aot_eager", fullgraph=True)
    want = loss_and_grads(model, prepared.forward, b)
    handle = offload.apply(model)
    try:
        for _ in range(2):  # fullgraph=True: a break would raise
            got = loss_and_grads(model, prepared.forward, b)
        assert_same(got, want)
        assert (prepared.counter.compilations, prepared.counter.recompilations) == (1, 0)
        assert_offloaded(handle.offloader.stats, 2)
    finally:
        handle.undo()
        prepared.undo()


@pytest.mark.xfail(raises=torch._dynamo.exc.Unsupported, strict=True,
                   reason="Dynamo refuses saved_tensors_hooks inside a graph (torch 2.13): whole scope cannot offload")
def test_whole_scope_fullgraph_traces_the_hooks(tiny_dir):
    model = build(tiny_dir, quant=True, how="kbit")
    prepared = prepare_for_compile(model, scope="whole", grad_ckpt=True, backend="aot_eager", fullgraph=True)
    handle = offload.apply(model)
    try:
        prepared.forward(**batch()).loss.backward()
    finally:
        handle.undo()
        prepared.undo()


def test_hooks_around_the_whole_graph_bring_everything_back_at_once(tiny_dir):
    """Why whole scope is not offloaded from outside: AOTAutograd's one backward unpacks all."""
    model = build(tiny_dir, quant=True, how="kbit")
    prepared = prepare_for_compile(model, scope="whole", grad_ckpt=True, backend="aot_eager", fullgraph=True)
    off = offload.CpuOffloader()
    unpacked_at_first_grad = []
    hooks = [p.register_post_accumulate_grad_hook(
        lambda p: unpacked_at_first_grad.append(off.stats.unpacked) if not unpacked_at_first_grad else None)
        for p in model.parameters() if p.requires_grad]
    try:
        with torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack):
            loss = prepared.forward(**batch()).loss
        loss.backward()
        assert off.stats.packed > LAYERS  # weights and every saved tensor of the graph, not the inputs alone
        assert unpacked_at_first_grad == [off.stats.packed]
    finally:
        for h in hooks:
            h.remove()
        prepared.undo()


@pytest.mark.parametrize("scope", ["whole", "regional"])
def test_optimize_offload_true_is_regional_exact_and_undone(tiny_dir, scope):
    model = build(tiny_dir, quant=True, how="kbit")
    b = batch()
    layers = decoder_layers(model)
    before = [(m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"),
               "_compiled_call_impl" in vars(m)) for m in layers]
    ref = optimize(model, batches=[b], grad_ckpt=True, offload=False, scope="regional", backend="aot_eager")
    want = loss_and_grads(model, ref.forward, b)
    ref.undo()
    opt = optimize(model, batches=[b], offload=True, scope=scope, backend="aot_eager")
    try:
        c, r = opt.choices, opt.reasons
        assert (c["scope"], c["ckpt_layers"], c["offload"]) == ("regional", f"{LAYERS}/{LAYERS}", True)
        assert ("Dynamo refuses saved-tensor hooks" in r["scope"]) == (scope == "whole")
        assert f"offload=True (the inputs of {LAYERS} checkpointed layers in CPU memory" in opt.description
        for _ in range(2):
            got = loss_and_grads(model, opt.forward, b)
        assert_same(got, want)
        assert opt.counter.compilations == 1
        assert_offloaded(opt.fast.offload.offloader.stats, 2)
    finally:
        opt.undo()
    assert [(m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"),
             "_compiled_call_impl" in vars(m)) for m in layers] == before


def test_a_memory_target_picks_offload_only_when_checkpointing_every_layer_is_not_enough(tiny_dir):
    model = build(tiny_dir, quant=True, how="kbit")
    batches = [batch(seq=64)]
    terms = estimate_terms(model, 2, 64, act_bytes=4, cast_dtype=torch.float32, recompute=True,
                           lora_in_place=True, compiled_loss=False)  # optimize()'s defaults, backend="eager"
    all_ckpt, all_off = peak_from_terms(terms, LAYERS), peak_from_terms(terms, LAYERS, offload=True)
    assert all_off < all_ckpt
    between = (all_ckpt + all_off) / 2
    target = between / (1 - MEMORY_HEADROOM)  # the plan fits its estimate under the target less the headroom
    assert planning_target(target) == pytest.approx(between)
    assert target > all_ckpt  # without the headroom, checkpointing every layer would have been taken as enough
    opt = optimize(model, batches=batches, max_memory_gib=target, backend="eager")
    try:
        c, r = opt.choices, opt.reasons
        assert c["offload"] is True and c["scope"] == "regional"
        assert int(c["ckpt_layers"].split("/")[0]) >= 1
        assert f"checkpointing every layer is estimated at {all_ckpt:.2f} GiB > {between:.4g} GiB" in r["offload"]
        assert f"the target {target} GiB less 10% headroom" in r["offload"]
        assert "offload=True" in opt.description
    finally:
        opt.undo()
    opt = optimize(model, batches=batches, max_memory_gib=(all_ckpt + 1) / (1 - MEMORY_HEADROOM), backend="eager")
    try:
        assert opt.choices["offload"] is False and opt.choices["scope"] == "whole"
        assert opt.reasons["offload"].startswith("not needed: the estimate fits the target without it")
    finally:
        opt.undo()
    # offload refused: the most frugal plan left (every layer checkpointed) is over the target, said before any change
    with pytest.raises(ValueError, match=rf"estimated at [\d.]+ GiB > .* even with {LAYERS}/{LAYERS} layers "
                                         r"checkpointed \(offload=False asked for\); (the longest sequence|no sequence fits)"):
        optimize(model, batches=batches, max_memory_gib=all_off / 2, offload=False, backend="eager")
    assert "forward" not in vars(model)


def test_plan_covers_each_way_of_asking():
    est = lambda n, off: 10.0 - n * (2.0 if off else 1.0)  # noqa: E731
    p = offload.plan(4, grad_ckpt="auto", ckpt_layers=None, max_memory_gib=None, offload="auto", scope="whole",
                     estimate=None)
    assert (p.ckpt_layers, p.offload, p.scope) == (0, False, "whole")
    p = offload.plan(4, grad_ckpt="auto", ckpt_layers=None, max_memory_gib=7.5, offload="auto", scope="whole",
                     estimate=est)
    assert (p.ckpt_layers, p.offload) == (3, False)
    p = offload.plan(4, grad_ckpt="auto", ckpt_layers=None, max_memory_gib=4.5, offload="auto", scope="whole",
                     estimate=est)
    assert (p.ckpt_layers, p.offload, p.scope) == (3, True, "regional") and p.scope_why
    p = offload.plan(4, grad_ckpt=True, ckpt_layers=2, max_memory_gib=None, offload=True, scope="regional",
                     estimate=None)
    assert (p.ckpt_layers, p.offload, p.scope, p.scope_why) == (2, True, "regional", None)
    p = offload.plan(4, grad_ckpt="auto", ckpt_layers=None, max_memory_gib=0.5, offload="auto", scope="whole",
                     estimate=est)
    assert (p.ckpt_layers, p.offload) == (4, True) and "and offloaded" in p.ckpt_why


@pytest.mark.parametrize("kwargs, message", [
    ({"offload": "yes"}, "offload must be one of"),
    ({"offload": 1}, "offload must be one of"),
    ({"offload": True, "grad_ckpt": False}, "needs checkpointing"),
    ({"offload": True, "ckpt_layers": 0}, "needs checkpointing"),
])
def test_bad_offload_options_are_refused_before_the_model_changes(tiny_dir, kwargs, message):
    model = build(tiny_dir, quant=False, how=None)
    with pytest.raises(ValueError, match=message):
        optimize(model, batches=[batch()], backend="eager", **kwargs)
    assert "forward" not in vars(model)


def test_prepare_fast_refuses_offload_in_whole_scope_and_a_reentrant_checkpoint(tiny_dir):
    model = build(tiny_dir, quant=False, how=None)
    with pytest.raises(ValueError, match="scope='regional'"):
        recipe.prepare_fast(model, dtype=torch.float32, grad_ckpt=True, offload=True, backend="eager")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="non-reentrant"):
        offload.apply(model)


def test_a_memory_target_keeps_each_loss_piece_to_a_fixed_number_of_rows(tiny_dir):
    """With a memory target the chunked loss takes pieces of at most TARGET_CHUNK_ROWS rows, so its
    transient (one piece of logits) stays the same at any length; without one it keeps ce_chunks
    pieces. The estimate the target is planned with counts the smaller piece."""
    from qlora_nb_utils.compile.plan import TARGET_CHUNK_ROWS, target_chunks

    assert target_chunks(4, 2048) == 4 and target_chunks(4, 4 * TARGET_CHUNK_ROWS + 1) == 5
    assert target_chunks(4, 64 * TARGET_CHUNK_ROWS) == 64 and target_chunks(0, 10**6) == 0
    model = build(tiny_dir, quant=True, how=None)
    long = batch(seq=4 * TARGET_CHUNK_ROWS)  # 2 rows: 8 pieces' worth of tokens
    chunks = {}
    for target in (None, 100.0):
        opt = optimize(model, batches=[long], max_memory_gib=target, backend="eager")
        try:
            chunks[target] = opt.choices["loss"]
            reason = opt.reasons["loss"]
        finally:
            opt.undo()
    assert chunks == {None: "chunked CE x4", 100.0: "chunked CE x8"}
    assert f"pieces of at most {TARGET_CHUNK_ROWS} rows under the memory target" in reason
    four, eight = (estimate_terms(model, 2, 4 * TARGET_CHUNK_ROWS, ce_chunks=n)["logits_gib"] for n in (4, 8))
    assert eight == pytest.approx(four / 2)


def test_an_offload_that_cannot_fit_in_host_memory_is_refused_before_any_step(monkeypatch):
    """Page-locked inputs cannot be swapped out: more than the memory available is refused up front,
    counted as torch's pinned allocator takes it (each rounded up to a power of two) or exactly."""
    monkeypatch.setattr(offload, "EXACT_HOST_BUFFERS", False)
    assert offload.host_bytes(32, 3 * 2**29, exact=False) == 32 * 2**31  # 1.5 GiB takes 2 GiB
    assert offload.host_bytes(32, 3 * 2**29, exact=True) == 32 * 3 * 2**29
    assert offload.host_bytes(4, 2**20, exact=False) == 4 * 2**20  # a power of two already
    monkeypatch.setattr(offload, "available_host_bytes", lambda: 40 * 2**30)
    offload.check_host_memory(32, 2**30)  # 32 GiB of 40: fine
    with pytest.raises(ValueError, match=r"needs about 64.0 GiB of CPU memory, and 40.0 GiB is available"):
        offload.check_host_memory(32, 2**30 + 1, "1 x 131073")
    monkeypatch.setattr(offload, "EXACT_HOST_BUFFERS", True)
    offload.check_host_memory(32, 2**30 + 1)  # exact buffers: 32 GiB and 32 bytes
    monkeypatch.setattr(offload, "available_host_bytes", lambda: None)  # not Linux: nothing to check against
    offload.check_host_memory(10**6, 2**40)


def test_the_host_memory_available_is_read_on_linux():
    have = offload.available_host_bytes()
    assert have is not None and 2**26 < have < 2**50  # this machine: between 64 MiB and 1 PiB
