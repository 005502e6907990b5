"""The LM head and loss over labelled rows only: ops.losses.labelled_rows, chunked_cross_entropy(rows=),
and optimize(loss_rows=...): the same loss and gradients, one compilation for every row count."""

import pytest
import torch

from qlora_nb_utils import data as qdata
from qlora_nb_utils import optimize
from qlora_nb_utils.ops.losses import ROW_BUCKETS, chunked_cross_entropy, labelled_rows


def _labels(b=3, s=40, keep=(40, 7, 0), seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (b, s), generator=g)
    for row, n in enumerate(keep):
        labels[row, n:] = -100
    return labels


def test_labelled_rows_lists_every_labelled_row_and_pads_with_ignored_ones():
    labels = _labels()
    targets = labels[:, 1:].reshape(-1)
    rows = labelled_rows(labels)
    wanted = set((targets != -100).nonzero().squeeze(1).tolist())
    assert wanted <= set(rows.tolist())
    assert rows[:len(wanted)].tolist() == sorted(wanted)
    assert (rows[len(wanted):] == targets.numel()).all()  # the padding: one past the last row
    assert rows.numel() == 64  # ceil(117 / 16) = 8, rounded up to 64
    assert labelled_rows(labels, multiple=3).numel() == 192  # lcm(64, 3)
    full = torch.randint(0, 50, (2, 600))  # nothing ignored: every row, then padding
    rows = labelled_rows(full)
    assert rows[:1198].tolist() == list(range(1198)) and rows.numel() == 1280 and rows[-1] == 1198  # step: ceil(1198 / 16) = 75 -> 128
    counts = set()
    for n in range(0, 1025, 7):
        big = torch.randint(0, 50, (8, 1024))
        big[:, n:] = -100
        counts.add(labelled_rows(big, multiple=4).numel())
    assert len(counts) <= ROW_BUCKETS + 1 and all(c % 4 == 0 for c in counts)  # bucketed: few sizes


def test_labelled_rows_pads_to_at_least_the_given_count_in_the_same_steps_and_no_further_than_every_row():
    labels = _labels()  # 117 target rows, the labelled ones fit in 64
    assert labelled_rows(labels, at_least=0).numel() == 64
    assert labelled_rows(labels, at_least=65).numel() == 128  # rounded up to the 64-row step
    assert labelled_rows(labels, at_least=10_000).numel() == 128  # never past every row's bucket (117 -> 128)
    rows = labelled_rows(labels, at_least=128)
    n = int((labels[:, 1:] != -100).sum())
    assert (rows[n:] == labels[:, 1:].numel()).all()  # the extra rows are ignored ones
    with pytest.raises(ValueError, match="at_least must be an integer >= 0"):
        labelled_rows(labels, at_least=-1)


def test_a_count_over_at_least_takes_every_rows_length_with_overflow_to_all():
    """Two lengths at most (a static graph's): at_least's bucket, else every row's."""
    total = 4 * 1023
    few, many = torch.full((4, 1024), -100), torch.full((4, 1024), -100)
    few[:, 1:50] = 3  # 196 labelled rows
    many[:, 1:600] = 3  # 2396 labelled rows
    short = labelled_rows(few, multiple=4, at_least=300, overflow_to_all=True)
    assert short.numel() == labelled_rows(few, multiple=4, at_least=300).numel() < total
    own = labelled_rows(many, multiple=4, at_least=300)  # its own bucket, without the option
    full = labelled_rows(many, multiple=4, at_least=300, overflow_to_all=True)
    assert short.numel() < own.numel() < full.numel() == labelled_rows(few, multiple=4, at_least=total).numel()
    assert torch.equal(full[:2396], own[:2396]) and (full[2396:] == total).all()  # the same rows, more ignored ones


@pytest.mark.parametrize("labels, buckets, message", [
    (torch.zeros(5, dtype=torch.long), 16, "must be \\(B, S\\)"),
    (torch.zeros(2, 1, dtype=torch.long), 16, "must be \\(B, S\\)"),
    (torch.zeros(2, 8, dtype=torch.long), 0, "buckets must be an integer"),
    (torch.zeros(2, 8, dtype=torch.long), 1.5, "buckets must be an integer"),
])
def test_labelled_rows_refuses_bad_input(labels, buckets, message):
    with pytest.raises(ValueError, match=message):
        labelled_rows(labels, buckets=buckets)


