"""optimize(recompute=...): the compiled backward recomputes the SwiGLU product and the norm
outputs instead of saving them (recipe.partitioner_settings), counted with
diagnostics.saved_for_backward: fewer saved tensors, the same loss and gradients, one graph."""

import pytest
import torch

from qlora_nb_utils import data as qdata
from qlora_nb_utils import diagnostics, optimize
from qlora_nb_utils.compile import recipe
from qlora_nb_utils.compile.memory_estimate import estimate_terms

# the partitioner that chooses what to save is Inductor's (min-cut); this backend runs it
# without generating code, so the test sees Inductor's choice in seconds
PARTITIONING_BACKEND = "aot_eager_decomp_partition"


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_and_grads(model, batch, backend, rec, **kw):
    torch.compiler.reset()
    opt = optimize(model, batches=[batch], backend=backend, recompute=rec, **kw)
    try:
        assert opt.choices["recompute"] == ("elementwise" if rec else "torch's default")
        saved = diagnostics.saved_for_backward(opt.forward, batch, model=model)
        grads = _grads(model)
        model.zero_grad(set_to_none=True)
        loss = opt(**batch).loss.detach()
        model.zero_grad(set_to_none=True)
        stats = opt.counter.to_dict()
        assert (stats["compilations"], stats["recompilations"]) == (1, 0), stats["recompile_reasons"]
    finally:
        opt.undo()
    return saved, grads, loss


def test_recompute_saves_one_intermediate_tensor_per_layer_fewer_with_the_same_loss_and_grads(tiny):
    model, tok = tiny
    config = model.get_base_model().config
    inter, layers = config.intermediate_size, config.num_hidden_layers
    (batch,) = qdata.build_batches(tok, batch_size=2, steps=1, max_len=64, padding="fixed")
    kept, g_kept, l_kept = _saved_and_grads(model, batch, PARTITIONING_BACKEND, False)
    lean, g_lean, l_lean = _saved_and_grads(model, batch, PARTITIONING_BACKEND, True)
    # torch's default saves gate, up and their SwiGLU product; recompute keeps gate and up only
    assert kept.count_last_dim(inter) == 3 * layers, kept.table()
    assert lean.count_last_dim(inter) == 2 * layers, lean.table()
    assert lean.total_bytes < 0.8 * kept.total_bytes
    assert kept.tokens == batch["input_ids"].numel() and kept.bytes_per_token == kept.total_bytes / kept.tokens
    torch.testing.assert_close(l_lean, l_kept, rtol=1e-6, atol=1e-6)
    assert g_kept.keys() == g_lean.keys() and g_kept
    for name in g_kept:  # fp32: recomputing gives the same values, summed in the same order
        torch.testing.assert_close(g_lean[name], g_kept[name], rtol=1e-5, atol=1e-7, msg=name)


def test_recompute_under_inductor_in_bf16_drops_what_the_memory_estimate_counts():
    """The product path (bf16, autocast, Inductor): per layer, one intermediate-sized and three
    hidden-sized saved tensors fewer (memory_estimate._ACT_RECOMPUTED, counted without lora_addmm,
    whose one addmm per projection already saves one of those hidden-sized copies)."""
    from qlora_nb_utils import models
    from qlora_nb_utils.compile.memory_estimate import _ACT_RECOMPUTED
    from qlora_nb_utils.compile.patches import bnb_cpu_packing

    model, tok = models.load_model("tiny", quant="nf4", dtype="bfloat16", device="cpu", prepare_kbit=True)
    handle = bnb_cpu_packing.apply(model)
    try:
        config = model.get_base_model().config
        hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        (batch,) = qdata.build_batches(tok, batch_size=2, steps=1, max_len=64, padding="fixed")
        kept, _, l_kept = _saved_and_grads(model, batch, "inductor", False, scope="regional", lora_addmm=False)
        lean, _, l_lean = _saved_and_grads(model, batch, "inductor", True, scope="regional", lora_addmm=False)
    finally:
        handle.undo()
    assert kept.count_last_dim(inter) - lean.count_last_dim(inter) == _ACT_RECOMPUTED[1] * layers, lean.table()
    assert kept.count_last_dim(hidden) - lean.count_last_dim(hidden) == _ACT_RECOMPUTED[0] * layers, (
        kept.table(), lean.table())
    assert lean.bytes_per_token < 0.75 * kept.bytes_per_token
    torch.testing.assert_close(l_lean, l_kept, rtol=2e-2, atol=2e-2)  # bf16: recompute may round in another kernel


