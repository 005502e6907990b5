"""A causal-LM loss that never holds the full logits: chunked linear + cross-entropy.

Why it exists: the last matmul of a Llama-3 model is by far the widest (vocabulary 128256),
and the standard path (``lm_head`` -> logits -> ``.float()`` -> ``F.cross_entropy``) keeps the
logits in bf16 and in fp32 plus the fp32 log-softmax for the backward: at batch 4 x 512 that
is 2048 x 128256 values at 2 + 4 + 4 bytes each, about 0.5 + 1 + 1 GiB, for a 1B model whose
NF4 weights take about 1 GiB. Here the tokens are
cut into ``chunks`` pieces; for each piece the forward computes its logits, its summed loss
*and already the gradient of that loss with respect to the hidden states* (softmax minus
one-hot, times the head), and keeps only that gradient. So at any time one chunk of fp32
logits exists, and what the backward needs is a tensor the size of the hidden states. The
cost: the head's input-gradient matmul moves from the backward into the forward (the same
FLOPs, done once), so the work is unchanged.

It is a ``torch.autograd.Function`` built from plain torch ops, so Dynamo traces it into the
same graph as the model (``fullgraph=True`` holds) and Inductor fuses the softmax arithmetic
around each chunk's matmul. The numbers are those of ``F.cross_entropy`` over
``logits.float()`` with ``reduction="mean"`` over non-ignored targets (what transformers'
``ForCausalLMLoss`` computes), checked in ``tests/test_peers.py`` for loss and gradients.
Liger-Kernel's fused linear cross-entropy and torchtune's chunked output loss are the same
idea. :class:`ChunkedLossLM` puts it in place of a PEFT causal LM's own loss, with what that
model's head does after ``hidden @ W^T`` (a bias, a logit scale, a soft cap; :mod:`.lm_head`
reads it from the model and checks it), so that the loss is the model's own.

**Labelled rows only.** On padded batches most target rows are ignored (the prompt and the
padding carry no label), yet the head's matmuls and the softmax ran over all of them: a
visible share of the step in the lab's profiles, and the fp32 chunks were the largest tensors
alive at the peak. :func:`labelled_rows` lists the rows that
carry a label, *outside* the compiled graph, padded up to a multiple of a bucket with an
index that reads as an ignored row; :func:`chunked_cross_entropy` (``rows=``) gathers just
those rows before the head. The loss and every gradient are the same (an ignored row adds
nothing to either), only the fp32 summation order differs. The bucket keeps the number of
distinct row counts small (at most 17 per batch shape), so a graph compiled with the count
dynamic (one compilation) meets few sizes.

:func:`chunked_token_log_probs` is the per-token form, for trainers that reduce the loss
themselves (TRL's ``SFTTrainer`` asks the model for each label's log-probability, the
next-token entropy and whether the label is the top-1 token, and sums them itself). Each
token's log-probability depends on its own row of hidden states only, so what the backward
needs is again one hidden-sized tensor, ``d log p / d hidden`` per row, scaled row by row by
the incoming gradient: any per-token weighting of the loss gets the exact gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .lm_head import LMHead, causal_lm_of, decoder_of, mapped, read_head
from .static_floats import with_static_floats

__all__ = ["IGNORE_INDEX", "ROW_BUCKETS", "CHUNK_MIN_ROWS", "labelled_rows", "chunked_cross_entropy", "chunked_token_log_probs", "TokenStats", "causal_lm_targets",
           "ChunkedLossLM"]

IGNORE_INDEX = -100
#: :func:`labelled_rows` rounds the row count up to a multiple of ``total / ROW_BUCKETS`` (at
#: least 64 rows): at most this many distinct counts per batch shape.
ROW_BUCKETS = 16
#: ``chunked_cross_entropy(min_chunk_rows=...)``'s value in :class:`ChunkedLossLM` (optimize()'s
#: loss in regional scope): fewer chunks while each would hold fewer rows. Splitting a few
#: hundred rows into more chunks saves peak memory but costs time, and more so the shorter the
#: chunk: a 128-row chunk is too short a matmul to fill the GPU (the lab's LoRA-concat
#: benchmark has the time and memory per chunk count).
CHUNK_MIN_ROWS = 512


def labelled_rows(labels: torch.Tensor, *, buckets: int = ROW_BUCKETS, multiple: int = 1,
                  ignore_index: int = IGNORE_INDEX, at_least: int = 0, overflow_to_all: bool = False,
                  shifted: bool = False) -> torch.Tensor:
    """The next-token target rows that carry a label, as indices for ``chunked_cross_entropy(rows=)``.

    Rows are numbered as :func:`causal_lm_targets` flattens them (``b * (S-1) + s`` predicts
    ``labels[b, s+1]``). The list is padded with ``total`` (one past the last row, which
    :func:`chunked_cross_entropy` reads as an ignored row) up to a multiple of
    ``ceil(total / buckets)`` rounded up to a multiple of 64 and of ``multiple``: every length
    is then divisible by the loss's chunk count, so a graph compiled with the length dynamic
    never guards on it. Reading the labels needs their values, so call it outside a compiled
    graph (on CUDA labels it waits for the device).

    Args:
        labels: ``(B, S)`` token ids with ``ignore_index`` where no loss is taken.
        buckets: how many sizes the padded count can take per batch shape (>= 1).
        multiple: the lengths are also multiples of this (the loss's ``chunks``; >= 1).
        ignore_index: the label value that is skipped.
        at_least: pad to at least this many rows (rounded up to the same step, at most every
            row's count): one length for every batch that needs no more, so CUDA graphs record
            one graph and not one per bucket (``optimize`` passes the most any batch shown needs).
        overflow_to_all: a count over ``at_least``'s length takes every row's length instead of
            its own bucket: two lengths at most (for a graph whose length is static).
        shifted: ``labels`` are already each position's next-token target (:func:`causal_lm_targets`'
            ``shifted``): rows are numbered ``b * S + s``.

    Returns:
        A 1-D int64 tensor on ``labels``' device.

    Raises:
        ValueError: ``labels`` not 2-D with at least 2 positions, ``buckets`` or ``multiple`` < 1,
            ``at_least`` < 0.
    """
    if labels.dim() != 2 or labels.shape[1] < (1 if shifted else 2):
        raise ValueError(f"labels must be (B, S) with S >= {1 if shifted else 2}, got shape {tuple(labels.shape)}")
    for name, value, low in (("buckets", buckets, 1), ("multiple", multiple, 1), ("at_least", at_least, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    valid = (labels if shifted else labels[:, 1:]).reshape(-1) != ignore_index
    rows = valid.nonzero().squeeze(1)
    n, total = rows.numel(), valid.numel()
    unit = math.lcm(64, multiple)
    per_bucket = -(-total // buckets)  # ceil division
    step = -(-per_bucket // unit) * unit
    floor = -(-max(1, min(at_least, total)) // step) * step
    cap = -(-max(n, floor) // step) * step
    if overflow_to_all and cap > floor:
        cap = -(-total // step) * step
    return torch.cat([rows, rows.new_full((cap - n,), total)])


def causal_lm_targets(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                      shifted: bool = False):
    """Shift for next-token prediction: positions ``0..S-2`` predict labels ``1..S-1``.

    Args:
        hidden: ``(B, S, D)`` final hidden states (after the final norm).
        labels: ``(B, S)`` token ids, ``ignore_index`` where no loss is taken.
        ignore_index: the label value that is skipped.
        shifted: ``labels[b, s]`` is already position ``s``'s target (HF's ``shift_labels``): no
            shift, every position predicts. A row split over ranks by position (context
            parallelism) needs this: a shard's last position predicts the next shard's first token.

    Returns:
        ``(hidden_2d, targets_1d)`` of shapes ``(B*(S-1), D)`` and ``(B*(S-1),)`` (``B*S`` rows when
        ``shifted``).
    """
    d = hidden.shape[-1]
    if shifted:
        return hidden.reshape(-1, d), labels.reshape(-1)
    return hidden[:, :-1, :].reshape(-1, d), labels[:, 1:].reshape(-1)


def _chunk_scores(logits, t, ignore_index: int):
    """One chunk's fp32 ``logits``: their log-softmax, the valid mask, safe targets and the target log-probs.

    ``log_softmax`` is the kernel ``F.cross_entropy`` runs, so that the recipe uncompiled computes
    the very numbers of the model's own loss. ``torch.logsumexp`` rounds otherwise on a CPU (its
    ``exp`` is the exact one; ``log_softmax``'s and Inductor's generated code use a faster one):
    over a 49k vocabulary in fp32 that alone moved the loss by 1e-5, where a rerun with the rows
    in another order moves it by 1e-6.
    """
    logp = torch.log_softmax(logits, dim=-1)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    return logp, valid, safe_t, logp.gather(1, safe_t.unsqueeze(1)).squeeze(1)


def _ce_math(raw: torch.Tensor, t: torch.Tensor, denom: torch.Tensor, ignore_index: int, want_grad: bool,
             scale: float = 1.0, softcap: float | None = None):
    """One chunk's summed CE over the model's logits from ``raw`` (``h @ W^T + b``) and, with
    ``want_grad``, its gradient to ``raw`` over ``denom``, in ``raw``'s dtype (zero on ignored rows)."""
    logits, dmap = mapped(raw, scale, softcap)
    logp, valid, safe_t, picked = _chunk_scores(logits, t, ignore_index)
    total = torch.where(valid, -picked, torch.zeros_like(picked)).sum()
    if not want_grad:
        return total, None
    # d(sum CE)/d logits = softmax - onehot, zero on ignored rows; the mean divides by count.
    g = torch.exp(logp)
    g = g.scatter_add(1, safe_t.unsqueeze(1), -torch.ones_like(picked).unsqueeze(1))
    g = g * (valid.unsqueeze(1) / denom)
    if dmap is not None:  # through the map: softcap's 1 - tanh^2, the scale
        g = g * dmap
    return total, g.to(raw.dtype)


