"""Model FLOPs of a (Q)LoRA step: a hand count, FlopCounterMode over a real step, MFU."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qlora_nb_utils import models
from qlora_nb_utils.bench import flops

# d=8, 2 heads of 4, 1 KV head, MLP 16, one layer, vocab 32
TINY = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
        "num_hidden_layers": 1, "vocab_size": 32}


def test_hand_count_of_a_tiny_config():
    t, r = 1 * 4, 2  # tokens, rank
    kn = {"q": (8, 8), "k": (8, 4), "v": (8, 4), "o": (8, 8), "gate": (8, 16), "up": (8, 16), "down": (16, 8)}
    base_f = sum(2 * t * k * n for k, n in kn.values())                       # 4608
    lora_f = sum(2 * t * r * (k + n) for k, n in kn.values())                 # 2048
    attn_f = 2 * 2 * 1 * 4 * 4 * 8                                            # QK^T and PV: 512
    head_f = 2 * t * 8 * 32                                                   # 2048
    # backward: layer 0's q/k/v read the embeddings (no grad): no input gradient there
    base_b = sum(2 * t * k * n for name, (k, n) in kn.items() if name not in ("q", "k", "v"))
    lora_b = sum(2 * t * r * (k + n) + 2 * t * r * n + (0 if name in ("q", "k", "v") else 2 * t * k * r)
                 for name, (k, n) in kn.items())
    got = flops.train_step_flops(TINY, 1, 4, lora_r=r)
    assert got.parts == {"base": (base_f, base_b), "lora": (lora_f, lora_b), "attention": (attn_f, 2 * attn_f),
                         "lm_head": (head_f, head_f)}
    assert (got.forward, got.backward) == (9216, 10368)
    assert got.total == got.forward + got.backward == 19584
    # the input-grad hook of prepare_model_for_kbit_training adds layer 0's q/k/v input grads
    hooked = flops.train_step_flops(TINY, 1, 4, lora_r=r, embed_requires_grad=True)
    extra = sum(2 * t * k * n + 2 * t * k * r for name, (k, n) in kn.items() if name in ("q", "k", "v"))
    assert hooked.total - got.total == extra
    assert flops.train_step_flops(TINY, 1, 4, lora_r=r, causal_halved=True).parts["attention"] == (256, 512)


def _counted(quant: str):
    model, _ = models.load_model("tiny", quant=quant, dtype="float32", device="cpu", attn_implementation="eager")
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    return counter.get_total_flops(), flops.train_step_flops(model.config, 2, 32, lora_r=16)


def test_count_matches_flop_counter_on_a_real_lora_step():
    counted, ours = _counted("none")
    # FlopCounterMode also counts the rotary embedding's tiny (positions x frequencies) matmul;
    # nothing else differs. Tolerance: 1e-5 relative (the rotary term is 6e-7 here).
    assert ours.total == pytest.approx(counted, rel=1e-5)


def test_qlora_step_counter_misses_only_bnb_forward_inside_its_custom_op():
    counted, ours = _counted("nf4")
    # bitsandbytes' 4-bit forward matmul runs inside its own custom op, below FlopCounterMode;
    # its backward (dequantize, then a plain matmul) is counted. So the counter sees exactly
    # our count minus the base forward, up to the same rotary term as above.
    assert ours.total - ours.parts["base"][0] == pytest.approx(counted, rel=1e-5)


def test_matmul_rate_and_mfu():
    rate = flops.measure_matmul_tflops("cpu", torch.float32, n=128, iters=3, warmup=1)
    assert rate > 0
    assert flops.mfu(2e12, 0.5, 8e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        flops.mfu(1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="lora_targets"):
        flops.train_step_flops(TINY, 1, 4, lora_targets=["lm_head"])
