"""Tiny LoRA / QLoRA models for the patch and compile tests, built the way users build them.

A tiny Llama is saved once to a temporary folder and loaded back through ``from_pretrained``
(with a bitsandbytes NF4 config for QLoRA), then set up for gradient checkpointing the two ways
users do it: ``gradient_checkpointing_enable()`` or ``prepare_model_for_kbit_training``.
"""

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

VOCAB = 256


def save_tiny_llama(folder, layers: int):
    """Save a seeded random tiny Llama with ``layers`` decoder layers to ``folder``."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def build(folder, *, quant: bool, how: str | None, use_cache: bool = False):
    """A tiny LoRA or QLoRA model, checkpointing enabled ``how`` users do it (or not at all)."""
    kwargs = {}
    if quant:
        kwargs = {"quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
            "device_map": {"": "cpu"}}
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    base.config.use_cache = use_cache
    if how == "kbit":
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=True)
    elif how == "enable":
        base.gradient_checkpointing_enable()
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():  # PEFT starts B at zero; non-zero B gives A gradients too
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model.train()


def batch(seq: int = 16, seed: int = 3):
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


#: fp32 on a CPU: the same ops in the same order, up to reduction order
TOL = {"rtol": 1e-5, "atol": 1e-6}


def loss_and_grads(model, forward, b):
    """The loss of ``forward(**b)`` and the gradients of ``model``'s trainable parameters."""
    model.zero_grad(set_to_none=True)
    loss = forward(**b).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(got, want):
    """Two :func:`loss_and_grads` results equal within :data:`TOL`, with gradients to compare."""
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert got[1].keys() == want[1].keys() and got[1]
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **TOL, msg=name)
