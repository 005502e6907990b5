"""startup.defer_sklearn: transformers' assisted-generation module imported without scikit-learn,
its ``roc_curve`` still scikit-learn's at the first call, undone exactly.

Each case runs in a fresh process (the module under test is imported once per process) beside a
stand-in scikit-learn on ``PYTHONPATH`` whose import is recorded, so the case does not depend on
whether this machine has the real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")


@pytest.fixture()
def fake_sklearn(tmp_path: Path) -> Path:
    pkg = tmp_path / "sklearn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "metrics.py").write_text("def roc_curve(y_true, y_score):\n    return ('fake roc', y_true, y_score)\n")
    return tmp_path


def _run(code: str, path: Path | None) -> dict:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    prelude = "import json, sys\nfrom qlora_nb_utils.startup import CANDIDATES, defer_sklearn\nout = {}\n"
    res = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code) + "\nprint(json.dumps(out))"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_without_it_transformers_imports_sklearn(fake_sklearn):
    """The stand-in is what transformers sees: importing the module imports scikit-learn's metrics."""
    out = _run("""
        import importlib
        cg = importlib.import_module(CANDIDATES)
        out["metrics"] = "sklearn.metrics" in sys.modules
        out["roc"] = cg.roc_curve.__module__
    """, fake_sklearn)
    assert out == {"metrics": True, "roc": "sklearn.metrics"}


def test_deferred_until_called_then_the_same_function(fake_sklearn):
    out = _run("""
        handle = defer_sklearn()
        out["handle"] = handle is not None and handle.active
        import peft  # what qlora-nb train imports: transformers' auto classes, generation, bitsandbytes
        import transformers.utils
        cg = sys.modules[CANDIDATES]
        out["metrics_after_imports"] = "sklearn.metrics" in sys.modules
        out["real_check_kept"] = cg.is_sklearn_available is transformers.utils.is_sklearn_available
        out["available"] = cg.is_sklearn_available()
        out["call"] = list(cg.roc_curve([0, 1], [0.2, 0.9]))
        out["metrics_after_call"] = "sklearn.metrics" in sys.modules
        out["roc_now"] = cg.roc_curve.__module__
        handle.undo()
        out["roc_after_undo"] = cg.roc_curve.__module__
        out["again"] = defer_sklearn() is None  # the module is imported: nothing left to defer
    """, fake_sklearn)
    assert out == {"handle": True, "metrics_after_imports": False, "real_check_kept": True, "available": True,
                   "call": ["fake roc", [0, 1], [0.2, 0.9]], "metrics_after_call": True,
                   "roc_now": "sklearn.metrics", "roc_after_undo": "sklearn.metrics", "again": True}


def test_undo_before_any_call_imports_sklearn_and_restores(fake_sklearn):
    out = _run("""
        handle = defer_sklearn()
        cg = sys.modules[CANDIDATES]
        out["deferred"] = cg.roc_curve.__module__
        handle.undo()
        out["restored"] = cg.roc_curve.__module__
        out["metrics"] = "sklearn.metrics" in sys.modules
        out["inactive"] = not handle.active
    """, fake_sklearn)
    assert out == {"deferred": "qlora_nb_utils.startup", "restored": "sklearn.metrics", "metrics": True,
                   "inactive": True}


def test_nothing_to_do_when_already_imported(fake_sklearn):
    out = _run("""
        import importlib
        importlib.import_module(CANDIDATES)
        out["none"] = defer_sklearn() is None
    """, fake_sklearn)
    assert out == {"none": True}


def test_nothing_to_do_without_sklearn():
    out = _run("""
        import importlib.util
        out["has"] = importlib.util.find_spec("sklearn") is not None
        out["none"] = defer_sklearn() is None
        out["imported"] = CANDIDATES in sys.modules
    """, None)
    if out["has"]:
        pytest.skip("this environment has scikit-learn")
    assert out == {"has": False, "none": True, "imported": False}


def test_the_command_line_defers_it_before_anything_loads(fake_sklearn, tmp_path):
    """``qlora-nb train`` with bad input stops before any model loads, after the deferral."""
    out = _run(f"""
        from qlora_nb_utils import cli
        out["rc"] = cli.main(["train", "--model", "tiny", "--data", "/nonexistent/data.jsonl", "--device", "cpu",
                              "--out", {str(tmp_path / "run")!r}])
        cg = sys.modules.get(CANDIDATES)
        out["deferred"] = cg is not None and cg.roc_curve.__module__ == "qlora_nb_utils.startup"
        out["metrics"] = "sklearn.metrics" in sys.modules
    """, fake_sklearn)
    assert out == {"rc": 2, "deferred": True, "metrics": False}


def test_the_distributed_launchers_defer_it_in_every_rank(fake_sklearn):
    """``run_main`` (each rank of ``torchrun -m qlora_nb_utils.distributed...``) defers it after the
    arguments are checked and before the run."""
    out = _run("""
        import argparse
        from qlora_nb_utils.distributed.runs import run_main

        seen = {}

        def run(args):
            cg = sys.modules.get(CANDIDATES)
            seen["deferred"] = cg is not None and cg.roc_curve.__module__ == "qlora_nb_utils.startup"
            seen["metrics"] = "sklearn.metrics" in sys.modules

        out["rc"] = run_main(argparse.ArgumentParser(), lambda args, world: args, run, [])
        out.update(seen)
    """, fake_sklearn)
    assert out == {"rc": 0, "deferred": True, "metrics": False}
