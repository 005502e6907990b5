"""lab/trials.py: a trial's process-wide settings, as each lab tool makes them in the process it measures."""

from torch._inductor import config as inductor

from lab import trials
from qlora_nb_utils.compile.patches import nf4_dequant
from qlora_nb_utils.ops import losses


def test_no_trial_named_sets_nothing():
    assert trials.from_environment({"PATH": "/bin"}) == {}


def test_the_nf4_row_threshold_trial_sets_the_cuda_threshold_only(monkeypatch):
    monkeypatch.setattr(nf4_dequant, "_cuda_rows", nf4_dequant._cuda_rows)  # put back after the test
    assert trials.from_environment({trials.ROWS_ENV: "0"}) == {"nf4_min_rows": 0}
    assert nf4_dequant.own_rows("cuda") == 0 and nf4_dequant.own_rows("cpu") == 0
    assert trials.nf4_min_rows(768) == 768 and nf4_dequant.own_rows("cuda") == 768


def test_the_light_trial_holds_kernels_to_one_configuration_and_the_loss_math_eager(monkeypatch):
    monkeypatch.setattr(losses, "_COMPILED_MATH", {})
    # torch's own patch puts the settings back (a monkeypatch of a config entry hides it from later reads)
    with inductor.patch({"triton.autotune_pointwise": True, "test_configs.force_filter_reduction_configs": False}):
        trial = trials.from_environment({trials.LIGHT_ENV: "one-config,eager-loss"})
        assert trial == {"light": {"autotune_pointwise": False, "force_filter_reduction_configs": True,
                                   "loss_math": "eager"}}
        assert inductor.triton.autotune_pointwise is False and inductor.test_configs.force_filter_reduction_configs
        assert losses._math(compiled=True) is losses._ce_math
    assert inductor.triton.autotune_pointwise is True


def test_the_combo_trial_turns_inductors_horizontal_fusion_on():
    with inductor.patch(combo_kernels=False):
        assert trials.from_environment({trials.LIGHT_ENV: "combo-kernels"}) == {"light": {"combo_kernels": True}}
        assert inductor.combo_kernels is True
    assert inductor.combo_kernels is False


def test_the_no_patterns_trial_turns_inductors_pattern_matcher_off():
    with inductor.patch(pattern_matcher=True):
        assert trials.from_environment({trials.LIGHT_ENV: "no-patterns"}) == {"light": {"pattern_matcher": False}}
        assert inductor.pattern_matcher is False
    assert inductor.pattern_matcher is True


def test_the_early_pool_trial_starts_inductors_workers_through_torch(monkeypatch):
    from torch._inductor import async_compile

    started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(True))
    assert trials.from_environment({trials.LIGHT_ENV: "early-pool"}) == {"light": {"early_pool": True}}
    assert started == [True]


def test_the_nested_trial_marks_the_llama_layer_and_says_so(monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", modeling_llama.LlamaDecoderLayer.forward)
    before = modeling_llama.LlamaDecoderLayer.forward
    trial = trials.from_environment({trials.NESTED_ENV: "1"})
    assert modeling_llama.LlamaDecoderLayer.forward is not before
    assert trial["nested"] == "LlamaDecoderLayer.forward" and trial["nested_compile_region"].startswith("(")


def test_the_stance_trial_runs_compiled_functions_as_plain_code():
    import torch
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    try:
        assert trials.from_environment({trials.STANCE_ENV: "force_eager"}) == {"stance": "force_eager"}
        assert torch.compile(lambda x: x + 1, backend=counter)(torch.ones(1)).item() == 2.0
    finally:
        torch.compiler.set_stance("default")
    assert counter.frame_count == 0
