"""gpulock: steps of concurrent processes never overlap; compilation inside a step does not hold the lock."""

import fcntl
import os

import pytest
import torch

from qlora_nb_utils.training import gpulock


def _free(path) -> bool:
    """Whether another open file description could take the lock now."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def test_no_env_means_no_lock(monkeypatch):
    monkeypatch.delenv(gpulock.LOCK_ENV, raising=False)
    assert gpulock.lock_path() is None
    with gpulock.step_lock():
        pass


def test_held_during_a_step_released_after(tmp_path):
    path = str(tmp_path / "gpu.lock")
    lock = gpulock.StepLock(path)
    try:
        with lock.step():
            assert lock.held and not _free(path)
        assert not lock.held and _free(path)
    finally:
        lock.close()


def test_released_while_compiling_inside_a_step(tmp_path):
    path = str(tmp_path / "gpu.lock")
    lock = gpulock.StepLock(path)
    seen = {}

    def backend(gm, example_inputs):
        seen["free_while_compiling"] = _free(path)
        return gm.forward

    fn = torch.compile(lambda x: x * 2 + 1, backend=backend)
    try:
        with lock.step():
            fn(torch.ones(3))
            seen["free_after_compile"] = _free(path)
    finally:
        lock.close()
    assert seen == {"free_while_compiling": True, "free_after_compile": False}


def test_close_removes_the_callbacks(tmp_path):
    from torch._dynamo.callback import callback_handler

    before = (len(callback_handler.start_callbacks), len(callback_handler.end_callbacks))
    lock = gpulock.StepLock(str(tmp_path / "gpu.lock"))
    with lock.step():
        assert len(callback_handler.start_callbacks) == before[0] + 1
    lock.close()
    assert (len(callback_handler.start_callbacks), len(callback_handler.end_callbacks)) == before


def test_train_takes_the_lock_per_step(tmp_path, monkeypatch):
    from qlora_nb_utils.training.loop import TrainConfig, train

    path = str(tmp_path / "gpu.lock")
    monkeypatch.setenv(gpulock.LOCK_ENV, path)
    model = torch.nn.Linear(4, 4)
    states = []

    class Out:
        def __init__(self, loss):
            self.loss = loss

    def forward(input_ids, attention_mask, labels):
        states.append(_free(path))
        return Out(model(input_ids.float()).pow(2).mean())

    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long),
             "labels": torch.ones(2, 4, dtype=torch.long)}
    try:
        train(model, [batch], TrainConfig(steps=3, progress=False), forward=forward)
    finally:
        gpulock._shared.pop(path).close()
    assert states == [False, False, False]
    assert _free(path)


def test_empty_path_is_rejected():
    with pytest.raises(ValueError, match="lock file"):
        gpulock.StepLock("")


def test_still_released_while_compiling_after_a_compiler_reset(tmp_path):
    # torch.compiler.reset() clears every compile callback; the lock must register again.
    path = str(tmp_path / "gpu.lock")
    lock = gpulock.StepLock(path)
    seen = []

    def backend(gm, example_inputs):
        seen.append(_free(path))
        return gm.forward

    try:
        for _ in range(2):
            with lock.step():
                torch.compile(lambda x: x - 1, backend=backend)(torch.ones(2))
            torch.compiler.reset()
    finally:
        lock.close()
    assert seen == [True, True]
