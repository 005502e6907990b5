"""`qlora-nb train`: what a run writes, the adapter reloaded, Ctrl-C/SIGTERM then --resume, bad input.

One real run (tiny model, CPU, fp32) is shared by the module; the interrupt tests start the real
command in a subprocess, stop it with a signal once a checkpoint exists, resume it, and compare
the whole loss curve with that uninterrupted run. Bad input must fail before any model loads:
the loaders are replaced by ones that fail the test, and the call must return in seconds.
"""

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from word_data import write_words

from qlora_nb_utils import cli

REPO = Path(__file__).resolve().parent.parent
STEPS = 120  # tiny steps take milliseconds: enough of them that a signal lands mid-run
TRAIN = ["train", "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", str(STEPS),
         "--batch-size", "2", "--seq-len", "48", "--eval-every", "40", "--eval-size", "4", "--save-every", "1",
         "--lr", "1e-3", "--no-progress"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """A small prompt/response JSONL whose rows fit in 48 tokens with the chat template."""
    return write_words(tmp_path_factory.mktemp("data") / "words.jsonl", 60)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_file):
    """The uninterrupted run, in this process: (out folder, metrics).

    With ``--check-parity 2``, which must leave no trace: the resumed runs, without it, are
    compared with this one step by step.
    """
    out = tmp_path_factory.mktemp("runs") / "full"
    assert cli.main(TRAIN + ["--data", str(data_file), "--out", str(out), "--check-parity", "2"]) == 0
    return out, json.loads((out / "metrics.json").read_text())


def test_a_run_writes_adapter_metrics_and_curve(finished):
    out, m = finished
    required = {"losses", "eval_losses", "steps_done", "tokens_per_s", "graph_breaks", "compilations", "compile_s",
                "optimize", "device", "versions", "command", "date", "sample"}
    assert required <= set(m)
    assert m["steps_done"] == STEPS and len(m["losses"]) == STEPS
    assert [e["step"] for e in m["eval_losses"]] == [0, 40, 80, 120]
    assert m["eval_losses"][-1]["loss"] < m["eval_losses"][0]["loss"]  # it learned something
    assert m["graph_breaks"] == 0
    assert 1 <= m["compilations"]["compilations"] <= 2
    assert m["tokens_per_s"] > 0 and m["compile_s"] > 0
    assert m["optimize"]["description"].startswith("optimize: ") and m["optimize"]["choices"]["device"] == "cpu"
    assert m["device"]["type"] == "cpu" and m["versions"]["torch"] and m["command"].startswith("qlora-nb train")
    assert set(m["sample"]) == {"prompt", "expected", "before", "after"} and m["sample"]["prompt"].startswith("Continue")
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    parity = m["parity"]
    assert parity["steps"] == 2 and set(parity["losses"]) == {"eager", "eager_permuted1", "eager_permuted2", "compiled"}
    assert parity["max_abs_loss_diff"] < 1e-4  # fp32 on a CPU: compiled is eager to rounding
    assert parity["losses"]["compiled"] == m["losses"][:2]  # same start, same batches as the run
    meta = json.loads((out / "checkpoint" / "meta.json").read_text())
    assert meta["model"] == "tiny" and meta["lora_r"] == 16 and meta["data_sha256"]


def test_the_adapter_reloads_with_peft_and_gives_the_same_eval_loss(finished, data_file):
    from peft import PeftModel

    from qlora_nb_utils import models
    from qlora_nb_utils.training import build_finetune_batches, evaluate

    out, m = finished
    tok = models.load_tokenizer("tiny")
    _, heldout, _ = build_finetune_batches(tok, data=data_file, batch_size=2, seq_len=48, seed=0, eval_size=4)
    base, _ = models.load_model("tiny", quant="nf4", lora=False, dtype="float32", device="cpu", prepare_kbit=True)
    model = PeftModel.from_pretrained(base, out / "adapter")
    loss = evaluate(model, heldout)
    assert loss == pytest.approx(m["eval_losses"][-1]["loss"], abs=1e-4)
    assert abs(loss - m["eval_losses"][0]["loss"]) > 1e-3  # the adapter is not a no-op


