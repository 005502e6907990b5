"""Which of the recipe's numerics moves the loss away from HF eager's: one choice at a time, uncompiled.

Why it exists: at 8B the compiled step stayed within the recipe's own floor, but the recipe
run uncompiled already differed from HF eager at step 0, before any update, by more than HF
eager's floor (``lab/results/compute/compute_extras_h100_call2.json``), and keeping k-bit prep's fp32
weights (``optimize(cast=False)``) did not close it (``compute_extras_h100_cast.json``). The
recipe has three numerics choices; everything else it does (the graph-break patches, causal-only
attention, padding to 8, the in-place LoRA update, the labelled rows) is exact arithmetic or
should be. :func:`split` trains HF eager and the recipe uncompiled (``Optimized.eager``: no
compile, so the compiler is not part of the question) from the same LoRA start on the same
batches, with the choices turned on one at a time:

* ``hf-numerics``: ``cast=False, autocast=False, ce_chunks=0``: the recipe without its numerics;
* ``+ chunked loss``: the chunked cross-entropy (fp32 per chunk) instead of the model's own;
* ``+ autocast``: bf16 autocast, with k-bit prep's fp32 weights kept: the fp32 LM head and the
  fp32 LoRA matmuls run in bf16;
* ``+ bf16 cast``: the non-LoRA weights cast to bf16 (the residual stream and the head in
  bf16), no autocast: the LoRA matmuls stay fp32;
* ``recipe``: all three, as ``optimize()`` chooses.

Each is judged against HF eager's floor (:func:`~qlora_nb_utils.training.parity.judge`: HF
eager again with the rows of every batch permuted). ``python -m
lab.parity_split --out FILE`` writes the comparison with device, versions, date
and command; on a CPU, where bf16 matmuls are slow, a small model and few steps.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["VARIANTS", "split", "main"]

#: The recipe uncompiled, its numerics choices turned on one at a time (``optimize()`` keywords).
VARIANTS: dict[str, dict[str, Any]] = {
    "hf-numerics": {"cast": False, "autocast": False, "ce_chunks": 0},
    "+ chunked loss": {"cast": False, "autocast": False},
    "+ autocast": {"cast": False, "ce_chunks": 0},
    "+ bf16 cast": {"autocast": False, "ce_chunks": 0},
    "recipe": {},
}


def split(model_name: str = "smollm2-135m", *, device: str = "cpu", dtype: str = "bfloat16", batch_size: int = 4,
          seq_len: int = 256, steps: int = 4, variants: Sequence[str] | None = None, lr: float = 2e-4,
          log=print) -> dict[str, Any]:
    """HF eager, its floor, and each variant of :data:`VARIANTS`, each trained ``steps`` steps.

    Args:
        model_name: a named model or checkpoint folder (NF4 base, LoRA, k-bit prepared as HF does).
        device: where to train.
        dtype: the compute dtype (the question is about bf16).
        batch_size: rows per batch.
        seq_len: padded length of the shipped data's batches.
        steps: optimizer steps per run (>= 1).
        variants: the names of :data:`VARIANTS` to run (None: all, in that order).
        lr: AdamW's learning rate.
        log: progress lines.

    Returns:
        ``{"hf-eager": losses, "floor": losses, "runs": {name: {"optimize": kwargs, "losses",
        "diffs", "step0_diff", "verdict"}}, "lora_start_checksum"}``.

    Raises:
        ValueError: an unknown variant or ``steps`` < 1.
        RuntimeError: a run did not start from HF eager's LoRA weights.
    """
    from qlora_nb_utils import data as qdata
    from qlora_nb_utils import models
    from qlora_nb_utils.compile.fast_path import optimize
    from qlora_nb_utils.training.loop import TrainConfig, train, trainable_state
    from qlora_nb_utils.training.parity import judge, loss_diffs, permute_rows

    names = list(VARIANTS) if variants is None else list(variants)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    cfg = TrainConfig(steps=steps, lr=lr, progress=False)

    def fresh():
        model, tok = models.load_model(model_name, quant="nf4", dtype=dtype, device=device, prepare_kbit=True)
        return model.train(), tok

    model, tok = fresh()
    batches = qdata.build_batches(tok, batch_size=batch_size, steps=steps, max_len=seq_len, padding="fixed")
    start = trainable_state(model)
    hf = [float(x) for x in train(model, batches, cfg)["loss"]]
    log(f"[parity_split] hf-eager {hf}")
    model, _ = fresh()
    floor = [float(x) for x in train(model, permute_rows(batches), cfg)["loss"]]
    log(f"[parity_split] floor (rows permuted) {floor}")
    checksum = float(sum(t.double().sum() for t in start.values()))
    out: dict[str, Any] = {"hf-eager": hf, "floor": floor, "lora_start_checksum": checksum, "runs": {}}
    for name in names:
        model, _ = fresh()
        state = trainable_state(model)
        if state.keys() != start.keys() or not all(state[k].equal(v) for k, v in start.items()):
            raise RuntimeError(f"{name}: the LoRA start differs from HF eager's")
        opt = optimize(model, batches=batches, backend="eager", **VARIANTS[name])
        try:
            losses = [float(x) for x in train(model, batches, cfg, forward=opt.eager)["loss"]]
        finally:
            opt.undo()
        diffs = loss_diffs(hf, losses)
        out["runs"][name] = {"optimize": VARIANTS[name], "losses": losses, "diffs": diffs, "step0_diff": diffs[0],
                             "max_diff": max(diffs), "verdict": judge(hf, floor, losses)}
        log(f"[parity_split] {name}: step 0 {diffs[0]:.2e}, max {max(diffs):.2e}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.parity_split --out FILE [...]``: write :func:`split`'s result."""
    import torch

    from qlora_nb_utils import env

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    res = split(args.model, device=args.device, dtype=args.dtype, batch_size=args.batch_size, seq_len=args.seq_len,
                steps=args.steps)
    head = {"what": __doc__.split("\n\n")[0], "device": env.device_info(torch.device(args.device)),
            "versions": env.versions(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m lab.parity_split " + shlex.join(sys.argv[1:] if argv is None else argv),
            "model": args.model, "dtype": args.dtype, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "steps": args.steps}
    Path(args.out).write_text(json.dumps({**head, **res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
