"""compile.workers: torch's compile pool asked to start early only by a run that compiles kernels on a GPU."""

import pytest
import torch

from qlora_nb_utils.compile.workers import start_compile_workers

async_compile = pytest.importorskip("torch._inductor.async_compile")


@pytest.fixture
def starts(monkeypatch):
    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(1))
    return calls


def test_a_gpu_run_on_inductor_starts_torchs_pool_once(starts):
    assert start_compile_workers(torch.device("cuda"), "inductor") is True
    assert start_compile_workers("cuda:0") is True
    assert len(starts) == 2


@pytest.mark.parametrize("device,backend", [("cpu", "inductor"), ("cuda", "eager"), ("cuda", "aot_eager")])
def test_runs_that_compile_no_triton_kernels_leave_the_pool_alone(starts, device, backend):
    assert start_compile_workers(device, backend) is False
    assert starts == []