@pytest.mark.parametrize("keep", [(40, 7, 0), (0, 0, 0), (40, 40, 40), (39, 40, 40)])
def test_chunked_loss_over_labelled_rows_equals_every_row(keep):
    labels = _labels(keep=keep)
    hidden = torch.randn(3, 40, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    full = chunked_cross_entropy(hidden, weight, labels, chunks=3)
    g_full = torch.autograd.grad(full, (hidden, weight))
    part = chunked_cross_entropy(hidden, weight, labels, chunks=3, rows=labelled_rows(labels))
    g_part = torch.autograd.grad(part, (hidden, weight))
    torch.testing.assert_close(part, full, rtol=1e-6, atol=1e-7)  # the fp32 sums are added in another order
    for a, b in zip(g_part, g_full):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)  # the head grad sums in fp32


def _masked(batch, keep):
    labels = batch["input_ids"].clone()
    for row, n in enumerate(keep):
        labels[row, n:] = -100
    return {**batch, "labels": labels}


def _lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_optimize_takes_labelled_rows_in_one_compilation_with_the_same_loss_and_grads(tiny):
    model, tok = tiny
    (base,) = qdata.build_batches(tok, batch_size=2, steps=1, max_len=128, padding="fixed")
    base = {**base, "attention_mask": torch.ones_like(base["input_ids"])}
    batches = [_masked(base, keep) for keep in ((128, 128), (20, 10), (128, 8), (0, 0))]
    sizes = {labelled_rows(b["labels"]).numel() for b in batches}
    assert len(sizes) > 1  # the row count changes between batches
    results = {}
    for rows in (True, False):
        torch.compiler.reset()  # the two runs compile the same code object
        opt = optimize(model, batches=batches, backend="aot_eager", loss_rows=rows)
        try:
            assert opt.choices["loss_rows"] == ("labelled" if rows else "all")
            losses, grads = [], []
            for batch in batches:
                loss = opt(**batch).loss
                loss.backward()
                losses.append(loss.detach())
                grads.append(_lora_grads(model))
                model.zero_grad(set_to_none=True)
            stats = opt.counter.to_dict()
            assert (stats["compilations"], stats["recompilations"]) == (1, 0), stats["recompile_reasons"]
            torch.testing.assert_close(opt.eager(**batches[1]).loss, losses[1], rtol=1e-5, atol=1e-6)
            if rows:  # the labelled rows are read outside the recipe: the recipe itself traces whole
                from qlora_nb_utils import diagnostics

                prepared = opt.prepare(**batches[1])
                assert "loss_rows" in prepared
                # every batch shown gets one length (the most any needs): one CUDA graph, not one per bucket
                lengths = {opt.prepare(**b)["loss_rows"].numel() for b in batches}
                assert lengths == {max(sizes)}, lengths
                assert diagnostics.graph_breaks(opt.eager_prepared, **prepared).graph_break_count == 0
        finally:
            opt.undo()
        results[rows] = losses, grads
    (l_rows, g_rows), (l_all, g_all) = results[True], results[False]
    torch.testing.assert_close(torch.stack(l_rows), torch.stack(l_all), rtol=1e-5, atol=1e-6)
    for a, b in zip(g_rows, g_all):
        assert a.keys() == b.keys() and a
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_loss_rows_auto_follows_the_ignored_share_and_refuses_the_models_own_loss(tiny):
    model, tok = tiny
    padded = qdata.build_batches(tok, batch_size=2, steps=2, max_len=256, padding="fixed")
    opt = optimize(model, batches=padded, backend="eager")
    opt.undo()
    assert opt.choices["loss_rows"] == "labelled" and "ignored" in opt.reasons["loss_rows"]
    full = [{**b, "labels": b["input_ids"].clone(), "attention_mask": torch.ones_like(b["input_ids"])}
            for b in padded]
    opt = optimize(model, batches=full, backend="eager")
    opt.undo()
    assert opt.choices["loss_rows"] == "all" and opt.reasons["loss_rows"].startswith("0%")
    opt = optimize(model, batches=padded, backend="eager", ce_chunks=0)
    opt.undo()
    assert opt.choices["loss_rows"] == "all"
    with pytest.raises(ValueError, match="loss_rows=True needs the chunked loss"):
        optimize(model, batches=padded, ce_chunks=0, loss_rows=True)
    with pytest.raises(ValueError, match="loss_rows must be one of"):
        optimize(model, batches=padded, loss_rows="some")


