"""How the HF ``Trainer`` and TRL's ``SFTTrainer`` call a model, answered by the optimized step.

Why this module exists: :meth:`~qlora_nb_utils.compile.fast_path.Optimized.install` makes
``model(**inputs)`` run the compiled recipe, so that a Trainer trains through ``optimize()``
instead of compiling the model its own way. A Trainer calls the model with more than a batch,
and each extra argument changes what it expects back:

* ``num_items_in_batch``: with gradient accumulation the Trainer counts the label tokens of
  every micro-batch of the step and, since the model takes loss keyword arguments, expects
  this micro-batch's *summed* loss divided by that count (it then does not divide by the
  accumulation steps itself). The recipe's loss is a mean over this micro-batch's tokens, so
  it is rescaled by (its tokens / the count).
* ``fused_lm_head=True`` (TRL's ``SFTTrainer`` since 1.x): TRL wants per-token ``log_probs``,
  ``entropy``, ``is_top1`` and ``label_mask`` and reduces the loss itself. The compiled head
  computes them (:func:`~qlora_nb_utils.ops.losses.chunked_token_log_probs`), so TRL's own
  fused head, whose out-of-place ``torch.mm(..., out=)`` breaks the graph, is never called.
* ``use_cache=False`` and other flags that change nothing in a training step are dropped.

A call without labels (logits wanted: generation, evaluation with metrics) goes to the
model's own forward, uncompiled. A training call with arguments the recipe does not take is
refused with their names, rather than silently trained another way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import torch
from transformers.utils import ModelOutput

__all__ = ["TokenStatsOutput", "trainer_forward"]

_BATCH_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")
# flags a Trainer passes that leave a training step's loss unchanged, with the values that do
_NEUTRAL = {"use_cache": (False, None), "return_dict": (True, None), "output_attentions": (False, None),
            "output_hidden_states": (False, None), "output_router_logits": (False, None)}


@dataclasses.dataclass
class TokenStatsOutput(ModelOutput):
    """What TRL reads from ``model(..., fused_lm_head=True)``: each per-token field is zero where
    the label is ignored; ``loss`` is their negative sum over ``num_items_in_batch`` (or the
    label count). The fields TRL computes only on request stay None."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


class Step(Protocol):
    """What :func:`trainer_forward` trains through: an object with the recipe's ``forward(**batch)``
    (an :class:`~qlora_nb_utils.compile.optimized.Optimized`; this module does not import it, which
    imports this one)."""

    forward: Callable[..., Any]


def trainer_forward(opt: Step, original: Callable[..., Any]) -> Callable[..., Any]:
    """A ``forward`` for the model that trains through ``opt`` and takes a Trainer's arguments.

    Args:
        opt: the :class:`~qlora_nb_utils.compile.fast_path.Optimized` to train with (its loss
            must be the chunked one: it is what returns per-token results).
        original: the model's own forward, for calls that want logits.
    """

    def forward(*args: Any, fused_lm_head: bool = False, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        if args:  # model(input_ids, ...): name it
            if len(args) > 1 or "input_ids" in kwargs:
                raise TypeError("the optimized forward takes its tensors by name (input_ids=..., labels=...)")
            kwargs["input_ids"] = args[0]
        labels = kwargs.get("labels")
        if labels is None or kwargs.get("input_ids") is None:  # logits wanted: the model's own forward
            if fused_lm_head:
                kwargs["fused_lm_head"] = True
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return original(**kwargs)
        extra = sorted(k for k, v in kwargs.items()
                       if k not in _BATCH_KEYS and not (k in _NEUTRAL and v in _NEUTRAL[k]))
        if extra:
            raise TypeError(f"optimize()'s training step takes {list(_BATCH_KEYS)}; this call also passed "
                            f"{extra}, which it would ignore")
        batch = {k: kwargs[k] for k in _BATCH_KEYS if kwargs.get(k) is not None}
        if fused_lm_head:
            stats = opt.forward(**batch, token_stats=True)
            count = stats.label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
            return TokenStatsOutput(loss=-stats.log_probs.sum() / count, log_probs=stats.log_probs,
                                    entropy=stats.entropy, is_top1=stats.is_top1, label_mask=stats.label_mask)
        out = opt.forward(**batch)
        if num_items_in_batch is not None:  # a mean over this micro-batch -> its sum over the step's count
            mine = (labels[..., 1:] != -100).sum()
            out.loss = out.loss * mine / torch.as_tensor(num_items_in_batch, device=out.loss.device)
        return out

    return forward
