"""Tests for qlora_nb_utils.env: versions, device and dtype checks, the bitsandbytes probe."""

import importlib.metadata
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from qlora_nb_utils import env


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend to have one CUDA GPU; returns a setter for its name and capability."""

    def install(name="Tesla T4", capability=(7, 5), mem_gib=15.0):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        props = SimpleNamespace(total_memory=int(mem_gib * 2**30))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)

    return install


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_versions_reports_every_library():
    info = env.versions()
    assert set(info) == {"python", "torch", "transformers", "peft", "bitsandbytes",
                         "accelerate", "datasets", "trl", "cuda"}
    assert info["torch"] == torch.__version__
    assert info["python"].count(".") == 2
    assert info["cuda"] == torch.version.cuda
    assert all(isinstance(v, str) for k, v in info.items() if k != "cuda")


def test_versions_never_raises_for_missing_library(monkeypatch):
    real = importlib.metadata.version

    def fake(dist):
        if dist == "trl":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", fake)
    assert env.versions()["trl"] == "not installed"


def test_resolve_device_auto_and_cpu(no_gpu):
    assert env.resolve_device("auto") == torch.device("cpu")
    assert env.resolve_device(None) == torch.device("cpu")
    assert env.resolve_device(" CPU ") == torch.device("cpu")
    assert env.resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("bad", ["npu", "cuda:x", "tpu", "", 3])
def test_resolve_device_rejects_unknown(bad):
    with pytest.raises(ValueError, match="'auto', 'cpu', 'cuda'"):
        env.resolve_device(bad)


def test_resolve_device_cuda_without_gpu_explains(no_gpu):
    with pytest.raises(ValueError, match="no CUDA GPU"):
        env.resolve_device("cuda")


def test_resolve_device_fake_gpu_gets_an_index(fake_gpu):
    fake_gpu()
    assert env.resolve_device("auto") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="has 1 CUDA GPU"):
        env.resolve_device("cuda:3")


@pytest.mark.parametrize("spelling, expected", [
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    ("fp16", torch.float16), ("float16", torch.float16), ("FP32", torch.float32),
    ("float32", torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
])
def test_resolve_dtype_accepts(spelling, expected):
    assert env.resolve_dtype(spelling, "cpu") is expected


@pytest.mark.parametrize("bad", ["int8", "bf32", "", torch.int8, torch.float64, None])
def test_resolve_dtype_rejects_and_lists_choices(bad):
    with pytest.raises(ValueError) as err:
        env.resolve_dtype(bad, "cpu")
    assert "bfloat16" in str(err.value) and "float16" in str(err.value)


def test_bf16_on_pre_ampere_gpu_names_gpu_and_offers_fp16(fake_gpu):
    fake_gpu("Tesla T4", (7, 5))
    with pytest.raises(ValueError) as err:
        env.resolve_dtype("bf16", "cuda")
    message = str(err.value)
    assert "Tesla T4" in message and "7.5" in message and "--dtype float16" in message
    assert env.resolve_dtype("float16", "cuda") is torch.float16


def test_bf16_on_ampere_gpu_is_fine(fake_gpu):
    fake_gpu("NVIDIA A100", (8, 0))
    assert env.resolve_dtype("bfloat16", "cuda:0") is torch.bfloat16


def test_device_info_fake_old_gpu(fake_gpu):
    fake_gpu("Tesla T4", (7, 5), mem_gib=15.0)
    info = env.device_info("cuda")
    assert info == {"type": "cuda", "name": "Tesla T4", "capability": (7, 5),
                    "total_mem_gib": pytest.approx(15.0), "bf16_supported": False,
                    "sm80_plus": False}


def test_device_info_cpu():
    info = env.device_info("cpu")
    assert info["type"] == "cpu" and info["capability"] is None and info["sm80_plus"] is None
    assert info["bf16_supported"] is True
    assert isinstance(info["name"], str) and info["name"]
    assert info["total_mem_gib"] is None or info["total_mem_gib"] > 0


def test_bnb_runs_nf4_on_this_cpu_and_caches(monkeypatch):
    monkeypatch.setattr(env, "_BNB_CACHE", {})
    ok, reason = env.bnb_status("cpu")
    assert ok, reason
    assert "runs NF4 on cpu" in reason

    def broken(dev):
        raise AssertionError("the cached answer should have been used")

    monkeypatch.setattr(env, "_bnb_round_trip", broken)
    assert env.bnb_status("cpu") == (ok, reason)
    env.require_bnb("cpu")  # must not raise


def test_bnb_not_installed_is_reported(monkeypatch):
    monkeypatch.setattr(env, "_BNB_CACHE", {})
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes the import fail
    ok, reason = env.bnb_status("cpu")
    assert not ok and "not installed" in reason
    with pytest.raises(RuntimeError, match="not installed"):
        env.require_bnb("cpu")


def test_bnb_without_backend_is_reported(monkeypatch):
    monkeypatch.setattr(env, "_BNB_CACHE", {})

    def no_kernel(dev):
        raise NotImplementedError("no kernel registered for this device")

    monkeypatch.setattr(env, "_bnb_round_trip", no_kernel)
    ok, reason = env.bnb_status("cpu")
    assert not ok
    assert "installed but cannot run NF4 on cpu" in reason and "no kernel registered" in reason


def test_bitsandbytes_cpu_kernel_note_is_said_plainly_inside_the_block_only(caplog):
    """bitsandbytes' warning about its optional CPU kernel reads like a broken install: inside the
    block it is one INFO line in plain words, other records pass, and the filter is gone after."""
    import logging

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    before = list(logger.filters)
    with caplog.at_level(logging.INFO, logger="bitsandbytes.backends.cpu.ops"):
        with env.bnb_cpu_kernel_note_in_plain_words():
            logger.warning(env.BNB_CPU_KERNEL_NOTE + " from kernels-community: %s. Please pip install kernels",
                           "No module named 'kernels'")
            logger.warning("something else: %s", 1)
        logger.warning(env.BNB_CPU_KERNEL_NOTE + " outside the block")
    (note, other, outside) = caplog.records
    assert note.levelno == logging.INFO and note.getMessage() == env.BNB_CPU_KERNEL_PLAIN
    assert other.levelno == logging.WARNING and other.getMessage() == "something else: 1"
    assert outside.levelno == logging.WARNING and outside.getMessage().startswith(env.BNB_CPU_KERNEL_NOTE)
    assert logger.filters == before  # reversible: nothing left on bitsandbytes' logger


def test_loading_nf4_on_the_cpu_says_the_bitsandbytes_note_once_in_plain_words():
    """A fresh process (bitsandbytes logs the note when first imported) loads a tiny NF4 model on
    the CPU twice with INFO logging on: the raw warning never shows, the plain line at most once,
    exactly once where bitsandbytes has the note to give (AVX512-BF16 and no ``kernels``)."""
    import subprocess

    code = """
