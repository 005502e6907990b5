"""Issue 20's compute job and its report: the schema, the comparison, failed runs, the trade-off plot."""

import json
from pathlib import Path

import pytest

from lab.peers import compute
from lab.report import peers_compute as report
from lab.report.__main__ import main as lab_report

ROOT = Path(__file__).resolve().parents[2]
#: the fields issue 20's checks read from every run
NAMED = {"name", "library", "model", "batch_size", "seq_len", "grad_ckpt", "median_step_ms", "peak_mem_gib", "mfu",
         "compile_s"}
TINY = {"name": "tiny-2x64-ckpt", "model": "tiny", "batch_size": 2, "seq_len": 64, "grad_ckpt": True, "held": True}


def _run(name, library, ms, gib, setting="s", **kw):
    return {"name": name, "library": library, "setting": setting, "model": "m", "batch_size": 8, "seq_len": 1024,
            "grad_ckpt": True, "median_step_ms": ms, "peak_mem_gib": gib, "mfu": 0.5, "compile_s": 1.0, **kw}


def test_compare_speed_and_memory_ratios_and_the_target():
    runs = [_run("unsloth", "unsloth", 700.0, 8.0), _run("ours", "ours", 600.0, 12.0),
            _run("ours-held", "ours", 630.0, 7.9), _run("ours", "ours", 100.0, 1.0, setting="no-unsloth-here")]
    pairs = {p["ours"]: p for p in compute.compare(runs)}
    assert set(pairs) == {"ours", "ours-held"}  # no Unsloth run at the other setting: no pair
    assert pairs["ours"]["speedup"] == pytest.approx(700 / 600) and pairs["ours"]["mem_ratio"] == pytest.approx(1.5)
    assert pairs["ours"]["faster"] and not pairs["ours"]["within_memory"] and not pairs["ours"]["target_met"]
    assert pairs["ours-held"]["speedup"] == pytest.approx(700 / 630) and pairs["ours-held"]["target_met"]
    assert not compute.compare(runs, target=1.2)[1]["target_met"]  # 1.11x misses a 1.2x target
    runs[0] = {**runs[0], "error": "CUDA out of memory"}
    failed = compute.compare(runs)[0]
    assert failed["speedup"] is None and not failed["target_met"] and "unsloth: CUDA out of memory" in failed["error"]


def test_unknown_setting_and_bad_warmup_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown setting.*8b-8x1024-ckpt"):
        compute.run_compute(tmp_path / "x.json", ["8b-16x1024"])
    with pytest.raises(ValueError, match="lacks"):
        compute.run_compute(tmp_path / "x.json", [{"model": "tiny", "batch_size": 2}])
    with pytest.raises(ValueError, match="warmup"):
        compute.run_compute(tmp_path / "x.json", [TINY], steps=2, warmup=2)


def test_a_failing_ours_run_is_an_error_row():
    from qlora_nb_utils import models
    from qlora_nb_utils.bench import main_job

    batches, _ = main_job.make_bench_batches(models.load_tokenizer("tiny"), batch_size=2, seq_len=64, steps=2)
    spec = {"name": "ours", "model": "tiny", "steps": 2, "warmup": 1, "lr": 1e-3, "seed": 0, "lora_r": 4,
            "lora_alpha": 8, "device": "cpu", "dtype": "float32", "optimize": {"attention": "sideways"}}
    run = compute.run_ours(spec, batches)
    assert run["name"] == "ours" and "attention" in run["error"] and (run["batch_size"], run["seq_len"]) == (2, 64)


@pytest.fixture(scope="module")
def compute_file(tmp_path_factory):
    """One CPU call: Unsloth fails (no CUDA), ours runs in its own process, the held row is held to
    an Unsloth peak that a stand-in Unsloth run reports (the real one needs a GPU)."""
    out = tmp_path_factory.mktemp("compute") / "peers_compute_cpu.json"
    common = dict(steps=3, warmup=1, device="cpu", peak_tflops=0.05, ours_options={"backend": "eager"},
                  log=lambda *_: None)
    first = compute.run_compute(out, [TINY], **common)
    with pytest.MonkeyPatch.context() as mp:  # a second call, another setting: an Unsloth run that worked
        mp.setattr(compute, "_unsloth_run", lambda ctx, path, limit: {
            "name": "unsloth", "batch_size": 1, "seq_len": 64, "median_step_ms": 50.0, "peak_mem_gib": 0.75,
            "mfu": 0.1, "compile_s": 0.5, "step_ms": [60.0, 50.0, 50.0]})
        second = compute.run_compute(out, [{**TINY, "name": "tiny-1x64-ckpt", "batch_size": 1}], **common)
    return out, first, second


def test_the_file_has_issue_20s_fields_and_failed_runs_say_why(compute_file):
    out, first, _ = compute_file
    res = json.loads(out.read_text())
    assert res["kind"] == "peers_compute" and {"device", "versions", "date", "command", "runs", "vs_unsloth"} <= set(res)
    assert len(res["calls"]) == 2 and set(res["settings"]) == {"tiny-2x64-ckpt", "tiny-1x64-ckpt"}
    runs = {(r["setting"], r["name"]): r for r in res["runs"]}
    assert len(runs) == 6  # the first call's rows kept by the second
    for run in runs.values():
        assert NAMED <= set(run), run
    uns, ours, held = (runs["tiny-2x64-ckpt", n] for n in ("unsloth", "ours", "ours-held"))
    assert "no CUDA device" in uns["error"] and uns["library"] == "unsloth"
    assert "no Unsloth peak" in held["error"]
    assert "error" not in ours and ours["library"] == "ours" and ours["compilations"] == 1
    assert ours["grad_ckpt"] and ours["optimize"]["ckpt_layers"].split("/")[0] != "0"
    assert len(ours["losses"]) == 3 and ours["peak_mem_gib"] > 0 and ours["mfu"] > 0
    assert first["vs_unsloth"][0]["speedup"] is None and not first["vs_unsloth"][0]["target_met"]


