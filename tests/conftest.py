"""Shared fixtures: every test starts seeded and with a fresh Dynamo cache."""

import os
import random

import pytest
import torch

# A test must never reach a model hub: CI and developer machines are offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed_and_reset():
    torch.compiler.reset()
    random.seed(0)
    torch.manual_seed(0)
    yield
    torch.compiler.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
