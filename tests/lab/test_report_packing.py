"""`qlora-nb report` on the packing benchmark's results: its tables, its two targets and its plot,
on a small synthetic file whose verdicts are known and on the committed H100 file."""

import json
from pathlib import Path

import pytest

from lab.report import packing
from lab.report.__main__ import _kind as lab_kind

REAL = Path(__file__).resolve().parents[2] / "lab" / "results" / "packing" / "packing_h100.json"


def _run(name, library, packed, tok, gib, **kw):
    return {"name": name, "library": library, "model": "m", "data": "kjv", "packed": packed,
            "real_tokens_per_s": tok, "peak_mem_gib": gib, "pad_fraction": 0.0 if packed else 0.8,
            "compilations": 1 if library == "ours" else None, **kw}


def _synthetic():
    return {"device": {"name": "GPU X"}, "versions": {"torch": "2.x"}, "date": "d", "calls": [{}],
            "data": {"m/kjv": {"rows": 4, "seq_len": 1024, "examples": 10}},
            "runs": [_run("ours-packed", "ours", True, 300.0, 20.0), _run("ours-padded", "ours", False, 100.0, 19.0),
                     _run("ours-lowmem-packed", "ours", True, 200.0, 9.0),
                     _run("unsloth-packed", "unsloth", True, 150.0, 10.0),
                     _run("trl-sft-packed", "trl", True, 90.0, 30.0),
                     {**_run("hf-eager-packed", "hf", True, None, None), "error": "CUDA out of memory | x"}]}


def test_targets_are_read_off_the_file():
    t = packing.targets(_synthetic(), "m", "kjv")
    assert t["packed_vs_padded"] == pytest.approx(3.0) and t["met"]["packed_vs_padded"]
    assert t["best_peer"]["name"] == "unsloth-packed"  # the errored run is no peer
    assert t["ours_within"]["name"] == "ours-lowmem-packed"  # ours-packed (20 GiB) is over unsloth's 10 GiB
    assert t["vs_best_peer"] == pytest.approx(200 / 150) and t["met"]["vs_best_peer"]
    assert t["per_peer"]["trl-sft-packed"] == ("ours-packed", pytest.approx(300 / 90))
    slow = _synthetic()
    slow["runs"][2]["real_tokens_per_s"] = 160.0  # 1.07x the best peer: under 1.3x
    assert packing.targets(slow, "m", "kjv")["met"]["vs_best_peer"] is False
    del slow["runs"][2]  # nothing of ours at or under unsloth's peak
    t = packing.targets(slow, "m", "kjv")
    assert t["ours_within"] is None and t["met"]["vs_best_peer"] is False and t["per_peer"]["unsloth-packed"] is None


def test_table_has_a_row_per_run_with_errors_and_the_verdicts():
    text = packing.markdown_table(_synthetic(), "packing_x.json")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    assert len(rows) == 6 and all(line.count("|") == 9 for line in rows)  # the error's own '|' is escaped
    assert "CUDA out of memory / x" in text and "3.00x (target >= 2x: met)" in text
    assert "ours-lowmem-packed 1.33x at 9.00 GiB" in text


def test_plot_and_cli_dispatch(tmp_path):
    path = tmp_path / "packing_x.json"
    path.write_text(json.dumps(_synthetic()))
    assert lab_kind(str(path), _synthetic()) == "packing"
    png = packing.write_plot(_synthetic(), path)
    assert png == tmp_path / "packing_x_tradeoff.png" and png.stat().st_size > 5000
    assert packing.write_plot({**_synthetic(), "runs": _synthetic()["runs"][-1:]}, path) is None  # errors only


def test_the_committed_h100_file():
    results = json.loads(REAL.read_text())
    assert packing.is_packing_file(results) and lab_kind(str(REAL), results) == "packing"
    text = packing.markdown_table(results, REAL.name)
    for model, data in packing.groups(results):
        assert f"**{model}, {data}**" in text
        names = [r["name"] for r in results["runs"] if (r["model"], r["data"]) == (model, data)]
        assert len(names) == len(set(names))
    t = packing.targets(results, "llama-3.2-1b-shape", "kjv")  # the 1B shipped-data rows are complete
    assert t["packed_vs_padded"] >= 2.0 and t["met"]["vs_best_peer"]


def test_loss_checks_and_kernels_are_tabled_per_step_and_against_flex():
    from lab.peers.packed_checks import compare_kernels, loss_verdict

    eager = [[10.0, 9.0, 8.0], [10.0, 9.002, 8.001], [10.0, 8.999, 8.003]]  # pairwise floor: 0, 3e-3, 3e-3
    check = loss_verdict([10.001, 9.001, 8.0], eager)
    assert check["floor_diffs"] == pytest.approx([0.0, 0.003, 0.003])
    assert check["steps_over_step_floor"] == [0] and check["steps_over_floor"] == [] and check["within_floor"]
    results = _synthetic() | {"loss_checks": [{"model": "m", "data": "kjv", "rows": 4, "seq_len": 1024,
                                                "doc_attention": "flex_attention", "scope": "whole", **check}]}
    flex = {"model": "m", "data": "kjv", "kernel": "flex_attention", "real_tokens_per_s": 100.0, "peak_mem_gib": 10.0,
            "losses": [10.0, 9.0, 8.0], "loss_check": check, "compilations": 1, "epoch_compilations": 1,
            "graph_breaks": 0}
    varlen = flex | {"kernel": "varlen", "real_tokens_per_s": 120.0, "losses": [10.0, 9.01, 8.0]}
    comparison = compare_kernels([flex, varlen])
    assert comparison["m/kjv/varlen"]["within_flex_floor"] is False  # 1e-2 over flex's 3e-3
    bench_flex = {"name": "ours-packed", "model": "m", "data": "kjv", "optimize": {"doc_attention": "flex_attention"},
                  "losses": [10.0, 9.0, 8.0], "real_tokens_per_s": 100.0, "peak_mem_gib": 10.0,
                  "parity": {"floor_max_abs_loss_diff": 0.02}}
    alone = compare_kernels([varlen], [bench_flex])["m/kjv/varlen"]  # no flex kernel run: the benchmark's row
    assert alone["flex_from"].startswith("runs: ours-packed") and alone["within_flex_floor"] is True
    assert comparison["m/kjv/varlen"]["same_call"] is False  # neither row says which call it came from
    # a regional pair is compared within its scope and apart from the whole-graph pair; same_call from the rows' call
    regional = [r | {"scope": "regional", "call": "gpu-1"} for r in (flex, varlen)]
    both = compare_kernels([flex, varlen, *regional])
    assert set(both) == {"m/kjv/varlen", "m/kjv/varlen/regional"}
    assert both["m/kjv/varlen/regional"]["same_call"] is True and both["m/kjv/varlen"]["same_call"] is False
    assert "m/kjv/varlen/regional" not in compare_kernels([flex, varlen, regional[1]])  # no regional flex to face
    results["doc_attention"] = {"runs": [flex, varlen, {**flex, "kernel": "sdpa", "error": "boom | x"}],
                                "comparison": comparison}
    text = packing.markdown_table(results, "packing_x.json")
    assert "| 0 | 1.0e-03 | 0.0e+00 | no |" in text and "every step within its own step's floor: no" in text
    assert "| m / kjv | varlen | 120 | 10.00 | 1 (1) | 0 | yes |  |" in text and "boom / x" in text
    assert "m/kjv/varlen: 1.20x flex's real tok/s" in text and "(over)" in text
