"""ops.vocab_parallel: the loss and gradients of a head split by vocabulary over two gloo ranks equal
one process's cross-entropy with the whole head (fp32, uneven rows and vocabulary, ignored rows, a soft cap)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from qlora_nb_utils.ops.vocab_parallel import vocab_parallel_cross_entropy, vocab_range

VOCAB, HIDDEN, ROWS = 11, 8, (5, 7)


def _cap(z):  # the head's soft cap (softcap=3.0)
    return 3.0 * torch.tanh(z / 3.0)


def _data():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    hidden = [torch.randn(n, HIDDEN, generator=g) for n in ROWS]
    labels = [torch.randint(0, VOCAB, (n,), generator=g) for n in ROWS]
    labels[0][1] = -100
    labels[1][4] = -100
    return weight, hidden, labels


class _Shapes(TorchDispatchMode):
    """The shapes of the tensors ops make (views left out: they allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func.is_view:
            return result
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return result


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        weight, hidden, labels = _data()
        start, stop = vocab_range(VOCAB, rank, world)
        got = {"range": (start, stop)}
        for frozen in (False, True):
            w = weight[start:stop].clone().requires_grad_(not frozen)
            h = hidden[rank].clone().requires_grad_()
            with _Shapes() as seen:
                loss = vocab_parallel_cross_entropy(h, w, labels[rank], vocab_start=start, chunk_rows=3, softcap=3.0)
                loss.backward()
            tag = "frozen_" if frozen else ""
            got |= {f"{tag}loss": loss.detach(), f"{tag}grad_h": h.grad, f"{tag}grad_w": w.grad,
                    f"{tag}weight_shaped": tuple(w.shape) in seen.shapes}
        # a trainable head's gradient assumes the same upstream gradient on every rank: otherwise refused
        w = weight[start:stop].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(hidden[rank], w, labels[rank], vocab_start=start, chunk_rows=3)
        try:
            (loss * (rank + 1)).backward()
            got["unequal_upstream"] = "accepted"
        except RuntimeError as err:
            got["unequal_upstream"] = str(err)
        out[rank] = got
    finally:
        torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_give_one_processs_loss_and_gradients():
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    weight, hidden, labels = _data()
    w = weight.clone().requires_grad_()
    hs = [h.clone().requires_grad_() for h in hidden]
    losses = [torch.nn.functional.cross_entropy(_cap(h @ w.t()), y, ignore_index=-100) for h, y in zip(hs, labels)]
    torch.stack(losses).mean().backward()  # data parallel: the mean of the ranks' losses
    for rank in (0, 1):
        got = out[rank]
        torch.testing.assert_close(got["loss"], losses[rank].detach(), atol=1e-6, rtol=1e-6)
        # each rank's hidden gradient is its own loss's; FSDP2 averages what flows from it
        torch.testing.assert_close(got["grad_h"], 2 * hs[rank].grad, atol=1e-6, rtol=1e-5)
        start, stop = got["range"]
        torch.testing.assert_close(got["grad_w"], w.grad[start:stop], atol=1e-6, rtol=1e-5)
        # a frozen head (QLoRA's): the same loss and hidden gradient, and no head-sized gradient made
        torch.testing.assert_close(got["frozen_loss"], got["loss"], atol=0, rtol=0)
        torch.testing.assert_close(got["frozen_grad_h"], got["grad_h"], atol=1e-7, rtol=1e-6)
        assert got["frozen_grad_w"] is None and not got["frozen_weight_shaped"] and got["weight_shaped"]
        assert "same upstream gradient" in got["unequal_upstream"]
    assert out[0]["range"] == (0, 6) and out[1]["range"] == (6, 11)


def test_compiled_piece_arithmetic_equals_eager():
    """The compiled float32 arithmetic of a piece (used on GPUs) computes what the eager one does."""
    from qlora_nb_utils.ops import vocab_parallel as vp

    g = torch.Generator().manual_seed(1)
    raw, y = torch.randn(6, 9, generator=g) * 8, torch.tensor([3, 12, -100, 5, 9, 4])
    lse, row_scale = torch.randn(6, generator=g) + 10, torch.rand(6, generator=g)
    stats, grad = vp._piece_fns(True)
    for cap in (None, 3.0):
        for got, want in ((stats(raw, y, 4, 0.5, cap), vp._piece_stats(raw, y, 4, 0.5, cap)),
                          ((grad(raw, y, lse, row_scale, 4, 0.5, cap),), (vp._piece_grad(raw, y, lse, row_scale, 4,
                                                                                          0.5, cap),))):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="process group"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long),
                                     vocab_start=0)
    with pytest.raises(ValueError, match="rank < world_size <= vocab"):
        vocab_range(3, 0, 4)
    assert [vocab_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
