"""The packing benchmark's pieces on a CPU: each library's form of a packed batch, the long-tail
lengths, the same examples packed and padded, and two packed peers agreeing on the tiny model."""

import statistics

import pytest
import torch

from lab import lengths
from lab.peers import packed as pk
from lab.peers.packed_batches import flatten_packed, for_transformers, row_documents
from qlora_nb_utils import models
from qlora_nb_utils.data.packing import pack_examples, real_tokens


def _examples():
    return [{"input_ids": list(range(10 * i + 3, 10 * i + 3 + n)), "labels": [-100] + list(range(10 * i + 4, 10 * i + 3 + n))}
            for i, n in enumerate((5, 9, 4, 7, 3))]


def test_each_library_form_keeps_the_documents_labels_and_real_tokens():
    batches, _ = pack_examples(_examples(), 16, rows_per_batch=4, pad_id=0)
    batch = batches[0]  # 28 tokens in 2 rows of 16, two all-padding filler rows
    assert "document_ids" not in for_transformers(batch) and "position_ids" in for_transformers(batch)
    rows = row_documents(batch)
    assert len(rows) == 2 and sum(map(len, (r["input_ids"] for r in rows))) == real_tokens(batch) == 28
    assert sorted(n for r in rows for n in r["seq_lengths"]) == [3, 4, 5, 7, 9]
    flat = flatten_packed(batch)
    assert flat["input_ids"].shape == (1, 28) and int(flat["packed_seq_lengths"].sum()) == 28
    assert flat["packed_seq_lengths"].dtype == torch.int32
    starts = torch.cumsum(flat["packed_seq_lengths"], 0)[:-1].tolist()
    assert (flat["position_ids"][0][[0] + starts] == 0).all()
    assert (flat["labels"][0][[0] + starts] == -100).all()  # no document predicts from the previous one
    keep = batch["document_ids"] != -1
    assert flat["input_ids"][0].tolist() == batch["input_ids"][keep].tolist()
    with pytest.raises(ValueError, match="no document"):
        flatten_packed(batches[0] | {"document_ids": torch.full_like(batch["document_ids"], -1)})


def test_long_tail_lengths_follow_the_stated_shape_and_the_seed():
    a = lengths.long_tail_lengths(4000, seed=3)
    assert a == lengths.long_tail_lengths(4000, seed=3) != lengths.long_tail_lengths(4000, seed=4)
    target = lengths.SHAREGPT_PROMPT_MEAN + lengths.SHAREGPT_COMPLETION_MEAN
    assert statistics.mean(a) == pytest.approx(target, rel=0.1)
    assert statistics.median(a) < 0.75 * statistics.mean(a)  # a long right tail
    ex = lengths.long_tail_examples(20, 1000, seed=0)
    for e in ex:
        prompt = e["labels"].count(-100)
        assert 1 <= prompt < len(e["input_ids"]) and all(3 <= t < 1000 for t in e["input_ids"])


def test_packed_and_padded_batches_hold_the_same_examples():
    tok = models.load_tokenizer("tiny")
    packed, padded, info = pk.build_data(tok, "long-tail", seq_len=256, rows=2, long_tail_examples=30)
    assert info["packing"]["truncated"] == info["lengths"]["over_seq_len"] > 0  # cut explicitly, and counted
    assert info["padded_pad_fraction"] > info["packing"]["pad_fraction"]
    # make_batches drops the last partial batch: at most rows - 1 examples missing from the padded side
    assert 0 <= info["packing"]["real_tokens"] - info["padded_real_tokens"] <= 256
    assert all(b["input_ids"].shape == (2, 256) for b in packed + padded)
    assert all(bool((b["document_ids"] != -1).any(dim=1).all()) for b in pk._full(packed))


def test_row_schema_and_errors():
    row = pk._row({"name": "unsloth-packed", "error": "boom"}, model="m", data="kjv", packed=True, pad_fraction=0.0)
    assert row["library"] == "unsloth" and row["error"] == "boom" and row["compilations"] is None
    ok = pk._row({"name": "hf-eager", "real_tokens_per_s": 5.0, "peak_mem_gib": 1.0, "median_step_ms": 2.0,
                  "steps": 3}, model="m", data="kjv", packed=False, pad_fraction=0.5)
    assert ok["compilations"] == 0 and ok["real_tokens_per_s"] == 5.0 and "error" not in ok
    with pytest.raises(ValueError):
        pk.run_packing("tiny", ["nope"], seq_len=64, rows=2, steps=2, warmup=0, out="/tmp/x.json")


def test_hf_packed_and_trl_padding_free_train_the_same_losses():
    from lab.peers import run_peer

    tok = models.load_tokenizer("tiny")
    packed, _, _ = pk.build_data(tok, "long-tail", seq_len=128, rows=2, long_tail_examples=16)
    timed = pk._full(packed)[:2]
    runs = {name: run_peer(name, timed, model="tiny", steps=2, warmup=0, device="cpu", dtype="float32")
            for name in ("hf-eager-packed", "trl-sft-packed")}
    assert not any("error" in r for r in runs.values()), runs
    hf, trl = runs["hf-eager-packed"], runs["trl-sft-packed"]
    assert hf["losses"] == pytest.approx(trl["losses"], abs=1e-5)
    assert hf["options"]["packed"] and trl["options"]["packed"]


def test_lowmem_target_is_the_lowest_unsloth_peak_of_the_same_model_and_data():
    rows = [{"name": "unsloth", "model": "m8", "data": "kjv", "peak_mem_gib": 21.0},
            {"name": "unsloth-packed", "model": "m8", "data": "kjv", "peak_mem_gib": 20.5},
            {"name": "unsloth-packed", "model": "m1", "data": "kjv", "peak_mem_gib": 9.9},  # another model
            {"name": "unsloth", "model": "m8", "data": "long-tail", "peak_mem_gib": 3.0},  # another data set
            {"name": "unsloth-packed", "model": "m8", "data": "kjv", "peak_mem_gib": 1.0, "error": "x"},
            {"name": "trl-sft-packed", "model": "m8", "data": "kjv", "peak_mem_gib": 2.0}]
    gib, how = pk.lowmem_target(rows, "m8", "kjv", "unsloth")
    assert gib == 20.5 and "unsloth-packed" in how
    assert pk.lowmem_target(rows, "m8", "kjv", "7.5") == (7.5, "--lowmem-gib 7.5")
    gib, how = pk.lowmem_target(rows, "m9", "kjv", "unsloth")
    assert gib is None and "no Unsloth peak" in how
    with pytest.raises(ValueError, match="lowmem_gib"):
        pk.lowmem_target(rows, "m8", "kjv", "lots")
