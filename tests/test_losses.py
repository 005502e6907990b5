"""ops.losses: the per-token chunked head against full logits, eager and compiled."""

import pytest
import torch
import torch.nn.functional as F

from qlora_nb_utils.ops.losses import chunked_cross_entropy, chunked_token_log_probs


def _inputs(seed=0, b=3, s=11, d=16, v=50):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, :4] = -100  # a prompt
    labels[2, -3:] = -100  # padding
    return hidden, weight, labels


def _reference(hidden, weight, labels):
    logits = hidden[:, :-1] @ weight.t()
    logp = F.log_softmax(logits, dim=-1)
    t = labels[:, 1:]
    valid = t != -100
    picked = logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    top1 = logits.argmax(-1) == t
    zero = torch.zeros_like(picked)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero), top1 & valid, valid


@pytest.mark.parametrize("chunks", [1, 4, 7])
def test_token_log_probs_equal_full_logits_and_their_gradient_for_any_weighting(chunks):
    hidden, weight, labels = _inputs()
    stats = chunked_token_log_probs(hidden, weight, labels, chunks=chunks)
    ref = _reference(hidden, weight, labels)
    for got, want in zip(stats, ref):
        assert got.shape == labels[:, 1:].shape
        if got.dtype == torch.bool:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got.double(), want.double(), rtol=2e-5, atol=2e-5)  # logits go fp32
    # an arbitrary per-token weighting (not a plain sum): the row-wise backward must still be exact
    w = torch.rand(labels[:, 1:].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (g_got,) = torch.autograd.grad((stats.log_probs.double() * w).sum(), hidden)
    (g_ref,) = torch.autograd.grad((ref[0] * w).sum(), hidden)
    torch.testing.assert_close(g_got, g_ref, rtol=2e-5, atol=1e-6)
    assert not stats.entropy.requires_grad


def test_the_mean_of_token_log_probs_is_the_chunked_cross_entropy():
    hidden, weight, labels = _inputs(seed=2)
    stats = chunked_token_log_probs(hidden, weight, labels, chunks=3)
    loss = -stats.log_probs.sum() / stats.label_mask.sum()
    torch.testing.assert_close(loss.double(), chunked_cross_entropy(hidden, weight, labels, chunks=3).double())


def test_token_log_probs_compile_in_one_graph_with_their_backward():
    hidden, weight, labels = _inputs(seed=3)
    hidden = hidden.detach().float().requires_grad_()
    weight = weight.float()

    def loss_of(h):
        stats = chunked_token_log_probs(h, weight, labels, chunks=4)
        return -(stats.log_probs.sum() / stats.label_mask.sum()), stats.is_top1.sum(), stats.entropy.sum()

    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True)
    got, want = compiled(hidden), loss_of(hidden)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    (g_got,) = torch.autograd.grad(got[0], hidden)
    (g_ref,) = torch.autograd.grad(want[0], hidden)
    torch.testing.assert_close(g_got, g_ref)


def test_token_log_probs_refuse_a_trainable_head_and_bad_shapes():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="frozen LM head"):
        chunked_token_log_probs(hidden, weight.clone().requires_grad_(), labels)
    with pytest.raises(ValueError, match="chunks must be"):
        chunked_token_log_probs(hidden, weight, labels, chunks=0)
    with pytest.raises(ValueError, match="expected hidden"):
        chunked_token_log_probs(hidden, weight, labels[:, :-1])


def test_compiled_math_gives_the_eager_loss_and_gradients_and_compiles_once():
    """compiled_math (a loss outside a compiled graph, as in regional scope): each chunk's softmax
    arithmetic through one torch.compile'd function with dynamic lengths, so chunks of other sizes
    reuse it; loss and gradients as the eager arithmetic's. Empty chunks are skipped. Its float
    arguments are constants: a cold compile (no cached graph) traces it once, with no restart."""
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    from qlora_nb_utils.ops import losses

    torch.compiler.reset()
    losses._COMPILED_MATH.clear()
    counters.clear()
    clear_compilation_metrics()
    hidden, weight, labels = _inputs(v=64)
    weight.requires_grad_(True)
    results = []
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for compiled, chunks in ((False, 4), (True, 4), (True, 3), (True, 40)):  # 40 chunks: some are empty
            hidden.grad = weight.grad = None
            loss = chunked_cross_entropy(hidden, weight, labels, chunks=chunks, compiled_math=compiled)
            loss.backward()
            results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
    frames = [m for m in get_compilation_metrics() if m.co_name == "_ce_math"]
    assert frames and all(not m.restart_reasons for m in frames), [m.restart_reasons for m in frames]
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)  # the arithmetic is fp32 (logits.float())
    assert "fn" in losses._COMPILED_MATH
    assert counters["stats"]["unique_graphs"] <= 2  # the lengths are dynamic: no graph per chunk size


def test_min_chunk_rows_takes_fewer_chunks_outside_a_graph_with_the_same_loss(monkeypatch):
    """min_chunk_rows: fewer pieces while a piece would hold fewer rows (a 128-row chunk is a matmul
    too short to fill a GPU); the loss and gradients stay those of four chunks. Inside a traced
    graph the row count is not looked at, so nothing guards on it."""
    from qlora_nb_utils.ops import losses

    hidden, weight, labels = _inputs(b=4, s=33, v=64)  # 128 target rows
    pieces = []
    real = losses._ce_math
    monkeypatch.setattr(losses, "_ce_math", lambda logits, *a: pieces.append(logits.shape[0]) or real(logits, *a))
    results = {}
    for min_rows in (0, 64, 1000):
        pieces.clear()
        hidden.grad = None
        loss = chunked_cross_entropy(hidden, weight, labels, chunks=4, min_chunk_rows=min_rows)
        loss.backward()
        results[min_rows] = (list(pieces), loss.detach(), hidden.grad.clone())
    assert results[0][0] == [32, 32, 32, 32] and results[64][0] == [64, 64] and results[1000][0] == [128]
    for min_rows in (64, 1000):
        torch.testing.assert_close(results[min_rows][1], results[0][1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(results[min_rows][2], results[0][2], rtol=1e-12, atol=1e-12)
    pieces.clear()
    torch.compiler.reset()
    compiled = torch.compile(lambda h: chunked_cross_entropy(h, weight, labels, chunks=4, min_chunk_rows=1000),
                             backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(hidden), results[0][1], rtol=1e-12, atol=1e-12)
    assert pieces == [32, 32, 32, 32]
