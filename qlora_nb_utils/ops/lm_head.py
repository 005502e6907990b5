"""What a causal LM's head does after ``hidden @ W^T``, read from the model and checked on it.

Why it exists: the chunked loss (:mod:`.losses`) is fast because it computes the LM head
itself, a chunk of rows at a time, instead of calling the model's head. That is only the
model's loss where the head is what the loss assumes. Many are not plain: Gemma-2 and Gemma-3
cap their logits (``c * tanh(z / c)``, ``final_logit_softcapping``), Cohere multiplies them by
``logit_scale``, Granite divides them by ``logits_scaling`` (and HyperCLOVA X multiplies by a
field of the same name), MiniCPM3 scales the hidden states before the head, some heads carry a
bias. A loss that skips any of these trains and reports a number the model does not define,
with no error: a Gemma-2 whose raw logits reach a few hundred is capped by the model at 30,
and a loss without the cap is many times the model's own.

So the head is not assumed from the architecture's name. :func:`read_head` takes the candidate
constants from the model (its config's cap and scales, the head's bias) and then *asks the
model*: one probe forward of a few tokens, with a hook that replaces the head's output by
known values ``Z`` of realistic size (tens, so that a cap bites) and records what the head
read. The model's own logits and loss from that ``Z`` must equal what the chunked loss would
compute from it (the cap and scale applied in fp32, ``F.cross_entropy``), and the head's input
must be the decoder's output (or a constant multiple of it, folded into the scale). A head that
passes is reproduced exactly; anything else (a LoRA or quantized head, another map, extra loss
terms such as a router's auxiliary loss) is reported as not reproduced, with the reason, and
:func:`~qlora_nb_utils.compile.optimize` then keeps the model's own head and loss.

The probe runs in training mode (an eval-mode pass without grad would make bitsandbytes repack
NF4 weights on a CPU), without grad, and leaves the random state as it found it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["LMHead", "read_head", "causal_lm_of", "decoder_of", "PROBE_TOKENS", "PROBE_MAGNITUDE"]

#: Tokens in the probe forward.
PROBE_TOKENS = 8
#: The probe's head outputs are normal with this standard deviation (or four times the cap, if larger).
PROBE_MAGNITUDE = 40.0


@dataclasses.dataclass(frozen=True)
class LMHead:
    """The map from ``hidden @ W^T + b`` to the model's logits, as :func:`read_head` found it.

    Attributes:
        scale: what the logits are multiplied by (1: nothing).
        softcap: the final-logit soft cap ``c`` of ``c * tanh(z / c)``, or None.
        bias: whether the head has an output bias (read from the head at each step).
        reproduced: whether the chunked loss computes this head's loss (else see ``why``).
        why: what was found, or why it is not reproduced.
    """

    scale: float = 1.0
    softcap: float | None = None
    bias: bool = False
    reproduced: bool = True
    why: str = "asked for"

    def describe(self) -> str:
        """The map in a few words, e.g. ``hidden @ W^T, softcap 30``."""
        parts = ["hidden @ W^T" + (" + b" if self.bias else "")]
        if self.scale != 1.0:
            parts.append(f"x {self.scale:.6g}")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:.6g}")
        return ", ".join(parts)


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside a PEFT model (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_of(causal_lm: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack whose ``last_hidden_state`` feeds the head (``.model`` in most of transformers).

    Raises:
        ValueError: the model has neither ``.model`` nor the attribute its ``base_model_prefix`` names.
    """
    decoder = getattr(causal_lm, "model", None)
    if not isinstance(decoder, torch.nn.Module):
        decoder = getattr(causal_lm, getattr(causal_lm, "base_model_prefix", "") or "model", None)
    if not isinstance(decoder, torch.nn.Module):
        raise ValueError(f"{type(causal_lm).__name__} has no decoder stack at .model or .{causal_lm.base_model_prefix}")
    return decoder


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def _configs(causal_lm: torch.nn.Module) -> list:
    config = getattr(causal_lm, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def _candidates(causal_lm: torch.nn.Module) -> tuple[list[float | None], list[float]]:
    """Soft caps and scales the model could apply, from its config and attributes (the probe picks)."""
    caps: list[float | None] = []
    scales = [1.0]
    for config in _configs(causal_lm):
        if (cap := _number(getattr(config, "final_logit_softcapping", None))) is not None:
            caps.append(cap)
        if (s := _number(getattr(config, "logit_scale", None))) is not None:
            scales.append(s)
        if (s := _number(getattr(config, "logits_scaling", None))) is not None:
            scales += [1.0 / s, s]  # Granite divides by it, HyperCLOVA X multiplies
    if (s := _number(getattr(causal_lm, "logit_scale", None))) is not None:
        scales.append(s)
    return list(dict.fromkeys(caps + [None])), list(dict.fromkeys(scales))


def _map(z: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    z = z * scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def mapped(raw: torch.Tensor, scale: float, softcap: float | None) -> tuple:
    """``raw`` (a chunk of ``h @ W^T + b``) in fp32 through the head's map,
    and ``d logits / d raw`` elementwise (None where it is 1: a plain head, nothing extra to compute)."""
    z = raw.float()
    if scale != 1.0:
        z = z * scale
    if softcap is None:
        return z, (None if scale == 1.0 else scale)
    t = torch.tanh(z / softcap)
    return t * softcap, (1.0 - t * t) * scale


def _probe(causal_lm: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Linear, ids: torch.Tensor,
           magnitude: float) -> dict[str, Any]:
    """One forward with the head's output replaced by known values; what the head read and what came out."""
    seen: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)

    def on_decoder(_module, _args, output):
        seen["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def on_head(_module, args, output):
        seen["x"] = args[0]
        seen["z"] = (torch.randn(output.shape, generator=gen) * magnitude).to(output.device, output.dtype)
        return seen["z"]

    hooks = [decoder.register_forward_hook(on_decoder), head.register_forward_hook(on_head)]
    was_training = causal_lm.training
    devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
    try:
        causal_lm.train()
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            out = causal_lm(input_ids=ids, labels=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        causal_lm.train(was_training)
    seen["logits"], seen["loss"] = getattr(out, "logits", None), getattr(out, "loss", None)
    return seen


def read_head(model: torch.nn.Module, input_ids: torch.Tensor | None = None) -> LMHead:
    """What ``model``'s head does after ``hidden @ W^T``, checked on a probe forward (module docstring).

    Args:
        model: a transformers causal LM or a PEFT model around one, on the device it runs on.
        input_ids: token ids to probe with (their first :data:`PROBE_TOKENS` of the first row);
            None: the ids ``1..PROBE_TOKENS``.

    Returns:
        An :class:`LMHead`; ``reproduced`` is False (with ``why``) where the chunked loss would
        not compute the model's own loss.
    """
    causal_lm = causal_lm_of(model)
    head = causal_lm.get_output_embeddings() if hasattr(causal_lm, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return LMHead(reproduced=False, why=f"its LM head is {type(head).__name__}, not a plain nn.Linear "
                                            "(a LoRA, quantized or trainable copy of the head)")
    try:
        decoder = decoder_of(causal_lm)
    except ValueError as err:
        return LMHead(reproduced=False, why=str(err))
    caps, scales = _candidates(causal_lm)
    magnitude = max([PROBE_MAGNITUDE] + [4 * c for c in caps if c is not None])
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        input_ids = torch.arange(1, PROBE_TOKENS + 1).unsqueeze(0)
    ids = input_ids[:1, :PROBE_TOKENS].to(head.weight.device) % head.weight.shape[0]
    seen = _probe(causal_lm, decoder, head, ids, magnitude)
    if seen.get("logits") is None or seen.get("loss") is None or "x" not in seen or "hidden" not in seen:
        return LMHead(reproduced=False, why="its forward returned no logits or loss, or never called its head")
    rtol = 1e-4 if seen["z"].dtype == torch.float32 else 2e-2
    k = 1.0
    if seen["x"] is not seen["hidden"] and not torch.equal(seen["x"], seen["hidden"]):
        x, hidden = seen["x"].float(), seen["hidden"].float()
        if x.shape != hidden.shape:
            return LMHead(reproduced=False, why="its head reads something else than the decoder's last hidden state")
        k = float((x * hidden).sum() / (hidden * hidden).sum().clamp(min=1e-30))  # least squares x ~ k hidden
        if not torch.allclose(x, k * hidden, rtol=rtol, atol=rtol * float(x.abs().max())):
            return LMHead(reproduced=False, why="its head reads the decoder's last hidden state changed on the way")
    if k != 1.0 and head.bias is not None:
        return LMHead(reproduced=False, why=f"its head reads the hidden state times {k:.6g} and adds a bias")
    z, logits = seen["z"].float(), seen["logits"].float()
    tol = rtol * max(1.0, float(logits.abs().max()))
    best = math.inf
    for cap in caps:
        for scale in scales:
            expect = _map(z, scale, cap)
            err = float((logits - expect).abs().max())
            best = min(best, err)
            if err > tol:
                continue
            own = float(seen["loss"])
            ours = float(F.cross_entropy(expect[0, :-1], ids[0, 1:]))
            if abs(own - ours) > rtol * max(1.0, abs(own)):
                return LMHead(reproduced=False, why=f"its loss ({own:.6g} on a probe) is not the cross-entropy of "
                                                    f"its logits ({ours:.6g}): it adds or weighs something")
            return LMHead(scale=scale * k, softcap=cap, bias=head.bias is not None,
                          why="read from the model, checked on a probe forward")
    return LMHead(reproduced=False, why=f"its forward changes the logits after hidden @ W^T in a way that is none of "
                                        f"the caps and scales its config names (largest difference {best:.3g} on a probe)")


