"""qlora-nb: every command refuses a bad output path (and other bad input) before any model loads."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from qlora_nb_utils import cli


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the refusals must come first.

    The public face (``qlora_nb_utils.load_model``) is patched too: a lazy name looked up while
    the stand-in is in place would otherwise keep it for every later test in the process.
    """
    import qlora_nb_utils
    from qlora_nb_utils import models
    from qlora_nb_utils.models import load

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    # top down: each records the real function as the one to put back (monkeypatch reads the
    # old value through the lazy lookup, which would find the stand-in below it once set)
    monkeypatch.setattr(qlora_nb_utils, "load_model", refuse, raising=False)
    monkeypatch.setattr(models, "load_model", refuse, raising=False)
    monkeypatch.setattr(load, "load_model", refuse)


def _refused(argv, capsys, *needles):
    start = time.monotonic()
    assert cli.main(argv) == 2
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith(f"qlora-nb {argv[0]}: error:")
    for needle in needles:
        assert needle in err, err
    return err


def test_bench_refuses_an_existing_file_as_out(tmp_path, capsys, no_model):
    out = tmp_path / "results.txt"
    out.write_text("mine\n")
    _refused(["bench", "--model", "tiny", "--device", "cpu", "--out", str(out)], capsys, "is a file, not a folder")
    assert out.read_text() == "mine\n"


def test_bench_refuses_an_out_under_a_file(tmp_path, capsys, no_model):
    (tmp_path / "f").write_text("")
    _refused(["bench", "--device", "cpu", "--out", str(tmp_path / "f" / "run")], capsys, "cannot be made")


def test_diagnose_refuses_a_folder_as_json(tmp_path, capsys, no_model):
    _refused(["diagnose", "--device", "cpu", "--json", str(tmp_path)], capsys, "is a folder")


def test_quantize_refuses_a_non_empty_out_and_a_bad_model(tmp_path, capsys, no_model):
    (tmp_path / "x").write_text("")
    _refused(["quantize", "tiny", str(tmp_path), "--device", "cpu"], capsys, "not empty", "--overwrite")
    _refused(["quantize", str(tmp_path / "nowhere"), str(tmp_path / "new"), "--device", "cpu"], capsys,
             "unknown model")


def test_train_refuses_an_existing_file_as_out(tmp_path, capsys, no_model):
    out = tmp_path / "run"
    out.write_text("")
    _refused(["train", "--model", "tiny", "--device", "cpu", "--out", str(out)], capsys, str(out))


def test_report_refuses_a_missing_file(tmp_path, capsys):
    _refused(["report", str(tmp_path / "missing.json")], capsys, "not found")


def test_bench_out_existing_file_exits_2_quickly_as_a_process(tmp_path):
    """The whole command, as a user runs it: exit 2 within 20 s, one line, no traceback."""
    out = tmp_path / "existing"
    out.write_text("")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "qlora_nb_utils.cli", "bench", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 2 and time.monotonic() - start < 20, proc.stderr
    assert "Traceback" not in proc.stderr and "is a file, not a folder" in proc.stderr


def test_the_out_of_memory_hint_does_not_suggest_the_memory_target_already_given(tmp_path, capsys, monkeypatch):
    import torch

    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    error.plan_estimate_gib = 12.34  # what finetune() attaches: the plan's estimate

    def fail(args):
        raise error

    monkeypatch.setattr(cli, "_train", fail)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    assert cli.main(["train", "--model", "tiny", "--out", str(tmp_path / "run"), "--max-memory-gib", "14.5"]) == 3
    err = capsys.readouterr().err
    assert "give --max-memory-gib" not in err and "under --max-memory-gib 14.5" in err
    assert "12.34 GiB" in err and "--seq-len" in err and "--batch-size" in err


def test_train_under_a_memory_target_no_plan_meets_exits_2_with_the_estimate(tmp_path, capsys):
    """Refused by optimize() before anything compiles: the estimate and the longest length said, exit 2."""
    code = cli.main(["train", "--model", "tiny", "--out", str(tmp_path / "run"), "--steps", "1",
                     "--batch-size", "2", "--seq-len", "64", "--max-memory-gib", "0.01", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "qlora-nb train: error: max_memory_gib=0.01: the step at 2 x 64 is estimated at" in err
    assert "no sequence fits at 2 row(s) a batch" in err and "Traceback" not in err


@pytest.mark.parametrize("error, code, hint", [
    (RuntimeError("kernel launch failed"), 3, None),
    ("oom", 3, "--max-memory-gib"),
    ("dynamo", 3, "--backend eager"),
    (KeyboardInterrupt(), 130, None),
])
def test_a_command_that_fails_after_its_checks_says_what_and_where_without_a_traceback(
        tmp_path, capsys, monkeypatch, error, code, hint):
    import torch

    if error == "oom":
        error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    elif error == "dynamo":
        from torch._dynamo.exc import FailOnRecompileLimitHit

        error = FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")

    def fail(args):
        raise error

    monkeypatch.setattr(cli, "_train", fail)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    out = tmp_path / "run"
    out.mkdir()
    assert cli.main(["train", "--model", "tiny", "--out", str(out)]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code == 3:
        assert f"failed: {type(error).__name__}" in err
        log = out / "qlora-nb-train-error.txt"
        assert log.is_file() and "Traceback" in log.read_text() and str(log) in err
        assert (hint or "failed") in err
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    if code == 3:
        with pytest.raises(type(error)):
            cli.main(["train", "--model", "tiny", "--out", str(out)])
