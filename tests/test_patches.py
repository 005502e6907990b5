"""Tests for qlora_nb_utils.compile.patches: each break without its patch, none with it, exact undo.

The models are tiny Llamas saved once to a temporary folder and loaded back through
``from_pretrained`` (with a bitsandbytes NF4 config for QLoRA), then set up for gradient
checkpointing the two ways users do it: ``gradient_checkpointing_enable()`` (transformers'
default, non-reentrant) and ``prepare_model_for_kbit_training(use_gradient_checkpointing=True)``
(peft, reentrant). Breaks are counted with the eager backend: where Dynamo breaks does not
depend on the backend.
"""

import inspect

import pytest
import torch
from tiny_lora import batch, build, save_tiny_llama
from transformers.modeling_utils import PreTrainedModel

from qlora_nb_utils.compile.patches import PATCHES, PatchHandle, input_require_grads, use_cache_warning
from qlora_nb_utils.diagnostics import check_fullgraph, graph_breaks
from qlora_nb_utils.reversible import check_versions, set_attribute


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), layers=2)


def loss_fn(model):
    return lambda **b: model(**b).loss


def lora_grads(model, forward, b):
    model.zero_grad(set_to_none=True)
    forward(**b).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def hooks_snapshot(model):
    return [(m, list(m._forward_hooks.items())) for m in model.modules() if m._forward_hooks]


# ----------------------------------------------------------------------------- smallest repro
def _embedding_with(hook):
    emb = torch.nn.Embedding(8, 4).requires_grad_(False)
    emb.register_forward_hook(hook)
    return emb


def _upstream_style_hook(module, input, output):
    output.requires_grad_(True)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="Dynamo cannot trace requires_grad_ on a returned intermediate (pytorch#170487)")
def test_smallest_repro_upstream_style_hook_breaks():
    assert check_fullgraph(_embedding_with(_upstream_style_hook), torch.tensor([1, 2])).ok


def test_traceable_hook_compiles_and_keeps_eager_behaviour():
    emb = _embedding_with(input_require_grads.requires_grad_unless_compiling)
    assert emb(torch.tensor([1, 2])).requires_grad  # eager: same effect as upstream's hook
    assert check_fullgraph(emb, torch.tensor([1, 2])).ok


# ----------------------------------------------------------------------------- upstream state
CASES = [(False, "enable"), (True, "kbit")]
CASE_IDS = ["lora-gradient_checkpointing_enable", "qlora-prepare_model_for_kbit_training"]


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="transformers' enable_input_require_grads hook breaks the graph")
@pytest.mark.parametrize("quant,how", CASES, ids=CASE_IDS)
def test_upstream_hook_breaks_fullgraph(tiny_dir, quant, how):
    model = build(tiny_dir, quant=quant, how=how)
    result = check_fullgraph(loss_fn(model), **batch())
    assert result.ok, result.error


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="transformers' use_cache warning_once breaks the graph")
def test_upstream_use_cache_warning_breaks(tiny_dir):
    model = build(tiny_dir, quant=False, how="enable", use_cache=True)
    with input_require_grads.patched(model):  # only the second break is left
        result = check_fullgraph(loss_fn(model), **batch())
    assert result.ok, result.error


# ----------------------------------------------------------------------------- with the patches
@pytest.mark.parametrize("quant,how,use_cache", [
    (False, "enable", False), (True, "kbit", True), (True, "enable", True)],
    ids=["lora-enable", "qlora-kbit-use_cache", "qlora-enable-use_cache"])
def test_patched_model_has_zero_breaks(tiny_dir, quant, how, use_cache):
    model = build(tiny_dir, quant=quant, how=how, use_cache=use_cache)
    handles = [input_require_grads.apply(model)]
    if use_cache:
        handles.append(use_cache_warning.apply(model))
    assert handles[0].details["hooks"] >= 1
    report = graph_breaks(loss_fn(model), **batch())
    assert report.graph_break_count == 0 and report.counted_breaks == 0, report.break_reasons
    assert report.graph_count == 1
    assert check_fullgraph(loss_fn(model), **batch()).ok
    for handle in handles:
        handle.undo()


