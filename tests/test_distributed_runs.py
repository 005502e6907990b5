"""What the three layouts share (``distributed/runs.py``): one set of options, checked once, before any model.

No process group and no model here: the options each layout's ``launch`` command line takes, the
``--optimize KEY=VALUE`` options parsed once into ``compile.OptimizeOptions`` (a bad one exits with
status 2 and a message that names it, before anything loads), and the shared summary fields. The
runs themselves are tested per layout (``test_fsdp*.py``, ``test_pipeline.py``,
``test_context_parallel.py``, ``test_launch_nodes.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re

import pytest
import torch

from qlora_nb_utils.distributed import launch, profiling, runs

LAYOUT_FLAGS = {"fsdp": ["--fast-path"], "pipeline": [], "context": []}
SHARED = ("model", "build", "data", "out", "steps", "global_batch_size", "micro_batch_size", "seq_len", "pack",
          "device", "dtype", "backend", "optimize", "lora_r", "lora_alpha", "lr", "warmup", "max_grad_norm", "seed",
          "timing_warmup", "eval", "no_adapter")


def _parser(layout: str) -> argparse.ArgumentParser:
    if layout == "fsdp":
        from qlora_nb_utils.distributed.fsdp_train import build_parser
    elif layout == "pipeline":
        from qlora_nb_utils.distributed.pipeline_train import build_parser
    else:
        from qlora_nb_utils.distributed.context_parallel import build_parser
    return build_parser()


@pytest.mark.parametrize("layout", launch.LAYOUTS)
def test_every_layout_takes_the_shared_options_by_the_same_names(layout):
    args = _parser(layout).parse_args(["--out", "x", "--batch-size", "2", "--warmup-steps", "3", "--data", "d.jsonl"])
    assert set(SHARED) <= set(vars(args))
    assert (args.global_batch_size, args.warmup, args.data) == (2, 3, "d.jsonl")  # qlora-nb train's names too


@pytest.mark.parametrize("layout", launch.LAYOUTS)
@pytest.mark.parametrize("pair, message", [
    ("nf4_dequant", "KEY=VALUE"),
    ("bogus=1", r"unknown optimize\(\) option"),
    ("mode=turbo", "mode must be one of"),
    ("backend=eager", "set by the .* layout itself: use --backend"),
])
def test_a_bad_optimize_option_exits_2_before_any_model_loads(layout, pair, message, capsys, monkeypatch, tmp_path):
    from qlora_nb_utils import models

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(models, "load_model", no_model)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as err:
        launch.main(["--layout", layout, *LAYOUT_FLAGS[layout], "--out", str(out), "--optimize", pair])
    assert err.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


def test_optimize_knobs_checks_the_pairs_with_what_the_layout_sets():
    got = runs.optimize_knobs(["nf4_dequant=true", "ce_chunks=8", "dtype=bfloat16"], layout="x",
                              fixed={"scope": "regional", "cast": False})
    assert got == {"nf4_dequant": True, "ce_chunks": 8, "dtype": torch.bfloat16}  # only what was asked for
    # a value that does not go with what the layout sets: refused here, not on every rank later
    with pytest.raises(ValueError, match="mode 'max-autotune' is an Inductor option"):
        runs.optimize_knobs(["mode=max-autotune"], layout="x", fixed={"backend": "eager"})
    with pytest.raises(ValueError, match="offload=True keeps checkpointed layers"):
        runs.optimize_knobs(["offload=true", "grad_ckpt=false"], layout="x")


def test_fsdp_takes_optimize_options_only_with_the_fast_path():
    from qlora_nb_utils.distributed import fsdp_train

    args = fsdp_train.build_parser().parse_args(["--out", "x", "--optimize", "nf4_dequant=true"])
    with pytest.raises(ValueError, match="add --fast-path"):
        fsdp_train.validate(args, 2)
    args = fsdp_train.build_parser().parse_args(["--out", "x", "--fast-path", "--optimize", "grad_ckpt=true"])
    with pytest.raises(ValueError, match="use --grad-ckpt"):
        fsdp_train.validate(args, 2)
    args = fsdp_train.validate(fsdp_train.build_parser().parse_args(
        ["--out", "x", "--fast-path", "--optimize", "lora_addmm=unfused"]), 2)
    assert args.optimize_knobs == {"lora_addmm": "unfused"}


def test_the_shared_summary_fields_time_steps_after_the_warmup():
    records = [{"step": s, "loss": 1.0, "step_ms": ms, "tokens": 100, "tokens_padded": 128}
               for s, ms in enumerate([5000.0, 100.0, 200.0, 100.0])]
    timed = runs.timed_records(records, 1)
    assert [r["step"] for r in timed] == [1, 2, 3]
    # fewer steps than the warm-up: the last step, or nothing
    assert runs.timed_records(records, 9) == records[-1:] and runs.timed_records(records, 9, or_last=False) == []
    # a resumed run's steps only (its records carry run_start)
    resumed = [dict(r, run_start=0 if r["step"] < 2 else 2) for r in records]
    assert [r["step"] for r in runs.timed_records(resumed, 1, start=2)] == [3]
    assert runs.command_line("qlora_nb_utils.distributed.launch").split()[1:3] == ["-m", "qlora_nb_utils.distributed.launch"]


def test_a_rank_leaves_with_its_code_and_everything_it_said_flushed(tmp_path):
    """exit_after_run skips the interpreter's teardown (where gloo's threads can abort a finished
    run) but not the run's output: the buffered stdout and the logging file are written first."""
    import subprocess
    import sys

    log = tmp_path / "rank.log"
    script = ("import logging\nfrom qlora_nb_utils.distributed.runs import exit_after_run\n"
              f"logging.basicConfig(filename={str(log)!r})\nlogging.warning('rank done')\n"
              "print('summary written', end='')\nexit_after_run(3)\nprint('never')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and done.stdout == "summary written", (done.stdout, done.stderr[-2000:])
    assert "rank done" in log.read_text()


def test_every_rank_module_ends_through_exit_after_run():
    from pathlib import Path

    import qlora_nb_utils.distributed as dist_pkg

    folder = Path(dist_pkg.__file__).parent
    for name in ("big_model", "fsdp_train", "pipeline_train", "context_parallel", "nf4_probe"):
        tail = (folder / f"{name}.py").read_text().split('if __name__ == "__main__":')[1]
        assert "exit_after_run(main())" in tail, name


def test_a_profile_says_where_a_step_went_per_rank(tmp_path):
    info = argparse.Namespace(device=torch.device("cpu"), rank=1)
    prof = profiling.start_profiler(info)
    x = torch.randn(64, 64)
    for _ in range(4):
        x = torch.tanh(x @ x)
    rec = profiling.write_profile(prof, tmp_path, info, steps=2)
    text = (tmp_path / "profile_rank1.txt").read_text()
    assert "# by CPU time" in text and "aten::mm" in text and "# by device time" not in text
    saved = json.loads((tmp_path / "profile_rank1.json").read_text())
    assert saved == rec and rec["rank"] == 1 and rec["steps"] == 2
    assert rec["wall_s_per_step"] > 0
    assert rec["device_s_per_step"] == 0 and rec["top_device_ops"] == []  # no device on a CPU



def test_the_8bit_optimizer_keeps_8bit_moments_for_large_tensors_and_unknown_names_are_refused():
    big, small = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(8))
    opt = runs.make_optimizer("adamw8bit", [big, small], 1e-2)
    before = big.detach().clone()
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    opt.step()
    assert not torch.equal(before, big.detach())
    assert opt.state[big]["state1"].dtype == torch.uint8 and opt.state[small]["state1"].dtype == torch.float32
    assert isinstance(runs.make_optimizer("adamw", [big], 1e-3), torch.optim.AdamW)
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'; choose from adamw, adamw8bit"):
        runs.make_optimizer("sgd", [big], 1e-3)