def test_train_resumes_at_a_step_with_its_optimizer_scheduler_and_batches(tmp_path):
    """The loop's part of --resume: stop in on_step, restore the boundary, go on from start_step."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from qlora_nb_utils.training import TrainConfig, TrainingInterrupted, load_trainable_state, train, trainable_state
    from qlora_nb_utils.training.loop import warmup_schedule

    def model_and_optim():
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2))
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj"]))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, opt, warmup_schedule(opt, 3)

    gen = torch.Generator().manual_seed(2)
    batches = [{"input_ids": (ids := torch.randint(0, 64, (2, 12), generator=gen)), "labels": ids} for _ in range(4)]
    cfg = TrainConfig(steps=7, progress=False, adapter_dir=tmp_path)
    model, opt, sched = model_and_optim()
    full = train(model, batches, cfg, optimizer=opt, scheduler=sched)["loss"].tolist()

    saved = {}

    def stop_after_3(step, row):
        if step == 2:  # dropout draws from the RNG: its state at the boundary must come back too
            saved.update(w=trainable_state(model), opt=copy.deepcopy(opt.state_dict()), sched=sched.state_dict(),
                         rng=torch.get_rng_state())
            raise KeyboardInterrupt

    model, opt, sched = model_and_optim()
    with pytest.raises(TrainingInterrupted):
        train(model, batches, cfg, optimizer=opt, scheduler=sched, on_step=stop_after_3)
    model, opt, sched = model_and_optim()
    load_trainable_state(model, saved["w"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    torch.set_rng_state(saved["rng"])
    rest = train(model, batches, cfg, optimizer=opt, scheduler=sched, start_step=3)
    assert rest["step"].tolist() == [3, 4, 5, 6]
    assert rest["loss"].tolist() == full[3:]


def _lora_grads(model, batch) -> dict:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _eval_pass(model, batch) -> None:
    import torch

    model.eval()
    with torch.no_grad():
        model(**batch)
    model.train()


def test_an_eval_pass_keeps_bnb_gradients(data_file):
    """bitsandbytes repacks NF4 weights on a CPU eval pass and then loses gradients; the patch keeps them."""
    import torch

    from qlora_nb_utils import models
    from qlora_nb_utils.compile.patches import bnb_cpu_packing
    from qlora_nb_utils.training import build_finetune_batches, evaluate

    tok = models.load_tokenizer("tiny")
    train_batches, heldout, _ = build_finetune_batches(tok, data=data_file, batch_size=2, seq_len=48, eval_size=4)

    def fresh():
        model, _ = models.load_model("tiny", quant="nf4", lora=True, dtype="float32", device="cpu", prepare_kbit=True)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B = 0 at init: give it values, so that every LoRA weight gets a gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        return model.train()  # from_pretrained hands it back in eval mode: a forward then repacks too

    def same(grads, reference):
        return all(torch.allclose(grads[n], reference[n], rtol=1e-4, atol=1e-7) for n in reference)

    model = fresh()
    reference = _lora_grads(model, train_batches[0])
    with bnb_cpu_packing.patched(model) as handle:
        assert handle.details["layers"] == 14  # tiny: 2 decoder layers x 7 linear layers
        _eval_pass(model, heldout[0])
        assert same(_lora_grads(model, train_batches[0]), reference)
    assert not handle.active
    evaluate(model, heldout)  # keeps the layout by itself
    assert same(_lora_grads(model, train_batches[0]), reference)

    if not bnb_cpu_packing.find_layers(model)[0].support_avx512bf16_for_cpu:
        return  # this CPU never takes bitsandbytes' repacking path: nothing to break
    _eval_pass(model, heldout[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "bitsandbytes::gemv_4bit: an autograd kernel was not registered"
        broken = _lora_grads(model, train_batches[0])
    # upstream as it is: gradients are lost (when this fails, bitsandbytes fixed it: drop the patch)
    assert not same(broken, reference)
    with bnb_cpu_packing.patched(model) as handle:  # the patch converts repacked weights back (lossy: bf16 scales)
        assert handle.details["unpacked"] == 14
        back = _lora_grads(model, train_batches[0])
    # gradients flow again; what is left is the scales' rounding (<1% here, against up to 128% lost)
    assert all((back[n] - reference[n]).norm() < 1e-2 * reference[n].norm() for n in reference)


def _spawn(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "qlora_nb_utils.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps_saved(out: Path) -> int:
    try:
        return json.loads((out / "checkpoint" / "history.json").read_text())["steps_done"]
    except (FileNotFoundError, ValueError):  # not written yet, or renamed away between the calls
        return 0


def _stop_after_checkpoint(proc: subprocess.Popen, out: Path, sig: int, at_least: int = 2, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while _steps_saved(out) < at_least:
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before a checkpoint:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no checkpoint in time")
        time.sleep(0.01)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    return proc.returncode, output


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_checkpoints_and_resume_gives_the_uninterrupted_curve(sig, code, finished, data_file, tmp_path):
    out = tmp_path / "run"
    args = TRAIN + ["--data", str(data_file), "--out", str(out)]
    rc, output = _stop_after_checkpoint(_spawn(args), out, sig)
    assert rc == code, output
    done = _steps_saved(out)
    assert 2 <= done < STEPS, output
    assert f"in {out / 'checkpoint'} (step {done})" in output, output
    assert "resume with: qlora-nb train" in output and "--resume" in output, output
    stopped = json.loads((out / "metrics.json").read_text())  # what was trained is recorded, marked
    assert stopped["interrupted"] is True and stopped["stopped_by"] == signal.Signals(sig).name
    assert stopped["steps_done"] == done and len(stopped["losses"]) == done
    assert stopped["losses"] == pytest.approx(finished[1]["losses"][:done], abs=1e-5)
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if sig == signal.SIGTERM:
        return  # the resume below is the same for both signals; once is enough
    resumed = _spawn(args + ["--resume"])
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    m = json.loads((out / "metrics.json").read_text())
    full = finished[1]
    assert m["resumed_from"] == done and m["steps_done"] == STEPS and m["interrupted"] is False
    assert len(m["losses"]) == STEPS
    diffs = [abs(a - b) for a, b in zip(m["losses"], full["losses"])]
    assert max(diffs) <= 1e-5, (max(diffs), diffs.index(max(diffs)))
    assert [e["step"] for e in m["eval_losses"]] == [e["step"] for e in full["eval_losses"]]
    assert m["eval_losses"][-1]["loss"] == pytest.approx(full["eval_losses"][-1]["loss"], abs=1e-5)


def test_the_cli_defaults_are_finetunes():
    from qlora_nb_utils.training.finetuning import DEFAULTS

    args = cli.build_parser().parse_args(["train"])
    assert cli._train_options(args) == DEFAULTS
    assert args.out == "runs/train" and not args.resume and not args.overwrite
    on = cli.build_parser().parse_args(["train", "--autotune", "on", "--mode", "default"])
    assert cli._train_options(on) == {**DEFAULTS, "autotune": True, "mode": "default"}
    assert cli._train_options(cli.build_parser().parse_args(["train", "--autotune", "off"]))["autotune"] is False


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model or tokenizer fails the test: bad input must be refused before."""
    from qlora_nb_utils import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the input was checked")

    for name in ("load_model", "load_tokenizer", "materialize"):
        monkeypatch.setattr(models, name, refuse)


