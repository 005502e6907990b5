"""Packed batches in the user's path: optimize() on packed batches, build_packed_batches, bench/train --packing.

The packer and the masks themselves are tested in test_packing.py; here, what a user runs: the
compiled step of ``optimize()`` on packed batches gives each document the loss and the LoRA
gradients it has alone (fp32, tiny NF4 model, CPU), in one compilation over batches of
different document layouts, and undoes cleanly; bad combinations are refused before the model
changes; ``qlora-nb bench --packing`` and ``qlora-nb train --packing`` write what the checks name.
"""

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F

from qlora_nb_utils import cli, optimize
from qlora_nb_utils import data as qdata
from qlora_nb_utils.data import packing

ATOL = 1e-5


def _docs(seed, lengths, vocab=2000):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(3, vocab, (n,), generator=g).tolist()), "labels": ids}
            for n in lengths]


def _lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


def _alone(model, docs):
    """The summed token loss of every document run alone, and how many tokens it predicts."""
    total, count = 0.0, 0
    for doc in docs:
        ids = torch.tensor([doc["input_ids"]])
        logits = model(input_ids=ids).logits
        total = total + F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        count += ids.shape[1] - 1
    return total, count


def _assert_packed_equals_each_document(model, opt, layouts, batches, alone_attention=contextlib.nullcontext):
    """Each packed batch's loss and LoRA grads equal those of its documents run one by one."""
    for seed, (lengths, batch) in enumerate(zip(layouts, batches)):
        model.zero_grad(set_to_none=True)
        loss = opt(**dict(batch)).loss
        loss.backward()
        packed_grads = _lora_grads(model)
        model.zero_grad(set_to_none=True)
        with alone_attention():
            total, count = _alone(model, _docs(seed, lengths))
            # the packed loss is the mean over every predicted token of every document
            assert count == int((batch["labels"] != -100).sum())
            torch.testing.assert_close(loss, total / count, atol=ATOL, rtol=0)
            (total / count).backward()
        alone_grads = _lora_grads(model)
        assert packed_grads.keys() == alone_grads.keys() and packed_grads
        for name in packed_grads:
            torch.testing.assert_close(packed_grads[name], alone_grads[name], atol=ATOL, rtol=1e-4, msg=name)


def test_optimize_trains_packed_batches_like_each_document_alone_in_one_compilation(tiny):
    model, _ = tiny
    layouts = [[30, 17, 40, 9, 25, 1], [64, 50, 14], [3, 61, 33, 31]]  # rows of 64, different documents
    batches = [packing.pack_examples(_docs(seed, lengths), 64, rows_per_batch=2, pad_id=0)[0][0]
               for seed, lengths in enumerate(layouts)]
    opt = optimize(model, batches=batches)
    try:
        c = opt.choices
        assert (c["packing"], c["attention"], c["doc_attention"]) == (True, "document", "sdpa")
        assert "no flex-attention backward on cpu" in opt.reasons["doc_attention"]
        assert model.get_base_model().config._attn_implementation == "sdpa"
        _assert_packed_equals_each_document(model, opt, layouts, batches)
        stats = opt.counter.to_dict()
        assert stats["compilations"] == 1 and stats["recompilations"] == 0
        assert opt.fast.prepared.options["fullgraph"] is True  # a break would have raised
        eager = opt.eager(**dict(batches[0])).loss
        torch.testing.assert_close(opt(**dict(batches[0])).loss, eager, atol=ATOL, rtol=0)
    finally:
        opt.undo()
        model.zero_grad(set_to_none=True)
    assert "forward" not in vars(model)


def test_flex_on_cuda_is_chosen_and_its_config_switch_undoes(tiny):
    model, _ = tiny
    from qlora_nb_utils.compile.choices import choose_doc_kernel
    from qlora_nb_utils.ops.doc_attention import use_document_attention

    assert choose_doc_kernel(torch.device("cuda"), "auto")[0] == "flex_attention"
    assert choose_doc_kernel(torch.device("cpu"), "auto")[0] == "sdpa"
    base = model.get_base_model()
    with use_document_attention(model, "flex_attention"):
        assert base.config._attn_implementation == "flex_attention"
        assert base.model.layers[0].self_attn.config._attn_implementation == "flex_attention"
    assert base.config._attn_implementation == "sdpa"


def test_optimize_gives_the_flex_mask_one_ids_buffer_under_cuda_graphs_only(tiny, monkeypatch):
    from qlora_nb_utils.compile import step_inputs

    seen = []
    real = step_inputs.with_document_mask
    monkeypatch.setattr(step_inputs, "with_document_mask", lambda *a, **kw: seen.append(kw.get("stable_ids")) or real(*a, **kw))
    model, _ = tiny
    (packed,), _ = packing.pack_examples(_docs(5, [20, 30]), 64, rows_per_batch=1, pad_id=0)
    for mode in ("default", "reduce-overhead"):  # only the step's wrapper is built: nothing runs on a CPU
        optimize(model, batches=[packed], backend="inductor", mode=mode).undo()
    assert seen == [False, True]


def _packed_and_padded():
    (packed,), _ = packing.pack_examples(_docs(5, [20, 30]), 64, rows_per_batch=1, pad_id=0)
    padded = {"input_ids": torch.ones(1, 64, dtype=torch.long), "attention_mask": torch.ones(1, 64, dtype=torch.long),
              "labels": torch.ones(1, 64, dtype=torch.long)}
    return packed, padded


