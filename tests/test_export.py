"""`qlora-nb export` and `qlora-nb generate`: a run as a plain checkpoint, and talking to it.

One real run (tiny model, CPU, fp32, a few steps) is shared by the module. The export is judged
against the model that was trained, rebuilt the way a user would (NF4 base + ``PeftModel``):
the same logits on held-out rows. Bad input must fail before any model loads: the loaders are
replaced by ones that fail the test.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from word_data import write_words

from qlora_nb_utils import cli

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Continue: mu nu"


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_words(tmp_path_factory.mktemp("data") / "words.jsonl", 40)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_file) -> Path:
    """A short real run; no warm-up, so that the adapter moves the logits (at 1e-2 it learns to end every turn at once)."""
    out = tmp_path_factory.mktemp("runs") / "run"
    argv = ["train", "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", "4", "--batch-size", "2",
            "--seq-len", "48", "--eval-size", "4", "--eval-every", "0", "--save-every", "0", "--lr", "1e-3",
            "--warmup-steps", "0", "--no-progress", "--data", str(data_file), "--out", str(out)]
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    folders = {"nf4": root / "nf4", "original": root / "original"}
    assert cli.main(["export", str(run), "--out", str(folders["nf4"])]) == 0
    assert cli.main(["export", str(run), "--out", str(folders["original"]), "--base", "original"]) == 0
    return folders


@pytest.fixture(scope="module")
def held_out(data_file):
    from qlora_nb_utils import models
    from qlora_nb_utils.training import build_finetune_batches

    tok = models.load_tokenizer("tiny")
    _, batches, _ = build_finetune_batches(tok, data=data_file, batch_size=2, seq_len=48, seed=0, eval_size=4,
                                           log=lambda _: None)
    return batches


def _logits(model, batches) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return torch.cat([model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.flatten(0, 1)
                          [b["attention_mask"].flatten().bool()] for b in batches])


@pytest.fixture(scope="module")
def trained_logits(run, held_out):
    """The trained model rebuilt as a user would: the NF4 base (fp32) + PeftModel; and the base alone.

    Its NF4 layers keep the training layout (``bnb_cpu_packing``): on a CPU with AVX512-BF16,
    bitsandbytes' eval-time repack rounds the block scales to bf16 and computes otherwise than training
    did (``training.load_trained`` does the same)."""
    from peft import PeftModel

    from qlora_nb_utils import models
    from qlora_nb_utils.compile.patches import bnb_cpu_packing

    base, _ = models.load_model("tiny", quant="nf4", lora=False, dtype="float32", device="cpu")
    model = PeftModel.from_pretrained(base, run / "adapter")
    bnb_cpu_packing.apply(model)
    with model.disable_adapter():
        base_only = _logits(model, held_out)
    return _logits(model, held_out), base_only


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def test_the_export_computes_what_the_trained_model_computed(exported, trained_logits, held_out):
    trained, base_only = trained_logits
    merged = _logits(_load(exported["nf4"]), held_out)
    assert (trained - base_only).abs().max() > 1e-2  # the adapter is not a no-op
    assert (merged - trained).abs().max() < 1e-4


def test_a_gguf_export_is_one_file_that_computes_what_the_trained_model_computed(run, tmp_path, trained_logits,
                                                                               held_out):
    from transformers import AutoModelForCausalLM

    trained, base_only = trained_logits
    out = tmp_path / "gguf"
    assert cli.main(["export", str(run), "--out", str(out), "--gguf", "f16"]) == 0
    assert [p.name for p in out.rglob("*")] == [f"{run.name}-f16.gguf"]  # no merged folder left behind
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file=f"{run.name}-f16.gguf", dtype=torch.float32)
    got = _logits(model, held_out)
    # float16 weights: far closer to the trained model than the adapter's own effect
    assert (got - trained).abs().max() < 0.1 * (trained - base_only).abs().max()
    assert (got.argmax(-1) == trained.argmax(-1)).float().mean() > 0.99


def test_the_original_base_export_is_another_model_and_says_so(exported, trained_logits, held_out, capsys):
    trained, _ = trained_logits
    diff = (_logits(_load(exported["original"]), held_out) - trained).abs().max().item()
    # the NF4 rounding of the base, seen in the logits: about 0.1 (max |diff|) on this run
    print(f"--base original: max |logit - trained logit| = {diff:.3g}")
    assert diff > 1e-3
    info = json.loads((exported["original"] / "export_info.json").read_text())
    assert info["base"] == "original" and info["is_trained_model"] is False
    nf4_info = json.loads((exported["nf4"] / "export_info.json").read_text())
    assert nf4_info["base"] == "nf4-dequantized" and nf4_info["is_trained_model"] is True
    assert nf4_info["base_model"] == "tiny" and nf4_info["steps_done"] == 4 and nf4_info["dtype"] == "float32"


def test_the_export_is_a_plain_checkpoint_that_needs_neither_peft_nor_bitsandbytes(exported, run):
    folder = exported["nf4"]
    names = {p.name for p in folder.iterdir()}
    assert "adapter_config.json" not in names and "model.safetensors" in names
    assert {"config.json", "generation_config.json", "export_info.json", "tokenizer.json"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["use_cache"] is True
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(folder).chat_template  # the run's template goes with the model
    # peft and bitsandbytes made unimportable: the checkpoint still loads and runs
    code = ("import sys; sys.modules['peft'] = None; sys.modules['bitsandbytes'] = None\n"
            "import torch; from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r})\n"
            "print(m(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == str(config["vocab_size"])


def test_the_adapter_names_its_base_by_the_runs_name_not_this_machines_cache(run):
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny"  # was the cache folder, e.g. ~/.cache/qlora_nb/tiny
    card = (run / "adapter" / "README.md").read_text()
    assert "base_model: tiny" in card and "qlora_nb" not in card


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the refusals must come first."""
    import transformers

    import qlora_nb_utils
    from qlora_nb_utils import models
    from qlora_nb_utils.models import load

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(qlora_nb_utils, "load_model", refuse, raising=False)
    monkeypatch.setattr(models, "load_model", refuse, raising=False)
    monkeypatch.setattr(load, "load_model", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def _refused(argv, capsys, *needles):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith(f"qlora-nb {argv[0]}: error:") and err.count("\n") == 1, err  # one line
    for needle in needles:
        assert needle in err, err
    return err


def _broken_runs(run: Path, tmp: Path) -> dict[str, Path]:
    no_adapter = tmp / "no_adapter"
    shutil.copytree(run, no_adapter, ignore=shutil.ignore_patterns("checkpoint"))
    shutil.rmtree(no_adapter / "adapter")
    no_metrics = tmp / "no_metrics"
    shutil.copytree(run, no_metrics, ignore=shutil.ignore_patterns("checkpoint", "metrics.json"))
    gone = tmp / "base_gone"
    shutil.copytree(run, gone, ignore=shutil.ignore_patterns("checkpoint"))
    metrics = json.loads((gone / "metrics.json").read_text())
    metrics["model"] = metrics["meta"]["model"] = str(tmp / "deleted-model")
    (gone / "metrics.json").write_text(json.dumps(metrics))
    hub = tmp / "hub_base"
    shutil.copytree(gone, hub)
    metrics["model"] = metrics["meta"]["model"] = "nobody-here/not-a-cached-model"
    (hub / "metrics.json").write_text(json.dumps(metrics))
    return {"missing": tmp / "nope", "no_adapter": no_adapter, "no_metrics": no_metrics, "base_gone": gone,
            "hub_base": hub}


def test_export_refuses_bad_input_before_any_model_loads(run, tmp_path, capsys, no_model):
    bad = _broken_runs(run, tmp_path)
    new = str(tmp_path / "new")
    _refused(["export", str(bad["missing"]), "--out", new], capsys, "no such folder")
    _refused(["export", str(bad["no_adapter"]), "--out", new], capsys, "not a qlora-nb train run", "adapter")
    _refused(["export", str(bad["no_metrics"]), "--out", new], capsys, "not a qlora-nb train run", "metrics.json")
    _refused(["export", str(bad["base_gone"]), "--out", new], capsys, "deleted-model", "not found")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x.txt").write_text("x")
    _refused(["export", str(run), "--out", str(full)], capsys, "exists and is not empty")
    _refused(["export", str(run), "--out", str(full / "x.txt")], capsys, "is a file")
    _refused(["export", str(run), "--out", str(run / "export")], capsys, "inside the run folder")
    assert not (tmp_path / "new").exists()


def test_generate_streams_the_same_greedy_completion_each_time(run, exported, capsys):
    argv = ["generate", str(run), PROMPT, "--max-new-tokens", "8", "--device", "cpu"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == first and first.strip()
    # the exported model says the same (greedy, fp32: the same logits to rounding)
    assert cli.main(["generate", str(exported["nf4"]), PROMPT, "--merged", "--max-new-tokens", "8",
                     "--device", "cpu"]) == 0
    assert capsys.readouterr().out == first
    assert cli.main(argv + ["--no-chat-template"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_refuses_bad_input_before_any_model_loads(run, tmp_path, capsys, no_model, monkeypatch):
    bad = _broken_runs(run, tmp_path)
    _refused(["generate", str(bad["missing"]), PROMPT], capsys, "no such folder")
    _refused(["generate", str(bad["no_adapter"]), PROMPT], capsys, "adapter")
    _refused(["generate", str(bad["base_gone"]), PROMPT], capsys, "deleted-model", "not found")
    _refused(["generate", str(run), PROMPT, "--merged"], capsys, "not an exported model")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    _refused(["generate", str(bad["hub_base"]), PROMPT], capsys, "nobody-here/not-a-cached-model",
             "not in the local Hugging Face cache")
    _refused(["generate", str(run / "adapter"), PROMPT, "--merged"], capsys, "adapter")


@pytest.mark.parametrize("command", ["export", "generate"])
def test_help_exits_0(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0 and "RUN_DIR" in capsys.readouterr().out


def test_load_trained_on_a_cpu_computes_as_training_did(run, trained_logits, held_out):
    """bitsandbytes' CPU inference repack (bf16 block scales on AVX512-BF16) is kept off: the loaded
    run gives the logits of the model as it trained."""
    from qlora_nb_utils.compile.patches import bnb_cpu_packing
    from qlora_nb_utils.training import load_trained

    model, _ = load_trained(run, device="cpu")
    layers = bnb_cpu_packing.find_layers(model)
    assert layers and all(layer.support_avx512bf16_for_cpu is False for layer in layers)
    trained, _ = trained_logits
    assert (_logits(model, held_out) - trained).abs().max() < 1e-5