#: ``_ce_math`` compiled once per process, for losses computed outside a compiled graph (:func:`_math`).
_COMPILED_MATH: dict = {}


def _math(compiled: bool):
    """``_ce_math``, or (``compiled`` and not already inside a graph being traced) its compiled form."""
    if not compiled or torch.compiler.is_compiling():
        return _ce_math
    if "fn" not in _COMPILED_MATH:
        # its floats (scale, softcap) constants: no restarted trace on a cold compile
        _COMPILED_MATH["fn"] = with_static_floats(torch.compile(_ce_math, dynamic=True, fullgraph=True))
    return _COMPILED_MATH["fn"]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean CE of the model's logits from ``hidden @ weight.T + bias``; gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunks: int, ignore_index: int, want_hidden: bool,
                want_weight: bool, compiled_math: bool = False, min_chunk_rows: int = 0, scale: float = 1.0,
                softcap: float | None = None):
        if min_chunk_rows and not torch.compiler.is_compiling():  # concrete row count: no guard on it
            chunks = max(1, min(chunks, -(-hidden.shape[0] // min_chunk_rows)))
        count = (targets != ignore_index).sum()
        denom = count.clamp(min=1).to(torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        want_bias = want_weight and bias is not None and bias.requires_grad
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        total = hidden.new_zeros((), dtype=torch.float32)
        math_fn = _math(compiled_math)
        # tensor_split gives exactly `chunks` pieces whatever the length (the last ones may be
        # shorter or empty), so the loop never depends on the token count: under dynamic shapes
        # Dynamo keeps the length symbolic instead of specialising on it.
        pieces = []
        want = want_hidden or want_weight
        for h, t in zip(hidden.tensor_split(chunks), targets.tensor_split(chunks)):
            if compiled_math and h.shape[0] == 0:
                continue  # an empty piece adds nothing (and would specialise the compiled arithmetic)
            chunk_total, g = math_fn(F.linear(h, weight, bias), t, denom, ignore_index, want, scale, softcap)
            total = total + chunk_total
            if not want:
                continue
            if want_hidden:
                pieces.append(g @ weight)
            if grad_weight is not None:
                grad_weight += (g.t() @ h).float()
            if grad_bias is not None:
                grad_bias += g.float().sum(0)
        grad_hidden = (torch.cat(pieces) if pieces else hidden.new_zeros(hidden.shape)) if want_hidden else None
        empty = hidden.new_empty(0)
        ctx.save_for_backward(*(g if g is not None else empty for g in (grad_hidden, grad_weight, grad_bias)))
        ctx.weight_dtype = weight.dtype
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        gh = grad_hidden * grad_out.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        gb = (grad_bias * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[2] and grad_bias.numel() else None
        return gh, gw, gb, None, None, None, None, None, None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          chunks: int = 4, ignore_index: int = IGNORE_INDEX,
                          rows: torch.Tensor | None = None, compiled_math: bool = False,
                          min_chunk_rows: int = 0, bias: torch.Tensor | None = None,
                          logit_scale: float = 1.0, softcap: float | None = None,
                          shifted: bool = False) -> torch.Tensor:
    """Causal-LM loss of an LM head without materialising all logits.

    Equal to ``F.cross_entropy(logits.float(), labels[:, 1:], ignore_index=ignore_index)`` (mean
    over non-ignored targets), gradients included, where ``logits`` are what the model's head
    makes of ``hidden[:, :-1]``: ``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap)``,
    each part only where given (see the module docstring for what is kept instead of the logits).

    Args:
        hidden: ``(B, S, D)`` final hidden states.
        weight: ``(V, D)`` LM-head weight (frozen in (Q)LoRA; a weight that requires grad gets
            its gradient too).
        labels: ``(B, S)`` token ids with ``ignore_index`` where no loss is taken.
        chunks: how many pieces the ``B*(S-1)`` token rows (or ``rows``) are cut into (>= 1).
        ignore_index: label value to skip.
        rows: the target rows to compute, from :func:`labelled_rows` (None: all of them); the
            result is the same as long as every labelled row is among them.
        compiled_math: when the loss runs outside a compiled graph (``optimize(scope="regional")``
            compiles the decoder layers only), compile each chunk's softmax arithmetic once
            (``torch.compile``, dynamic lengths): one fused kernel pass instead of about ten eager
            kernels over the fp32 logits. Inside a graph being traced it changes nothing.
        min_chunk_rows: outside a graph being traced, use fewer than ``chunks`` pieces while
            each would have fewer rows than this (0: always ``chunks``; :data:`CHUNK_MIN_ROWS`
            says why). A piece then never holds more rows than ``max(min_chunk_rows, rows / chunks)``.
        bias: ``(V,)`` the head's output bias, or None (it gets its gradient when it requires one
            and ``weight`` does too).
        logit_scale: the factor the model multiplies its logits by (Cohere's ``logit_scale``,
            one over Granite's ``logits_scaling``); 1: none.
        softcap: the model's final-logit soft cap (Gemma-2/3's ``final_logit_softcapping``), or None.
        shifted: ``labels`` are each position's target already (:func:`causal_lm_targets`); ``rows``
            then from ``labelled_rows(..., shifted=True)``.

    Returns:
        The scalar fp32 loss.

    Raises:
        ValueError: ``chunks`` < 1, shapes that do not fit together, a scale or cap that is not a
            finite number > 0.
    """
    _check_head_inputs(hidden, weight, labels, chunks, bias, logit_scale, softcap)
    h, t = causal_lm_targets(hidden, labels, ignore_index, shifted)
    if rows is not None:  # index total (the padding of labelled_rows) reads row total-1, ignored
        inside = rows < t.shape[0]
        safe = rows.clamp(max=t.shape[0] - 1)
        h = h.index_select(0, safe)
        t = torch.where(inside, t.index_select(0, safe), torch.full_like(safe, ignore_index))
    grad_on = torch.is_grad_enabled()
    return _ChunkedLinearCrossEntropy.apply(h, weight, bias, t, chunks, ignore_index, grad_on and h.requires_grad,
                                            grad_on and weight.requires_grad, bool(compiled_math),
                                            int(min_chunk_rows), float(logit_scale),
                                            None if softcap is None else float(softcap))


class TokenStats(NamedTuple):
    """Per-token results of :func:`chunked_token_log_probs`, each ``(B, S-1)``, zero where ignored."""

    log_probs: torch.Tensor  #: log-probability of each next-token label (fp32, differentiable)
    entropy: torch.Tensor  #: entropy of the next-token distribution (fp32, no gradient)
    is_top1: torch.Tensor  #: the label is the most likely token (bool)
    label_mask: torch.Tensor  #: the label is not ignored (bool)


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """Per-token ``log_softmax(logits)[label]``, entropy and top-1 of the model's logits, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunks: int, ignore_index: int, want_hidden: bool,
                scale: float = 1.0, softcap: float | None = None):
        log_probs, entropies, tops, grads = [], [], [], []
        for h, t in zip(hidden.tensor_split(chunks), targets.tensor_split(chunks)):
            logits, dmap = mapped(F.linear(h, weight, bias), scale, softcap)
            logp, valid, safe_t, picked = _chunk_scores(logits, t, ignore_index)
            probs = torch.exp(logp)
            zero = torch.zeros_like(picked)
            log_probs.append(torch.where(valid, picked, zero))
            entropies.append(torch.where(valid, -(probs * logp).sum(-1), zero))
            tops.append((logits.argmax(-1) == t) & valid)
            if want_hidden:  # d log p[label] / d logits = onehot - softmax, zero on ignored rows
                g = (-probs).scatter_add(1, safe_t.unsqueeze(1), torch.ones_like(picked).unsqueeze(1))
                g = g * valid.unsqueeze(1)
                if dmap is not None:
                    g = g * dmap
                grads.append(g.to(hidden.dtype) @ weight)
        entropy, top1 = torch.cat(entropies), torch.cat(tops)
        ctx.save_for_backward(torch.cat(grads) if want_hidden else hidden.new_empty(0))
        ctx.mark_non_differentiable(entropy, top1)
        return torch.cat(log_probs), entropy, top1

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_entropy, _grad_top1):
        (d_hidden,) = ctx.saved_tensors
        gh = d_hidden * grad_log_probs.unsqueeze(1).to(d_hidden.dtype) if ctx.needs_input_grad[0] else None
        return gh, None, None, None, None, None, None, None, None


def chunked_token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                            chunks: int = 4, ignore_index: int = IGNORE_INDEX, bias: torch.Tensor | None = None,
                            logit_scale: float = 1.0, softcap: float | None = None) -> TokenStats:
    """Each next-token label's log-probability under an LM head, without all the logits at once.

    ``log_probs`` equals ``log_softmax(logits.float())`` at ``labels[:, 1:]`` (0 where the label
    is ignored), with its gradient to ``hidden``, where ``logits`` are the head's as in
    :func:`chunked_cross_entropy` (bias, scale, soft cap); ``-log_probs.sum() / n`` is the mean
    cross-entropy. The LM head must be frozen (as in (Q)LoRA): a per-token gradient to the
    head's weight would need every chunk's logits kept.

    Args:
        hidden: ``(B, S, D)`` final hidden states.
        weight: ``(V, D)`` LM-head weight, frozen.
        labels: ``(B, S)`` token ids with ``ignore_index`` where no loss is taken.
        chunks: how many pieces the ``B*(S-1)`` token rows are cut into (>= 1).
        ignore_index: label value to skip.
        bias, logit_scale, softcap: the head's, as in :func:`chunked_cross_entropy`.

    Returns:
        A :class:`TokenStats` of ``(B, S-1)`` tensors.

    Raises:
        ValueError: ``chunks`` < 1, shapes that do not fit, a bad scale or cap, or a head weight
            or bias that requires grad.
    """
    _check_head_inputs(hidden, weight, labels, chunks, bias, logit_scale, softcap)
    if torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad)):
        raise ValueError("chunked_token_log_probs needs a frozen LM head (its weight or bias requires grad); "
                         "use chunked_cross_entropy, which also computes the head's gradient")
    h, t = causal_lm_targets(hidden, labels, ignore_index)
    want = torch.is_grad_enabled() and h.requires_grad
    log_probs, entropy, top1 = _ChunkedTokenLogProbs.apply(h, weight, bias, t, chunks, ignore_index, want,
                                                           float(logit_scale),
                                                           None if softcap is None else float(softcap))
    shape = labels[:, 1:].shape
    return TokenStats(log_probs.view(shape), entropy.view(shape), top1.view(shape), t.view(shape) != ignore_index)


def _check_head_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunks: int,
                       bias: torch.Tensor | None = None, logit_scale: float = 1.0,
                       softcap: float | None = None) -> None:
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2] or weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"expected hidden (B, S, D), labels (B, S), weight (V, D); got "
                         f"{tuple(hidden.shape)}, {tuple(labels.shape)}, {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != tuple(weight.shape[:1]):
        raise ValueError(f"bias must be (V,) = {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
    if torch.compiler.is_compiling():  # checked when the module was built and on the eager calls
        return
    for name, value in (("logit_scale", logit_scale), ("softcap", softcap)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


class ChunkedLossLM(torch.nn.Module):
    """A PEFT causal LM whose loss is :func:`~qlora_nb_utils.ops.losses.chunked_cross_entropy`.

    ``forward(input_ids, attention_mask, labels)`` runs the decoder stack, then the chunked
    head + loss; it returns a ``CausalLMOutputWithPast`` holding only ``loss``, so it drops into
    :func:`qlora_nb_utils.training.train` and :func:`qlora_nb_utils.compile.prepare_for_compile`.
    With ``token_stats=True`` it returns the :class:`TokenStats` of
    :func:`chunked_token_log_probs` instead (for trainers that reduce per-token losses themselves).
    ``loss_rows`` (from :func:`labelled_rows`) limits the head and the loss to those rows.
    ``shift_labels`` (instead of ``labels``) gives each position's target already shifted, as
    transformers' losses take it: a row split over ranks by position (context parallelism) shifts
    before it is split, so that a shard's last position keeps its target.
    ``compiled_math``: :func:`chunked_cross_entropy`'s, for a loss run outside a compiled graph.
    ``min_chunk_rows``: :func:`chunked_cross_entropy`'s (0: always ``chunks`` pieces).
    ``head``: what the model's head does after ``hidden @ W^T`` (:class:`~.lm_head.LMHead`); None
    reads it from the model and checks it on a probe forward (:func:`~.lm_head.read_head`), and
    refuses a head it cannot reproduce.

    Sharded by vocabulary (:meth:`split_vocab`): the head's weight holds this rank's vocabulary
    rows only, and the loss is :func:`~.vocab_parallel.vocab_parallel_cross_entropy` over the
    labelled rows (every rank must call ``forward`` together: the loss communicates).

    Raises:
        ValueError: ``head`` is None and the model's head does something the chunked loss does
            not reproduce (the message says what).
    """

    #: set by :meth:`split_vocab`: ``{"start", "stop", "vocab", "group"}``, or None (the whole head)
    vocab_split: dict | None = None

    def __init__(self, model: torch.nn.Module, chunks: int = 4, compiled_math: bool = False,
                 min_chunk_rows: int = 0, head: LMHead | None = None) -> None:
        super().__init__()
        self.model = model
        self.chunks = chunks
        self.compiled_math = compiled_math
        self.min_chunk_rows = min_chunk_rows
        if head is None:
            head = read_head(model)
            if not head.reproduced:
                raise ValueError(f"the chunked loss cannot compute this model's loss: {head.why}")
        self.head = head

    def split_vocab(self, rank: int, world_size: int, group=None) -> tuple[int, int]:
        """Keep this rank's vocabulary rows of the head's weight (``vocab_parallel.vocab_range``) and
        compute the loss vocabulary-parallel from now on; returns the rows ``(start, stop)``.

        Raises:
            ValueError: the head has a bias, shares its weight with the input embedding, or is split already.
        """
        from .vocab_parallel import vocab_range

        causal_lm = causal_lm_of(self.model)
        out = causal_lm.get_output_embeddings()
        if self.vocab_split is not None:
            raise ValueError("the head is split by vocabulary already")
        if out.bias is not None:
            raise ValueError("a vocabulary-parallel head with a bias is not supported")
        emb = causal_lm.get_input_embeddings()
        if emb is not None and emb.weight is out.weight:
            raise ValueError("the LM head shares its weight with the input embedding (tied): the embedding needs "
                             "every row, so the head cannot be split by vocabulary")
        vocab = out.weight.shape[0]
        start, stop = vocab_range(vocab, rank, world_size)
        out.weight = torch.nn.Parameter(out.weight.detach()[start:stop].clone(), requires_grad=out.weight.requires_grad)
        self.vocab_split = {"start": start, "stop": stop, "vocab": vocab, "group": group}
        return start, stop

    def _vocab_parallel_loss(self, hidden, weight, labels, shifted=False):
        from .vocab_parallel import vocab_parallel_cross_entropy

        h, y = causal_lm_targets(hidden, labels, IGNORE_INDEX, shifted)
        keep = (y != IGNORE_INDEX).nonzero()[:, 0]
        return vocab_parallel_cross_entropy(h[keep], weight, y[keep], vocab_start=self.vocab_split["start"],
                                            chunk_rows=1024, logit_scale=self.head.scale, softcap=self.head.softcap,
                                            group=self.vocab_split["group"])

    def forward(self, input_ids, attention_mask=None, labels=None, token_stats: bool = False,
                loss_rows=None, shift_labels=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        shifted = shift_labels is not None  # each position's target given (a row split by position)
        if shifted:
            if token_stats:
                raise ValueError("per-token statistics take labels, not shift_labels")
            labels = shift_labels
        causal_lm = causal_lm_of(self.model)
        hidden = decoder_of(causal_lm)(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        out = causal_lm.get_output_embeddings()
        if self.vocab_split is not None:
            if token_stats:
                raise ValueError("per-token statistics need the whole vocabulary: not with a split head")
            return CausalLMOutputWithPast(loss=self._vocab_parallel_loss(hidden, out.weight, labels, shifted))
        head = {"bias": out.bias, "logit_scale": self.head.scale, "softcap": self.head.softcap}
        if token_stats:
            return chunked_token_log_probs(hidden, out.weight, labels, chunks=self.chunks, **head)
        return CausalLMOutputWithPast(loss=chunked_cross_entropy(hidden, out.weight, labels, chunks=self.chunks,
                                                                 rows=loss_rows, compiled_math=self.compiled_math,
                                                                 min_chunk_rows=self.min_chunk_rows, shifted=shifted,
                                                                 **head))


def reference_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                            ignore_index: int = IGNORE_INDEX, *, bias: torch.Tensor | None = None,
                            logit_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """The standard path, for comparison: full logits, the head's map, ``.float()``, ``F.cross_entropy``."""
    h, t = causal_lm_targets(hidden, labels, ignore_index)
    logits = F.linear(h, weight, bias).float() * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, t, ignore_index=ignore_index)
