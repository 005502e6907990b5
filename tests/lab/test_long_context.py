"""lab.long_context: the search finds the edge to 1024 tokens in few tries and within its deadline,
the linear prediction, the merged file's fields, and one real try (tiny model, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import long_context as lc
from lab import long_context_merge as lcm
from lab import long_context_search as lcs

ROOT = Path(__file__).resolve().parents[2]


class FakeTry:
    """A try whose reserved peak is ``a + b * L`` GiB; it fails (OOM) above ``cap``; each takes ``secs``."""

    def __init__(self, cap=22.0, a=7.0, b=15.0 / 61_000, secs=60.0, clock=None):
        self.cap, self.a, self.b, self.secs, self.clock, self.calls = cap, a, b, secs, clock, []

    def __call__(self, L, timeout_s):
        self.calls.append((L, timeout_s))
        if self.clock is not None:
            self.clock.t += self.secs
        peak = self.a + self.b * L
        if peak > self.cap:
            return {"seq_len": L, "ok": False, "oom": True, "error": "OutOfMemoryError: CUDA out of memory",
                    "wall_s": self.secs}
        return {"seq_len": L, "ok": True, "peak_mem_gib": peak - 0.5, "reserved_gib": peak, "wall_s": self.secs,
                "choices": {"ckpt_layers": "32/32", "offload": "True", "scope": "regional"}}

    def edge(self, step=lcs.STEP):
        return int((self.cap - self.a) / self.b) // step * step


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_the_linear_fit_and_its_prediction():
    runs = [{"seq_len": L, "ok": True, "reserved_gib": 3.0 + 1e-4 * L} for L in (8192, 16384, 32768)]
    pred = lcs.predict(runs, cap_gib=10.0)
    assert pred["a_gib"] == pytest.approx(3.0) and pred["b_gib_per_token"] == pytest.approx(1e-4)
    assert pred["edge_tokens"] == pytest.approx(70_000) and pred["max_seq_len"] == 68 * 1024
    assert max(map(abs, pred["residuals_gib"])) < 1e-9 and pred["of"] == "reserved_gib"
    assert lcs.fit_line([(8192, 1.0)]) is None and lcs.predict(runs[:1], 10.0) is None


def test_the_fit_keeps_to_the_regime_of_the_longest_try():
    # a short try without checkpointing has a steeper slope: it must not bend the line at the edge
    runs = [{"seq_len": 4096, "ok": True, "reserved_gib": 20.0, "choices": {"ckpt_layers": "0/32"}}]
    runs += [{"seq_len": L, "ok": True, "reserved_gib": 3.0 + 1e-4 * L, "choices": {"ckpt_layers": "32/32"}}
             for L in (16384, 32768)]
    pred = lcs.predict(runs, cap_gib=10.0)
    assert pred["regime"] == "same" and pred["b_gib_per_token"] == pytest.approx(1e-4)


@pytest.mark.parametrize("cap,b", [(22.0, 15.0 / 61_000), (38.5, 31.5 / 150_000), (22.0, 15.0 / 20_500)])
def test_the_search_finds_the_edge_to_1024_in_few_tries(cap, b):
    clock = Clock()
    fake = FakeTry(cap=cap, b=b, clock=clock)
    written = []
    res = lcs.search(fake, cap_gib=cap, probes=[8192, 16384, 32768], deadline_s=10_000, clock=clock,
                    on_run=lambda runs, pred: written.append(len(runs)))
    assert res["edge_found"] and res["stopped"] == "edge found"
    assert res["max_seq_len"] == fake.edge()
    assert any(r["seq_len"] == fake.edge() + lcs.STEP and not r["ok"] for r in res["runs"])
    assert len(fake.calls) <= 6  # a linear peak: probes, the predicted edge, its neighbour
    assert written == list(range(1, len(res["runs"]) + 1))  # the file is rewritten after every try
    assert [r for r in res["runs"] if not r["ok"]] and all(r["oom"] for r in res["runs"] if not r["ok"])


def test_a_curved_peak_is_bisected_and_still_found():
    class Curved(FakeTry):
        def __call__(self, L, timeout_s):
            run = super().__call__(L, timeout_s)
            if run["ok"]:  # the fit from the probes overshoots: the edge is lower than it predicts
                run["reserved_gib"] = self.a + self.b * L + 2e-10 * L * L
            if self.a + self.b * L + 2e-10 * L * L > self.cap:
                run = {"seq_len": L, "ok": False, "oom": True, "error": "CUDA out of memory", "wall_s": 1.0}
            return run

    fake = Curved()
    res = lcs.search(fake, cap_gib=22.0, probes=[8192, 16384], deadline_s=10_000, clock=Clock())
    edge = max(L for L in range(1024, 200_000, 1024) if fake.a + fake.b * L + 2e-10 * L * L <= fake.cap)
    assert res["edge_found"] and res["max_seq_len"] == edge and len(fake.calls) <= 12


def test_the_search_respects_its_deadline_and_records_what_it_had():
    clock = Clock()
    fake = FakeTry(secs=100.0, clock=clock)
    res = lcs.search(fake, cap_gib=22.0, probes=[8192, 16384, 32768], deadline_s=350, clock=clock)
    assert clock.t <= 350 and len(fake.calls) == 3  # a fourth 100 s try would not fit the 50 s left
    assert res["stopped"] == "deadline" and not res["edge_found"] and res["max_seq_len"] == 32768
    assert all(timeout <= 350 - 5 - done * 100 for done, (_, timeout) in enumerate(fake.calls))


def test_failures_bound_the_search_and_a_setup_error_stops_it():
    runs = [{"seq_len": 8192, "ok": True}, {"seq_len": 16384, "ok": False, "timeout": True},
            {"seq_len": 32768, "ok": False, "oom": True}]
    assert lcs.bracket(runs) == (8192, 32768)  # a timeout bounds nothing
    broken = lambda L, t: {"seq_len": L, "ok": False, "error": "ImportError: no bitsandbytes", "wall_s": 1}  # noqa: E731
    res = lcs.search(broken, cap_gib=22.0, probes=[8192, 16384], deadline_s=1000, clock=Clock())
    assert res["stopped"].startswith("setup error") and len(res["runs"]) == 1 and res["max_seq_len"] is None
    # all probes out of memory: it halves below the shortest failure
    fake = FakeTry(b=15.0 / 3000)
    res = lcs.search(fake, cap_gib=22.0, probes=[8192], deadline_s=10_000, clock=Clock())
    assert res["edge_found"] and res["max_seq_len"] == fake.edge()


def _driver_file(tmp_path, peer, cap, card, max_len):
    runs = [{"seq_len": 16384, "ok": True, "peak_mem_gib": 10.0, "reserved_gib": 10.5, "step_s": 2.0,
             "tokens_per_s": 8192.0, "first_step_s": 30.0, "cpu_ram_gib": 40.0, "graph_breaks": 0 if peer == "ours"
             else None, "compilations": 2 if peer == "ours" else None, "choices": {"ckpt_layers": "32/32"}},
            {"seq_len": max_len + 1024, "ok": False, "oom": True, "error": "OutOfMemoryError: CUDA out of memory",
             "peak_mem_gib": None}]
    rec = {"peer": peer, "cap_gib": cap, "card": f"{card} GB", "max_seq_len": max_len, "runs": runs, "prediction": None,
           "edge_found": True, "bracket": [max_len, max_len + 1024], "stopped": "edge found",
           "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"},
           "versions": {"torch": "2.11.0", **({"unsloth": "2026.10.9"} if peer == "unsloth" else {})},
           "date": "2026-11-27T00:00:00+00:00", "command": "x"}
    path = tmp_path / f"{peer}_{cap}.json"
    path.write_text(json.dumps(rec))
    return path


def test_merge_writes_every_field_the_results_file_needs(tmp_path, monkeypatch):
    files = [_driver_file(tmp_path, p, cap, card, n) for p, cap, card, n in
             [("ours", 22.0, 24, 60_416), ("unsloth", 22.0, 24, 50_176), ("ours", 38.5, 40, 130_048),
              ("unsloth", 38.5, 40, 120_832)]]
    assert lc.main(["merge", *map(str, files), "--out-dir", str(tmp_path / "out")]) == 0
    rec = json.loads((tmp_path / "out" / "long_context_h100.json").read_text())
    for key in ("device", "versions", "date", "command", "cap_note", "budgets"):
        assert rec[key], key
    assert "22.0" in rec["cap_note"] and "38.5" in rec["cap_note"] and rec["versions"]["unsloth"] == "2026.10.9"
    assert rec["versions"]["torch"] == "2.11.0" and rec["versions"]["unsloth_process"]["torch"] == "2.11.0"
    first = rec["budgets"][0]
    assert [b["cap_gib"] for b in rec["budgets"]] == [22.0, 38.5] and first["card"] == "24 GB"
    assert (first["ours_max_seq_len"], first["unsloth_max_seq_len"]) == (60_416, 50_176)
    assert first["graph_breaks"] == 0 and first["compilations"] == 2
    for run in first["ours_runs"] + first["unsloth_runs"]:
        assert {"seq_len", "ok", "peak_mem_gib", "step_s", "tokens_per_s"} <= set(run)
    # the lab's index reads the lengths as results and the cap as a setting
    from lab import index

    dest = tmp_path / "lab" / "results" / "long_context" / "long_context_h100.json"
    dest.parent.mkdir(parents=True)
    dest.write_text(json.dumps(rec))
    monkeypatch.setattr(index, "ROOT", tmp_path)
    metrics = {r["metric"] for r in index.rows_of(dest)}
    assert {"ours_max_seq_len", "unsloth_max_seq_len", "tokens_per_s", "reserved_gib"} <= metrics
    assert not metrics & {"cap_gib", "card"}


def test_one_real_try_trains_two_steps_on_the_cpu(tmp_path):
    out = tmp_path / "try.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    # aot_eager: the whole optimize() path short of Inductor's code generation, which takes ~40 s here
    cmd = [sys.executable, "-m", "lab.long_context", "try", "--peer", "ours", "--model", "tiny", "--seq-len", "256",
           "--cap-gib", "22", "--backend", "aot_eager", "--tile-mlp", "96", "--account", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["ok"] is True, rec.get("error")
    assert rec["seq_len"] == 256 and len(rec["losses"]) == 2 and rec["step_s"] > 0
    assert rec["engine"] == lc.ENGINE  # the build, so that the merge keeps an earlier build's runs apart
    assert rec["tokens_per_s"] == pytest.approx(256 / rec["step_s"])
    assert rec["cpu_ram_gib"] > 0 and rec["peak_mem_gib"] is None and rec["cap"]["cap_applied"] is False
    assert rec["compilations"] >= 1 and rec["graph_breaks"] == 0 and rec["choices"]["ckpt_layers"]
    assert rec["tile_mlp"] == 96 and rec["choices"]["tile_mlp"] == "96"  # pieces of 96 positions: no graph break
    assert "needs CUDA" in rec["memory_account"]["skipped"]  # the allocator's record is CUDA's


def test_an_allocator_variant_is_merged_under_its_own_key(tmp_path):
    rec = json.loads(_driver_file(tmp_path, "ours", 22.0, 24, 40_960).read_text())
    rec["alloc_conf"] = "expandable_segments:True"
    variant = tmp_path / "ours-xs_22.0.json"
    variant.write_text(json.dumps(rec))
    plain = _driver_file(tmp_path, "ours", 22.0, 24, 33_792)  # ours_22.0.json, written again
    assert lcm.variant_key(rec) == "ours_expandable_segments" and lcm.variant_key({"peer": "ours"}) == "ours"
    merged = lcm.merge([plain, variant, _driver_file(tmp_path, "unsloth", 22.0, 24, 51_200)])
    (entry,) = merged["budgets"]
    assert (entry["ours_max_seq_len"], entry["ours_expandable_segments_max_seq_len"],
            entry["unsloth_max_seq_len"]) == (33_792, 40_960, 51_200)
    assert entry["ours_expandable_segments_alloc_conf"] == "expandable_segments:True"
    assert "ours_alloc_conf" not in entry
    args = lc.build_parser().parse_args(["try", "--peer", "ours", "--cap-gib", "22", "--out", "x.json", "--seq-len",
                                         "1024", "--alloc-conf", "expandable_segments:True"])
    assert args.alloc_conf == "expandable_segments:True"
    assert lcm.variant_key({"peer": "ours", "tile_mlp": 4096, "alloc_conf": "expandable_segments:True"}) \
        == "ours_tile4096_expandable_segments"


def test_an_account_bisection_keeps_time_for_one_recorded_try_at_its_longest_length(tmp_path, monkeypatch):
    fake, seen = FakeTry(secs=1.0), []

    def fake_subprocess_try(args, L, timeout_s, work, model_dir, account=False):
        seen.append((L, timeout_s, account))
        run = fake(L, timeout_s)
        if account:
            run["memory_account"] = {"peak_gib": 21.0, "parts": {"other": 1.0}}
        return run

    monkeypatch.setattr(lc, "subprocess_try", fake_subprocess_try)
    out = tmp_path / "ours_22.json"
    args = lc.build_parser().parse_args(["bisect", "--peer", "ours", "--cap-gib", "22", "--out", str(out),
                                         "--deadline-s", "400", "--probe", "16384,32768", "--account"])
    result = lc.run_bisect(args)
    *search_calls, last = seen
    assert not any(acc for _, _, acc in search_calls)
    assert max(t for _, t, _ in search_calls) <= 400 - lc.ACCOUNT_RESERVE_S  # the search's deadline is shortened
    assert last[0] == result["max_seq_len"] == fake.edge() and last[2] is True
    rec = json.loads(out.read_text())
    assert rec["memory_account"]["seq_len"] == fake.edge() and rec["memory_account"]["parts"] == {"other": 1.0}
    assert rec["engine"] == lc.ENGINE  # the build the driver measured: its runs merge under a key of their own
    merged = lcm.merge([out], primary={"ours": f"ours_{lc.ENGINE}"})
    assert merged["budgets"][0]["ours_memory_account"]["peak_gib"] == 21.0


def test_calls_of_one_variant_are_combined_and_a_primary_variant_stands_for_its_peer(tmp_path):
    xs = {"alloc_conf": "expandable_segments:True"}
    first = json.loads(_driver_file(tmp_path, "ours", 22.0, 24, 40_960).read_text())
    first["runs"] = [r for r in first["runs"] if r["ok"]] + [{"seq_len": 40_960, "ok": True}]  # no edge yet
    (a := tmp_path / "call1.json").write_text(json.dumps({**first, **xs, "stopped": "deadline"}))
    second = json.loads(_driver_file(tmp_path, "ours", 22.0, 24, 45_056).read_text())  # 45,056 ok, 46,080 OOM
    second["runs"] = [{"seq_len": 45_056, "ok": True}, *[r for r in second["runs"] if not r["ok"]]]
    (b := tmp_path / "call2.json").write_text(json.dumps({**second, **xs}))
    plain = _driver_file(tmp_path, "ours", 22.0, 24, 33_792)
    merged = lcm.merge([a, b, plain, _driver_file(tmp_path, "unsloth", 22.0, 24, 30_720)],
                      primary={"ours": "ours_expandable_segments"})
    (entry,) = merged["budgets"]
    assert entry["ours_variant"] == "ours_expandable_segments" and "ours_expandable_segments_runs" not in entry
    assert [r["seq_len"] for r in entry["ours_runs"]] == [16_384, 40_960, 45_056, 46_080]
    assert [r["source"] for r in entry["ours_runs"]] == ["call1.json", "call1.json", "call2.json", "call2.json"]
    assert entry["ours_max_seq_len"] == 45_056 and entry["ours_edge_found"] is True
    assert entry["ours_stopped"] == "edge found" and entry["unsloth_max_seq_len"] == 30_720
    assert entry["ours_plain_max_seq_len"] == 33_792  # the default allocator's run, kept apart
    # a merged file merges again with a later call: its runs keep their first source
    (m := tmp_path / "long_context_h100.json").write_text(json.dumps(merged))
    again = lcm.merge([m])["budgets"][0]
    assert again["ours_expandable_segments_max_seq_len"] == 45_056
    assert again["ours_expandable_segments_runs"][0]["source"] == "call1.json"


def test_a_later_build_is_its_own_variant_and_the_first_primary_each_cap_has_stands_for_the_peer(tmp_path):
    """Runs of a later build of the product (``engine``) are kept apart from the earlier build's, whose
    failures would otherwise bound the later one's longer successes; ``--primary a,b``: the first each cap has."""
    older = json.loads(_driver_file(tmp_path, "ours", 22.0, 24, 40_960).read_text())  # 41,984 OOM there
    (a := tmp_path / "older.json").write_text(json.dumps(older))
    newer = json.loads(_driver_file(tmp_path, "ours", 22.0, 24, 51_200).read_text())
    (b := tmp_path / "newer.json").write_text(json.dumps({**newer, "engine": "mlp_op"}))
    wide = _driver_file(tmp_path, "ours", 38.5, 40, 90_112)
    assert lcm.variant_key({"peer": "ours", "engine": "mlp_op", "alloc_conf": "expandable_segments:True"}) \
        == "ours_mlp_op_expandable_segments"
    merged = lcm.merge([a, b, wide], primary={"ours": "ours_mlp_op,ours"})
    small, large = merged["budgets"]
    assert small["ours_variant"] == "ours_mlp_op" and small["ours_max_seq_len"] == 51_200
    assert small["ours_engine"] == "mlp_op" and small["ours_plain_max_seq_len"] == 40_960
    assert large["ours_max_seq_len"] == 90_112 and "ours_variant" not in large
    args = lc.build_parser().parse_args(["merge", "x.json", "--out-dir", ".", "--primary", "ours=ours_mlp_op,ours"])
    assert args.primary == ["ours=ours_mlp_op,ours"]
    # exact-size host buffers for the offloaded inputs (CPU RAM, not GPU memory): the same variant
    assert lcm.variant_key({"peer": "ours", "exact_host_buffers": True, "alloc_conf": "expandable_segments:True"}) \
        == lcm.variant_key({"peer": "ours", "alloc_conf": "expandable_segments:True"}) == "ours_expandable_segments"
    args = lc.build_parser().parse_args(["try", "--peer", "ours", "--cap-gib", "22", "--out", "x.json", "--seq-len",
                                         "1024", "--exact-host-buffers"])
    assert args.exact_host_buffers is True


