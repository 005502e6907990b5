"""Cross-entropy over a vocabulary split across ranks: the LM head is never gathered whole.

Why: under FSDP2 the LM head's weight (vocabulary x hidden, 1 GiB in bf16 at Llama-3-8B's 128k
vocabulary) is sharded like any other, so the loss must all-gather it, and the unit that owns it
(the root) keeps it gathered through the forward: the whole head sits on every GPU at the step's
peak. Splitting the head by vocabulary rows instead (each rank keeps its contiguous rows, outside
FSDP2's sharding: ``fully_shard(..., ignored_params={head.weight})``), the loss can be computed
without any rank holding the whole head:

* every rank's labelled hidden rows are all-gathered (rows x hidden: small beside the head);
* each rank computes the logits of every row against its own vocabulary rows, in pieces of
  ``chunk_rows`` rows, and every rank's per-row maximum and sum of exponentials are
  all-gathered and combined into the log-sum-exp; the target's logit comes from the rank that
  owns it (an all-reduced sum);
* each rank's loss is the mean over its own labelled rows, as data parallelism has it.

The gradient is made in the forward, as :mod:`.losses`' chunked loss makes it: once a piece's
log-sum-exp is known, each rank forms ``(softmax - onehot) / labelled rows`` on its vocabulary
rows and from it its share of every row's hidden gradient and (for a trainable head) of its head
rows' gradient, so no logits are recomputed in the backward and no gathered rows are kept for
it. One reduce-scatter at the end sums the shares of every row over the vocabulary shards on the
row's owner. The head gradient is the sum of every rank's loss gradient divided by the world
size (the average FSDP2 gives the sharded parameters), which assumes the same upstream gradient
on every rank (``loss.backward()``); the backward checks it for a trainable head and refuses
otherwise. A frozen head (QLoRA's) gets no gradient at all and no weight-sized buffer.

The per-piece float32 arithmetic (max, exponentials, the one-hot subtraction) is compiled on a
GPU: eager, it is about ten passes over each piece of logits.

``logit_scale`` and ``softcap``: what the model's head does to ``hidden @ W^T`` elementwise
(:class:`~.lm_head.LMHead`), applied to each shard's logits: exact under the vocabulary split,
as every elementwise map is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .lm_head import mapped

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


def _piece_stats(raw: torch.Tensor, y: torch.Tensor, start: int, scale: float, softcap: float | None):
    """One piece's logits on this rank's vocabulary rows (``raw = h @ W_k^T``, through the head's map):
    the per-row maximum, the sum of ``exp(z - max)``, and the target's logit where this rank owns
    the target (0 elsewhere), all in float32."""
    z, _ = mapped(raw, scale, softcap)
    mx = z.amax(dim=1)
    se = torch.exp(z - mx[:, None]).sum(dim=1)
    mine = (y >= start) & (y < start + z.shape[1])
    picked = z.gather(1, (y - start).clamp(0, z.shape[1] - 1)[:, None])[:, 0]
    return mx, se, torch.where(mine, picked, torch.zeros_like(picked))


def _piece_grad(raw: torch.Tensor, y: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor, start: int,
                scale: float, softcap: float | None) -> torch.Tensor:
    """``d loss / d raw`` of one piece on this rank's vocabulary rows: ``(softmax - onehot) * row_scale``
    (0 on ignored rows), through the head's map, in ``raw``'s dtype."""
    z, dmap = mapped(raw, scale, softcap)
    g = torch.exp(z - lse[:, None])
    mine = (y >= start) & (y < start + z.shape[1])
    g = g.scatter_add(1, (y - start).clamp(0, z.shape[1] - 1)[:, None], -mine.to(g.dtype)[:, None])
    g = g * row_scale[:, None]
    if dmap is not None:
        g = g * dmap
    return g.to(raw.dtype)


#: the piece arithmetic compiled once per process (:func:`_piece_fns`)
_COMPILED: dict = {}


def _piece_fns(compiled: bool):
    """``(_piece_stats, _piece_grad)``, or their compiled forms: about ten float32 passes over each
    piece of logits fused into one read of it, each, with the lengths dynamic (one compilation each)."""
    if not compiled:
        return _piece_stats, _piece_grad
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(_piece_stats, dynamic=True, fullgraph=True)
        _COMPILED["grad"] = torch.compile(_piece_grad, dynamic=True, fullgraph=True)
    return _COMPILED["stats"], _COMPILED["grad"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, start, chunk_rows, scale, softcap, compiled, group):
        world, n, rank = dist.get_world_size(group), hidden.shape[0], dist.get_rank(group)
        counts = torch.tensor([n], device=hidden.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
        rows = int(counts.item())
        all_h = _gather_rows(hidden.detach(), rows, group)
        all_y = _gather_rows(labels, rows, group, fill=-100)  # padded rows are ignored
        w = weight.detach()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # each row's share of its owner's mean: 1 / the owner's labelled rows (0 on ignored rows)
        valid = all_y != -100
        per_owner = valid.view(world, rows).sum(dim=1).clamp(min=1).to(torch.float32)
        row_scale = valid.to(torch.float32) / per_owner.repeat_interleave(rows)
        stats_fn, grad_fn = _piece_fns(compiled)
        lse = torch.empty(all_h.shape[0], dtype=torch.float32, device=hidden.device)
        target = torch.empty_like(lse)
        part_h = torch.empty_like(all_h) if need_h else None  # this rank's share of every row's gradient
        grad_w = torch.zeros_like(w, dtype=torch.float32) if need_w else None
        for lo in range(0, all_h.shape[0], chunk_rows):
            h, y = all_h[lo:lo + chunk_rows], all_y[lo:lo + chunk_rows]
            raw = h @ w.t()
            mx, se, target[lo:lo + h.shape[0]] = stats_fn(raw, y, start, scale, softcap)
            # every rank's (max, sum) of the piece, combined into the log-sum-exp over the whole vocabulary
            both = torch.empty((world * 2 * h.shape[0],), dtype=torch.float32, device=hidden.device)
            dist.all_gather_into_tensor(both, torch.cat([mx, se]), group=group)
            both = both.view(world, 2, h.shape[0])
            top = both[:, 0].amax(dim=0)
            lse[lo:lo + h.shape[0]] = top + (both[:, 1] * torch.exp(both[:, 0] - top)).sum(dim=0).log()
            if need_h or need_w:
                g = grad_fn(raw, y, lse[lo:lo + h.shape[0]], row_scale[lo:lo + h.shape[0]], start, scale, softcap)
                if need_h:
                    torch.matmul(g, w, out=part_h[lo:lo + h.shape[0]])
                if need_w:
                    grad_w += (g.t() @ h).float()
        dist.all_reduce(target, group=group)  # each target's logit, from the rank that owns it
        own = slice(rank * rows, rank * rows + n)
        loss = torch.where(valid[own], lse[own] - target[own], torch.zeros_like(lse[own])).sum() / per_owner[rank]
        grad_h = None
        if need_h:  # every row's shares summed over the vocabulary shards, on the row's owner
            grad_h = torch.empty((rows, all_h.shape[1]), dtype=all_h.dtype, device=all_h.device)
            dist.reduce_scatter_tensor(grad_h, part_h, group=group)
            grad_h = grad_h[:n]
        empty = hidden.new_empty(0)
        ctx.save_for_backward(grad_h if need_h else empty, grad_w if need_w else empty)
        ctx.group, ctx.weight_dtype, ctx.world = group, weight.dtype, world
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            # the head's gradient was summed over every rank's rows in the forward, for an upstream
            # gradient that is the same on every rank (``loss.backward()``, or the loss scaled alike
            # everywhere); anything else would need each rank's rows apart, so it is refused
            seen = torch.empty(ctx.world, dtype=torch.float32, device=grad_out.device)
            dist.all_gather_into_tensor(seen, grad_out.detach().float().reshape(1), group=ctx.group)
            if not bool((seen == seen[0]).all()):
                raise RuntimeError("a trainable vocabulary-split head needs the same upstream gradient of the loss "
                                   f"on every rank (the ranks gave {seen.tolist()}): call backward on the loss "
                                   "itself, or scale it alike on every rank")
            gw = (grad_w * (grad_out.float() / ctx.world)).to(ctx.weight_dtype)
        return gh, gw, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor, *,
                                 vocab_start: int, chunk_rows: int = 1024, logit_scale: float = 1.0,
                                 softcap: float | None = None, compiled_math: bool | None = None,
                                 group=None) -> torch.Tensor:
    """This rank's mean cross-entropy over its labelled rows, the head split by vocabulary (module docstring).

    Args:
        hidden: this rank's rows, ``[rows, hidden]`` (the rows to predict from: already shifted).
        weight_shard: this rank's head rows ``[stop - vocab_start, hidden]`` (:func:`vocab_range`).
        labels: the target of each row, ``[rows]`` (global vocabulary ids; -100: ignored).
        vocab_start: the first vocabulary id ``weight_shard`` holds.
        chunk_rows: rows per piece of logits (the memory of the loss).
        logit_scale, softcap: what the head does to ``hidden @ W^T`` (``c * tanh(s * z / c)``;
            :class:`~.lm_head.LMHead`).
        compiled_math: compile the float32 arithmetic of each piece (None: on a GPU).
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
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if compiled_math is None:
        compiled_math = hidden.is_cuda
    return _VocabParallelCE.apply(hidden, weight_shard, labels, int(vocab_start), int(chunk_rows), float(logit_scale),
                                  None if softcap is None else float(softcap), bool(compiled_math), group)
