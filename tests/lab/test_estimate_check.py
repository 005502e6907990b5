"""lab.estimate_check: the plan's printed estimate read from a description, forced choices left out, the fit."""

from __future__ import annotations

import pytest

from lab import estimate_check as ec

TILED = ("optimize: device=cuda (where the model is); ckpt_layers=32/32 (estimated peak above 19.8 GiB (the target "
         "22.0 GiB less 10% headroom) even with every layer checkpointed and offloaded); offload=True (the inputs of 32 "
         "checkpointed layers in CPU memory, copied on a side stream; checkpointing every layer is estimated at 30.1 GiB "
         "> 19.8 GiB); tile_mlp=4096 (every layer checkpointed and offloaded is estimated at 33.91 GiB > 19.8 GiB (the "
         "target 22.0 GiB less 10% headroom); each MLP in pieces of 4096 positions: 18.88 GiB); sdpa_kernel=cudnn (x)")
PLAIN = ("optimize: device=cuda (where the model is); ckpt_layers=29/32 (estimated peak 19.51 GiB <= 19.8 GiB (the "
         "target 22.0 GiB less 10% headroom) at 1 x 16384); offload=False (not needed); tile_mlp=0 (not needed); "
         "keep_attention=False (the MLP runs in pieces)")


def _run(desc, seq_len=1000, peak=20.0, ok=True):
    return {"optimize": desc, "seq_len": seq_len, "peak_mem_gib": peak, "reserved_gib": peak and peak + 1, "ok": ok,
            "cap_gib": 22.0}


def test_the_estimate_is_the_one_of_the_choices_made():
    assert ec.estimate_of(TILED) == 18.88  # the MLP pieces' figure, not the untiled 33.91
    assert ec.estimate_of(PLAIN) == 19.51
    assert ec.estimate_of("optimize: device=cpu (where the model is)") is None
    row = ec.row_of(_run(TILED, peak=21.88), "x.json")
    assert (row["tile_mlp"], row["offload"], row["keep_attention"]) == ("4096", "True", "False")
    assert row["peak_minus_estimate_gib"] == pytest.approx(3.0)


def test_tries_whose_estimate_does_not_count_a_forced_choice_are_left_out():
    assert ec.row_of(_run(TILED.replace("tile_mlp=4096 (every", "tile_mlp=4096 (asked for; every")), "x") is None
    kept = PLAIN.replace("keep_attention=False (the MLP runs in pieces)", "keep_attention=True (29 layers keep it)")
    assert ec.row_of(_run(kept), "x") is None
    host = PLAIN.replace("keep_attention=False (the MLP runs in pieces)", "keep_attention=host (29 layers keep it)")
    assert ec.row_of(_run(host), "x")["keep_attention"] == "host"  # the plan's own choice: kept
    assert ec.row_of(_run(PLAIN, ok=False), "x") is None
    assert ec.row_of(_run(PLAIN, peak=None), "x") is None


def test_the_fit_is_a_line_through_the_tiled_rows_only():
    rows = [ec.row_of(_run(TILED, seq_len=n, peak=18.88 - 3 + n * 40 / 2**20), "x") for n in (10_000, 50_000, 90_000)]
    rows.append(ec.row_of(_run(PLAIN, seq_len=20_000, peak=5.0), "x"))  # untiled: not in the fit
    got = ec.fit(rows)
    assert got["points"] == 3 and got["per_token_kib"] == pytest.approx(40.0) and got["intercept_gib"] == pytest.approx(-3.0)
    assert got["max_abs_residual_gib"] < 1e-9
    assert ec.fit(rows[:1]) is None


