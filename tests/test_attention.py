"""Causal-only SDPA: same loss as the padding mask on right-padded batches, one graph, undo, bad input."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qlora_nb_utils import attention, diagnostics


def _model(attn="sdpa"):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, attn_implementation=attn)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0
    mask[2, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_causal_sdpa_gives_the_masked_loss_and_grads_on_right_padded_batches():
    model, batch = _model(), _batch()
    ref = model(**batch).loss
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    with attention.use_causal_sdpa(model) as handle:
        assert model.config._attn_implementation == attention.CAUSAL_SDPA
        new = model(**batch).loss
        grads = torch.autograd.grad(new, list(model.parameters()))
    assert not handle.active
    torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_without_the_mask_the_padded_positions_differ():
    """The switch really drops the mask: logits at pad positions change, real positions do not."""
    model, batch = _model(), _batch()
    ref = model(**batch).logits
    with attention.use_causal_sdpa(model):
        new = model(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(new[real], ref[real], atol=1e-5, rtol=1e-5)
    assert (new[~real] - ref[~real]).abs().max() > 1e-3


def test_compiled_causal_sdpa_is_one_graph_and_builds_no_mask():
    model, batch = _model(), _batch()
    ref = model(**batch).loss
    torch._dynamo.reset()
    with attention.use_causal_sdpa(model):
        counter = diagnostics.CompileCounter(backend="aot_eager")
        compiled = counter.compile(model, fullgraph=True)
        loss = compiled(**batch).loss
        graph = diagnostics.graph_breaks(model, **batch)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    assert counter.to_dict()["compilations"] == 1
    assert graph.graph_break_count == 0 and graph.graph_count == 1
    torch._dynamo.reset()


def test_undo_restores_sdpa_and_the_model_runs_as_before():
    model, batch = _model(), _batch()
    before = model(**batch).loss
    handle = attention.use_causal_sdpa(model)
    handle.undo()
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(model(**batch).loss, before)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="expects a model using 'sdpa'"):
        attention.use_causal_sdpa(_model("eager"))
    with pytest.raises(ValueError, match="holds no transformers config"):
        attention.use_causal_sdpa(torch.nn.Linear(2, 2))
    left = {"attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]])}
    with pytest.raises(ValueError, match="batch 1 is not right-padded"):
        attention.check_right_padded([_batch(), left])
    with pytest.raises(ValueError, match="must be 2-D"):
        attention.check_right_padded([{"attention_mask": torch.ones(3)}])
    assert attention.check_right_padded([_batch(), {"input_ids": torch.ones(2, 3)}]) == 2
