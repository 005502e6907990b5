"""lab/gpu/compile_time/cold_start.py: the fields the checks read, from a run's raw record, and the merge.

The script runs on the GPU machine (its dry run on a CPU takes minutes); here only its arithmetic:
the time to the first step from the parent's launch clock, the wall to step 60, the median that
leaves the first step out, and several calls' files joined into one.
"""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cold_start", ROOT / "lab/gpu/compile_time/cold_start.py")
cold_start = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cold_start)


def test_the_three_shapes_of_the_measurement():
    assert {(s["model"], s["batch_size"], s["seq_len"], s["packing"]) for s in cold_start.SHAPES.values()} == {
        ("smollm2-135m", 4, 128, "auto"), ("llama-3.2-1b-shape", 8, 1024, "on"), ("llama-3.1-8b-shape", 4, 2048, "on")}
    assert {lib for lib, _ in cold_start.ORDER} == {"ours", "ours-before", "hf-eager", "unsloth"}
    assert cold_start.BEFORE == ["--scope", "whole", "--compile-cache", "off"]


def test_a_run_record_becomes_the_checked_fields():
    shape = {"model": "m", "batch_size": 8, "seq_len": 1024, "packed": True}
    step_ms = [20_000.0] + [100.0] * 59 + [999.0]  # 61 steps: the 61st is not in the wall to step 60
    rec = {"step_ms": step_ms, "launched_unix": 1000.0, "first_step_end_unix": 1030.0, "peak_mem_gib": 5.0,
           "graph_breaks": 0, "compilations": 1}
    row = cold_start._finish(rec, "ours", "cold", shape, 61)
    assert row["time_to_first_step_s"] == 30.0
    assert row["median_step_ms"] == 100.0  # the compiling step left out
    assert row["wall_60_s"] == 30.0 + 59 * 0.1
    assert (row["library"], row["cache"], row["batch_size"], row["seq_len"]) == ("ours", "cold", 8, 1024)
    assert row["peak_mem_gib"] == 5.0 and row["graph_breaks"] == 0 and row["compilations"] == 1
    failed = cold_start._finish({"error": "boom"}, "unsloth", "warm", shape, 60)
    assert failed["error"] == "boom" and failed["time_to_first_step_s"] is None


def test_calls_merge_into_one_file(tmp_path):
    base = {"what": "w", "device": {"name": "GPU"}, "versions": {}, "tool": "t", "time_to_first_step_how": "h",
            "wall_60_how": "w60", "skipped": [], "wall_s": 1.0}
    files = []
    for shape, date in (("a", "2026-01-01"), ("b", "2026-01-02")):
        path = tmp_path / f"{shape}.json"
        path.write_text(json.dumps({**base, "shape": shape, "date": date, "command": f"cmd {shape}",
                                    "runs": [{"library": "ours", "model": shape}]}))
        files.append(str(path))
    out = tmp_path / "merged.json"
    assert cold_start.merge(str(out), files) == 0
    merged = json.loads(out.read_text())
    assert [r["model"] for r in merged["runs"]] == ["a", "b"] and merged["date"] == "2026-01-02"
    assert merged["command"] == ["cmd a", "cmd b"] and [c["shape"] for c in merged["calls"]] == ["a", "b"]


def test_merge_keeps_whether_the_modules_had_their_bytecode(tmp_path):
    """A call's imports take seconds more without bytecode: each run says which kind of call it came from."""
    base = {"what": "w", "device": {}, "versions": {}, "tool": "t", "time_to_first_step_how": "h", "wall_60_how": "w",
            "skipped": [], "shape": "s", "command": "c", "runs": [{"library": "ours"}]}
    with_bc, without = tmp_path / "a.json", tmp_path / "b.json"
    with_bc.write_text(json.dumps({**base, "date": "2026-01-01", "bytecode": "written (40 s)"}))
    without.write_text(json.dumps({**base, "date": "2026-01-02"}))
    out = tmp_path / "m.json"
    assert cold_start.merge(str(out), [str(with_bc), str(without)], conditions="quiet") == 0
    merged = json.loads(out.read_text())
    assert [r.get("bytecode") for r in merged["runs"]] == ["written (40 s)", None]
    assert [c.get("bytecode") for c in merged["calls"]] == ["written (40 s)", None]
    assert all(r["conditions"] == "quiet" for r in merged["runs"])


