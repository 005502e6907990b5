"""lab/ring_precision.py on 2 gloo processes, a small shape: the file has each seed's errors of the ring and of the
whole-row kernel against float64, their ratio, and the run's device, versions, date and command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lab.paths import ROOT


def test_two_processes_write_errors_of_both_paths_against_float64(tmp_path):
    out = tmp_path / "ring.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "lab.ring_precision",
           "--out", str(out), "--seq-len", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--seeds", "2"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rec = json.loads(out.read_text())
    assert [r["seed"] for r in rec["rows"]] == [0, 1] and rec["rows"][0]["world_size"] == 2
    for row in rec["rows"]:
        for path in ("whole_row_vs_float64", "ring_vs_float64"):
            errs = row[path]
            # bf16 arithmetic is not exact, and nowhere near wrong (unit-scale inputs)
            assert all(0 < errs[f"{n}_diff"] < 0.5 for n in ("out", "dq", "dk", "dv")), (path, errs)
        assert row["ring_over_whole_row"]["dv_ratio"] == (row["ring_vs_float64"]["dv_diff"]
                                                          / row["whole_row_vs_float64"]["dv_diff"])
    assert set(rec["ring_over_whole_row_max"]) == {"out_ratio", "dq_ratio", "dk_ratio", "dv_ratio"}
    assert rec["device"] and rec["versions"]["torch"] and rec["date"] and "lab.ring_precision" in rec["command"]