@pytest.mark.parametrize("name", runs.OPTIMIZERS)
def test_an_optimizer_split_over_stages_updates_each_tensor_as_one_over_all_of_them(name):
    torch.manual_seed(0)
    start = [torch.randn(64, 128), torch.randn(96, 64), torch.randn(16)]
    joined = [torch.nn.Parameter(t.clone()) for t in start]
    split = [torch.nn.Parameter(t.clone()) for t in start]
    one = runs.make_optimizer(name, joined, 1e-2)
    stages = [runs.make_optimizer(name, split[:1], 1e-2), runs.make_optimizer(name, split[1:], 1e-2)]
    for _ in range(3):
        grads = [torch.randn_like(t) for t in start]
        for p, q, g in zip(joined, split, grads):
            p.grad, q.grad = g.clone(), g.clone()
        one.step()
        for opt in stages:
            opt.step()
    for p, q, t in zip(joined, split, start):
        assert torch.equal(p.detach(), q.detach()) and not torch.equal(p.detach(), t)


def test_launch_runs_the_layout_asked_for_and_refuses_an_unknown_one(monkeypatch, capsys):
    import subprocess

    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="[pipeline] world_size=2 steps=2\nnoise\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    runs.launch(2, ["--out", "x"], layout="pipeline")
    runs.launch(1, ["--out", "y"])
    assert seen[0][-5:] == ["qlora_nb_utils.distributed.launch", "--layout", "pipeline", "--out", "x"]
    assert seen[1][-3:] == ["qlora_nb_utils.distributed.fsdp_train", "--out", "y"]
    assert "--nproc-per-node=2" in seen[0] and "--nproc-per-node=1" in seen[1]
    assert capsys.readouterr().out.count("[pipeline] world_size=2") == 2  # the run's report, not the rest
    with pytest.raises(ValueError, match="layout must be one of fsdp, pipeline, context"):
        runs.launch(2, ["--out", "z"], layout="tensor")
    assert len(seen) == 2