def test_a_trial_of_ours_runs_with_its_environment_and_records_it(tmp_path, monkeypatch):
    seen = {}

    def spawn(cmd, env, log, timeout_s):
        seen["env"] = env
        return 0.0, 1.0, 1  # launched, wall, exit: no metrics.json written

    monkeypatch.setattr(cold_start, "_spawn", spawn)
    shape = {"model": "tiny", "batch_size": 2, "seq_len": 64, "packing": "auto"}
    rec = cold_start._run_ours("ours-cpp-wrapper", shape, tmp_path, tmp_path / "dirs", "cpu", 2, 10)
    assert seen["env"]["TORCHINDUCTOR_CPP_WRAPPER"] == "1"
    assert rec["env"] == {"TORCHINDUCTOR_CPP_WRAPPER": "1"} and "no metrics.json" in rec["error"]
    rec = cold_start._run_ours("ours", shape, tmp_path, tmp_path / "dirs", "cpu", 2, 10)
    assert "env" not in rec and seen["env"].get("TORCHINDUCTOR_CPP_WRAPPER") != "1"


def test_ours_trains_the_peers_learning_rate_schedule(tmp_path, monkeypatch):
    from qlora_nb_utils.training.loop import TrainConfig

    seen = {}

    def spawn(cmd, env, log, timeout_s):
        seen["cmd"] = cmd
        return 0.0, 1.0, 1

    monkeypatch.setattr(cold_start, "_spawn", spawn)
    shape = {"model": "tiny", "batch_size": 2, "seq_len": 64, "packing": "auto"}
    cold_start._run_ours("ours", shape, tmp_path, tmp_path / "dirs", "cpu", 2, 10)
    cmd = seen["cmd"]
    # HF eager's child trains with TrainConfig's schedule: the learning rate held from the first step
    assert int(cmd[cmd.index("--warmup-steps") + 1]) == TrainConfig(steps=2).warmup_steps == 0


def test_hf_eager_builds_its_batches_and_the_prebuilt_trial_reads_the_parents(tmp_path, monkeypatch):
    seen = []

    def spawn(cmd, env, log, timeout_s):
        seen.append((cmd, env))
        return 0.0, 1.0, 1

    monkeypatch.setattr(cold_start, "_spawn", spawn)
    shape = {"model": "tiny", "model_dir": "tiny", "batch_size": 2, "seq_len": 64, "packing": "auto", "packed": False}
    for lib in ("hf-eager", "hf-eager-prebuilt"):
        rec = cold_start._run_peer(lib, shape, tmp_path, tmp_path / "dirs", tmp_path / "batches.pt", "cpu", 2, 10)
        assert "no record" in rec["error"]
    (built, env), (prebuilt, _) = seen
    assert "--batches" not in built and built[built.index("--batch-size") + 1] == "2"
    assert built[built.index("--packing") + 1] == "auto" and built[built.index("--seq-len") + 1] == "64"
    assert prebuilt[prebuilt.index("--batches") + 1] == str(tmp_path / "batches.pt") and "--batch-size" not in prebuilt
    assert env["HF_DATASETS_CACHE"] == str(tmp_path / "dirs" / "datasets")  # emptied with a cold run's folders
    assert set(cold_start.HF) <= set(cold_start.NO_COMPILE) and set(cold_start.HF) <= set(cold_start.PEERS)


