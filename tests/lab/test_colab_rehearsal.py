"""The Colab rehearsal (lab/colab_rehearsal.py) and what it leaves in notebooks/: outputs of a GPU run,
stamped, with no path of the machine that ran them."""

import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import colab_rehearsal as cr

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "lab" / "results" / "notebooks" / "notebooks_gpu.json"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_lanes_name_gpus_notebooks_and_profiles(tmp_path):
    a, b = tmp_path / "01_a.ipynb", tmp_path / "02_b.ipynb"
    a.write_text("{}")
    b.write_text("{}")
    lane = cr.parse_lane(f"2,3:{a}=gpu-short,{b}")
    assert lane.gpus == "2,3" and lane.notebooks == [(a, "gpu-short"), (b, None)]
    assert cr.parse_lane(str(a)).gpus is None
    assert cr.parse_lane(f"cpu:{a}").gpus == "cpu"
    with pytest.raises(ValueError, match="GPUS must be"):
        cr.parse_lane(f"gpu0:{a}")
    with pytest.raises(FileNotFoundError, match="no notebook"):
        cr.parse_lane(f"0:{tmp_path / 'missing.ipynb'}")
    with pytest.raises(ValueError, match="not a notebook"):
        cr.parse_lane(f"0:{tmp_path / 'x.py'}")


def test_a_rehearsal_folder_holds_the_notebook_and_the_wheel_only(tmp_path):
    nb, wheel = tmp_path / "src" / "03_x.ipynb", tmp_path / "src" / "qlora_nb_utils-0.1.0-py3-none-any.whl"
    nb.parent.mkdir()
    nb.write_text("{}")
    wheel.write_bytes(b"PK")
    content, home, target = cr.prepare(nb, wheel, tmp_path / "root")
    assert sorted(p.name for p in content.iterdir()) == sorted([nb.name, wheel.name])
    assert target == content / nb.name and list(home.iterdir()) == []
    with pytest.raises(FileExistsError, match="empty folder"):
        cr.prepare(nb, wheel, tmp_path / "root")


def test_the_runtime_sees_no_repository_and_no_project_settings(tmp_path):
    base = {"PATH": "/usr/bin", "PYTHONPATH": str(ROOT), "QLORA_NB_CACHE": "/x", "PIP_INDEX_URL": "http://i",
            "HF_HOME": "/hf", "TORCHINDUCTOR_CACHE_DIR": "/shared", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env = cr.clean_env(base, tmp_path / "home", tmp_path / "house", "2", "gpu-short")
    assert "PYTHONPATH" not in env and "QLORA_NB_CACHE" not in env and "PIP_INDEX_URL" not in env
    assert env["HOME"] == str(tmp_path / "home") and env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "home"))
    assert env["PIP_NO_INDEX"] == "1" and env["PIP_FIND_LINKS"] == str(tmp_path / "house")
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["QLORA_NB_PROFILE"] == "gpu-short"
    online = cr.clean_env(base, tmp_path / "home", tmp_path / "house", "cpu", None, online=True)
    assert "PIP_NO_INDEX" not in online and online["CUDA_VISIBLE_DEVICES"] == "" and "QLORA_NB_PROFILE" not in online


def test_a_cell_that_runs_past_the_budget_is_interrupted(tmp_path):
    # the executor as the rehearsal runs it, in this environment's Jupyter kernel: a cell that would
    # sleep for minutes is interrupted once the 1 s budget is spent, the next cell never runs, and the
    # notebook is written back with the interrupt in its outputs
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": src}
                    for src in ("import time\ntime.sleep(600)", "print('after')")],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"c{i}"
    (tmp_path / "nb.ipynb").write_text(json.dumps(nb))
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", cr._EXECUTE, "nb.ipynb", "1", "900"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert run.returncode != 0 and "time budget of 1 s spent: interrupting the kernel" in run.stdout, run.stdout
    assert "nb.ipynb: failed" in run.stdout and "never awaited" not in run.stderr, run.stderr[-2000:]
    first, second = json.loads((tmp_path / "nb.ipynb").read_text())["cells"]
    assert [o.get("ename") for o in first["outputs"]] == ["KeyboardInterrupt"]
    assert second["execution_count"] is None and second["outputs"] == []
    assert took < 100, f"{took:.0f} s: the sleep ran on"


def _nb(*outputs):
    return {"cells": [{"cell_type": "code", "source": "", "outputs": list(outputs)}], "metadata": {}}


def test_progress_bars_are_kept_as_jupyter_shows_them():
    nb = _nb({"output_type": "stream", "name": "stderr", "text": "step:   0%|  | 0/2\r"},
             {"output_type": "stream", "name": "stderr", "text": "step:  50%|# | 1/2\rstep: 100%|##| 2/2\n"},
             {"output_type": "stream", "name": "stdout", "text": "done\n"})
    assert cr.coalesce_streams(nb) == 1
    outs = nb["cells"][0]["outputs"]
    assert [o["name"] for o in outs] == ["stderr", "stdout"]
    assert outs[0]["text"] == "step: 100%|##| 2/2\n"


def test_machine_paths_are_replaced_and_what_is_left_is_found(tmp_path):
    folder = "/tmp/colab-rehearsal-abc/03_x/content"
    nb = _nb({"output_type": "stream", "name": "stderr",
              "text": f"{folder}/run/log.txt\n/opt/torch/.venv/lib/python3.12/site-packages/torch/x.py:3: Warning\n"},
             {"output_type": "display_data", "data": {"image/png": "/tmp/not-a-path-in-base64",
                                                      "text/plain": "<Figure>"}})
    nb["cells"][0]["metadata"] = {"execution": {"iopub.execute_input": "2026-11-27T08:15:30Z"}}
    replaced, left = cr.tidy(nb, {folder: "/content", "/opt/torch/.venv/lib/python3.12/site-packages": "<site-packages>"})
    assert nb["cells"][0]["metadata"] == {}  # nbclient's timestamps are not kept
    text = nb["cells"][0]["outputs"][0]["text"]
    assert replaced == 2 and left == []
    assert text.startswith("/content/run/log.txt\n<site-packages>/torch/x.py")
    assert nb["cells"][0]["outputs"][1]["data"]["image/png"] == "/tmp/not-a-path-in-base64"  # images untouched
    assert cr.machine_paths(_nb({"output_type": "stream", "name": "stdout", "text": "see /home/me/x\n"}))


def test_every_notebook_shows_the_outputs_of_its_gpu_rehearsal_or_the_record_says_why_not():
    record = json.loads(RESULTS.read_text())
    rows = {r["name"]: r for r in record["notebooks"]}
    assert sorted(rows) == [p.name for p in NOTEBOOKS], "every notebook has a row in the rehearsal's results"
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        with_outputs = [c for c in code if c.get("outputs")]
        row = rows[path.name]
        if not row["passed"]:
            assert row.get("error"), f"{path.name}: a notebook that did not pass says why"
            assert not with_outputs and cr.STAMP not in nb["metadata"], f"{path.name}: outputs of a run that did not pass"
            continue
        stamp = nb["metadata"].get(cr.STAMP)
        assert stamp, f"{path.name}: no {cr.STAMP} metadata"
        for key in ("device", "gpus", "versions", "date", "profile", "command"):
            assert stamp.get(key) not in (None, "", {}), (path.name, key)
        assert stamp["date"] == row["date"] and stamp["device"] == row["device"] and stamp["passed"] is True
        assert stamp["device"] != "cpu" and stamp["versions"].get("torch")
        assert all(c.get("execution_count") for c in code), f"{path.name}: a cell did not run"
        assert len(with_outputs) >= len(code) // 2, f"{path.name}: most cells show nothing"
        assert cr.machine_paths(nb) == [], f"{path.name}: machine paths in outputs"
    assert sum(r["passed"] is True for r in rows.values()) >= 8


def _timed(seconds: float, source: str = "x = 1") -> dict:
    start = datetime.datetime(2026, 11, 29, 1, 0, 0, tzinfo=datetime.timezone.utc)
    return {"cell_type": "code", "source": source, "execution_count": 1, "metadata": {"execution": {
        "iopub.execute_input": start.isoformat().replace("+00:00", "Z"),
        "shell.execute_reply": (start + datetime.timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")}},
        "outputs": [{"output_type": "stream", "name": "stderr", "text": "/tmp/site/torch/x.py:1: Warning\n"}]}


def test_adopt_records_each_cells_seconds_and_tidies_a_notebook_run_elsewhere(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": "# t", "metadata": {}}, _timed(3.25, "\nimport torch"),
                    _timed(71.0, "live = run()")],
          "metadata": {cr.STAMP: {"device": "NVIDIA H200", "gpus": 1, "versions": {"torch": "2.11.0"},
                                  "date": "2026-11-29T01:30:00+00:00", "profile": "gpu", "command": "bash x.sh",
                                  "passed": True, "seconds": 80.0, "environment": "the repository's own"}}}
    assert cr.cell_seconds(nb) == [{"code_cell": 0, "seconds": 3.2, "first_line": "import torch"},
                                   {"code_cell": 1, "seconds": 71.0, "first_line": "live = run()"}]
    src, out = tmp_path / "03_x.ipynb", tmp_path / "notebooks"
    src.write_text(json.dumps(nb))
    out.mkdir()
    results = tmp_path / "results.json"
    assert cr.main(["adopt", str(src), "--results", str(results), "--notebooks-dir", str(out)]) == 0
    (row,) = json.loads(results.read_text())["notebooks"]
    assert row["slowest_cell_s"] == 71.0 and row["passed"] is True and row["cells_run"] == 2
    assert row["environment"] == "the repository's own" and row["date"] == "2026-11-29T01:30:00+00:00"
    written = json.loads((out / "03_x.ipynb").read_text())
    assert all(not c.get("metadata") for c in written["cells"][1:]) and cr.machine_paths(written) == []
    assert "<site-packages>/torch/x.py" in written["cells"][1]["outputs"][0]["text"]
    del nb["metadata"][cr.STAMP]["versions"]
    src.write_text(json.dumps(nb))
    with pytest.raises(ValueError, match="lacks"):
        cr.main(["adopt", str(src), "--results", str(results), "--notebooks-dir", str(out)])