import importlib.util, logging
logging.basicConfig(level=logging.INFO)
from qlora_nb_utils import models
for _ in range(2):
    models.load_model("tiny", quant="nf4", lora=False, device="cpu")
from bitsandbytes.functional import has_avx512bf16
print("EXPECT_NOTE", int(has_avx512bf16() and importlib.util.find_spec("kernels") is None))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    expect = int(result.stdout.split("EXPECT_NOTE")[1].split()[0])
    assert env.BNB_CPU_KERNEL_NOTE not in result.stderr + result.stdout
    assert result.stderr.count(env.BNB_CPU_KERNEL_PLAIN) == expect, result.stderr[-2000:]


def test_prefer_expandable_segments_sets_it_only_when_nothing_chose(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # set, then removed: put back as it was after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    done, why = env.prefer_expandable_segments()
    assert done and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True", why
    # a setting already made (by the user or by this call) is left as it is
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    done, why = env.prefer_expandable_segments()
    assert not done and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128" and "already set" in why
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late: the allocator has read it
    done, why = env.prefer_expandable_segments()
    assert not done and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "already initialized" in why


def test_train_with_a_memory_target_asks_for_expandable_segments_before_training(tmp_path, monkeypatch, capsys):
    from qlora_nb_utils import cli
    from qlora_nb_utils.training import finetuning

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # set, then removed: put back as it was after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    seen = {}
    monkeypatch.setattr(finetuning, "finetune", lambda **kw: seen.update(conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
    monkeypatch.setattr(finetuning, "check_options", lambda **kw: None)
    assert cli.main(["train", "--model", "tiny", "--out", str(tmp_path / "r"), "--max-memory-gib", "22"]) == 0
    assert seen["conf"] == "expandable_segments:True"
    assert "allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in capsys.readouterr().err
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert cli.main(["train", "--model", "tiny", "--out", str(tmp_path / "r2")]) == 0  # no target: left alone
    assert seen["conf"] is None


def _import_fresh(tmp_path, name, monkeypatch, *, write: bool):
    """Import a new one-file package from tmp_path, its bytecode written or not."""
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", not write)
    monkeypatch.delitem(sys.modules, name, raising=False)
    __import__(name)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # the package's own imports, as before
    return sys.modules[name]


def test_a_module_imported_without_its_bytecode_is_named_with_the_command_that_writes_it(tmp_path, monkeypatch):
    mod = _import_fresh(tmp_path, "qnb_nobytecode_pkg", monkeypatch, write=False)
    assert not os.path.exists(mod.__cached__)
    assert env.missing_bytecode(("qnb_nobytecode_pkg", "torch", "not_imported_module")) == ["qnb_nobytecode_pkg"]
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    note = env.bytecode_note(("qnb_nobytecode_pkg",))
    assert "no bytecode for qnb_nobytecode_pkg (PYTHONDONTWRITEBYTECODE is set)" in note
    assert note.endswith(f"{sys.executable} -m compileall -q -j 0 {tmp_path}")  # the folder it is installed in
    # the command the note gives writes it, and then the note is gone
    import subprocess
    subprocess.run(note.split("write it once with: ")[1].split(), check=True)
    assert os.path.exists(mod.__cached__) and env.bytecode_note(("qnb_nobytecode_pkg",)) is None


def test_modules_with_their_bytecode_give_no_note(tmp_path, monkeypatch):
    mod = _import_fresh(tmp_path, "qnb_bytecode_pkg", monkeypatch, write=True)
    assert os.path.exists(mod.__cached__)
    assert env.missing_bytecode(("qnb_bytecode_pkg",)) == [] and env.bytecode_note(("qnb_bytecode_pkg",)) is None