def test_recompute_step_has_no_graph_break(tiny):
    model, tok = tiny
    (batch,) = qdata.build_batches(tok, batch_size=2, steps=1, max_len=64, padding="fixed")
    opt = optimize(model, batches=[batch], backend="eager", recompute=True)
    try:
        assert diagnostics.graph_breaks(opt.eager_prepared, **opt.prepare(**batch)).graph_break_count == 0
    finally:
        opt.undo()


def test_partitioner_settings_are_scoped_and_refused_where_torch_lacks_them(monkeypatch):
    config = torch._functorch.config
    before = (getattr(config, recipe.RECOMPUTE_KNOB), config.activation_memory_budget)
    with recipe.partitioner_settings(0.5, recompute_elementwise=True):
        assert (getattr(config, recipe.RECOMPUTE_KNOB), config.activation_memory_budget) == (False, 0.5)
    assert (getattr(config, recipe.RECOMPUTE_KNOB), config.activation_memory_budget) == before
    monkeypatch.setattr(recipe, "RECOMPUTE_KNOB", "no_such_setting")
    assert not recipe.can_recompute_elementwise()
    with pytest.raises(RuntimeError, match="no torch._functorch.config.no_such_setting"):
        with recipe.partitioner_settings(recompute_elementwise=True):
            pass


def test_recompute_choice_is_checked_and_counted_by_the_estimate(tiny, monkeypatch):
    model, tok = tiny
    with pytest.raises(ValueError, match="recompute"):
        optimize(model, recompute="sometimes")
    kept = estimate_terms(model, 8, 1024)
    lean = estimate_terms(model, 8, 1024, recompute=True)
    counted = 8 * 1024 * (3 * kept["hidden"] + kept["intermediate"]) * kept["act_bytes"] / 2**30
    assert kept["per_layer_gib"] - lean["per_layer_gib"] == pytest.approx(counted)
    # the in-place LoRA update: one more intermediate-sized tensor in the MLP's backward, at most that at the peak
    from qlora_nb_utils.compile.memory_estimate import peak_from_terms

    inplace = estimate_terms(model, 8, 1024, recompute=True, lora_in_place=True)
    one = 8 * 1024 * kept["intermediate"] * kept["act_bytes"] / 2**30
    assert lean["lora_in_place_gib"] == 0.0 and inplace["lora_in_place_gib"] == pytest.approx(one)
    for n in (0, 1, kept["layers"]):
        assert 0.0 <= peak_from_terms(inplace, n) - peak_from_terms(lean, n) <= one + 1e-12
    from qlora_nb_utils.compile import fast_path

    monkeypatch.setattr(fast_path, "can_recompute_elementwise", lambda: False)
    with pytest.raises(ValueError, match="recompute=True: torch .* has no setting"):
        optimize(model, backend="eager", recompute=True)  # refused at once, not at the first step
    opt = optimize(model, backend="eager")
    try:
        assert opt.choices["recompute"] == "torch's default"
        assert "no such setting" in opt.reasons["recompute"]
    finally:
        opt.undo()


def test_saved_for_backward_refuses_a_batch_without_input_ids():
    with pytest.raises(ValueError, match="input_ids"):
        diagnostics.saved_for_backward(lambda **b: None, {"labels": torch.zeros(2, 3)})