MEMORY_TARGETS = {"fsdp": ["--fast-path", "--optimize", "max_memory_gib=22"], "pipeline": ["--max-mem-gib", "22"],
                  "context": ["--max-memory-gib", "22"]}


@pytest.mark.parametrize("layout", launch.LAYOUTS)
def test_a_memory_target_asks_for_expandable_segments_before_the_run_as_train_does(layout, monkeypatch, capsys,
                                                                                    tmp_path):
    import importlib

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # set, then removed: put back as it was after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    module = importlib.import_module({"fsdp": "qlora_nb_utils.distributed.fsdp_train",
                                      "pipeline": "qlora_nb_utils.distributed.pipeline_train",
                                      "context": "qlora_nb_utils.distributed.context_parallel"}[layout])
    seen = []
    runner = "_run_or_trainer" if layout == "fsdp" else "run"
    monkeypatch.setattr(module, runner, lambda args: seen.append((runs.memory_target_gib(args),
                                                                  os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))))
    base = ["--layout", layout, "--out", str(tmp_path / "run")]
    assert launch.main(base + MEMORY_TARGETS[layout]) == 0
    assert seen[-1] == (22.0, "expandable_segments:True")
    assert "launch: allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in capsys.readouterr().err
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert launch.main(base + (["--fast-path"] if layout == "fsdp" else [])) == 0  # no target: left alone
    assert seen[-1] == (None, None)
    assert launch.main(base + MEMORY_TARGETS[layout] + ["--device", "cpu"]) == 0  # a CPU run: nothing to set
    assert seen[-1] == (22.0, None) and "allocator" not in capsys.readouterr().err
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")  # the user's own setting is kept
    assert launch.main(base + MEMORY_TARGETS[layout]) == 0
    assert seen[-1] == (22.0, "max_split_size_mb:128")
