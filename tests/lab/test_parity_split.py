"""bench.parity_split: the recipe uncompiled with its numerics choices turned on one at a time,
each against HF eager's losses on the same batches from the same LoRA start."""

import pytest

from lab import parity_split


def test_the_recipe_without_its_numerics_choices_is_hf_eager_to_the_bit():
    # bf16 on the CPU: the patches, causal-only attention, padding and the labelled rows change
    # no bit of the loss over two steps; the bf16 cast does, from step 0
    r = parity_split.split("tiny", steps=2, seq_len=64, batch_size=2, variants=["hf-numerics", "recipe"], log=lambda *_: None)
    assert len(r["hf-eager"]) == len(r["floor"]) == 2
    hf_numerics, recipe = r["runs"]["hf-numerics"], r["runs"]["recipe"]
    assert hf_numerics["losses"] == r["hf-eager"] and hf_numerics["max_diff"] == 0.0
    assert hf_numerics["verdict"]["within_floor"]
    assert recipe["step0_diff"] > 0 and recipe["optimize"] == {}
    assert set(recipe["verdict"]) >= {"within_floor", "floor_max_abs_loss_diff", "max_abs_loss_diff"}


@pytest.mark.parametrize("kwargs, message", [({"variants": ["fp8"]}, "unknown variants"), ({"steps": 0}, "steps must be")])
def test_split_refuses_bad_input_before_loading_a_model(kwargs, message):
    with pytest.raises(ValueError, match=message):
        parity_split.split("no-such-model", **kwargs)
