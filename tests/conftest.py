"""Shared fixtures: every test starts seeded and with a fresh Dynamo cache."""

import os
import random
import sys
from pathlib import Path

import pytest
import torch

# The lab (lab/ beside the package) runs from a checkout: its tests import it from the repository root.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# A test must never reach a model hub: CI and developer machines are offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (the test command runs one worker per core) each worker computes on one
# thread, and so does every process it starts (notebook kernels, CLI runs, FSDP ranks): two
# processes that each use every core slow each other many times over.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_and_reset():
    torch.compiler.reset()
    random.seed(0)
    torch.manual_seed(0)
    yield
    torch.compiler.reset()


@pytest.fixture(scope="module")
def tiny():
    """The tiny NF4 + LoRA model (fp32, CPU) with its tokenizer, for a module's tests.

    Its NF4 weights are kept in bitsandbytes' training layout (no_grad passes must not repack
    them into the CPU inference layout: another kernel, other numbers, lost gradients; see
    ``bnb_cpu_packing``), and LoRA B is non-zero (PEFT starts it at zero), so A gets gradients too.
    """
    from qlora_nb_utils import models
    from qlora_nb_utils.compile.patches import bnb_cpu_packing

    model, tok = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu")
    handle = bnb_cpu_packing.apply(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    yield model, tok
    handle.undo()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