def test_patched_gradients_match_eager_reentrant_qlora(tiny_dir):
    """Reentrant checkpointing (peft's default) needs the hook in eager; compiled it does not."""
    model = build(tiny_dir, quant=True, how="kbit")
    b = batch()
    reference = lora_grads(model, model, b)
    with input_require_grads.patched(model):
        eager_patched = lora_grads(model, model, b)
        compiled = lora_grads(model, torch.compile(model, backend="aot_eager", fullgraph=True), b)
    assert reference.keys() == compiled.keys() and len(reference) == 28
    assert any(g.abs().sum() > 0 for g in reference.values())
    for name in reference:
        assert torch.equal(reference[name], eager_patched[name]), name
        torch.testing.assert_close(compiled[name], reference[name], rtol=1e-5, atol=1e-7)


def test_undo_restores_hooks_exactly_and_is_idempotent(tiny_dir):
    model = build(tiny_dir, quant=True, how="kbit")
    before = hooks_snapshot(model)
    handle = input_require_grads.apply(model)
    assert handle.details["hooks"] == 2  # transformers' and peft's calls both registered one
    after = hooks_snapshot(model)
    assert input_require_grads.find_hooks(model) == []
    assert [(m, [k for k, _ in items]) for m, items in after] == \
        [(m, [k for k, _ in items]) for m, items in before]  # same hook ids, same order
    assert _count_traceable(model) == 2
    handle.undo()
    restored = hooks_snapshot(model)
    assert len(restored) == len(before)
    for (m1, items1), (m2, items2) in zip(before, restored):
        assert m1 is m2
        assert all(k1 == k2 and h1 is h2 for (k1, h1), (k2, h2) in zip(items1, items2))
    assert not handle.active
    handle.undo()  # a second undo changes nothing
    assert all(h1 is h2 for (_, i1), (_, i2) in zip(before, hooks_snapshot(model))
               for (_, h1), (_, h2) in zip(i1, i2))


def _count_traceable(model):
    return sum(h is input_require_grads.requires_grad_unless_compiling
               for m in model.modules() for h in m._forward_hooks.values())


def test_undo_does_not_resurrect_a_hook_removed_meanwhile(tiny_dir):
    model = build(tiny_dir, quant=False, how="enable")
    assert len(input_require_grads.find_hooks(model)) == 2  # transformers' and peft's
    handle = input_require_grads.apply(model)
    model.disable_input_require_grads()  # removes the one it tracks, by its hook id
    assert _count_traceable(model) == 1
    handle.undo()
    assert len(input_require_grads.find_hooks(model)) == 1 and _count_traceable(model) == 0


def test_no_hooks_means_nothing_to_do(tiny_dir):
    model = build(tiny_dir, quant=False, how=None)
    with input_require_grads.patched(model) as handle:
        assert handle.details == {"hooks": 0}


def test_patched_context_manager_undoes_on_error(tiny_dir):
    model = build(tiny_dir, quant=False, how="enable")
    originals = [h for _, _, h in input_require_grads.find_hooks(model)]
    with pytest.raises(KeyError):
        with input_require_grads.patched(model):
            assert input_require_grads.find_hooks(model) == []
            raise KeyError("boom")
    assert [h for _, _, h in input_require_grads.find_hooks(model)] == originals


def test_global_mode_patches_models_set_up_meanwhile(tiny_dir):
    original = PreTrainedModel.__dict__["enable_input_require_grads"]
    with input_require_grads.patched() as handle:
        assert PreTrainedModel.__dict__["enable_input_require_grads"] is not original
        model = build(tiny_dir, quant=False, how="enable")
        assert input_require_grads.find_hooks(model) == []
        assert check_fullgraph(loss_fn(model), **batch()).ok
    assert PreTrainedModel.__dict__["enable_input_require_grads"] is original
    assert not handle.active