def test_the_hf_child_builds_its_batches_and_records_the_time(tmp_path, monkeypatch):
    monkeypatch.setenv("QLORA_NB_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "hf.json"
    args = cold_start.main.__globals__["argparse"].Namespace(
        model="tiny", batches=None, batch_size=2, seq_len=256, packing="auto", steps=2, device="cpu", out=str(out))
    assert cold_start.child_hf(args) == 0
    rec = json.loads(out.read_text())
    assert "error" not in rec, rec.get("traceback")
    assert rec["data"].startswith("built in the process") and rec["data_s"] > 0 and len(rec["step_ms"]) == 2
    from qlora_nb_utils.data import batch_cache, token_cache

    assert not batch_cache.default_dir().exists() and not token_cache.default_dir().exists()  # nothing kept


def test_the_rebatched_trial_shares_ours_caches_but_builds_its_batches(tmp_path, monkeypatch):
    """``ours-rebatched`` is a warm start of ours as before the batch cache: ours' compile caches, the
    token cache kept, the batch cache emptied."""
    from qlora_nb_utils.data import batch_cache, token_cache

    monkeypatch.setenv("QLORA_NB_CACHE", str(tmp_path / "cache"))
    for folder in (batch_cache.default_dir(), token_cache.default_dir()):
        folder.mkdir(parents=True)
        (folder / "entry").write_text("kept")
    assert cold_start._caches_for("ours", "warm", tmp_path) == tmp_path / "ours-cache"
    assert (batch_cache.default_dir() / "entry").exists()  # ours' warm run reads its batches back
    assert cold_start._caches_for("ours-rebatched", "warm", tmp_path) == tmp_path / "ours-cache"
    assert not batch_cache.default_dir().exists() and (token_cache.default_dir() / "entry").exists()
    assert cold_start.OURS["ours-rebatched"] == cold_start.OURS["ours"]
    batch_cache.default_dir().mkdir(parents=True)
    cold_start._caches_for("ours", "cold", tmp_path)  # a cold run: every cache emptied
    assert not batch_cache.default_dir().exists() and not token_cache.default_dir().exists()


def test_each_trial_of_ours_is_named_to_its_child_through_the_environment():
    """The child applies them (lab/trials.py); here only which trial sends which name."""
    from lab import trials

    assert cold_start.OURS["ours-nested"] == ["--scope", "whole"]
    assert cold_start.OURS_ENV["ours-nested"] == {trials.NESTED_ENV: "1"}
    assert cold_start.OURS_ENV["ours-rows0"] == {trials.ROWS_ENV: "0"}
    assert cold_start.OURS_ENV["ours-light"] == {trials.LIGHT_ENV: "one-config,eager-loss"}


def _run(lib, cache, call, ttfs, wall, model="/tmp/x/llama-3.1-8b-shape"):
    return {"library": lib, "cache": cache, "call_date": call, "model": model, "batch_size": 4, "seq_len": 2048,
            "time_to_first_step_s": ttfs, "wall_60_s": wall, "median_step_ms": 100.0}


def test_comparisons_set_ours_beside_the_peers_of_the_same_call_only():
    runs = [_run("ours", "cold", "c1", 40.0, 60.0), _run("unsloth", "cold", "c1", 50.0, 90.0),
            _run("hf-eager", "cold", "c1", 20.0, 150.0), _run("ours", "warm", "c1", 25.0, 45.0),
            _run("unsloth", "cold", "c2", 50.0, 90.0),  # no ours in call c2: no comparison
            _run("ours", "cold", "c3", 40.0, 60.0), _run("hf-eager", "cold", "c3", None, None)]  # a failed peer
    out = cold_start.comparisons(runs)
    assert [c["case"] for c in out] == ["llama-3.1-8b-shape 4 x 2048 cold, call c1",
                                       "llama-3.1-8b-shape 4 x 2048 warm, call c1"]
    c, warm = out
    assert c["unsloth_wall_60_ratio"] == 1.5 and c["hf_eager_wall_60_ratio"] == 2.5
    assert c["unsloth_time_to_first_step_ratio"] == 1.25 and c["hf_eager_time_to_first_step_ratio"] == 0.5
    assert c["ours_wall_60_s"] == 60.0 and c["unsloth_cache"] == "cold"
    # HF eager compiles nothing: its one run of the call beside ours' warm one; Unsloth ran cold only
    assert warm["hf_eager_wall_60_ratio"] == round(150.0 / 45.0, 3) and warm["hf_eager_cache"] == "cold"
    assert "unsloth_wall_60_ratio" not in warm and warm["ours_wall_60_s"] == 45.0


def test_merge_writes_the_comparisons(tmp_path):
    base = {"what": "w", "device": {"name": "GPU"}, "versions": {}, "tool": "t", "time_to_first_step_how": "h",
            "wall_60_how": "w60", "skipped": [], "wall_s": 1.0, "shape": "s", "date": "d1", "command": "c"}
    runs = [{k: v for k, v in _run(lib, "cold", None, t, w).items() if k != "call_date"}
            for lib, t, w in (("ours", 30.0, 40.0), ("unsloth", 60.0, 80.0))]
    path = tmp_path / "a.json"
    path.write_text(json.dumps({**base, "runs": runs}))
    out = tmp_path / "merged.json"
    cold_start.merge(str(out), [str(path)])
    merged = json.loads(out.read_text())
    assert [c["unsloth_wall_60_ratio"] for c in merged["comparisons"]] == [2.0]


def test_a_failed_run_of_ours_keeps_its_traceback(tmp_path, monkeypatch):
    def spawn(cmd, env, log, timeout_s):
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "qlora-nb-train-error.txt").write_text("qlora-nb train ...\n\nTraceback: KeyError: 'example_value'\n")
        log.write_text("qlora-nb train: failed: InternalTorchDynamoError: KeyError: example_value\n")
        return 0.0, 1.0, 3

    monkeypatch.setattr(cold_start, "_spawn", spawn)
    shape = {"model": "tiny", "batch_size": 2, "seq_len": 64, "packing": "auto"}
    rec = cold_start._run_ours("ours-nested", shape, tmp_path, tmp_path / "dirs", "cpu", 2, 10)
    assert "exit 3" in rec["error"] and "InternalTorchDynamoError" in rec["error"]
    assert "KeyError: 'example_value'" in rec["traceback"]


