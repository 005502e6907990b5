"""The Unsloth peer's CLI, batch reading, timing summary and error path, on a CPU without unsloth."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.peers import unsloth as pu

REPO = Path(__file__).resolve().parents[2]


def _batches(n=2, bs=2, seq=8, dtype=torch.int64):
    out = []
    for _ in range(n):
        ids = torch.randint(3, 100, (bs, seq), dtype=dtype)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


@pytest.fixture
def files(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    batches = tmp_path / "batches.pt"
    torch.save(_batches(), batches)
    return model, batches, tmp_path / "runs" / "RUN.json"


def _argv(model, batches, out, **over):
    opts = {"--model-dir": model, "--batches": batches, "--steps": 5, "--warmup": 2, "--lr": 2e-4,
            "--seed": 0, "--lora-r": 16, "--lora-alpha": 32, "--out": out}
    opts.update(over)
    return [str(x) for kv in opts.items() for x in kv]


def test_parse_args_accepts_the_peers_cli(files):
    args = pu.parse_args(_argv(*files) + ["--grad-ckpt"])
    assert (args.steps, args.warmup, args.lora_r, args.lora_alpha, args.grad_ckpt) == (5, 2, 16, 32.0, True)
    assert args.max_grad_norm == 1.0  # clipped as training.train clips ours
    assert pu.parse_args(_argv(*files, **{"--max-grad-norm": 0})).max_grad_norm == 0.0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"--model-dir": "/nonexistent/model"}, "is not a directory"),
        ({"--batches": "/nonexistent/b.pt"}, "does not exist"),
        ({"--warmup": 5}, "--warmup must be"),
        ({"--warmup": -1}, "--warmup must be"),
        ({"--steps": 0}, "must be >= 1"),
        ({"--lr": "nan"}, "finite number > 0"),
        ({"--lr": "abc"}, "not a number"),
        ({"--max-grad-norm": -1}, "finite number > 0"),
    ],
)
def test_parse_args_rejects_bad_input_with_a_clear_message(files, capsys, change, message):
    with pytest.raises(SystemExit) as exc:
        pu.parse_args(_argv(*files, **change))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_args_wants_a_checkpoint_folder(files, capsys):
    model, batches, out = files
    (model / "config.json").unlink()
    with pytest.raises(SystemExit):
        pu.parse_args(_argv(model, batches, out))
    assert "no config.json" in capsys.readouterr().err


def test_load_batches_returns_shape(tmp_path):
    path = tmp_path / "b.pt"
    torch.save(_batches(n=3, bs=4, seq=16), path)
    batches, bs, seq = pu.load_batches(path)
    assert (len(batches), bs, seq) == (3, 4, 16)
    assert batches[0]["labels"].dtype == torch.int64


@pytest.mark.parametrize(
    "content, message",
    [
        ([], "non-empty list"),
        ({"input_ids": torch.zeros(1, 2, dtype=torch.int64)}, "non-empty list"),
        ([{"input_ids": torch.zeros(2, 8, dtype=torch.int64)}], "lacks"),
        (_batches(dtype=torch.int32), "2-D int64"),
        (_batches(n=1) + _batches(n=1, seq=9), "fixed-length padding"),
    ],
)
def test_load_batches_rejects_other_content(tmp_path, content, message):
    path = tmp_path / "b.pt"
    torch.save(content, path)
    with pytest.raises(ValueError, match=message):
        pu.load_batches(path)


def test_step_summary_counts_real_tokens_like_every_peer():
    from lab.peers.results import summarize_run

    ms, tokens = [1000.0, 900.0, 10.0, 30.0, 20.0], [512, 512, 100, 300, 150]
    s = pu.step_summary(ms, warmup=2, tokens=tokens)
    assert s["median_step_ms"] == 20.0
    # the median of each step's real tokens / its time, not batch_size * seq_len / the median step
    assert s["tokens_per_s"] == s["real_tokens_per_s"] == pytest.approx(10_000.0)
    ref = summarize_run("x", losses=[0.0] * 5, step_ms=ms, tokens=tokens, peak_mem_gib=0.0, batch_size=4,
                        seq_len=128, warmup=2)
    assert s["real_tokens_per_s"] == pytest.approx(ref["real_tokens_per_s"])
    with pytest.raises(ValueError, match="no timed step"):
        pu.step_summary([1.0, 2.0], warmup=2, tokens=[1, 1])
    with pytest.raises(ValueError, match="token counts"):
        pu.step_summary([1.0, 2.0], warmup=0, tokens=[1])


def test_load_batches_takes_packed_batches_only_with_packed():
    from qlora_nb_utils.data.packing import pack_examples

    rows = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (5, 9, 4, 7)]
    batches, _ = pack_examples(rows, 16, rows_per_batch=2, pad_id=0)
    path = Path(pytest.importorskip("tempfile").mkdtemp()) / "packed.pt"
    torch.save(batches, path)
    got, bs, seq = pu.load_batches(path, packed=True)
    assert (bs, seq) == (2, 16) and len(got) == len(batches)
    with pytest.raises(ValueError, match="need --packed"):
        pu.load_batches(path)


def test_set_offline_env_keeps_callers_values():
    env = {"HF_HUB_OFFLINE": "0"}
    pu.set_offline_env(env)
    assert env["HF_HUB_OFFLINE"] == "0"
    assert env["UNSLOTH_DISABLE_STATISTICS"] == "1"


def test_missing_unsloth_is_recorded_not_raised(files, monkeypatch):
    """Even on a GPU host, an unimportable unsloth ends in RUN.json with the error, status 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    monkeypatch.setitem(sys.modules, "unsloth", None)  # makes `import unsloth` raise ImportError
    assert pu.main(_argv(*files)) == 0
    record = json.loads(files[2].read_text())
    assert record["name"] == "unsloth"
    assert record["error"].startswith(("ImportError", "ModuleNotFoundError"))
    assert "unsloth" in record["traceback_tail"]
    assert "median_step_ms" not in record


def test_bad_batch_file_is_recorded(files, tmp_path):
    model, _, out = files
    bad = tmp_path / "bad.pt"
    torch.save([{"input_ids": torch.zeros(2, 8, dtype=torch.int64)}], bad)
    assert pu.main(_argv(model, bad, out)) == 0
    assert json.loads(out.read_text())["error"].startswith("ValueError:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cli_without_cuda_writes_error_json_and_exits_0(files):
    """The real entry point, in a fresh process: no transformers before unsloth, no CUDA -> error JSON."""
    model, batches, out = files
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys, runpy; sys.argv[0] = 'peer'; "
         "runpy.run_module('lab.peers.unsloth', run_name='__main__'); "],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    # runpy without argv: argparse must refuse with status 2.
    assert proc.returncode == 2 and "--model-dir" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "lab.peers.unsloth", *_argv(model, batches, out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["name"] == "unsloth"
    assert record["error"] == "RuntimeError: no CUDA device: the Unsloth peer runs on an NVIDIA GPU only"
    assert record["versions"]["torch"] == torch.__version__


def test_importing_the_module_leaves_transformers_unloaded():
    code = "import sys, lab.peers.unsloth; print('transformers' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr
