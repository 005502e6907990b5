"""The training loop: history columns, determinism, accumulation, interrupts, adapters."""

import pandas as pd
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from qlora_nb_utils.training.loop import (
    TrainConfig,
    TrainingInterrupted,
    load_trainable_state,
    summarize,
    train,
    trainable_state,
)

VOCAB = 96


def tiny_lora(seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    base = LlamaForCausalLM(cfg)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    # PEFT initialises B to zero; give it values so that gradients reach A too.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


def make_batches(n: int = 4, bsz: int = 2, seq: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (bsz, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0  # some padding, which the token count must leave out
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def test_history_columns_and_token_counts():
    hist = train(tiny_lora(), make_batches(), TrainConfig(steps=3, progress=False))
    assert list(hist["step"]) == [0, 1, 2]
    assert {"run", "loss", "step_ms", "tokens", "tokens_per_s", "peak_mem_gib", "lr", "grad_norm"} <= set(hist.columns)
    assert (hist["tokens"] == 2 * 16 - 3).all()
    assert (hist["step_ms"] > 0).all() and (hist["peak_mem_gib"] > 0).all()
    # the run's peak so far never falls and is never below the step's own peak
    assert hist["peak_mem_gib"].is_monotonic_increasing
    assert (hist["peak_mem_gib"] >= hist["step_peak_mem_gib"]).all()


def test_loss_falls_when_repeating_one_batch():
    batch = make_batches(n=1)
    hist = train(tiny_lora(), batch, TrainConfig(steps=12, lr=5e-2, progress=False))
    assert hist["loss"].iloc[-1] < hist["loss"].iloc[0] - 0.05


def test_same_seed_same_losses_and_restore_state():
    model = tiny_lora()
    start = trainable_state(model)
    first = train(model, make_batches(), TrainConfig(steps=3, progress=False))
    assert not torch.equal(next(iter(start.values())), trainable_state(model)[next(iter(start))])
    load_trainable_state(model, start)
    second = train(model, make_batches(), TrainConfig(steps=3, progress=False))
    pd.testing.assert_series_equal(first["loss"], second["loss"], rtol=0, atol=0)


def test_grad_accum_of_halves_equals_full_batch():
    full = make_batches(n=1, bsz=4)[0]
    full["attention_mask"][:] = 1
    full["labels"] = full["input_ids"].clone()
    halves = [{k: v[:2] for k, v in full.items()}, {k: v[2:] for k, v in full.items()}]
    a = tiny_lora()
    b = tiny_lora()
    train(a, [full], TrainConfig(steps=1, max_grad_norm=None, progress=False))
    train(b, halves, TrainConfig(steps=1, grad_accum=2, max_grad_norm=None, progress=False))
    for (n, pa), pb in zip(trainable_state(a).items(), trainable_state(b).values()):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6, msg=n)


def test_interrupt_saves_adapter_and_keeps_history(tmp_path):
    model = tiny_lora()
    batches = make_batches()
    calls = {"n": 0}

    def forward(**batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return model(**batch)

    with pytest.raises(TrainingInterrupted) as info:
        train(model, batches, TrainConfig(steps=5, progress=False, adapter_dir=tmp_path / "ad"), forward=forward)
    assert len(info.value.history) == 2
    assert (tmp_path / "ad" / "adapter_config.json").is_file()
    assert info.value.adapter_dir == tmp_path / "ad"


def test_adapter_saved_at_end(tmp_path):
    train(tiny_lora(), make_batches(), TrainConfig(steps=1, progress=False, adapter_dir=tmp_path / "a"))
    assert (tmp_path / "a" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    "kwargs", [{"steps": 0}, {"grad_accum": 0}, {"lr": 0.0}, {"warmup_steps": -1}]
)
def test_bad_config_is_rejected(kwargs):
    with pytest.raises(ValueError):
        TrainConfig(**kwargs)


def test_no_trainable_parameter_is_an_error():
    model = tiny_lora()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        train(model, make_batches(), TrainConfig(steps=1, progress=False))


def test_empty_batches_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        train(tiny_lora(), [], TrainConfig(steps=1, progress=False))


def test_summarize_medians_skip_warmup():
    hist = pd.DataFrame(
        {"step": range(5), "loss": [5, 4, 3, 2, 1], "step_ms": [1000, 10, 20, 30, 40],
         "tokens_per_s": [1, 100, 200, 300, 400], "peak_mem_gib": [1, 2, 3, 2, 1]}
    )
    s = summarize(hist, warmup=1)
    assert s["median_step_ms"] == 25 and s["tokens_per_s"] == 250
    assert s["peak_mem_gib"] == 3 and s["first_step_s"] == 1.0 and s["losses"] == [5, 4, 3, 2, 1]
    assert s["steady_peak_mem_gib"] is None  # a history without per-step peaks
    with pytest.raises(ValueError, match="warm-up"):
        summarize(hist, warmup=5)


def test_summarize_separates_the_steady_peak_from_the_compile_steps():
    step_peaks = [9.0, 4.0, 3.0, 3.5, 3.0]  # the first step compiled and peaked higher
    hist = pd.DataFrame({"step": range(5), "loss": [5, 4, 3, 2, 1], "step_ms": [1000, 10, 20, 30, 40],
                         "tokens_per_s": [1, 100, 200, 300, 400], "step_peak_mem_gib": step_peaks,
                         "peak_mem_gib": pd.Series(step_peaks).cummax()})
    s = summarize(hist, warmup=2)
    assert s["peak_mem_gib"] == 9.0 and s["steady_peak_mem_gib"] == 3.5


def test_compiled_forward_matches_eager_fp32():
    batches = make_batches()
    model = tiny_lora()
    start = trainable_state(model)
    eager = train(model, batches, TrainConfig(steps=4, progress=False))
    load_trainable_state(model, start)
    compiled = train(model, batches, TrainConfig(steps=4, progress=False), forward=torch.compile(model, fullgraph=True))
    diff = (eager["loss"] - compiled["loss"]).abs().max()
    assert diff <= 1e-4, diff


def test_a_run_does_not_count_garbage_left_by_earlier_work():
    """A tensor held only by a reference cycle is collected before the run measures anything."""
    import gc
    import weakref

    model, batches = tiny_lora(), make_batches()
    big = torch.zeros(1 << 20)
    cycle = [big]
    cycle.append(cycle)
    alive = weakref.ref(big)
    del big, cycle
    gc.disable()  # no automatic collection: only the run's own can free the cycle
    try:
        assert alive() is not None
        train(model, batches, TrainConfig(steps=1, progress=False))
    finally:
        gc.enable()
    assert alive() is None
