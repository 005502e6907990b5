"""Packed batches: the packer's rows and numbers, the document mask, and the tiny model on both.

The model tests use the tiny NF4 QLoRA model in fp32 on a CPU. Gradients go through SDPA with
the dense document mask (torch has no flex backward on a CPU); flex attention with the
``BlockMask`` built outside the graph is checked forward, compiled with ``fullgraph=True``.
"""

import pytest
import torch
import torch.nn.functional as F

from qlora_nb_utils import data as qdata
from qlora_nb_utils import diagnostics
from qlora_nb_utils.data import packing
from qlora_nb_utils.ops import doc_attention

ATOL = 1e-5


def _ex(n, start=0, learn_from=0):
    ids = list(range(start, start + n))
    return {"input_ids": ids, "labels": [-100] * learn_from + ids[learn_from:]}


# ----------------------------------------------------------------------------- the packer
def test_best_fit_decreasing_on_a_hand_made_case():
    # longest first: 6 opens bin 0 (room 2), 5 opens bin 1 (room 3), 4 opens bin 2 (room 4);
    # 3 -> bin 1 (room 3 is the tightest fit), 2 -> bin 0, 1 -> bin 2
    assert packing.best_fit_bins([3, 6, 2, 5, 4, 1], 8) == [[1, 2], [3, 0], [4, 5]]
    assert packing.best_fit_bins([4, 4, 4], 8) == [[0, 1], [2]]  # ties in input order


def test_rows_positions_documents_and_labels_at_the_boundaries():
    rows = [_ex(3, 10), _ex(4, 20, learn_from=2), _ex(2, 30)]
    (batch,), stats = packing.pack_examples(rows, 5, rows_per_batch=3, pad_id=0)
    # bins: [4-token], [3-token + 2-token], and a filler row of padding
    assert batch["input_ids"].tolist() == [[20, 21, 22, 23, 0], [10, 11, 12, 30, 31], [0] * 5]
    assert batch["labels"].tolist() == [[-100, -100, 22, 23, -100], [-100, 11, 12, -100, 31], [-100] * 5]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0, -1], [0, 0, 0, 1, 1], [-1] * 5]
    assert all(t.shape == (3, 5) and t.dtype == torch.long for t in batch.values())
    assert stats.to_dict() == {"documents": 3, "rows": 3, "slots": 15, "real_tokens": 9, "pad_tokens": 6,
                               "efficiency": 0.6, "pad_fraction": 0.4, "truncated": 0}


def test_every_batch_has_one_shape_and_every_token_is_kept_once():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 60, (50,), generator=g).tolist()
    rows = [_ex(n, 1000 * i) for i, n in enumerate(lengths)]
    batches, stats = packing.pack_examples(rows, 64, rows_per_batch=4, pad_id=0, seed=1)
    assert {tuple(t.shape) for b in batches for t in b.values()} == {(4, 64)}
    kept = sorted(x for b in batches for x in b["input_ids"][b["document_ids"] >= 0].tolist())
    assert kept == sorted(x for r in rows for x in r["input_ids"])
    assert stats.real_tokens == sum(lengths) and stats.rows == 4 * len(batches)
    assert stats.efficiency > 0.9 and stats.pad_fraction == pytest.approx(1 - stats.efficiency)
    # learned tokens: every label but each document's first survives
    learned = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert learned == sum(n - 1 for n in lengths)
    again, _ = packing.pack_examples(rows, 64, rows_per_batch=4, pad_id=0, seed=1)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(batches, again) for k in a)
    other, _ = packing.pack_examples(rows, 64, rows_per_batch=4, pad_id=0, seed=2)
    assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, other))


def test_shipped_data_packs_with_far_less_padding(tiny):
    _, tok = tiny
    rows = qdata.tokenize_examples(qdata.load_examples(None, limit=64), tok, max_len=256)
    padded = 1 - sum(rows["length"]) / (len(rows) * max(rows["length"]))
    _, stats = packing.pack_examples(list(rows), 256, rows_per_batch=4, pad_id=tok.pad_token_id)
    assert stats.pad_fraction < padded and stats.pad_fraction < 0.25