@pytest.mark.parametrize("case, message", [
    ("mixed", "batches are packed"),
    ("mask", "has an attention_mask"),
    ("no_positions", "has no position_ids"),
    ("causal", "attend to each other"),
    ("flex_on_cpu", "cannot train on a CPU"),
    ("unknown_kernel", "doc_attention must be one of"),
])
def test_bad_packed_input_is_refused_before_the_model_changes(tiny, case, message):
    model, _ = tiny
    packed, padded = _packed_and_padded()
    options = {"batches": [packed]}
    if case == "mixed":
        options["batches"] = [packed, padded]
    elif case == "mask":
        options["batches"] = [{**packed, "attention_mask": padded["attention_mask"]}]
    elif case == "no_positions":
        options["batches"] = [{k: v for k, v in packed.items() if k != "position_ids"}]
    elif case == "causal":
        options["attention"] = "causal"
    elif case == "flex_on_cpu":
        options["doc_attention"] = "flex_attention"
    else:
        options["doc_attention"] = "varlen?"
    before = {n: p.dtype for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        optimize(model, **options)
    assert {n: p.dtype for n, p in model.named_parameters()} == before and "forward" not in vars(model)
    assert model.get_base_model().config._attn_implementation == "sdpa"


def test_build_packed_batches_keeps_every_token_and_cuts_only_when_allowed(tiny):
    _, tok = tiny
    batches, stats = qdata.build_packed_batches(tok, batch_size=2, max_len=512, limit=24, seed=0)
    whole = qdata.tokenize_examples(qdata.load_examples(None, limit=24), tok, max_len=qdata.UNCUT)
    assert stats.documents == 24 and stats.truncated == 0
    assert stats.real_tokens == sum(whole["length"]) == sum(qdata.real_tokens(b) for b in batches)
    assert {tuple(b["input_ids"].shape) for b in batches} == {(2, 512)}
    assert stats.pad_fraction < 0.2  # the same examples padded to 512 are mostly padding
    longest = max(whole["length"])
    with pytest.raises(ValueError, match="longer than max_len=64"):
        qdata.build_packed_batches(tok, batch_size=2, max_len=64, limit=24, truncate=False)
    _, cut = qdata.build_packed_batches(tok, batch_size=2, max_len=64, limit=24)
    assert 0 < cut.truncated <= 24 and longest > 64


def test_bench_packing_writes_what_the_checks_name(tmp_path):
    out = tmp_path / "bench"
    argv = ["bench", "--packing", "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", "50",
            "--warmup", "1", "--seq-len", "512", "--batch-size", "2", "--limit", "12", "--backend", "aot_eager",
            "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["packing"] is True and r["whole_epoch"] is True  # 12 examples pack into fewer than 50 batches
    assert [run["name"] for run in r["runs"]] == ["hf-eager", "fast-padded", "fast"]
    assert r["pad_fraction"] < r["padded_pad_fraction"]
    assert r["graph_breaks"] == 0 and r["compilations"] == 1 and r["fullgraph_ok"] is True
    assert r["max_abs_loss_diff"] < 1e-4  # fp32 on a CPU: compiled is its eager to rounding
    assert r["real_tokens_per_s"] > 0 and r["real_tokens_speedup_vs_padded"] > 0
    assert r["epoch_batches"] == len(r["runs"][2]["losses"])
    assert (out / "loss_curves.png").is_file()


def test_train_packing_on_writes_a_packed_run(tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", "3", "--batch-size", "2",
            "--seq-len", "256", "--eval-every", "0", "--save-every", "0", "--eval-size", "4", "--packing", "on",
            "--backend", "aot_eager", "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["packing"] is True and m["pad_fraction"] < 0.25
    assert m["optimize"]["choices"]["packing"] is True and m["graph_breaks"] == 0
    assert m["compilations"]["compilations"] == 1
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_varlen_trains_packed_batches_like_each_document_alone_in_one_compilation(tiny):
    """doc_attention='varlen' on a CPU: the varlen cuts drive the dense reference. The cuts
    reach every layer through transformers' keywords, and transformers builds no mask. One
    compilation over layouts whose cut counts fall in two sizes."""
    from qlora_nb_utils.ops import doc_attention

    model, _ = tiny
    layouts = [[30, 17, 40, 9, 25, 1], [3] * 20 + [4] * 10 + [8], [64, 50, 14]]
    batches = [packing.pack_examples(_docs(seed, lengths), 64, rows_per_batch=2, pad_id=0)[0][0]
               for seed, lengths in enumerate(layouts)]
    sizes = {doc_attention.document_cu_seqlens(b["document_ids"]).numel() for b in batches}
    assert len(sizes) == 2 and min(sizes) == 16
    opt = optimize(model, batches=batches, doc_attention="varlen")
    try:
        assert opt.choices["doc_attention"] == "varlen" and "dense mask" in opt.reasons["doc_attention"]
        assert model.get_base_model().config._attn_implementation == doc_attention.VARLEN
        _assert_packed_equals_each_document(
            model, opt, layouts, batches, alone_attention=lambda: doc_attention.use_document_attention(model, "sdpa"))
        stats = opt.counter.to_dict()
        assert stats["compilations"] == 1 and stats["recompilations"] == 0
        with pytest.raises(ValueError, match="cu_seq_lens_q"):  # the cuts are needed, never guessed
            model(input_ids=batches[0]["input_ids"], position_ids=batches[0]["position_ids"])
    finally:
        opt.undo()
        model.zero_grad(set_to_none=True)
    assert model.get_base_model().config._attn_implementation == "sdpa"