def _bad_cases(tmp: Path, data_file: Path, finished_out: Path) -> list[tuple[list[str], str]]:
    not_a_model = tmp / "not_a_model"
    not_a_model.mkdir()
    broken = tmp / "broken.jsonl"
    broken.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "no response"}\n')
    empty_out = tmp / "empty_out"
    base = TRAIN + ["--data", str(data_file), "--out", str(tmp / "fresh")]
    return [
        (base + ["--model", str(not_a_model)], "no config.json"),
        (base + ["--mode", "warp-speed"], "mode must be one of"),
        (base + ["--backend", "no-such-backend"], "backend must be one of"),
        (base + ["--backend", "cudagraphs"], "backend must be one of"),  # registered in torch, not a train backend
        # optimize()'s options, checked by the one OptimizeOptions the run trains with
        (base + ["--max-memory-gib", "-1"], "max_memory_gib must be None or a number > 0"),
        (base + ["--compile-cache", "on", "--backend", "eager"], "leaves no compiled artifacts"),
        (base + ["--mode", "reduce-overhead", "--backend", "eager"], "is an Inductor option"),
        (base + ["--mode", "max-autotune", "--autotune", "off"], "autotune=False contradicts mode 'max-autotune'"),
        (base + ["--data", str(broken)], f"{broken}:2"),
        (base + ["--data", str(tmp / "missing.jsonl")], "not found"),
        (TRAIN + ["--data", str(data_file), "--out", str(empty_out), "--resume"], "no checkpoint"),
        (TRAIN + ["--data", str(data_file), "--out", str(finished_out), "--resume", "--lora-r", "8"], "lora_r"),
        (TRAIN + ["--data", str(data_file), "--out", str(finished_out)], "already holds a run"),
        (TRAIN + ["--data", str(data_file), "--out", str(finished_out), "--resume"], "has done 120 steps"),
    ]