@pytest.mark.parametrize("call, message", [
    (lambda: packing.pack_examples([_ex(3)], 1, rows_per_batch=1, pad_id=0), "seq_len must be an int >= 2"),
    (lambda: packing.pack_examples([], 8, rows_per_batch=1, pad_id=0), "no examples"),
    (lambda: packing.pack_examples([_ex(3)], 8, rows_per_batch=0, pad_id=0), "rows_per_batch"),
    (lambda: packing.pack_examples([_ex(0)], 8, rows_per_batch=1, pad_id=0), "example 0 has no tokens"),
    (lambda: packing.pack_examples([_ex(2), _ex(9)], 8, rows_per_batch=1, pad_id=0),
     "example 1 has 9 tokens, more than seq_len=8.*truncate=True"),
    (lambda: packing.pack_examples([{"input_ids": [1, 2], "labels": [1]}], 8, rows_per_batch=1, pad_id=0),
     "2 input_ids but 1 labels"),
    (lambda: packing.best_fit_bins([], 8), "no examples"),
    (lambda: packing.collate_packed([[_ex(5), _ex(4)]], 8, 0), "more than seq_len=8"),
    (lambda: doc_attention.document_dense_mask(torch.zeros(4)), "2-D"),
    (lambda: doc_attention.document_block_mask(torch.zeros(1, 4)), "integers"),
    (lambda: doc_attention.with_document_mask(None, "math"), "kernel must be one of"),
    (lambda: doc_attention.with_document_mask(lambda **b: b, "sdpa")(input_ids=torch.ones(1, 2)), "document_ids"),
])
def test_bad_input_is_refused_clearly(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_truncation_only_when_asked_and_counted():
    (batch,), stats = packing.pack_examples([_ex(10, 1)], 8, rows_per_batch=1, pad_id=0, truncate=True)
    assert batch["input_ids"].tolist() == [list(range(1, 9))] and stats.truncated == 1 and stats.efficiency == 1.0


# ----------------------------------------------------------------------------- the mask
def test_the_masks_are_document_causal_and_skip_blocks_across_documents():
    from torch.nn.attention.flex_attention import create_mask

    docs = torch.tensor([[0] * 128 + [1] * 100 + [-1] * 28, [0] * 256])
    dense = doc_attention.document_dense_mask(docs)
    assert dense.shape == (2, 1, 256, 256)
    q, k = torch.arange(256)[:, None], torch.arange(256)[None]
    assert torch.equal(dense[1, 0], q >= k)
    assert not dense[0, 0, 128:, :128].any() and dense[0, 0, 128:228, 128:228].equal((q >= k)[:100, :100])
    assert dense[0, 0, 228:, 228:].equal((q >= k)[:28, :28])  # the tail sees only itself
    full = create_mask(doc_attention.document_mask_mod(docs), 2, 1, 256, 256, device="cpu")
    assert torch.equal(full, dense)
    block = doc_attention.document_block_mask(docs)
    # blocks each query block visits (partial + full): in row 0 the second query block skips
    # the first key block (documents meet at the block edge); one document visits both
    visits = block.kv_num_blocks[:, 0] + block.full_kv_num_blocks[:, 0]
    assert visits.tolist() == [[1, 1], [1, 2]]
    assert doc_attention.varlen_available() == hasattr(torch.nn.attention, "varlen")


def _packed_ids(rows: int, seq_len: int, seed: int) -> torch.Tensor:
    """Documents of random lengths in order along each row, then a padding tail (-1), as packing lays them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        lengths = torch.randint(1, 200, (seq_len,), generator=gen)
        row = torch.repeat_interleave(torch.arange(seq_len), lengths)[:seq_len].clone()
        tail = int(torch.randint(0, seq_len // 3, (1,), generator=gen))
        if tail:
            row[-tail:] = -1
        out.append(row)
    return torch.stack(out)


@pytest.mark.parametrize("seq_len, block", [(512, 128), (256, 16), (1024, 64)])
def test_the_block_mask_from_document_runs_is_create_block_masks(seq_len, block):
    """Built from each block's first and last document (no seq_len^2 tensor), the mask is the one
    create_block_mask makes from the same mask_mod: the same blocks, partial and whole."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = _packed_ids(3, seq_len, seed=seq_len + block)
    ours = doc_attention.document_block_mask(ids, block)
    ref = create_block_mask(doc_attention.document_mask_mod(ids), B=3, H=None, Q_LEN=seq_len, KV_LEN=seq_len,
                            device="cpu", BLOCK_SIZE=block)
    assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert torch.equal(ours.to_dense(), ref.to_dense())


def test_a_long_document_mask_needs_no_square_tensor(monkeypatch):
    """64k tokens: the block lists come from the documents' runs; create_block_mask is not called."""
    import torch.nn.attention.flex_attention as flex

    def refuse(*args, **kwargs):
        raise AssertionError("create_block_mask builds seq_len x seq_len masks")

    monkeypatch.setattr(flex, "create_block_mask", refuse)
    ids = torch.repeat_interleave(torch.arange(40), 65536 // 40 + 1)[:65536][None]
    mask = doc_attention.document_block_mask(ids)
    assert mask.kv_num_blocks.shape == (1, 1, 512)
    assert int((mask.kv_num_blocks + mask.full_kv_num_blocks).min()) >= 1  # every query block sees its own
    # an id that comes back after another is not one run: the reference builder is used (refused here)
    with pytest.raises(AssertionError, match="seq_len x seq_len"):
        doc_attention.document_block_mask(torch.tensor([[0] * 128 + [1] * 128 + [0] * 256]))


def _captured_ids(block):
    return next(c.cell_contents for c in block.mask_mod.__closure__ if torch.is_tensor(c.cell_contents))


def test_stable_ids_read_one_buffer_per_shape_and_give_the_same_mask():
    """Under CUDA graphs the ids a flex mask captures are a static input: one address for every batch."""
    from torch.nn.attention.flex_attention import create_mask

    a = torch.tensor([[0] * 100 + [1] * 156, [0] * 256])
    b = torch.tensor([[0] * 30 + [1] * 200 + [-1] * 26, [0] * 128 + [1] * 128])
    first = doc_attention.document_block_mask(a, stable_ids=True)
    held = _captured_ids(first)
    assert held is not a and torch.equal(held, a)
    second = doc_attention.document_block_mask(b, stable_ids=True)
    assert _captured_ids(second) is held and held.data_ptr() == _captured_ids(first).data_ptr()
    assert torch.equal(held, b) and torch.equal(b, torch.tensor([[0] * 30 + [1] * 200 + [-1] * 26, [0] * 128 + [1] * 128]))
    plain = doc_attention.document_block_mask(b)
    assert _captured_ids(plain) is b  # without it, the batch's own tensor
    for got, want in ((second, plain),):
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(create_mask(second.mask_mod, 2, 1, 256, 256, device="cpu"), doc_attention.document_dense_mask(b))
    other = doc_attention.document_block_mask(b[:1], stable_ids=True)  # another shape: its own buffer
    assert _captured_ids(other) is not held and torch.equal(held, b)
    kw = doc_attention.document_attention_kwargs(a, "flex_attention", stable_ids=True)
    assert _captured_ids(kw["attention_mask"]) is held and torch.equal(held, a)


# ----------------------------------------------------------------------------- the model (conftest.tiny)


def _docs(seed, lengths, vocab=2000):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(3, vocab, (n,), generator=g).tolist()), "labels": ids}
            for n in lengths]


