"""Cross-entropy over a vocabulary split across ranks: the LM head is never gathered whole.

Why: under FSDP2 the LM head's weight (vocabulary x hidden, 1 GiB in bf16 at Llama-3-8B's 128k
vocabulary) is sharded like any other, so the loss must all-gather it, and the unit that owns it
(the root) keeps it gathered through the forward: the whole head sits on every GPU at the step's
peak. Splitting the head by vocabulary rows instead (each rank keeps its contiguous rows, outside
FSDP2's sharding: ``fully_shard(..., ignored_params={head.weight})``), the loss can be computed
without any rank holding the whole head:

* every rank's labelled hidden rows are all-gathered (rows x hidden: small beside the head);
* each rank computes the logits of every row against its own vocabulary rows, in pieces of
  ``chunk_rows`` rows, and the per-row maximum and sum of exponentials are all-reduced into the
  log-sum-exp; the target's logit comes from the rank that owns it (an all-reduced sum);
* each rank's loss is the mean over its own labelled rows, as data parallelism has it.

In the backward the upstream gradients of all rows are all-gathered, each rank recomputes its
pieces' logits (none is kept: memory is one piece, as in the chunked loss), forms
``(softmax - onehot) x grad`` on its vocabulary rows, and from it the gradient of its head rows
(complete: it saw every row; none at all for a frozen head, as QLoRA's is) and its partial
gradient of every hidden row, one owner's rows at a time, which a reduce sums over the
vocabulary shards on the row's owner (memory: one rank's rows in float32, not every rank's). The head
gradient is the sum of every rank's loss gradient divided by the world size: the average FSDP2
gives the sharded parameters.

``logit_fn``: what the model's head does to ``hidden @ W^T`` elementwise (a scale, a soft cap,
``ops.lm_head.read_head``), applied to each shard's logits; its gradient comes from autograd on
the recomputed piece. An elementwise function is exact under the vocabulary split; anything that
mixes the vocabulary (a softmax temperature learned per row, say) is not.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["vocab_range", "vocab_parallel_cross_entropy"]


def vocab_range(vocab: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous rows ``[start, stop)`` of a ``vocab``-row head that ``rank`` keeps (the first
    ``vocab % world_size`` ranks one row more)."""
    if world_size < 1 or not 0 <= rank < world_size or vocab < world_size:
        raise ValueError(f"need 0 <= rank < world_size <= vocab, got rank {rank}, world_size {world_size}, "
                         f"vocab {vocab}")
    base, extra = divmod(vocab, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _gather_rows(x: torch.Tensor, rows: int, group, fill: float = 0) -> torch.Tensor:
    """Every rank's ``x`` (first dimension padded to ``rows`` with ``fill``), stacked in rank order."""
    pad = torch.full((rows - x.shape[0], *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    local = torch.cat([x, pad]).contiguous()
    out = torch.empty((dist.get_world_size(group) * rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, local, group=group)
    return out


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, start, chunk_rows, logit_fn, group):
        world, n = dist.get_world_size(group), hidden.shape[0]
        counts = torch.tensor([n], device=hidden.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
        rows = int(counts.item())
        all_h = _gather_rows(hidden.detach(), rows, group)
        all_y = _gather_rows(labels, rows, group, fill=-100)  # padded rows are ignored
        stop = start + weight.shape[0]
        lse = torch.empty(all_h.shape[0], dtype=torch.float32, device=hidden.device)
        target = torch.zeros_like(lse)
        for lo in range(0, all_h.shape[0], chunk_rows):
            z = logit_fn(all_h[lo:lo + chunk_rows] @ weight.detach().t()).float()
            y = all_y[lo:lo + chunk_rows]
            mx = z.max(dim=1).values
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
            se = (z - mx[:, None]).exp().sum(dim=1)
            dist.all_reduce(se, group=group)
            lse[lo:lo + chunk_rows] = mx + se.log()
            mine = (y >= start) & (y < stop)
            picked = z.gather(1, (y - start).clamp(0, weight.shape[0] - 1)[:, None])[:, 0]
            target[lo:lo + chunk_rows] = torch.where(mine, picked, torch.zeros_like(picked))
        dist.all_reduce(target, group=group)
        rank = dist.get_rank(group)
        own = slice(rank * rows, rank * rows + n)
        valid = labels != -100
        per_row = torch.where(valid, lse[own] - target[own], torch.zeros_like(lse[own]))
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(all_h, all_y, lse, weight)
        ctx.meta = (start, chunk_rows, logit_fn, group, rows, n, world)
        ctx.count = count
        return per_row.sum() / count

    @staticmethod
    def backward(ctx, grad_out):
        all_h, all_y, lse, weight = ctx.saved_tensors
        start, chunk_rows, logit_fn, group, rows, n, world = ctx.meta
        # every rank's per-row upstream gradient: its own loss's, 1 / its labelled rows
        g_local = torch.zeros(rows, dtype=torch.float32, device=all_h.device)
        g_local[:n] = (grad_out.float() / ctx.count)
        g_all = torch.empty(world * rows, dtype=torch.float32, device=all_h.device)
        dist.all_gather_into_tensor(g_all, g_local, group=group)
        g_all = torch.where(all_y != -100, g_all, torch.zeros_like(g_all))
        need_w = ctx.needs_input_grad[1]  # a frozen head (QLoRA's): no head gradient at all
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        rank = dist.get_rank(group)
        mine_h = None
        for block in range(world):  # one owner's rows at a time: memory is one block, not every row
            first = block * rows
            grad_h = torch.zeros((rows, all_h.shape[1]), dtype=torch.float32, device=all_h.device)
            for lo in range(first, first + rows, chunk_rows):
                hi = min(lo + chunk_rows, first + rows)
                with torch.enable_grad():
                    h = all_h[lo:hi].detach().requires_grad_()
                    w = weight.detach().requires_grad_(need_w)
                    z = logit_fn(h @ w.t())
                y = all_y[lo:hi]
                dz = (z.detach().float() - lse[lo:hi, None]).exp()
                mine = (y >= start) & (y < start + weight.shape[0])
                idx = (y - start).clamp(0, weight.shape[0] - 1)
                hit = mine.nonzero()[:, 0]
                dz[hit, idx[hit]] -= 1.0
                dz *= g_all[lo:hi, None]
                grads = torch.autograd.grad(z, (h, w) if need_w else (h,), dz.to(z.dtype))
                grad_h[lo - first:hi - first] = grads[0].float()
                if need_w:
                    grad_w += grads[1].float()
            # the row's partial gradients summed over the vocabulary shards, on the row's owner
            owner = block if group is None else dist.get_global_rank(group, block)
            dist.reduce(grad_h, dst=owner, group=group)
            if block == rank:
                mine_h = grad_h
        grad_w = (grad_w / world).to(weight.dtype) if need_w else None
        return (mine_h[:n].to(all_h.dtype), grad_w, None, None, None, None, None)


def vocab_parallel_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor, *,
                                 vocab_start: int, chunk_rows: int = 1024,
                                 logit_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                                 group=None) -> torch.Tensor:
    """This rank's mean cross-entropy over its labelled rows, the head split by vocabulary (module docstring).

    Args:
        hidden: this rank's rows, ``[rows, hidden]`` (the rows to predict from: already shifted).
        weight_shard: this rank's head rows ``[stop - vocab_start, hidden]`` (:func:`vocab_range`).
        labels: the target of each row, ``[rows]`` (global vocabulary ids; -100: ignored).
        vocab_start: the first vocabulary id ``weight_shard`` holds.
        chunk_rows: rows per piece of logits (the memory of the loss).
        logit_fn: what the head does to ``hidden @ W^T`` elementwise (None: nothing).
        group: the process group (None: the default).

    Raises:
        ValueError: shapes that do not fit, ``chunk_rows`` < 1, or no process group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("vocab_parallel_cross_entropy needs an initialised process group (torch.distributed)")
    if hidden.dim() != 2 or weight_shard.dim() != 2 or hidden.shape[1] != weight_shard.shape[1]:
        raise ValueError(f"need hidden [rows, h] and weight_shard [vocab rows, h]; got {tuple(hidden.shape)} and "
                         f"{tuple(weight_shard.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [rows] = {tuple(hidden.shape[:1])}, got {tuple(labels.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return _VocabParallelCE.apply(hidden, weight_shard, labels, int(vocab_start), int(chunk_rows),
                                  logit_fn or (lambda z: z), group)