# ----------------------------------------------------------------------------- guards
@pytest.mark.parametrize("patch", sorted(PATCHES))
def test_version_guard_refuses(tiny_dir, monkeypatch, patch):
    model = build(tiny_dir, quant=False, how="enable", use_cache=True)
    before = hooks_snapshot(model)
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.49.0")
    with pytest.raises(RuntimeError, match=r"transformers.*4\.49\.0"):
        PATCHES[patch].apply(model)
    assert model.config.use_cache is True
    assert all(h1 is h2 for (_, i1), (_, i2) in zip(before, hooks_snapshot(model))
               for (_, h1), (_, h2) in zip(i1, i2))


def test_changed_hook_body_is_refused_and_nothing_is_swapped(tiny_dir):
    model = build(tiny_dir, quant=False, how="enable")

    def make_inputs_require_grads(module, input, output):  # same name, different body
        return output * 1

    model.get_input_embeddings().register_forward_hook(make_inputs_require_grads)
    with pytest.raises(RuntimeError, match="no longer calls requires_grad_"):
        input_require_grads.apply(model)
    assert _count_traceable(model) == 0


def test_changed_method_signature_is_refused(monkeypatch):
    def enable_input_require_grads(self, layers):
        pass

    monkeypatch.setattr(PreTrainedModel, "enable_input_require_grads", enable_input_require_grads)
    with pytest.raises(RuntimeError, match=r"parameters \['self', 'layers'\]"):
        input_require_grads.apply()


def test_use_cache_guard_refuses_when_the_warning_is_gone(tiny_dir, monkeypatch):
    from transformers.utils import generic

    monkeypatch.setattr(generic, "merge_with_config_defaults", lambda func: func)
    with pytest.raises(RuntimeError, match="no longer warns"):
        use_cache_warning.apply(build(tiny_dir, quant=False, how=None, use_cache=True))


def test_use_cache_patch_undo_and_model_required(tiny_dir):
    model = build(tiny_dir, quant=False, how="enable", use_cache=True)
    configs = use_cache_warning.find_configs(model)
    assert len(configs) == 1 and configs[0] is model.base_model.model.config
    handle = use_cache_warning.apply(model)
    assert handle.details == {"configs": 1} and configs[0].use_cache is False
    handle.undo()
    handle.undo()
    assert configs[0].use_cache is True
    with pytest.raises(ValueError, match="needs a model"):
        use_cache_warning.apply()


# ----------------------------------------------------------------------------- _base
def test_check_versions_message_names_range_and_verified():
    with pytest.raises(RuntimeError, match=r"torch>=99.*verified on"):
        check_versions("demo", {"torch": ">=99"}, {"torch": "2.13.0"})
    with pytest.raises(RuntimeError, match="not installed"):
        check_versions("demo", {"no_such_package_xyz": ">=1"}, {})
    check_versions("demo", {"torch": ">=2.0"}, {})


def test_set_attribute_restores_identity_or_class_fallback():
    class Thing:
        shared = "class value"

    obj, own = Thing(), object()
    obj.mine = own
    handle = PatchHandle("demo")
    set_attribute(handle, obj, "mine", "new")
    set_attribute(handle, obj, "shared", "instance value")
    set_attribute(handle, Thing, "extra", 1)
    handle.undo()
    assert obj.mine is own
    assert "shared" not in vars(obj) and obj.shared == "class value"
    assert not hasattr(Thing, "extra")


def test_patch_handle_undoes_newest_first_and_reports_first_error():
    order = []
    handle = PatchHandle("demo")
    handle.add_undo(lambda: order.append(1))
    handle.add_undo(lambda: (_ for _ in ()).throw(ValueError("step 2")))
    handle.add_undo(lambda: order.append(3))
    with pytest.raises(ValueError, match="step 2"):
        handle.undo()
    assert order == [3, 1]
    handle.undo()  # already undone: nothing runs again
    assert order == [3, 1]
    with pytest.raises(RuntimeError):
        handle.add_undo(lambda: None)


def test_every_patch_module_exposes_the_contract():
    for name, module in PATCHES.items():
        assert module.NAME == name
        assert set(module.SUPPORTED) <= set(module.VERIFIED_ON)
        assert list(inspect.signature(module.apply).parameters) == ["model"]
        assert inspect.signature(module.apply).parameters["model"].default is None
        assert callable(module.patched)
        assert "Smallest reproduction" in module.__doc__