def test_kept_attention_asked_on_or_off_is_a_variant_and_auto_is_the_product():
    assert lcm.variant_key({"peer": "ours", "keep_attention": "on"}) == "ours_kept_attention"
    assert lcm.variant_key({"peer": "ours", "keep_attention": True}) == "ours_kept_attention"
    assert lcm.variant_key({"peer": "ours", "keep_attention": "off"}) == "ours_no_kept_attention"
    assert lcm.variant_key({"peer": "ours", "keep_attention": "auto"}) == "ours"
    assert lcm.variant_key({"peer": "ours", "keep_attention": None}) == "ours"
    args = lc.build_parser().parse_args(["try", "--peer", "ours", "--cap-gib", "22", "--out", "x.json", "--seq-len",
                                         "1024", "--keep-attention", "off"])
    assert args.keep_attention == "off"
    with pytest.raises(SystemExit):
        lc.build_parser().parse_args(["try", "--peer", "ours", "--cap-gib", "22", "--out", "x.json", "--seq-len",
                                      "1024", "--keep-attention", "yes"])


def test_single_tries_settle_an_edge_an_earlier_bisection_left_open(tmp_path):
    """``lab/gpu/long_context/gpu_edge_tries.sh`` writes one ``try`` file per length: merged with the earlier file, an ok
    try raises the longest length, an out-of-memory one a step above it closes the bracket."""
    xs = {"alloc_conf": "expandable_segments:True"}
    older = json.loads(_driver_file(tmp_path, "unsloth", 38.5, 40, 40_960).read_text())
    older["runs"] = [r for r in older["runs"] if r["ok"]]  # 16,384 ok; no failure yet: no edge
    (a := tmp_path / "call2.json").write_text(json.dumps({**older, **xs, "edge_found": False, "stopped": "deadline"}))
    first = lcm.merge([a], primary={"unsloth": "unsloth_expandable_segments"})
    (m := tmp_path / "long_context_h100.json").write_text(json.dumps(first))
    assert first["budgets"][0]["unsloth_edge_found"] is False

    def try_file(L, ok):
        rec = {"peer": "unsloth", **xs, "seq_len": L, "cap_gib": 38.5, "ok": ok, "wall_s": 100.0,
               "peak_mem_gib": 30.0 if ok else None, "reserved_gib": 31.0 if ok else None,
               "device": "NVIDIA H100 80GB HBM3", "versions": {"unsloth": "2026.10.9"},
               "date": "2026-11-28T00:00:00+00:00", "command": "bash lab/gpu/long_context/gpu_edge_tries.sh"}
        if not ok:
            rec.update(oom=True, error="OutOfMemoryError: CUDA out of memory")
        (p := tmp_path / f"unsloth_38.5_{L}.json").write_text(json.dumps(rec))
        return p

    merged = lcm.merge([try_file(41_984, True), try_file(43_008, False), m],
                       primary={"unsloth": "unsloth_expandable_segments"})
    (entry,) = merged["budgets"]
    assert entry["unsloth_max_seq_len"] == 41_984 and entry["unsloth_edge_found"] is True
    assert entry["unsloth_bracket"] == [41_984, 43_008] and entry["card"] == "40 GB"
    assert [(r["seq_len"], r["source"]) for r in entry["unsloth_runs"]] == [
        (16_384, "call2.json"), (41_984, "unsloth_38.5_41984.json"), (43_008, "unsloth_38.5_43008.json")]
    # alone, a failed try bounds nothing it could stand for
    alone = lcm.merge([try_file(43_008, False)])["budgets"][0]
    assert alone["unsloth_expandable_segments_max_seq_len"] is None
