"""lab/gpu/fsdp/big_cap_results.py on fake run folders: one row per run, the printed steps' allocator retries
as differences of the running count, the profile where there is one."""

from __future__ import annotations

import importlib.util
import json

import pytest

from lab.paths import ROOT


def _module():
    spec = importlib.util.spec_from_file_location("big_cap_results", ROOT / "lab/gpu/fsdp/big_cap_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(folder, cap, tps, date):
    folder.mkdir()
    big = {"cap_gib": cap, "optimize": ["grad_ckpt=true"], "tokens_per_s": tps, "median_step_ms": 1e3,
           "peak_mem_gib_per_gpu": 21.4, "graph_breaks": 0, "date": date, "command": "launch ..."}
    (folder / "pipeline_h200.json").write_text(json.dumps({"big_model": big, "device": {"name": "H200"},
                                                           "versions": {"torch": "2.11"}}))


def test_rows_read_each_run_its_retries_and_its_profile(tmp_path):
    mod = _module()
    _run(tmp_path / "call2_a", 22.0, 1500.0, "2026-01-01")
    _run(tmp_path / "call2_b", 40.0, 2200.0, "2026-01-02")
    (tmp_path / "call2_a" / "commit.txt").write_text("abc1234\n")
    (tmp_path / "call2_b" / "profile_rank0.json").write_text(json.dumps(
        {"rank": 0, "wall_s_per_step": 8.0, "device_s_per_step": 7.5, "top_device_ops": []}))
    (tmp_path / "call2_stdout.txt").write_text("[pipeline] finished\na 0 30000 1 20.6\na 1 10000 900 21.4\n"
                                               "a 2 11000 2100 21.4\n")
    rec = mod.merge(tmp_path)
    a, b = rec["runs"]
    assert (a["run"], a["cap_gib"], a["commit"]) == ("call2_a", 22.0, "abc1234")
    assert a["step_ms_each"] == [30000.0, 10000.0, 11000.0] and a["alloc_retries_per_step"] == [899, 1200]
    assert "alloc_retries_per_step" not in b and b["profile"] == [{"rank": 0, "wall_s_per_step": 8.0,
                                                                    "device_s_per_step": 7.5}]
    assert rec["date"] == "2026-01-02" and rec["device"] == {"name": "H200"}
    # a run's own log, with every rank's running count and peak, is read before the printed lines
    _run(tmp_path / "call3_a", 22.0, 1700.0, "2026-01-03")
    steps = [{"step": i, "step_ms": ms, "alloc_retries": [r0, r1], "peak_mem_gib_per_rank": [20.0, p1]}
             for i, ms, r0, r1, p1 in [(0, 30000.0, 0, 1, 19.0), (1, 9000.0, 0, 40, 19.5), (2, 9500.0, 2, 90, 19.6)]]
    (tmp_path / "call3_a" / "log.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (tmp_path / "call3_stdout.txt").write_text("a 0 1 1 1.0\n")
    c = mod.merge(tmp_path)["runs"][2]
    assert c["step_ms_each"] == [30000.0, 9000.0, 9500.0] and c["alloc_retries_per_step_rank"] == [[0, 2], [39, 50]]
    assert c["peak_mem_gib_per_rank"] == [20.0, 19.6] and "alloc_retries_per_step" not in c
    empty = tmp_path / "none"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no run folder"):
        mod.merge(empty)