def test_bad_input_exits_2_with_a_message_before_any_model_loads(finished, data_file, tmp_path, capsys,
                                                                 no_model_load):
    for argv, message in _bad_cases(tmp_path, data_file, finished[0]):
        start = time.perf_counter()
        assert cli.main(argv) == 2, argv
        took = time.perf_counter() - start
        err = capsys.readouterr().err
        assert message in err and err.startswith("qlora-nb train: error: "), (argv, err)
        assert took < 20, (argv, took)
    assert not (tmp_path / "fresh").exists()  # nothing written either


@pytest.mark.parametrize("packing", [True, False])
def test_batches_tokenize_the_training_split_once(data_file, monkeypatch, packing):
    """Packed or not, the training split is tokenized once (a packed run cuts its padded view from it)."""
    from qlora_nb_utils import data, models
    from qlora_nb_utils.training import build_finetune_batches

    tok = models.load_tokenizer("tiny")
    real = data.tokenize_examples
    calls = []

    def counting(ds, tokenizer, max_len=256, **kw):
        calls.append(max_len)
        return real(ds, tokenizer, max_len=max_len, **kw)

    monkeypatch.setattr(data, "tokenize_examples", counting)
    train, heldout, _ = build_finetune_batches(tok, data=data_file, batch_size=2, seq_len=48, eval_size=4,
                                               packing=packing, log=lambda m: None, cache=False)  # built here
    assert calls == ([data.UNCUT, 48] if packing else [48, 48])  # the training split, then the held-out one
    assert ("document_ids" in train[0]) is packing and heldout


def test_packing_asked_for_builds_no_padded_training_batches(data_file, monkeypatch):
    """``--packing on`` goes straight to the packed batches (only ``auto`` weighs padded ones against
    them, seconds of a start at long rows): the same batches as ``auto`` gives where it packs."""
    import torch

    from qlora_nb_utils import data, models
    from qlora_nb_utils.training import build_finetune_batches

    tok = models.load_tokenizer("tiny")
    kw = dict(data=data_file, batch_size=2, seq_len=256, eval_size=4, log=lambda m: None, cache=False)  # built here
    auto, auto_held, _ = build_finetune_batches(tok, packing="auto", **kw)
    assert "document_ids" in auto[0]  # rows of 256 on this data: auto packs
    cuts = []
    real_cut = data.cut_tokenized
    monkeypatch.setattr(data, "cut_tokenized", lambda *a, **k: cuts.append(1) or real_cut(*a, **k))
    on, on_held, _ = build_finetune_batches(tok, packing=True, **kw)
    assert cuts == []  # no padded view cut for the training split
    assert len(on) == len(auto) and len(on_held) == len(auto_held)
    for a, b in zip(on + on_held, auto + auto_held):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("packing", [True, False, "auto"])
def test_every_packing_choice_prints_the_padding_share(data_file, packing):
    """``--packing off`` says how much of its batches is padding, as ``on`` and ``auto`` do."""
    from qlora_nb_utils import data, models
    from qlora_nb_utils.training import build_finetune_batches

    lines = []
    train, _, _ = build_finetune_batches(models.load_tokenizer("tiny"), data=data_file, batch_size=2, seq_len=48,
                                         eval_size=4, packing=packing, log=lines.append)
    said = [line for line in lines if line.startswith("==> packing:")]
    assert len(said) == 1 and "% padding" in said[0], lines
    if packing is False:
        share = data.padding_stats(train)["waste_fraction"]
        assert said[0] == f"==> packing: off (asked for): padded batches are {share:.0%} padding"


def test_a_gemma2_run_reports_the_models_own_held_out_loss(tmp_path, data_file):
    """Gemma-2 caps its logits at 30; with the tied embedding scaled by 100 the raw logits reach the
    hundreds, so a loss without the cap is many times the model's. The run's held-out loss must be
    what the model's own forward gives on the same rows with the saved adapter."""
    import torch
    from peft import PeftModel
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from qlora_nb_utils import models
    from qlora_nb_utils.training import build_finetune_batches, evaluate

    tok = models.load_tokenizer("tiny")
    config = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=30.0,
                          tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(config)
    with torch.no_grad():
        gemma.get_input_embeddings().weight.mul_(100)
    folder = tmp_path / "gemma2"
    gemma.save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "run"
    argv = ["train", "--model", str(folder), "--data", str(data_file), "--out", str(out), "--device", "cpu",
            "--dtype", "float32", "--steps", "8", "--batch-size", "2", "--seq-len", "48", "--eval-every", "0",
            "--eval-size", "4", "--save-every", "0", "--backend", "aot_eager", "--no-progress"]
    assert cli.main(argv) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert "softcap 30" in m["optimize"]["description"]
    _, heldout, _ = build_finetune_batches(tok, data=data_file, batch_size=2, seq_len=48, seed=0, eval_size=4)
    base, _ = models.load_model(str(folder), quant="nf4", lora=False, device="cpu", prepare_kbit=True)
    own = evaluate(PeftModel.from_pretrained(base, out / "adapter"), heldout)
    assert own == pytest.approx(m["final_eval_loss"], abs=1e-3)
    with torch.no_grad():  # the cap bites: without it the same rows score far higher
        causal_lm = base.get_base_model() if hasattr(base, "get_base_model") else base
        batch = heldout[0]
        hidden = causal_lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        from qlora_nb_utils.ops.losses import chunked_cross_entropy

        uncapped = float(chunked_cross_entropy(hidden, causal_lm.get_output_embeddings().weight, batch["labels"]))
    assert uncapped > 2 * own


