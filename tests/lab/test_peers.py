"""Peers: the run schema, the same batches for everyone, ours' loss and cast, errors, the report."""

import json

import pytest
import torch
import torch.nn.functional as F

from lab import peers
from lab.peers import runner
from lab.report.__main__ import main as lab_report
from qlora_nb_utils import models
from qlora_nb_utils.bench import main_job as bench
from qlora_nb_utils.compile.recipe import cast_non_lora
from qlora_nb_utils.ops import losses

SCHEMA = {"name", "batch_size", "seq_len", "median_step_ms", "tokens_per_s", "mfu", "peak_mem_gib", "compile_s",
          "losses", "step_ms", "notes"}


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_chunked_cross_entropy_equals_f_cross_entropy(chunks, dtype, tol):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :5] = -100  # masked prompt
    ours = losses.chunked_cross_entropy(hidden, weight, labels, chunks=chunks)
    gh, gw = torch.autograd.grad(ours, (hidden, weight))
    ref = F.cross_entropy((hidden[:, :-1] @ weight.T).float().reshape(-1, 50), labels[:, 1:].reshape(-1),
                          ignore_index=-100)
    rh, rw = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(gh.float(), rh.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(gw.float(), rw.float(), atol=tol, rtol=tol)


def test_chunked_cross_entropy_compiles_as_one_graph():
    from qlora_nb_utils.diagnostics import CompileCounter

    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight, labels = torch.randn(50, 16), torch.randint(0, 50, (2, 9))
    counter = CompileCounter(backend="eager")
    fn = torch.compile(lambda h: losses.chunked_cross_entropy(h, weight, labels, chunks=4),
                       backend=counter.as_backend(), fullgraph=True)
    fn(hidden).backward()
    assert counter.compilations == 1
    torch.testing.assert_close(fn(hidden), losses.reference_cross_entropy(hidden, weight, labels))
    with pytest.raises(ValueError, match="chunks"):
        losses.chunked_cross_entropy(hidden, weight, labels, chunks=0)


def test_cast_keeps_lora_fp32_trainable_and_base_frozen():
    model, _ = models.load_model("tiny", quant="nf4", dtype="bfloat16", device="cpu", prepare_kbit=True)
    upcast = {n for n, p in model.named_parameters() if p.dtype == torch.float32 and "lora_" not in n}
    assert upcast, "prepare_model_for_kbit_training upcasts the norms and embeddings to fp32"
    assert cast_non_lora(model, torch.bfloat16) == len(upcast)
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.dtype == torch.float32 and p.requires_grad, name
        else:
            assert not p.requires_grad, name
            assert not p.is_floating_point() or p.dtype == torch.bfloat16, (name, p.dtype)


def test_unknown_peer_and_bad_ours_options_are_clear_errors():
    with pytest.raises(ValueError, match="unknown peer.*hf-eager"):
        peers.peer_names(["hf-eager", "pytorch-lightning"])
    with pytest.raises(ValueError, match="mode must be None or one of.*max-autotune"):
        peers.validate_ours_options({"mode": "fastest"})
    with pytest.raises(ValueError, match="backend must be one of.*inductor"):
        peers.validate_ours_options({"backend": "tvmx"})
    with pytest.raises(ValueError, match="memory_budget"):
        peers.validate_ours_options({"memory_budget": 2})
    with pytest.raises(ValueError, match="unknown option"):
        peers.validate_ours_options({"chunks": 4})
    with pytest.raises(ValueError, match="ckpt_layers picks which layers.*grad_ckpt=True"):
        peers.validate_ours_options({"ckpt_layers": 4})
    with pytest.raises(ValueError, match="ckpt_layers must be None"):
        peers.validate_ours_options({"grad_ckpt": True, "ckpt_layers": -1})
    with pytest.raises(ValueError, match="autocast must be True or False"):
        peers.validate_ours_options({"autocast": "bf16"})
    with pytest.raises(ValueError, match="unknown peer"):
        peers.run_peers("tiny", ["ours-nope"], 2, 64, 3, 1, "/nonexistent/x.json")


def test_ours_fast_variant_checkpoints_the_asked_layers_and_keeps_the_loss():
    """causal-only attention + partial checkpointing in fp32: hf-eager's losses, one compilation;
    a left-padded batch is refused before anything trains."""
    tok = models.load_tokenizer("tiny")
    batches, _ = bench.make_bench_batches(tok, batch_size=2, seq_len=64, steps=3)
    variants = {"t": {"autocast": True, "causal_attn": True, "grad_ckpt": True, "ckpt_layers": 1}}
    ref = peers.run_peer("hf-eager", batches, model="tiny", warmup=1, device="cpu", lr=1e-3)
    run = peers.run_peer("ours-t", batches, model="tiny", warmup=1, device="cpu", lr=1e-3, variants=variants)
    assert "error" not in run, run.get("error")
    assert run["compilations"] == 1
    assert "ckpt_layers=1/2" in run["notes"] and "attention=causal" in run["notes"]
    assert "autocast=False (float32: nothing to autocast)" in run["notes"]  # fp32 on a CPU
    assert max(abs(a - b) for a, b in zip(ref["losses"], run["losses"])) < 1e-4
    left = [{**b, "attention_mask": b["attention_mask"].clone()} for b in batches]
    left[1]["attention_mask"][0, :3] = 0  # padding in front of real tokens
    bad = peers.run_peer("ours-t", left, model="tiny", warmup=1, device="cpu", variants=variants)
    assert "is not right-padded" in bad["error"]


def test_a_peer_that_raises_is_an_error_run(monkeypatch):
    tok = models.load_tokenizer("tiny")
    batches, _ = bench.make_bench_batches(tok, batch_size=2, seq_len=64, steps=2)

    def boom(*args, **kwargs):
        raise RuntimeError("no GPU kernel for this")

    monkeypatch.setattr(runner, "_peer_hf", boom)  # where run_peer looks it up
    run = peers.run_peer("hf-eager", batches, model="tiny", warmup=1, device="cpu")
    assert run == {"name": "hf-eager", "batch_size": 2, "seq_len": 64, "error": "RuntimeError: no GPU kernel for this",
                   "notes": ""}


def test_pick_ours_takes_the_fastest_within_unsloths_memory():
    def run(name, ms, mem, variant=None):
        r = {"name": name, "batch_size": 4, "seq_len": 512, "median_step_ms": ms, "peak_mem_gib": mem}
        return {**r, "variant": variant} if variant else r

    runs = [run("unsloth", 120, 3.5), run("ours-chunked", 80, 5.2, "chunked"), run("ours-ckpt", 95, 3.0, "ckpt"),
            run("ours-budget", 90, 3.4, "budget")]
    names = [r["name"] for r in peers.pick_ours(runs)]
    assert names == ["unsloth", "ours-chunked", "ours-ckpt", "ours"]
    assert runs[3]["within_memory_cap"] and runs[3]["memory_cap_gib"] == 3.5
    runs[0]["error"] = "unsloth not installed"  # no cap: the fastest wins
    assert [r["name"] for r in peers.pick_ours(runs)][1] == "ours"


@pytest.fixture(scope="module")
def peers_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers") / "peers_cpu.json"
    res = peers.run_peers("tiny", ["hf-eager", "ours", "ours-default-compile", "unsloth"], batch_size=2, seq_len=64,
                          steps=4, warmup=1, out=out, device="cpu", lr=1e-3, peak_tflops=0.05,
                          timeout_s={"default": 300, "ours-default-compile": 1}, log=lambda *_: None)
    return out, res


def test_run_peers_writes_every_peer_with_the_schema(peers_file):
    out, res = peers_file
    on_disk = json.loads(out.read_text())
    assert on_disk["runs"] == json.loads(json.dumps(res["runs"], default=str))
    assert {"device", "versions", "command", "date", "model", "peak_tflops", "shapes"} <= set(on_disk)
    runs = {r["name"]: r for r in on_disk["runs"]}
    assert list(runs) == ["hf-eager", "ours", "ours-default-compile", "unsloth"]
    for name in ("hf-eager", "ours"):
        assert SCHEMA <= set(runs[name]) and "error" not in runs[name], runs[name]
        assert len(runs[name]["losses"]) == len(runs[name]["step_ms"]) == 4
        assert 0 < runs[name]["mfu"] and runs[name]["peak_mem_gib"] > 0
    assert runs["ours"]["variant"] == "chunked" and runs["ours"]["compilations"] == 1
    # a peer past its time limit is an error run, not a missing row
    assert "timed out after 1 s" in runs["ours-default-compile"]["error"]
    assert runs["unsloth"].get("error") or SCHEMA <= set(runs["unsloth"])


def test_every_peer_process_read_the_same_batches(peers_file):
    out, _ = peers_file
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    saved = torch.load(out.parent / "peers_cpu_work" / "batches_2x64.pt")
    tok = models.load_tokenizer("tiny")
    again, _ = bench.make_bench_batches(tok, batch_size=2, seq_len=64, steps=4)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(saved, again) for k in a)
    # same adapters, same batches, fp32: our compiled loss lies on the eager one
    diffs = [abs(a - b) for a, b in zip(runs["hf-eager"]["losses"], runs["ours"]["losses"])]
    assert max(diffs) < 1e-4, diffs


def test_report_prints_the_table_and_writes_plots(peers_file, capsys):
    out, _ = peers_file
    assert lab_report([str(out)]) == 0
    text = capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    hf = next(r for r in runs if r["name"] == "hf-eager")
    ours = next(r for r in runs if r["name"] == "ours")
    row = next(line for line in text.splitlines() if line.startswith("| ours |"))
    assert f"| {ours['median_step_ms']:.1f} | {hf['median_step_ms'] / ours['median_step_ms']:.2f}x |" in row
    assert "| ours-default-compile | 2 x 64 | error: timed out" in text
    for kind in ("loss_curves", "step_ms", "peak_mem"):
        png = out.with_name(f"peers_cpu_{kind}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
