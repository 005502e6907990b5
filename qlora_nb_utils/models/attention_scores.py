"""What a model's attention does beyond causal softmax, read from the model on a probe forward.

Why it exists: SDPA computes ``softmax(q k^T * scale + mask) v`` and nothing else, and
transformers' ``sdpa_attention_forward`` drops, without a word, what some models do to their
scores: Gemma-2 caps them (``c * tanh(s / c)``, ``attn_logit_softcapping``), gpt-oss adds learned
sinks to the softmax, T5-like models add a position bias. A model loaded with SDPA then trains
and evaluates with attention its own definition does not have. Scaling (Gemma's
``query_pre_attn_scalar``, Granite's ``attention_multiplier``) reaches SDPA as its ``scale``, and
sliding windows live in the mask, so those are not at stake here.

So the attention is not assumed from the architecture's name or its config (Gemma-3's config
has the Gemma-2 field, and its layers do not pass it on). :func:`read_attention` *asks the model*:
one probe forward of a few tokens, its configs' attention implementation switched to a recorder
registered with transformers' ``AttentionInterface``, which records what every layer passes to
its attention. :func:`~qlora_nb_utils.models.load.load_model` loads such a model with its eager
attention, and ``optimize()`` keeps the change when compiled
(:mod:`qlora_nb_utils.ops.model_attention`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

__all__ = ["AttentionScores", "read_attention", "PROBE_TOKENS", "FLEX_TRAINS_SCORES"]

_PROBE = "qlora_nb_attention_probe"
#: Tokens in the probe forward.
PROBE_TOKENS = 8
#: What an attention call may take that changes nothing SDPA and flex attention do not do themselves.
#: Whether ``optimize()`` may train a score change SDPA drops with flex attention (the change in its
#: score modification) on CUDA; off, the model's own eager attention trains instead. Eager
#: attention is the reference a model's loss is judged by; flex attention is faster and leaner at
#: long rows. On for a soft cap (with or without a sliding window): there its loss and LoRA
#: gradients match the eager forward's to fp32 rounding on a GPU, padded and packed, with the cap
#: biting. Learned sinks and a position bias are not yet checked so (:meth:`AttentionScores.flex_cannot`
#: keeps them eager). ``attention``/``doc_attention`` choices say which one ran.
FLEX_TRAINS_SCORES = True
_KNOWN = {"dropout", "scaling", "sliding_window", "softcap", "s_aux", "sinks", "position_bias", "is_causal",
          "position_ids", "use_cache", "cache_position", "output_attentions", "cu_seq_lens_q", "cu_seq_lens_k",
          "max_length_q", "max_length_k", "past_key_values", "kernel_options"}


@dataclasses.dataclass(frozen=True)
class AttentionScores:
    """What a model's layers pass their attention, as :func:`read_attention` found it.

    Attributes:
        seen: whether the probe saw an attention call (False: the model's attention is not
            called through transformers' interface, and nothing is known).
        softcap: the score soft cap ``c`` of ``c * tanh(s / c)``, or None.
        windows: the sliding windows the layers pass (sorted; empty: none).
        dropout: the largest attention dropout in training mode.
        sinks: whether the softmax has learned sinks (``s_aux``).
        position_bias: whether a position bias is added to the scores.
        unknown: other arguments the attention takes, which the fast path does not know.
    """

    seen: bool = False
    softcap: float | None = None
    windows: tuple[int, ...] = ()
    dropout: float = 0.0
    sinks: bool = False
    position_bias: bool = False
    unknown: tuple[str, ...] = ()

    @property
    def sdpa_drops(self) -> list[str]:
        """What SDPA would drop, in words (empty: SDPA computes this attention)."""
        drops = [f"soft-caps its scores at {self.softcap:g}"] if self.softcap is not None else []
        drops += ["adds learned sinks to its softmax"] if self.sinks else []
        drops += ["adds a position bias to its scores"] if self.position_bias else []
        drops += [f"takes {', '.join(self.unknown)}"] if self.unknown else []
        return drops

    def flex_cannot(self, device: torch.device) -> str | None:
        """Why flex attention cannot train this attention on ``device`` (None: it can)."""
        if device.type != "cuda":
            return f"torch has no flex-attention backward on {device.type}"
        if not FLEX_TRAINS_SCORES:
            return "flex attention for score changes is switched off (attention_scores.FLEX_TRAINS_SCORES)"
        unchecked = [what for what, on in (("learned sinks", self.sinks), ("a position bias", self.position_bias)) if on]
        if unchecked:
            return (f"its gradients with {' and '.join(unchecked)} are not yet known to match the model's own "
                    "attention to fp32 rounding")
        if self.dropout:
            return f"attention dropout {self.dropout:g}, which flex attention has not"
        if self.unknown:
            return f"{', '.join(self.unknown)}, which flex attention does not take"
        return None


def _probe_function(calls: list[dict[str, Any]]) -> Callable:
    def record(module, query, key, value, attention_mask, **kwargs):
        calls.append(kwargs)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    return record


def read_attention(model: torch.nn.Module) -> AttentionScores:
    """What ``model``'s attention does beyond causal softmax, read on a probe forward (module docstring).

    The probe runs in training mode (the dropout a step uses; an eval-mode pass without grad would
    make bitsandbytes repack NF4 weights on a CPU), without grad, with the configs' attention
    implementation switched to a recorder and back, and leaves the random state as it found it.

    Args:
        model: a transformers causal LM or a PEFT model around one, on the device it runs on.
    """
    from transformers import AttentionInterface

    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    calls: list[dict[str, Any]] = []
    AttentionInterface.register(_PROBE, _probe_function(calls))
    embed = causal_lm.get_input_embeddings()
    ids = (torch.arange(1, PROBE_TOKENS + 1) % embed.num_embeddings)[None].to(embed.weight.device)
    devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
    configs = {id(m.config): m.config for m in causal_lm.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation")}
    before = {key: cfg._attn_implementation for key, cfg in configs.items()}
    was_training = causal_lm.training
    try:
        for cfg in configs.values():
            cfg._attn_implementation = _PROBE
        causal_lm.train()
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            causal_lm(input_ids=ids, use_cache=False)
    finally:
        causal_lm.train(was_training)
        for key, cfg in configs.items():  # a property: restore by setting the old value
            cfg._attn_implementation = before[key]
    if not calls:
        return AttentionScores()
    caps = {float(c["softcap"]) for c in calls if c.get("softcap") is not None}
    windows = {int(c["sliding_window"]) for c in calls if c.get("sliding_window") is not None}
    unknown = {k for c in calls for k, v in c.items() if k not in _KNOWN and v is not None}
    return AttentionScores(
        seen=True, softcap=max(caps) if caps else None, windows=tuple(sorted(windows)),
        dropout=max(float(c.get("dropout") or 0.0) for c in calls),
        sinks=any(c.get("s_aux") is not None or c.get("sinks") is not None for c in calls),
        position_bias=any(c.get("position_bias") is not None for c in calls), unknown=tuple(sorted(unknown)))