@pytest.mark.slow
def test_the_step_0_held_out_loss_is_the_base_models_own(tmp_path, data_file):
    """SmolLM2's real weights: the held-out loss a run reports at step 0 (LoRA B is zero) is the
    base model's own loss on those rows, loaded as a user would (``load_model(..., lora=False)``,
    whose ``dtype="auto"`` is the run's fp32 on a CPU). The recipe's loss is computed with the
    kernel ``F.cross_entropy`` runs (``ops.losses._chunk_scores``), so they agree to fp32 rounding."""
    from qlora_nb_utils import models
    from qlora_nb_utils.training import build_finetune_batches, evaluate

    out = tmp_path / "run"
    argv = ["train", "--model", "smollm2-135m", "--data", str(data_file), "--out", str(out), "--device", "cpu",
            "--steps", "1", "--batch-size", "2", "--seq-len", "48", "--eval-every", "0", "--eval-size", "8",
            "--save-every", "0", "--backend", "eager", "--no-progress"]
    assert cli.main(argv) == 0
    m = json.loads((out / "metrics.json").read_text())
    step0 = m["eval_losses"][0]
    assert step0["step"] == 0
    tok = models.load_tokenizer("smollm2-135m")
    _, heldout, _ = build_finetune_batches(tok, data=data_file, batch_size=2, seq_len=48, seed=0, eval_size=8)
    base, _ = models.load_model("smollm2-135m", lora=False, device="cpu")
    own = evaluate(base, heldout)
    assert own == pytest.approx(step0["loss"], abs=1e-5)


def test_the_held_out_loss_compiles_nothing_where_the_layers_are_compiled_in_place(data_file):
    """Regional scope compiles each decoder layer in place: the held-out loss (no_grad, eval mode) runs
    them eagerly instead of compiling the training graph again, and gives the eager model's number."""
    import torch

    from qlora_nb_utils import models, optimize
    from qlora_nb_utils.training import build_finetune_batches, evaluate

    tok = models.load_tokenizer("tiny")
    train_batches, heldout, _ = build_finetune_batches(tok, data=data_file, batch_size=2, seq_len=48, eval_size=4)
    model, _ = models.load_model("tiny", quant="none", lora=True, dtype="float32", device="cpu")
    want = evaluate(model, heldout)
    opt = optimize(model.train(), batches=train_batches[:1], backend="aot_eager", scope="regional")
    try:
        opt.forward(**train_batches[0]).loss.backward()
        assert opt.counter.compilations == 1
        got = evaluate(opt.module, heldout)
        assert opt.counter.compilations == 1 and opt.counter.recompilations == 0
    finally:
        opt.undo()
    assert abs(got - want) < 1e-5
    assert torch.is_grad_enabled()  # evaluate leaves grad mode as it found it


@pytest.mark.parametrize("note", ["note: no bytecode for torch (PYTHONDONTWRITEBYTECODE is set): ...", None])
def test_a_run_says_when_the_libraries_have_no_bytecode_before_it_loads_anything(tmp_path, monkeypatch, note):
    from qlora_nb_utils import env, models
    from qlora_nb_utils.training import finetuning

    class Loaded(Exception):
        pass

    def load_tokenizer(*a, **k):
        raise Loaded

    monkeypatch.setattr(env, "bytecode_note", lambda: note)
    monkeypatch.setattr(models, "load_tokenizer", load_tokenizer)
    opts = finetuning.check_options(out=tmp_path / "r", model="tiny", device="cpu")
    lines: list[str] = []
    run = finetuning.Run(opts, stop=None, progress=False, log=lines.append)
    with pytest.raises(Loaded):
        run.prepare()
    assert [line for line in lines if line.startswith("note: no bytecode")] == ([note] if note else [])
