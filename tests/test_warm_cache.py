"""optimize(warm_cache=...): AOTAutograd's on-disk cache takes the recipe's graphs, which hold
autograd Functions (recipe.partitioner_settings(cache_functions=True)). Without the setting the
cache refuses them (a bypass), so a warm process traced and partitioned the joint graph again;
with it, a second compile after torch.compiler.reset() (what a new process sees) is a hit and
trains to the same bits."""

import pytest
import torch
from torch._dynamo.utils import counters

from qlora_nb_utils import data as qdata
from qlora_nb_utils import optimize
from qlora_nb_utils.compile import fast_path, recipe


def _batch(tok):
    (batch,) = qdata.build_batches(tok, batch_size=2, steps=1, max_len=64, padding="fixed")
    return batch


def _compile_once(model, batch, **kw):
    """One fresh Dynamo compile of a regional step: (loss, LoRA grads, AOTAutograd's counters)."""
    torch.compiler.reset()
    counters.clear()
    opt = optimize(model, batches=[batch], scope="regional", **kw)
    try:
        loss = opt(**batch).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        assert opt.counter.compilations == 1, opt.counter.recompile_reasons
        return loss.detach(), grads, dict(counters["aot_autograd"]), opt.choices["warm_cache"]
    finally:
        opt.undo()


@pytest.mark.skipif(not recipe.can_cache_functions(), reason="this torch has no setting for it")
def test_warm_cache_makes_a_second_compile_an_aot_autograd_cache_hit_with_the_same_bits(tiny, tmp_path):
    from torch._inductor.utils import fresh_cache

    model, tok = tiny
    batch = _batch(tok)
    with fresh_cache(dir=str(tmp_path)):
        cold_loss, cold_grads, cold, choice = _compile_once(model, batch)  # "auto"
        assert choice is True
        assert cold.get("autograd_cache_saved", 0) >= 1 and not cold.get("autograd_cache_bypass"), cold
        warm_loss, warm_grads, warm, _ = _compile_once(model, batch)
        assert warm.get("autograd_cache_hit", 0) >= 1, warm
        assert not warm.get("autograd_cache_miss") and not warm.get("autograd_cache_bypass"), warm
        # the same warm cache without the setting: the cache refuses the graph (torch's default; if a
        # torch takes autograd Functions by itself, this fails and the setting is no longer needed)
        _, _, off, choice = _compile_once(model, batch, warm_cache=False)
        assert choice is False
        assert off.get("autograd_cache_bypass", 0) >= 1 and not off.get("autograd_cache_hit"), off
    assert torch.equal(cold_loss, warm_loss)
    assert cold_grads.keys() == warm_grads.keys() and len(cold_grads) > 0
    for name, grad in cold_grads.items():
        assert torch.equal(grad, warm_grads[name]), name


def test_cache_setting_is_scoped_and_refused_where_torch_lacks_it(monkeypatch):
    config = torch._functorch.config
    if recipe.can_cache_functions():
        before = getattr(config, recipe.CACHE_FUNCTIONS_KNOB)
        with recipe.partitioner_settings(cache_functions=True):
            assert getattr(config, recipe.CACHE_FUNCTIONS_KNOB) is True
        assert getattr(config, recipe.CACHE_FUNCTIONS_KNOB) == before
    monkeypatch.setattr(recipe, "CACHE_FUNCTIONS_KNOB", "no_such_setting")
    assert not recipe.can_cache_functions()
    with pytest.raises(RuntimeError, match="no torch._functorch.config.no_such_setting"):
        with recipe.partitioner_settings(cache_functions=True):
            pass


def test_warm_cache_choice_is_checked_refused_early_and_explained(tiny, monkeypatch):
    model, _ = tiny
    with pytest.raises(ValueError, match="warm_cache must be one of"):
        optimize(model, warm_cache="sometimes")
    opt = optimize(model, backend="eager")
    try:  # only Inductor has the cache
        assert opt.choices["warm_cache"] is False and "backend 'eager'" in opt.reasons["warm_cache"]
    finally:
        opt.undo()
    monkeypatch.setattr(fast_path, "can_cache_functions", lambda: False)
    with pytest.raises(ValueError, match="warm_cache=True: torch .* has no setting"):
        optimize(model, warm_cache=True)  # refused at once, not at the first step
    opt = optimize(model)
    try:
        assert opt.choices["warm_cache"] is False
        assert "no such setting" in opt.reasons["warm_cache"]
    finally:
        opt.undo()
