"""What a fine-tune is judged by: the held-out loss, and a completion a person can read.

Why one function for the held-out loss: the number a run reports, the number its saved adapter
reproduces after a reload, and the number a test checks must be the same computation, or a
difference between them means nothing. :func:`evaluate` is that computation: eager (compiled
regions inside the module too: ``torch.compiler.set_stance("force_eager")``; a decoder layer
compiled in place for training, as the regional scope does, would otherwise compile again for
``no_grad`` and eval mode, a second compilation of the training graph at the first evaluation), under
``torch.no_grad()``, in eval mode, under autocast when the run trained under it, and the *token*
mean over the held-out batches. A plain mean of per-batch losses would weigh a batch of short
answers like one of long answers; each batch's mean is weighted by its number of learned
tokens (labels other than -100 after the next-token shift), so the result is the mean over
every learned token, whatever the batching. It takes any module whose ``forward(**batch)``
returns ``.loss`` as a token mean: the compiled recipe's module, a PEFT model, a plain HF model.

On a CPU both functions keep bitsandbytes' inference repacking off while they run
(:mod:`qlora_nb_utils.compile.patches.bnb_cpu_packing`): an eval-mode pass without grad would
otherwise compute the NF4 layers in another precision than training does (2e-4 apart on the tiny
model, so a reloaded adapter would not reproduce the run's number) and leave the weights in a
layout that loses gradients when training goes on.

:func:`complete` is the greedy continuation of one prompt (``model.generate``, KV cache on),
printed before and after training so that a person sees what changed, not just a number.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch

__all__ = ["evaluate", "learned_tokens", "complete"]

IGNORE_INDEX = -100


def learned_tokens(batch: dict[str, torch.Tensor]) -> int:
    """How many targets a causal-LM loss averages over: labels != -100 after the shift."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module):
    """Eval mode, no grad, and on a CPU bitsandbytes' NF4 layers kept in their training layout."""
    was = module.training
    keep = contextlib.nullcontext()
    if next(module.parameters()).device.type == "cpu":
        from ..compile.patches import bnb_cpu_packing

        keep = bnb_cpu_packing.patched(module)
    with keep, torch.no_grad():
        module.eval()
        try:
            yield
        finally:
            module.train(was)


def evaluate(module: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], *,
             autocast_dtype: torch.dtype | None = None) -> float:
    """The mean loss per learned token of ``module`` over ``batches`` (see the module docstring).

    Args:
        module: returns ``.loss`` (a mean over its batch's learned tokens) from ``forward(**batch)``.
        batches: dicts of tensors with ``input_ids``, ``attention_mask``, ``labels``; moved to
            the module's device.
        autocast_dtype: run under ``torch.autocast`` in this dtype (None or float32: no autocast).

    Returns:
        The token-weighted mean loss.

    Raises:
        ValueError: the batches hold no learned token.
    """
    device = next(module.parameters()).device
    total, count = 0.0, 0
    with _eval_mode(module), _autocast(device, autocast_dtype), _eager_stance():
        for batch in batches:
            n = learned_tokens(batch)
            if n == 0:
                continue
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            total += float(module(**batch).loss) * n
            count += n
    if count == 0:
        raise ValueError("the held-out batches hold no learned token (every label is -100)")
    return total / count


def _eager_stance():
    """Every compiled region runs eagerly inside (no compilation, no guard check); a no-op on a
    torch without compiler stances."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def complete(model: Any, tokenizer: Any, prompt_text: str, *, max_new_tokens: int = 32,
             autocast_dtype: torch.dtype | None = None, add_special_tokens: bool = False) -> str:
    """The greedy continuation of ``prompt_text`` (already rendered, e.g. with the chat template).

    Args:
        model: a causal LM with ``generate`` (a PEFT model or a plain HF model).
        tokenizer: its tokenizer.
        prompt_text: the text to continue.
        max_new_tokens: how many tokens at most.
        autocast_dtype: as in :func:`evaluate`.
        add_special_tokens: let the tokenizer add its BOS (False for a chat-template rendering,
            which writes its own).

    Returns:
        The new text alone, special tokens dropped.

    Generation runs eagerly (``torch.compiler.set_stance("force_eager")``): in a model whose
    decoder layers are compiled for training (regional scope), each layer's KV-cache state is a
    guard of the one shared layer code, so generating through them would compile it again per
    layer until Dynamo's recompile limit stops the run. A few tokens do not need a graph.
    """
    device = next(model.parameters()).device
    enc = tokenizer(prompt_text, return_tensors="pt", add_special_tokens=add_special_tokens).to(device)
    with _eval_mode(model), _autocast(device, autocast_dtype), _eager_stance():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
