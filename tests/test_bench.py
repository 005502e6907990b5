"""The main job end to end on small sizes: JSON fields, parity, plots, the CLI and its errors."""

import json

import pytest
import torch

from qlora_nb_utils import cli, models, plots
from qlora_nb_utils.bench import main_job as bench
from qlora_nb_utils.training.loop import TrainConfig, train

REQUIRED = {
    "device", "versions", "command", "date", "model", "eager", "compiled", "graph_breaks", "compilations",
    "recompilations", "compile_s", "speedup", "max_abs_loss_diff",
}
PER_RUN = {"median_step_ms", "tokens_per_s", "peak_mem_gib", "losses"}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = cli.main([
        "bench", "--model", "tiny", "--device", "cpu", "--steps", "5", "--warmup", "1", "--batch-size", "2",
        "--seq-len", "160", "--backend", "eager", "--out", str(out), "--no-progress",
    ])
    assert code == 0
    return out


def test_cli_writes_json_with_every_field(cli_results):
    res = json.loads((cli_results / "results.json").read_text())
    assert REQUIRED <= set(res)
    for run in ("eager", "compiled"):
        assert PER_RUN <= set(res[run]) and len(res[run]["losses"]) == 5
    assert {"torch", "transformers", "peft", "bitsandbytes", "python"} <= set(res["versions"])
    assert res["device"]["type"] == "cpu" and res["model"] == "tiny"
    assert res["graph_breaks"] == 0 and res["fullgraph_ok"]
    assert res["compilations"] == 1 and res["recompilations"] == 0  # fixed-length padding: one shape
    assert res["max_abs_loss_diff"] <= 1e-5  # the eager backend runs the same kernels
    assert res["padding"]["shapes"] == [[2, 160]]