def _token_losses(logits, labels):
    """Per-token loss of each position t >= 1 predicted from t - 1 (0 where the label is -100)."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")


def _lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


def test_packed_equals_unpacked_per_token_loss_and_lora_grads(tiny):
    model, _ = tiny
    docs = _docs(0, [30, 17, 40, 9, 25, 1])
    (batch,), stats = packing.pack_examples(docs, 64, rows_per_batch=2, pad_id=0)
    assert stats.rows == 2
    model.zero_grad(set_to_none=True)
    run = doc_attention.with_document_mask(model, "sdpa")
    docs_ids = batch["document_ids"].clone()
    out = run(**{k: v for k, v in batch.items() if k != "labels"})
    packed = _token_losses(out.logits, batch["labels"])
    packed.sum().backward()
    g_packed = _lora_grads(model)
    assert len(g_packed) > 0 and all(g.abs().sum() > 0 for g in g_packed.values())
    model.zero_grad(set_to_none=True)
    total, checked = 0.0, 0
    for doc in docs:
        ids = torch.tensor([doc["input_ids"]])
        alone = _token_losses(model(input_ids=ids).logits, ids)[0]
        total = total + alone.sum()
        # find the document in the packed rows by its tokens (they are unique random draws)
        for r in range(2):
            for d in docs_ids[r].unique().tolist():
                where = docs_ids[r] == d
                if d >= 0 and batch["input_ids"][r][where].tolist() == doc["input_ids"]:
                    at = int(where.nonzero()[0])
                    n = len(doc["input_ids"])
                    torch.testing.assert_close(packed[r, at:at + n - 1], alone, atol=ATOL, rtol=0)
                    checked += 1
    assert checked == len(docs)
    total.backward()
    g_alone = _lora_grads(model)
    assert g_alone.keys() == g_packed.keys()
    for name in g_packed:
        torch.testing.assert_close(g_packed[name], g_alone[name], atol=ATOL, rtol=0, msg=name)
    model.zero_grad(set_to_none=True)


def _changed_one_document(batch, row=0, doc=1):
    other = {k: v.clone() for k, v in batch.items()}
    where = other["document_ids"][row] == doc
    other["input_ids"][row, where] = (other["input_ids"][row, where] + 7) % 2000 + 3
    return other, where


def test_no_attention_crosses_a_document_sdpa(tiny):
    model, _ = tiny
    (batch,), _ = packing.pack_examples(_docs(1, [20, 30, 12]), 64, rows_per_batch=1, pad_id=0)
    batch.pop("labels")
    other, where = _changed_one_document(batch, doc=1)
    run = doc_attention.with_document_mask(model, "sdpa")
    with torch.no_grad():
        a, b = run(**dict(batch)).logits[0], run(**dict(other)).logits[0]
    torch.testing.assert_close(a[~where], b[~where], atol=1e-6, rtol=0)
    assert (a[where] - b[where]).abs().max() > 1e-3


@pytest.fixture
def flex(tiny):
    model, _ = tiny
    base = model.get_base_model()
    base.set_attn_implementation("flex_attention")
    try:
        yield model
    finally:
        base.set_attn_implementation("sdpa")


def test_compiled_flex_is_one_graph_one_compilation_and_matches_sdpa(tiny, flex):
    """Forward only (no flex backward on a CPU): 3 batches of different layouts, fullgraph=True."""
    model, _ = tiny
    layouts = [[100, 120, 36, 30, 200], [256, 50, 206], [1, 255, 128, 128]]
    batches = []
    for seed, lengths in enumerate(layouts):
        (b,), _ = packing.pack_examples(_docs(seed, lengths), 256, rows_per_batch=2, pad_id=0)
        b.pop("labels")
        batches.append(b)
    flex.get_base_model().set_attn_implementation("sdpa")
    with torch.no_grad():
        refs = [doc_attention.with_document_mask(model, "sdpa")(**dict(b)).logits for b in batches]
    flex.get_base_model().set_attn_implementation("flex_attention")
    counter = diagnostics.CompileCounter(backend="aot_eager")
    run = doc_attention.with_document_mask(counter.compile(model, fullgraph=True), "flex_attention")
    with torch.no_grad():
        for b, ref in zip(batches, refs):
            torch.testing.assert_close(run(**dict(b)).logits, ref, atol=ATOL, rtol=0)
        assert counter.to_dict()["compilations"] == 1
        # no attention crosses a document, compiled, on the last layout (one recompile at most)
        other, where = _changed_one_document(batches[2], row=1, doc=0)
        a, b = run(**dict(batches[2])).logits[1], run(**dict(other)).logits[1]
        torch.testing.assert_close(a[~where], b[~where], atol=1e-6, rtol=0)
        assert (a[where] - b[where]).abs().max() > 1e-3
        assert counter.to_dict()["compilations"] == 1
        torch._dynamo.reset()
        kw = dict(batches[0])
        kw["attention_mask"] = doc_attention.document_block_mask(kw.pop("document_ids"))
        report = diagnostics.graph_breaks(model, **kw)
    assert report.graph_break_count == 0 and report.graph_count == 1


def test_compiled_sdpa_trains_packed_batches_with_one_compilation(tiny):
    """The CPU training path: dense document mask, forward + backward, fullgraph=True."""
    model, _ = tiny
    counter = diagnostics.CompileCounter(backend="aot_eager")
    run = doc_attention.with_document_mask(counter.compile(model, fullgraph=True), "sdpa")
    batches, _ = packing.pack_examples(_docs(3, [50, 20, 60, 9, 33, 40, 64, 5]), 64, rows_per_batch=2, pad_id=0)
    assert len(batches) >= 3
    for b in batches:
        eager = doc_attention.with_document_mask(model, "sdpa")(**dict(b)).loss
        loss = run(**dict(b)).loss
        loss.backward()
        torch.testing.assert_close(loss, eager, atol=ATOL, rtol=0)
    model.zero_grad(set_to_none=True)
    assert counter.to_dict()["compilations"] == 1


def test_what_transformers_does_with_packed_position_ids_alone(tiny):
    """Why the mask is built here: from packed ``position_ids`` alone (no ``attention_mask``),
    transformers 5.17 finds the documents itself; with SDPA that compiles as one graph (a dense
    mask built in the graph), with flex it breaks on ``create_block_mask``'s deprecation warning."""
    model, _ = tiny
    (b,), _ = packing.pack_examples(_docs(4, [20, 30, 14]), 64, rows_per_batch=1, pad_id=0)
    ids, pos = b["input_ids"], b["position_ids"]
    with torch.no_grad():
        ref = doc_attention.with_document_mask(model, "sdpa")(input_ids=ids, document_ids=b["document_ids"]).logits
        torch._dynamo.reset()
        sdpa = diagnostics.graph_breaks(model, input_ids=ids, position_ids=pos)
        counter = diagnostics.CompileCounter(backend="aot_eager")
        logits = counter.compile(model, fullgraph=True)(input_ids=ids, position_ids=pos).logits
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
        base = model.get_base_model()
        base.set_attn_implementation("flex_attention")
        try:
            torch._dynamo.reset()
            flex = diagnostics.graph_breaks(model, input_ids=ids, position_ids=pos)
        finally:
            base.set_attn_implementation("sdpa")
    assert sdpa.graph_break_count == 0 and counter.to_dict()["compilations"] == 1
    assert flex.graph_break_count > 0
    assert any("warn" in r["reason"] for r in flex.break_reasons)