def test_the_memory_estimate_counts_only_the_head_rows(tiny):
    from qlora_nb_utils.compile.memory_estimate import estimate_terms

    model, _ = tiny
    full = estimate_terms(model, 8, 1024, ce_chunks=4)
    part = estimate_terms(model, 8, 1024, ce_chunks=4, head_rows=1024)
    assert part["logits_gib"] == pytest.approx(full["logits_gib"] / 8)
    assert {k: v for k, v in part.items() if k != "logits_gib"} == {k: v for k, v in full.items() if k != "logits_gib"}


@pytest.mark.parametrize("dynamic_rows", [True, False])
def test_the_row_count_is_dynamic_without_cuda_graphs_and_static_under_them(dynamic_rows):
    from qlora_nb_utils.compile.step_inputs import StepInputs, prepare_batch

    inputs = StepInputs(pad_multiple=8, row_chunks=4, min_rows=64, cuda_graphs=not dynamic_rows)
    labels = torch.full((2, 40), -100)
    labels[:, 20:] = 7
    out = prepare_batch({"input_ids": torch.ones(2, 40, dtype=torch.long), "labels": labels}, inputs)
    rows = out["loss_rows"]
    assert rows.numel() == 64  # padded up to the count asked for: one length
    assert (0 in getattr(rows, "_dynamo_weak_dynamic_indices", set())) is dynamic_rows
    assert (0 in getattr(rows, "_dynamo_static_indices", set())) is not dynamic_rows
    labels = torch.full((4, 1024), -100)
    labels[:, 1:600] = 7  # more labelled rows than the 64 any shown batch needed
    more = prepare_batch({"input_ids": torch.ones(4, 1024, dtype=torch.long), "labels": labels}, inputs)["loss_rows"]
    every = labelled_rows(labels, multiple=4, at_least=4 * 1023).numel()
    assert (more.numel() == every) is not dynamic_rows  # static: every row's length (two lengths at most)


def test_optimize_keeps_the_row_count_static_under_cuda_graphs_only(tiny, monkeypatch):
    from qlora_nb_utils.compile import fast_path

    seen = {}
    real = fast_path.step_forward

    def spy(compiled, inputs):
        seen.setdefault("dynamic_rows", []).append(inputs.dynamic_rows)
        return real(compiled, inputs)

    monkeypatch.setattr(fast_path, "step_forward", spy)
    model, _ = tiny
    labels = torch.full((2, 32), -100)
    labels[:, 16:] = 5
    batch = {"input_ids": torch.ones(2, 32, dtype=torch.long), "labels": labels}
    for mode in ("default", "reduce-overhead"):  # CUDA graphs asked for on a CPU: only the step's inputs are looked at
        opt = optimize(model, batches=[batch], backend="inductor", mode=mode, loss_rows=True)
        opt.undo()
    assert seen["dynamic_rows"] == [True, False]


def test_in_regional_scope_each_batch_takes_its_own_row_count_with_the_same_loss(tiny):
    """The loss outside the graph (regional scope) meets any row count without compiling again, so
    each batch gets its own, rounded up to 64 rows only, where a loss inside the graph pads every
    batch to the most any needs (at 8B, 8 x 1024 about 450 rows a batch instead of 1024)."""
    model, tok = tiny
    (base,) = qdata.build_batches(tok, batch_size=2, steps=1, max_len=128, padding="fixed")
    base = {**base, "attention_mask": torch.ones_like(base["input_ids"])}
    batches = [_masked(base, keep) for keep in ((128, 128), (20, 10), (128, 8))]
    losses = {}
    for rows in (True, False):
        torch.compiler.reset()
        opt = optimize(model, batches=batches, backend="aot_eager", scope="regional", loss_rows=rows)
        try:
            if rows:
                lengths = [opt.prepare(**b)["loss_rows"].numel() for b in batches]
                own = [-(-max(1, int((b["labels"][:, 1:] != -100).sum())) // 64) * 64 for b in batches]
                assert lengths == own and len(set(lengths)) > 1, (lengths, own)
                assert "each batch its own count" in opt.reasons["loss_rows"]
            losses[rows] = torch.stack([opt(**b).loss.detach() for b in batches])
        finally:
            opt.undo()
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)
