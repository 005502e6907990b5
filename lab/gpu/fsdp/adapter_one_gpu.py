"""Does the adapter of a sharded GPU run load on one GPU and give the run's eval loss?

Wrote: the ``adapter_one_gpu`` field of lab/results/fsdp/fsdp2_sharded_h200.json (through fsdp_launch_results.py)
Rerun: CUDA_VISIBLE_DEVICES=0 python3 lab/gpu/fsdp/adapter_one_gpu.py OUT/runs/launch_torchrun --out OUT/adapter_one_gpu.json
  (on the lent GPU machine after lab/gpu/fsdp/gpu_fsdp_launch.sh's torchrun step, from the repository root)

Why: a user trains on several GPUs and serves on one. The sharded run (``fsdp_train --eval``) measured
the mean next-token loss of its first global batch with the adapter it saved; here one process on one
GPU builds the same NF4 base (``models.load_model``: the same bf16 checkpoint quantized again, which
gives the same packed bytes; for ``--build layerwise`` the same seeded random NF4 weights), loads that adapter with plain ``PeftModel.from_pretrained`` and measures
the same loss over the same rows. The sharded eval ran the fast path's compiled loss in bf16 and this
one runs the eager PEFT forward, so the two differ by bf16 rounding: the check's tolerance is stated
(``TOL``) and, beside it, the same eval with all rows in one batch instead of one at a time (another
bf16 summation order) shows how large such a difference is. The base's own loss (an untrained adapter) shows the
check can fail.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

#: bf16 on a GPU, loss about 10: a relative difference of 1e-3
TOL = 1e-2


def eval_loss(model, batch: dict, rows_at_once: int) -> float:
    from qlora_nb_utils.distributed.global_batches import loss_sum, target_count

    total = 0.0
    with torch.no_grad():
        for i in range(0, batch["input_ids"].shape[0], rows_at_once):
            micro = {k: v[i:i + rows_at_once].cuda() for k, v in batch.items()}
            total += float(loss_sum(model, micro))
    return total / max(1, target_count(batch))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="the sharded run's --out folder (summary.json, adapter/)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from peft import PeftModel

    from qlora_nb_utils import env, models
    from qlora_nb_utils.distributed.global_batches import make_global_batches

    summary = json.loads((args.run / "summary.json").read_text())
    o = summary["options"]
    opts = argparse.Namespace(**{k: o[k] for k in ("steps", "global_batch_size", "seq_len", "pack", "seed",
                                                   "permute_rows")})
    if o.get("build") == "layerwise":  # the same seeded random NF4 weights, built the same way on one GPU
        from qlora_nb_utils.distributed.big_model import build_named_base

        base = build_named_base(o["model"], device="cuda", quant_storage=getattr(torch, summary["quant_storage"]),
                                seed=o["seed"])
        tok = models.load_tokenizer(o["model"])
    else:
        base, tok = models.load_model(o["model"], quant="nf4", dtype="bfloat16", device="cuda", lora=False)
    base.train()
    batch = make_global_batches(tok, opts)[0]
    untrained = eval_loss(base, batch, o["micro_batch_size"])  # a fresh adapter (B = 0) adds nothing
    model = PeftModel.from_pretrained(base, str(args.run / "adapter"))
    model.train()  # the sharded eval ran in train mode (LoRA dropout 0)
    one = eval_loss(model, batch, o["micro_batch_size"])
    together = eval_loss(model, batch, batch["input_ids"].shape[0])
    diff = abs(one - summary["eval_loss"])
    rec = {"run": str(args.run.name), "world_size": summary["world_size"], "model": o["model"],
           "sharded_eval_loss": summary["eval_loss"], "one_gpu_eval_loss": one, "abs_diff": diff, "tol": TOL,
           "same_eval_loss": diff <= TOL, "one_gpu_rows_at_once_eval_loss": together,
           "bf16_order_diff": abs(together - one), "untrained_eval_loss": untrained,
           "adapter_changed_loss": abs(untrained - one) > TOL,
           "device": env.device_info(torch.device("cuda")), "versions": env.versions(),
           "command": "python3 " + " ".join(["lab/gpu/fsdp/adapter_one_gpu.py", *sys.argv[1:]])}
    args.out.write_text(json.dumps(rec, indent=1) + "\n")
    print({k: rec[k] for k in ("sharded_eval_loss", "one_gpu_eval_loss", "abs_diff", "same_eval_loss",
                               "bf16_order_diff", "untrained_eval_loss")})
    return 0 if rec["same_eval_loss"] and rec["adapter_changed_loss"] else 1


if __name__ == "__main__":
    sys.exit(main())