def test_the_held_row_gets_unsloths_peak_through_optimize(compute_file):
    _, _, second = compute_file
    runs = {r["name"]: r for r in second["runs"] if r["setting"] == "tiny-1x64-ckpt"}
    held = runs["ours-held"]
    assert "error" not in held, held.get("error")
    assert held["max_memory_gib"] == 0.75 and "0.75 GiB" in held["optimize"]["ckpt_layers"] + held["description"]
    pair = next(p for p in second["vs_unsloth"] if p["ours"] == "ours-held" and p["setting"] == "tiny-1x64-ckpt")
    assert pair["speedup"] == pytest.approx(50.0 / held["median_step_ms"])
    assert pair["mem_ratio"] == pytest.approx(held["peak_mem_gib"] / 0.75)


def test_report_prints_the_pairs_and_plots_the_tradeoff(compute_file, capsys, tmp_path):
    out, _, second = compute_file
    assert lab_report([str(out)]) == 0
    text = capsys.readouterr()
    row = next(line for line in text.out.splitlines() if line.startswith("| tiny-1x64-ckpt |") and "ours-held" in line)
    pair = next(p for p in second["vs_unsloth"] if p["ours"] == "ours-held" and p["setting"] == "tiny-1x64-ckpt")
    assert f"| {pair['speedup']:.2f}x | {pair['mem_ratio']:.2f}x |" in row
    assert "no run at the trade-off shape" in text.err  # tiny is not the 8B shape
    png = report.write_tradeoff_plot(out, second, shape=("tiny", 1, 64))
    assert png.name == "peers_compute_cpu_tradeoff.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tradeoff_points_from_the_committed_offload_files(tmp_path):
    files = sorted((ROOT / "lab" / "results" / "memory").glob("offload_h100*.json"))
    assert files, "lab/results/memory/offload_h100*.json are committed"
    loaded = [(f.name, json.loads(f.read_text())) for f in files]
    points = report.tradeoff_points(None, loaded)
    runs = [r for _, res in loaded for r in res["runs"] if "error" not in r]
    assert len(points) == len(runs) and {p["library"] for p in points} == {"ours"}
    by = {(p["source"].split(" ")[0], p["label"]): p for p in points}
    first = loaded[0][1]["runs"][0]
    assert by[files[0].name, f"ours, {first['name']}"]["peak_gib"] == first["peak_alloc_gib"]
    assert report.tradeoff_points(None, loaded, shape=("llama-3.1-8b-shape", 2, 1024)) == []
    png = report.plot_tradeoff(points, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no run"):
        report.plot_tradeoff([], tmp_path / "none.png")


def test_the_committed_h100_file_and_its_tradeoff_plot(tmp_path):
    path = ROOT / "lab" / "results" / "compute" / "peers_compute_h100.json"
    res = json.loads(path.read_text())
    assert report.is_compute_file(res) and {"device", "versions", "date", "command"} <= set(res)
    assert {r["setting"] for r in res["runs"]} == set(compute.SETTINGS)
    for run in res["runs"]:
        assert NAMED <= set(run) and run["library"] in ("ours", "unsloth"), run["name"]
        assert run["model"] in ("llama-3.2-1b-shape", "llama-3.1-8b-shape")
    assert compute.compare(res["runs"]) == res["vs_unsloth"]  # the stored ratios are the runs' ratios
    offload = [(f.name, json.loads(f.read_text())) for f in sorted((ROOT / "lab" / "results" / "memory").glob("offload_h100*.json"))]
    points = report.tradeoff_points(res, offload, compute_name=path.name)
    at_shape = [r for r in res["runs"] if (r["model"], r["batch_size"], r["seq_len"]) == report.TRADEOFF_SHAPE]
    assert len(at_shape) >= 5  # Unsloth and ours, checkpointing off and on, the held run (+ any A/B variants)
    assert sum(p["source"].startswith(path.name) for p in points) == len(at_shape)  # one point per run
    assert sorted(p["peak_gib"] for p in points if p["library"] == "unsloth") == sorted(
        r["peak_mem_gib"] for r in at_shape if r["library"] == "unsloth")
    png = report.plot_tradeoff(points, tmp_path / "tradeoff.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = report.markdown_table(res, path.name)
    assert len([line for line in table.splitlines() if line.startswith("| 8b-") or line.startswith("| 1b-")]) == len(
        res["vs_unsloth"])


def test_plan_adds_variants_only_when_asked():
    from lab.peers.compute import SETTINGS, _plan, _variants

    st = SETTINGS["8b-8x1024-ckpt"]
    assert [n for n, _, _ in _plan("k", st, "regional", {})] == ["unsloth", "ours", "ours-held"]
    variants = _variants(['ours-no-recompute={"recompute": false}'])
    plan = _plan("k", st, "regional", {}, variants)
    assert [n for n, _, _ in plan] == ["unsloth", "ours", "ours-no-recompute", "ours-held"]
    ours, no_rec = plan[1][2], plan[2][2]
    assert no_rec == {**ours, "recompute": False} and "recompute" not in ours
    for bad in ("ours-x", "ours-x=[1]", "other={}", "ours-x={bad"):
        with pytest.raises(ValueError, match="--variant"):
            _variants([bad])
