"""The HF default QLoRA recipe as a peer: eager (``hf-eager``) and under plain ``torch.compile``.

Why it exists: it is the baseline every other peer is measured against, the recipe a
transformers user gets from the docs (``prepare_model_for_kbit_training`` + ``get_peft_model``,
bitsandbytes NF4 with double quantization), eager; ``ours-default-compile`` is the same model
with nothing but ``torch.compile(model)`` added, which says how much of our speed plain
compilation gives. ``hf-eager-packed`` is eager on packed batches the way transformers takes
them: ``input_ids``, ``labels`` and ``position_ids`` that restart at every document, no
``attention_mask`` (from those positions transformers builds the per-document causal mask for
SDPA itself); the batch's ``document_ids`` are not passed.
"""

from __future__ import annotations

from typing import Any

import torch

from lab.peers.common import _hf_model, _train_cfg
from lab.peers.packed_batches import for_transformers
from lab.peers.results import _from_history


def _peer_hf(ctx: dict, batches: list, compiled: bool) -> dict[str, Any]:
    from qlora_nb_utils.training.loop import train

    model, _ = _hf_model(ctx)
    forward, notes = model, "prepare_model_for_kbit_training + get_peft_model, eager"
    if compiled:
        forward = torch.compile(model)
        notes = "prepare_model_for_kbit_training + get_peft_model, plain torch.compile(model)"
    if ctx["name"].endswith("-packed"):
        def forward(**batch):  # noqa: E306  (the packed batch as transformers takes it)
            return model(**for_transformers(batch))

        notes += ("; packed batches: input_ids, labels, position_ids restarting per document, no attention_mask "
                  "(transformers builds the document mask from the positions); document_ids not passed")
    hist = train(model, batches, _train_cfg(ctx), forward=forward, label=ctx["name"])
    return _from_history(ctx["name"], hist, ctx, notes, {"compiled": compiled,
                                                         "packed": ctx["name"].endswith("-packed")})
