"""A causal-LM loss that never holds the full logits: chunked linear + cross-entropy.

Why it exists: the last matmul of a Llama-3 model is by far the widest (vocabulary 128256),
and the standard path (``lm_head`` -> logits -> ``.float()`` -> ``F.cross_entropy``) keeps the
logits in bf16 and in fp32 plus the fp32 log-softmax for the backward: at batch 4 x 512 that
is about 0.5 + 1 + 1 GiB for a 1B model whose NF4 weights take 1 GiB. Here the tokens are
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
idea. :class:`ChunkedLossLM` puts it in place of a PEFT causal LM's own loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy", "causal_lm_targets", "ChunkedLossLM"]

IGNORE_INDEX = -100


def causal_lm_targets(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """Shift for next-token prediction: positions ``0..S-2`` predict labels ``1..S-1``.

    Args:
        hidden: ``(B, S, D)`` final hidden states (after the final norm).
        labels: ``(B, S)`` token ids, ``ignore_index`` where no loss is taken.
        ignore_index: the label value that is skipped.

    Returns:
        ``(hidden_2d, targets_1d)`` of shapes ``(B*(S-1), D)`` and ``(B*(S-1),)``.
    """
    d = hidden.shape[-1]
    return hidden[:, :-1, :].reshape(-1, d), labels[:, 1:].reshape(-1)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean CE of ``(hidden @ weight.T).float()``; gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunks: int, ignore_index: int,
                want_hidden: bool, want_weight: bool):
        count = (targets != ignore_index).sum()
        denom = count.clamp(min=1).to(torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        total = hidden.new_zeros((), dtype=torch.float32)
        # tensor_split gives exactly `chunks` pieces whatever the length (the last ones may be
        # shorter or empty), so the loop never depends on the token count: under dynamic shapes
        # Dynamo keeps the length symbolic instead of specialising on it.
        pieces = []
        for h, t in zip(hidden.tensor_split(chunks), targets.tensor_split(chunks)):
            logits = (h @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            valid = t != ignore_index
            safe_t = torch.where(valid, t, torch.zeros_like(t))
            picked = logits.gather(1, safe_t.unsqueeze(1)).squeeze(1)
            total = total + torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
            if not (want_hidden or want_weight):
                continue
            # d(sum CE)/d logits = softmax - onehot, zero on ignored rows; the mean divides by count.
            g = torch.exp(logits - lse.unsqueeze(1))
            g = g.scatter_add(1, safe_t.unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
            g = (g * (valid.unsqueeze(1) / denom)).to(hidden.dtype)
            if want_hidden:
                pieces.append(g @ weight)
            if grad_weight is not None:
                grad_weight += (g.t() @ h).float()
        grad_hidden = torch.cat(pieces) if want_hidden else None
        ctx.save_for_backward(grad_hidden if grad_hidden is not None else hidden.new_empty(0),
                              grad_weight if grad_weight is not None else weight.new_empty(0))
        ctx.weight_dtype = weight.dtype
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_out.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          chunks: int = 4, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Causal-LM loss of an LM head without materialising all logits.

    Equal to ``F.cross_entropy((hidden[:, :-1] @ weight.T).float(), labels[:, 1:],
    ignore_index=ignore_index)`` (mean over non-ignored targets), gradients included; see the
    module docstring for what is kept instead of the logits.

    Args:
        hidden: ``(B, S, D)`` final hidden states.
        weight: ``(V, D)`` LM-head weight (frozen in (Q)LoRA; a weight that requires grad gets
            its gradient too).
        labels: ``(B, S)`` token ids with ``ignore_index`` where no loss is taken.
        chunks: how many pieces the ``B*(S-1)`` token rows are cut into (>= 1).
        ignore_index: label value to skip.

    Returns:
        The scalar fp32 loss.

    Raises:
        ValueError: ``chunks`` < 1, or shapes that do not fit together.
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2] or weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"expected hidden (B, S, D), labels (B, S), weight (V, D); got "
                         f"{tuple(hidden.shape)}, {tuple(labels.shape)}, {tuple(weight.shape)}")
    h, t = causal_lm_targets(hidden, labels, ignore_index)
    grad_on = torch.is_grad_enabled()
    return _ChunkedLinearCrossEntropy.apply(h, weight, t, chunks, ignore_index,
                                            grad_on and h.requires_grad, grad_on and weight.requires_grad)


class ChunkedLossLM(torch.nn.Module):
    """A PEFT causal LM whose loss is :func:`~qlora_nb_utils.ops.losses.chunked_cross_entropy`.

    ``forward(input_ids, attention_mask, labels)`` runs the decoder stack, then the chunked
    head + loss; it returns a ``CausalLMOutputWithPast`` holding only ``loss``, so it drops into
    :func:`qlora_nb_utils.training.train` and :func:`qlora_nb_utils.compile.prepare_for_compile`.
    """

    def __init__(self, model: torch.nn.Module, chunks: int = 4) -> None:
        super().__init__()
        self.model = model
        self.chunks = chunks

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        causal_lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        hidden = causal_lm.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        weight = causal_lm.get_output_embeddings().weight
        return CausalLMOutputWithPast(loss=chunked_cross_entropy(hidden, weight, labels, chunks=self.chunks))


def reference_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                            ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The standard path, for comparison: full logits, ``.float()``, ``F.cross_entropy``."""
    h, t = causal_lm_targets(hidden, labels, ignore_index)
    return F.cross_entropy((h @ weight.t()).float(), t, ignore_index=ignore_index)
