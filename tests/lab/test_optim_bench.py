"""The optimizer study on the tiny model: every optimizer trains the same curve, the compiled
step compiles once for the whole LR warm-up, and bad input is refused."""

import pytest
import torch

from lab import optim_bench


@pytest.fixture(scope="module")
def study():
    return optim_bench.compare_optimizers("tiny", quant="none", steps=4, batch_size=2, max_len=192, device="cpu",
                                          backend="eager", warmup=1, repeats=3, log=lambda *_: None)


def test_every_optimizer_trains_the_same_curve_and_the_compiled_step_compiles_once(study):
    runs = {r["optimizer"]: r for r in study["runs"]}
    assert list(runs) == list(optim_bench.OPTIMIZERS)
    assert runs["compiled"]["optimizer_compilations"] == 1  # the warm-up changes lr at every step
    assert runs["foreach"]["optimizer_compilations"] is None
    for r in runs.values():
        assert len(r["losses"]) == 4 and r["max_abs_loss_diff_vs_first"] <= 1e-5
        assert r["optimizer_step"]["repeats"] == 3 and r["optimizer_step"]["median_ms"] > 0
    assert study["options"]["trainable_tensors"] > 0 and {"device", "versions", "command", "date"} <= set(study)


def test_the_step_timer_needs_gradients_and_repeats():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    with pytest.raises(ValueError, match="gradient"):
        optim_bench.time_optimizer_step(opt, [p])
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="repeats"):
        optim_bench.time_optimizer_step(opt, [p], repeats=0)
    assert optim_bench.time_optimizer_step(opt, [p], repeats=2, warmup=0)["repeats"] == 2


def test_unknown_optimizers_are_refused():
    with pytest.raises(ValueError, match="compiled"):
        optim_bench.compare_optimizers("tiny", optimizers=("sgd",))
    with pytest.raises(ValueError, match="at least one"):
        optim_bench.compare_optimizers("tiny", optimizers=())