def test_the_priming_process_runs_on_caches_of_its_own_and_leaves_none(tmp_path, monkeypatch):
    """Before the measured runs: one process that imports what they import and compiles one kernel, on
    compile caches of its own, removed after it; its record says how long it took and how it ended."""
    seen = {}

    def spawn(cmd, env, log, timeout_s):
        seen.update(cmd=cmd, env=env)
        (Path(env["TORCHINDUCTOR_CACHE_DIR"]) / "kernel").mkdir(parents=True)  # what a compile leaves
        return 0.0, 2.5, 0

    monkeypatch.setattr(cold_start, "_spawn", spawn)
    rec = cold_start.prime(tmp_path, "cuda")
    assert seen["cmd"][-3:] == ["child-prime", "--device", "cuda"]
    assert seen["env"]["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "prime-cache"))
    assert not (tmp_path / "prime-cache").exists()
    assert rec["process_s"] == 2.5 and rec["exit"] == 0 and "peft" in rec["imports"]


def test_the_priming_child_compiles_on_a_cpu():
    assert cold_start.child_prime("cpu") == 0


def test_merge_keeps_whether_a_call_was_primed(tmp_path):
    base = {"what": "w", "device": {}, "versions": {}, "tool": "t", "time_to_first_step_how": "h", "wall_60_how": "w",
            "skipped": [], "shape": "s", "command": "c", "runs": [{"library": "ours"}]}
    primed, plain = tmp_path / "a.json", tmp_path / "b.json"
    primed.write_text(json.dumps({**base, "date": "2026-01-01", "primed": {"process_s": 9.0, "exit": 0}}))
    plain.write_text(json.dumps({**base, "date": "2026-01-02"}))
    out = tmp_path / "m.json"
    assert cold_start.merge(str(out), [str(primed), str(plain)]) == 0
    merged = json.loads(out.read_text())
    assert [c.get("primed") for c in merged["calls"]] == [{"process_s": 9.0, "exit": 0}, None]


def test_the_autotune_trial_asks_qlora_nb_train_for_the_benchmarks():
    """ours-autotune is the default before optimize() chose one configuration per kernel: --autotune on."""
    assert cold_start.OURS["ours-autotune"] == ["--autotune", "on"]
    assert cold_start.OURS["ours"] == []
