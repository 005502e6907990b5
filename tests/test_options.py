"""compile.options: optimize()'s options object, its decision table, and the line count of optimize().

The descriptions in ``optimize_descriptions.json`` were recorded from ``optimize()`` before its
choices were split into small functions: each case here must still read exactly as recorded.
"""

import json
from pathlib import Path

import pytest
import torch

from qlora_nb_utils import data as qdata
from qlora_nb_utils import models, optimize

DESCRIPTIONS = json.loads((Path(__file__).parent / "optimize_descriptions.json").read_text())


def _docs(seed, lengths, vocab=2000):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(3, vocab, (n,), generator=g).tolist()), "labels": ids}
            for n in lengths]


@pytest.fixture(scope="module")
def cases():
    """A tiny NF4 model and the keyword arguments of each recorded case (bf16 last: it casts the weights)."""
    from qlora_nb_utils.data import packing

    model, tok = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu")
    fixed = qdata.build_batches(tok, batch_size=2, steps=3, max_len=64, padding="fixed")
    varied = qdata.build_batches(tok, batch_size=2, steps=6, max_len=256, padding="longest")
    packed = [packing.pack_examples(_docs(s, [20, 30, 10]), 64, rows_per_batch=2, pad_id=0)[0][0] for s in (1, 2)]
    kwargs = {
        "default": dict(batches=fixed),
        "no_batches": dict(),
        "varied_eager": dict(batches=varied, backend="eager", grad_ckpt=True),
        "memory": dict(batches=fixed, max_memory_gib=0.001, backend="eager"),
        "memory_fit": dict(batches=fixed, max_memory_gib=100.0, backend="eager"),
        "regional": dict(batches=fixed, scope="regional", loss_rows=True, ce_min_rows=0, autocast=False),
        "packed": dict(batches=packed, backend="aot_eager"),
        "own_loss": dict(batches=fixed, ce_chunks=0, mode="default", dynamic=True, recompute=False,
                         warm_cache=False, lora_addmm=False, nf4_dequant=False, memory_budget=0.5, pad_multiple=1),
        "knobs": dict(batches=varied, lora_addmm="ungrouped", eager_numerics=True, offload=False,
                      attention="mask", ckpt_layers=1, grad_ckpt=True),
        "nf4_true": dict(batches=fixed, nf4_dequant=True, backend="eager"),
        "bf16": dict(batches=fixed, dtype=torch.bfloat16),
    }
    assert list(kwargs) == list(DESCRIPTIONS)
    return model, kwargs


def test_descriptions_read_as_recorded(cases):
    model, kwargs = cases
    seen = {}
    for name, kw in kwargs.items():
        opt = optimize(model, **kw)
        try:
            seen[name] = opt.description
        finally:
            opt.undo()
    for name, want in DESCRIPTIONS.items():
        assert seen[name] == want, name