def test_real_tokens_counts_the_mask_the_documents_or_everything():
    padded = {"input_ids": torch.zeros(2, 5, dtype=torch.long),
              "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    assert packing.real_tokens(padded) == 8
    batches, stats = packing.pack_examples([_ex(3), _ex(4), _ex(2)], 8, rows_per_batch=2, pad_id=0)
    assert sum(packing.real_tokens(b) for b in batches) == stats.real_tokens == 9
    assert packing.real_tokens({"input_ids": torch.zeros(3, 4, dtype=torch.long)}) == 12
    with pytest.raises(ValueError, match="input_ids"):
        packing.real_tokens({"labels": torch.zeros(1, 2)})


def test_with_document_mask_passes_unpacked_batches_only_when_not_required():
    seen = []
    run = doc_attention.with_document_mask(lambda **b: seen.append(sorted(b)) or "ran", "sdpa", required=False)
    assert run(input_ids=torch.ones(1, 2)) == "ran" and seen == [["input_ids"]]
    with pytest.raises(ValueError, match="document_ids"):
        doc_attention.with_document_mask(lambda **b: b, "sdpa")(input_ids=torch.ones(1, 2))


def test_varlen_cuts_start_at_every_document_and_row_and_pad_to_a_power_of_two():
    # row 0: doc 0 (3), doc 1 (2), tail (1); row 1: doc 0 again (a new row is a new sequence), tail
    docs = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, -1, -1]])
    cuts = doc_attention.document_cu_seqlens(docs)
    assert cuts.dtype == torch.int32 and cuts.numel() == doc_attention.MIN_CUTS
    assert cuts.tolist() == [0, 3, 5, 6, 10] + [12] * 11
    many = torch.arange(40).repeat_interleave(2).view(2, 40)  # 40 documents of 2 tokens
    assert doc_attention.document_cu_seqlens(many).numel() == 64
    kw = doc_attention.document_attention_kwargs(docs, "varlen")
    assert kw["max_length_q"] == kw["max_length_k"] == 6 and kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    dense = doc_attention._cut_mask(cuts, 2, 6)
    assert torch.equal(dense, doc_attention.document_dense_mask(docs))
    with pytest.raises(ValueError, match="kernel must be one of"):
        doc_attention.document_attention_kwargs(docs, "flash")


def test_no_attention_crosses_a_document_varlen(tiny):
    model, _ = tiny
    (batch,), _ = packing.pack_examples(_docs(1, [20, 30, 12]), 64, rows_per_batch=1, pad_id=0)
    batch.pop("labels")
    other, where = _changed_one_document(batch, doc=1)
    with torch.no_grad():
        ref = doc_attention.with_document_mask(model, "sdpa")(**dict(batch)).logits[0]
        with doc_attention.use_document_attention(model, "varlen"):
            run = doc_attention.with_document_mask(model, "varlen")
            a, b = run(**dict(batch)).logits[0], run(**dict(other)).logits[0]
    torch.testing.assert_close(a, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(a[~where], b[~where], atol=1e-6, rtol=0)
    assert (a[where] - b[where]).abs().max() > 1e-3
