"""compile.recipe: the fast recipe as plain functions, on tiny LoRA/QLoRA models on a CPU.

The recipe's speed is measured on a GPU by the peers benchmark (``docs/fast_recipe.md``); here
its behaviour: the cast touches only non-LoRA float weights, the prepared forward gives the
model's own loss, checkpointing covers only the first N layers, everything comes undone, and
inconsistent options are refused with a message.
"""

import pytest
import torch
from tiny_lora import batch, build, save_tiny_llama

from qlora_nb_utils.compile import recipe
from qlora_nb_utils.compile.checkpointing import decoder_layers


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=2)


def test_cast_non_lora_leaves_lora_and_packed_weights_alone(folder):
    model = build(folder, quant=False, how=None)
    floats = [n for n, p in model.named_parameters() if p.is_floating_point() and "lora_" not in n]
    assert recipe.cast_non_lora(model, torch.bfloat16) == len(floats) > 0
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if "lora_" in name else torch.bfloat16), name
    assert recipe.cast_non_lora(model, torch.bfloat16) == 0  # nothing left to cast


def test_cast_non_lora_leaves_packed_nf4_words_in_a_float_storage_alone(folder):
    """``bnb_4bit_quant_storage`` a float dtype (how FSDP loads QLoRA): the 4-bit codes are packed in float
    words. A numeric cast would rewrite the bytes and halve how many there are; the model keeps its loss."""
    model = build(folder, quant=True, how=None)
    packed = [p for p in model.parameters() if recipe.is_quantized_weight(p)]
    assert len(packed) == 14  # 7 projections x 2 layers
    for p in packed:
        p.data = p.data.reshape(-1).view(torch.float32).reshape(-1, 1)  # the same bytes in float32 words, as a float storage holds them
    raw = [p.data.view(torch.uint8).clone() for p in packed]
    b = batch()
    with torch.no_grad():
        expected = model(**b).loss
    others = [n for n, p in model.named_parameters()
              if p.is_floating_point() and "lora_" not in n and not recipe.is_quantized_weight(p)]
    assert recipe.cast_non_lora(model, torch.bfloat16) == len(others) > 0
    for p, before in zip(packed, raw):
        assert p.dtype == torch.float32 and torch.equal(p.data.view(torch.uint8), before)
    assert recipe.cast_non_lora(model, torch.float32) == len(others)  # back: the packed words never moved
    with torch.no_grad():
        got = model(**b).loss
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-2)  # only the bf16 round trip of the other weights


def test_prepare_fast_gives_the_model_loss_checkpoints_the_first_layers_and_undoes(folder):
    model = build(folder, quant=True, how="kbit")
    b = batch()
    with torch.no_grad():
        expected = model(**b).loss
    flags = [layer.gradient_checkpointing for layer in decoder_layers(model)]
    assert flags == [True, True]
    fast = recipe.prepare_fast(model, dtype=torch.float32, ce_chunks=2, grad_ckpt=True, ckpt_layers=1,
                               backend="eager", batches=[b], causal_attn=True)
    try:
        assert (fast.cast, fast.ckpt_layers, fast.layers, fast.autocast) == (0, 1, 2, False)
        assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False]
        loss = fast.forward(**b).loss
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)
        loss.backward()
        assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
        assert fast.counter.to_dict()["compilations"] >= 1
    finally:
        fast.undo()
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == flags
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("kwargs, message", [
    ({"ckpt_layers": 1}, "needs grad_ckpt=True"),
    ({"causal_attn": True}, "needs the batches"),
])
def test_prepare_fast_refuses_inconsistent_options(folder, kwargs, message):
    model = build(folder, quant=False, how=None)
    with pytest.raises(ValueError, match=message):
        recipe.prepare_fast(model, dtype=torch.float32, backend="eager", **kwargs)


def test_prepare_fast_refuses_left_padded_batches_for_causal_attention(folder):
    model = build(folder, quant=False, how=None)
    b = batch()
    b["attention_mask"][:, 0] = 0  # a pad on the left
    with pytest.raises(ValueError):
        recipe.prepare_fast(model, dtype=torch.float32, backend="eager", causal_attn=True, batches=[b])
    assert model.config._attn_implementation == "sdpa"  # nothing was left swapped


def test_activation_memory_budget_is_scoped():
    config = torch._functorch.config
    before = config.activation_memory_budget
    with recipe.activation_memory_budget(0.25):
        assert config.activation_memory_budget == 0.25
    with recipe.activation_memory_budget(None):
        assert config.activation_memory_budget == before
    assert config.activation_memory_budget == before
