"""ops.lm_head and optimize()'s loss: the model's own head (bias, scale, soft cap) for every family.

Each family is a two-layer random model built from its transformers config, its head scaled so
that the raw logits reach about 80 (a soft cap of 30 bites, a scale changes the loss by tens),
with LoRA on every linear layer and B non-zero. ``optimize()``'s loss and LoRA gradients must
equal the model's own forward's, fp32 on the CPU.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from qlora_nb_utils.compile import optimize
from qlora_nb_utils.ops.lm_head import LMHead, read_head
from qlora_nb_utils.ops.losses import chunked_cross_entropy

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: model_type -> (config overrides, the head optimize() must find)
FAMILIES = {
    "llama": ({}, "hidden @ W^T"),
    "qwen2": ({}, "hidden @ W^T"),  # biased q, k, v projections
    "qwen3": ({"head_dim": 16}, "hidden @ W^T"),
    "mistral": ({"sliding_window": None}, "hidden @ W^T"),
    "gemma2": ({"head_dim": 16, "final_logit_softcapping": 30.0}, "hidden @ W^T, softcap 30"),
    "gemma3_text": ({"head_dim": 16, "final_logit_softcapping": 30.0}, "hidden @ W^T, softcap 30"),
    "phi3": ({}, "hidden @ W^T"),
    "olmo2": ({}, "hidden @ W^T"),
    "cohere": ({"logit_scale": 0.0625}, "hidden @ W^T, x 0.0625"),
    "granite": ({"logits_scaling": 8.0}, "hidden @ W^T, x 0.125"),  # divides by it
    "hyperclovax": ({"logits_scaling": 0.125}, "hidden @ W^T, x 0.125"),  # multiplies by the same field
    "phi": ({}, "hidden @ W^T + b"),  # an output bias
}
#: families whose map changes the loss: the loss without it must be far off (the test bites)
MAPPED = ("gemma2", "gemma3_text", "cohere", "granite", "hyperclovax")
TOL = 1e-5


def _model(model_type: str, lora_targets="all-linear", **overrides):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**_COMMON, **FAMILIES.get(model_type, ({}, ""))[0], **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # raw logits up to about 80, realistic for a trained model, enough for a cap to bite
        raw = model.get_output_embeddings()(model.model(input_ids=torch.arange(3, 40)[None]).last_hidden_state)
        model.get_output_embeddings().weight.mul_(80 / float(raw.abs().max()))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = torch.randint(3, 256, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt
    labels[1, -2:] = -100
    return model.train(), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _loss_and_grads(model, forward, batch):
    model.zero_grad(set_to_none=True)
    loss = forward(**batch).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(own, got):
    (own_loss, own_grads), (loss, grads) = own, got
    assert abs(loss - own_loss) <= TOL, (loss, own_loss)
    assert own_grads.keys() == grads.keys()
    for name, ref in own_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=TOL, atol=TOL * float(ref.abs().max()), msg=name)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_optimize_computes_each_familys_own_loss_and_lora_gradients(model_type):
    model, batch = _model(model_type)
    own = _loss_and_grads(model, model, batch)
    opt = optimize(model, batches=[batch], backend="aot_eager")
    try:
        assert opt.choices["head"] == FAMILIES[model_type][1], opt.description
        assert opt.choices["loss"] == "chunked CE x4"
        _assert_same(own, _loss_and_grads(model, opt.eager, batch))  # the recipe uncompiled
        _assert_same(own, _loss_and_grads(model, opt.forward, batch))  # traced through AOTAutograd, fullgraph
    finally:
        opt.undo()
    if model_type in MAPPED:  # the map matters at these magnitudes: a loss without it is far off
        causal_lm = model.get_base_model()
        with torch.no_grad():
            hidden = causal_lm.model(input_ids=batch["input_ids"]).last_hidden_state
            plain = chunked_cross_entropy(hidden, causal_lm.get_output_embeddings().weight, batch["labels"])
        assert abs(float(plain) - own[0]) > 1.0


def test_a_config_field_the_architecture_does_not_use_is_not_applied():
    """Llama ignores a ``logits_scaling`` in its config: the probe picks the scale the model applies."""
    model, batch = _model("llama", logits_scaling=4.0)
    head = read_head(model, batch["input_ids"])
    assert head.reproduced and head.scale == 1.0 and head.softcap is None


def test_a_head_it_cannot_reproduce_keeps_the_models_own_loss():
    model, batch = _model("llama", lora_targets=["q_proj", "v_proj", "lm_head"])  # LoRA on the head
    head = read_head(model)
    assert not head.reproduced and "LoRA" in head.why
    own = _loss_and_grads(model, model, batch)
    opt = optimize(model, batches=[batch], backend="aot_eager")
    try:
        assert opt.choices["loss"] == "model's own" and opt.choices["loss_rows"] == "all"
        assert "head=model's own" in opt.description and "LoRA" in opt.reasons["head"]
        _assert_same(own, _loss_and_grads(model, opt.forward, batch))
    finally:
        opt.undo()
    with pytest.raises(ValueError, match="loss_rows=True needs the chunked loss"):
        optimize(model, batches=[batch], loss_rows=True)


def test_a_forward_that_changes_the_logits_otherwise_is_refused():
    model, batch = _model("llama")
    causal_lm = model.get_base_model()
    hook = causal_lm.register_forward_hook(lambda m, a, out: out.__setitem__("logits", out.logits * 2.0 + 1.0))
    try:
        head = read_head(model)
    finally:
        hook.remove()
    assert not head.reproduced and "none of the caps and scales" in head.why


def test_the_probe_leaves_mode_rng_and_model_as_they_were():
    model, batch = _model("gemma2")
    model.eval()
    state = torch.random.get_rng_state()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    head = read_head(model, batch["input_ids"])
    assert head == LMHead(softcap=30.0, why=head.why) and not model.training
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not model.get_base_model().get_output_embeddings()._forward_hooks


@pytest.mark.parametrize(("kwargs", "match"), [({"logit_scale": 0.0}, "logit_scale"), ({"softcap": -1.0}, "softcap"),
                                               ({"bias": torch.zeros(3)}, "bias")])
def test_chunked_loss_refuses_a_bad_head(kwargs, match):
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(torch.randn(1, 4, 8), torch.randn(16, 8), torch.zeros(1, 4, dtype=torch.long), **kwargs)