def test_single_try_files_are_read_beside_driver_records(tmp_path):
    import json

    stamp = {"device": {"name": "GPU X"}, "versions": {"torch": "2.11"}}
    (tmp_path / "call1_ours_24.json").write_text(json.dumps({**stamp, "cap_gib": 22.0, "runs": [
        {k: v for k, v in _run(TILED, seq_len=100_000, peak=21.0).items() if k != "cap_gib"}]}))
    (tmp_path / "call2_ours_38.5_200000.json").write_text(json.dumps({**stamp, **_run(TILED, 200_000, 30.0),
                                                                       "cap_gib": 38.5}))
    rows, got_stamp = ec.collect(tmp_path)
    assert [(r["seq_len"], r["cap_gib"], r["source"]) for r in rows] == [
        (100_000, 22.0, "call1_ours_24.json"), (200_000, 38.5, "call2_ours_38.5_200000.json")]
    assert got_stamp["device"] == {"name": "GPU X"}


def test_todays_estimate_is_an_upper_bound_of_every_recorded_peak_within_the_margin():
    """Every long-context try the lab measured (its plan's choices, its peak): the estimate as it is now counts
    at least that peak, and at most MAX_RATIO times it (the recorded peaks are measurements)."""
    shape = ec.shape_8b()
    tries = ec.recorded_tries()
    assert len({run["seq_len"] for _, run in tries}) >= 8
    plans = set()
    for source, run in tries:
        est, peak = ec.estimate_for(run, shape), run["peak_mem_gib"]
        assert peak <= est <= ec.MAX_RATIO * peak, (source, run["seq_len"], est, peak)
        c = run["choices"]
        plans.add((c["ckpt_layers"] == "32/32", c["offload"], c["tile_mlp"] != "0", c.get("keep_attention", "False")))
    assert len(plans) >= 4  # some and every layer checkpointed, offload, the MLP in pieces, kept outputs


def test_a_measured_record_becomes_rows_and_a_check():
    record = {"runs": [
        {"ok": True, "seq_len": 16384, "target_gib": 22.0, "knobs": {}, "estimate_gib": 11.0, "peak_mem_gib": 10.0,
         "choices": {"ckpt_layers": "29/32", "offload": "False", "tile_mlp": "0", "keep_attention": "host"}},
        {"ok": True, "seq_len": 262144, "target_gib": 38.5, "knobs": {}, "estimate_gib": 35.0, "peak_mem_gib": 34.0,
         "choices": {"ckpt_layers": "32/32", "offload": "True", "tile_mlp": "4096"}},
        {"ok": False, "seq_len": 300000, "target_gib": 38.5, "error": "refused"}]}
    rows = ec.rows_from(record)
    assert [(r["seq_len"], r["keep_attention"]) for r in rows] == [(16384, "host"), (262144, "False")]
    got = ec.check(rows)
    assert got["every_row_within"] and got["lengths"] == [16384, 262144] and got["max_ratio"] == pytest.approx(1.1)
    rows[0]["peak_mem_gib"] = 11.5  # an estimate below its peak fails the check
    assert not ec.check(rows)["every_row_within"]


def test_the_measuring_script_runs_its_tries_in_one_process_on_the_cpu(tmp_path):
    """lab.estimate_peaks with the tiny model: one plan per try, a refused target recorded and the next try run."""
    from lab import estimate_peaks

    assert estimate_peaks.parse_tries("256:22,512:0.5:scope=regional;tile_mlp=64") == [
        {"seq_len": 256, "target_gib": 22.0, "knobs": {}},
        {"seq_len": 512, "target_gib": 0.5, "knobs": {"scope": "regional", "tile_mlp": 64}}]
    out = tmp_path / "peaks.json"
    assert estimate_peaks.main(["--model", "tiny", "--tries", "64:0.01:backend=eager,128:100:backend=eager",
                                "--out", str(out)]) == 0
    import json

    runs = json.loads(out.read_text())["runs"]
    assert [(r["seq_len"], r["ok"]) for r in runs] == [(64, False), (128, True)]
    assert "is estimated at" in runs[0]["error"] and runs[1]["estimate_gib"] > 0
    assert "the plan's estimated peak" in runs[1]["optimize"]