def test_cli_writes_loss_plot(cli_results):
    png = cli_results / "loss_curves.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_read_the_results_file(cli_results):
    import matplotlib

    matplotlib.use("Agg")
    fig = plots.plot_loss_curves(cli_results / "results.json")
    line = fig.axes[0].get_lines()[0]
    res = json.loads((cli_results / "results.json").read_text())
    assert list(line.get_ydata()) == res["eager"]["losses"]
    assert plots.plot_step_time(cli_results / "results.json").axes[0].patches
    assert plots.plot_memory(res).axes[0].patches


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--model", "no-such-model", "--device", "cpu"], "tiny"),
        (["bench", "--model", "tiny", "--device", "cpu", "--steps", "3", "--warmup", "3"], "warmup"),
    ],
)
def test_cli_bad_input_is_a_clear_error(argv, message, capsys, tmp_path):
    assert cli.main(argv + ["--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_the_jobs_optimize_options_are_one_checked_object_not_recorded_twice():
    from qlora_nb_utils.bench.main_job import validate_options
    from qlora_nb_utils.bench.record import results_header
    from qlora_nb_utils.compile import OptimizeOptions

    opts = validate_options({"model": "tiny", "device": "cpu", "scope": "regional", "max_memory_gib": 2})
    assert opts["optimize_options"] == OptimizeOptions(scope="regional", max_memory_gib=2)
    assert "optimize_options" not in results_header(opts, "cpu", torch.float32, "x", {})["options"]
    for bad, message in (({"grad_ckpt": "sometimes"}, "grad_ckpt must be one of"),
                         ({"doc_attention": "dense"}, "doc_attention must be one of"),
                         ({"max_memory_gib": True}, "max_memory_gib must be None or a number > 0")):
        with pytest.raises(ValueError, match=message):
            validate_options({"model": "tiny", "device": "cpu", **bad})


def test_cli_rejects_bad_argument_values(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--steps", "0"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["diagnose", "--seq-lens", "64,abc"])
    with pytest.raises(SystemExit):
        cli.main(["diagnose", "--attn", "flash"])
    assert cli.ATTN_CHOICES == models.ATTN_CHOICES  # the CLI's copy (no torch import for --help)


def test_qlora_eager_and_inductor_losses_agree_fp32_tiny():
    """The tolerance the README states for tiny in fp32: 1e-4 over the run."""
    model, tok = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu")
    batches, _ = bench.make_bench_batches(tok, batch_size=2, seq_len=160, steps=4)
    runs = bench.side_by_side(model, batches, TrainConfig(steps=4, lr=1e-3, progress=False), log=lambda *_: None)
    res = bench.compare(runs, warmup=1)
    assert res["graph_breaks"] == 0 and res["fullgraph_ok"]
    assert res["compilations"] == 1
    assert res["max_abs_loss_diff"] <= 1e-4, res["max_abs_loss_diff"]


@pytest.mark.slow
def test_loss_falls_on_shipped_data_with_smollm2():
    model, tok = models.load_model("smollm2-135m", quant="nf4", dtype="float32", device="cpu")
    batches, _ = bench.make_bench_batches(tok, batch_size=2, seq_len=96, steps=2)
    hist = train(model, batches, TrainConfig(steps=6, lr=1e-3, progress=False))
    # steps 0, 2, 4 see batch 0; steps 1, 3, 5 see batch 1: each batch's loss must fall
    assert hist["loss"][4] < hist["loss"][0] - 0.1 and hist["loss"][5] < hist["loss"][1] - 0.1
    assert torch.isfinite(torch.tensor(hist["loss"].values)).all()


def test_diagnose_counts_and_strict_exit_codes(tmp_path, capsys):
    report_path = tmp_path / "diag.json"
    base = ["diagnose", "--model", "tiny", "--quant", "none", "--device", "cpu", "--backend", "eager", "--batch-size", "2"]
    # the fast path (the default): lengths that are not multiples of 8 compile once
    assert cli.main(base + ["--grad-ckpt", "--seq-lens", "17,23,31,45", "--json", str(report_path), "--strict",
                            "--max-compilations", "1"]) == 0
    report = json.loads(report_path.read_text())
    assert report["fast"] and report["graph_breaks"] == 0 and report["fullgraph_ok"]
    assert report["lengths"] == [17, 23, 31, 45]
    assert report["compilations"] == 1 and report["recompilations"] == 0, report["recompile_reasons"]
    assert "pad_multiple=8" in report["optimize"] and report["command"].startswith("qlora-nb diagnose")
    # plain prepare_for_compile over three lengths: a static graph, then one dynamic graph
    assert cli.main(base + ["--no-fast", "--seq-lens", "16,24,32", "--json", str(report_path), "--strict"]) == 0
    report = json.loads(report_path.read_text())
    assert not report["fast"] and report["graph_breaks"] == 0 and report["fullgraph_ok"]
    assert report["compilations"] == 2 and report["recompilations"] == 1
    assert "size mismatch" in report["recompile_reasons"][0]
    assert report["model"] == "tiny" and "torch" in report["versions"] and report["attn"] == "sdpa"
    # the same run judged against a budget of one compilation fails under --strict only
    assert cli.main(base + ["--no-fast", "--seq-lens", "16,24,32", "--max-compilations", "1"]) == 0
    assert cli.main(base + ["--no-fast", "--seq-lens", "16,24,32", "--max-compilations", "1", "--strict"]) == 1
    assert "compilations" in capsys.readouterr().err
    # --fast with an option of the other path is refused before anything loads
    assert cli.main(base + ["--fast", "--regional"]) == 2


def test_problems_lists_each_failure():
    from qlora_nb_utils.diagnostics import checks

    clean = {"graph_breaks": 0, "fullgraph_ok": True, "compilations": 1, "seq_lens": [16]}
    assert checks.problems(clean) == []
    bad = {"graph_breaks": 2, "fullgraph_ok": False, "fullgraph_error": "Unsupported: x\nmore", "compilations": 5,
           "seq_lens": [1, 2, 3]}
    found = checks.problems(bad, max_compilations=2)
    assert len(found) == 3 and "Unsupported: x" in found[1] and "5 compilations" in found[2]


def test_a_compiler_failure_during_the_run_over_lengths_is_reported_not_raised():
    """What the H200 showed for whole-model causal flex (Inductor's CantSplit on the dynamic
    graph), made on a CPU: a backend that refuses dynamic graphs fails the second length."""
    from qlora_nb_utils.diagnostics import checks

    def static_only(gm, example_inputs):
        if any(isinstance(x, torch.SymInt) for x in example_inputs):
            raise RuntimeError("this backend compiles static graphs only")
        return gm.forward

    report = checks.diagnose(model="tiny", quant="none", seq_lens=[16, 24, 32], batch_size=2, device="cpu",
                             compile_kwargs={"backend": static_only})
    assert report["graph_breaks"] == 0 and report["fullgraph_ok"]
    assert report["run_failed_at_len"] == 24 and "static graphs only" in report["run_error"]
    (found,) = checks.problems(report)
    assert "failed at length 24" in found


def test_diagnose_grad_ckpt_upstream_breaks_and_prepared_is_clean(tmp_path):
    base = ["diagnose", "--model", "tiny", "--quant", "none", "--grad-ckpt", "--device", "cpu", "--backend", "eager",
            "--seq-lens", "32", "--strict"]
    assert cli.main(base + ["--no-patches", "--json", str(tmp_path / "raw.json")]) == 1
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert raw["graph_breaks"] >= 1 and not raw["fullgraph_ok"] and "requires_grad_" in raw["fullgraph_error"]
    assert cli.main(base + ["--json", str(tmp_path / "fixed.json")]) == 0
    fixed = json.loads((tmp_path / "fixed.json").read_text())
    assert fixed["graph_breaks"] == 0 and fixed["fullgraph_ok"] and "input_require_grads" in fixed["patches"]
    assert cli.main(base + ["--regional"]) == 0


def test_resolve_device_dtype_names_the_default_and_refuses_unknown_names():
    from qlora_nb_utils.env import resolve_device_dtype

    assert resolve_device_dtype("cpu", "auto") == (torch.device("cpu"), torch.float32)  # exact parity on a CPU
    assert resolve_device_dtype("cpu", None) == (torch.device("cpu"), torch.float32)
    assert resolve_device_dtype("cpu", "bfloat16")[1] is torch.bfloat16
    with pytest.raises(ValueError):
        resolve_device_dtype("cpu", "float7")


def test_warm_shapes_runs_each_shape_once_and_leaves_the_weights_alone():
    model, tok = models.load_model("tiny", quant="none", dtype="float32", device="cpu")
    short, _ = bench.make_bench_batches(tok, batch_size=2, seq_len=64, steps=2)
    long, _ = bench.make_bench_batches(tok, batch_size=2, seq_len=96, steps=2)
    batches = [short[0], long[0], short[1], long[1]]  # two shapes, each twice
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []

    def forward(**batch):
        calls.append(tuple(batch["input_ids"].shape))
        return model(**batch)

    assert bench.warm_shapes(model, batches, forward=forward) == 2
    assert calls == [(2, 64), (2, 96)]
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_compiled_run_advanced_a_compilation_at_a_time_is_the_run_in_one_go():
    from qlora_nb_utils.bench import CompiledRun, compiled_run
    from qlora_nb_utils.training.loop import trainable_state

    model, tok = models.load_model("tiny", quant="none", dtype="float32", device="cpu", lora=True)
    short, _ = bench.make_bench_batches(tok, batch_size=2, seq_len=64, steps=3)
    long, _ = bench.make_bench_batches(tok, batch_size=2, seq_len=96, steps=1)
    batches = [short[0], long[0], short[1], short[2]]  # a second length at step 1 only
    start = trainable_state(model)
    cfg = TrainConfig(steps=6, lr=1e-3, seed=0, progress=False)  # cycles the list: steps 4-5 reuse 0-1
    whole, counter = compiled_run(model, batches, cfg, start=start, backend="eager", label="whole")
    assert counter.compilations == 2  # static, then dynamic at the new length

    run = CompiledRun(model, batches, cfg, start=start, backend="eager", label="cut")
    lines = [run.advance() for _ in range(4)]
    assert lines[0].startswith("cut: step 0; compilation 1 at step 0") and "the first call" in lines[0]
    assert lines[1].startswith("cut: step 1; compilation 2 at step 1") and "size mismatch" in lines[1]
    assert lines[2] == "cut: steps 2-5, no compilation; the run is complete"
    assert lines[3] == "cut: all 6 steps already ran" and run.done
    cut = run.history()
    assert list(cut["step"]) == list(range(6)) == list(whole["step"])
    assert list(cut["loss"]) == pytest.approx(list(whole["loss"]), rel=1e-6, abs=0)
    assert list(cut["lr"]) == list(whole["lr"])  # one warm-up schedule, not one per call
    assert (cut["peak_mem_gib"].diff().dropna() >= 0).all()  # the peak so far, as one call reports it


def test_a_compiled_run_needs_batches_and_something_to_train():
    from qlora_nb_utils.bench import CompiledRun

    model, _ = models.load_model("tiny", quant="none", dtype="float32", device="cpu", lora=True)
    with pytest.raises(ValueError, match="at least one batch"):
        CompiledRun(model, [], TrainConfig(steps=1), backend="eager")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        CompiledRun(model, [{"input_ids": torch.ones(1, 4, dtype=torch.long)}], TrainConfig(steps=1), backend="eager")
