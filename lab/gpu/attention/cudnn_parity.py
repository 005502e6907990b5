"""cuDNN's attention kernel against SDPA's default (flash) in the compiled QLoRA step: the same loss, judged
against the floor, and the step time of each.

Wrote: lab/results/long_context/cudnn_parity_h200.json
Rerun: python lab/gpu/attention/cudnn_parity.py --out $OUT/cudnn_parity.json   (one GPU, from the repository root)

Why: ``optimize(sdpa_kernel="auto")`` takes cuDNN's kernel on Hopper. It is another kernel for the same
attention, so its loss must stay within what bf16 nondeterminism alone gives. The floor here is the
flash run again with the rows of each batch in two other orders (``training.parity``); the candidate
is the cuDNN run on the batches as given. Each run starts from the same adapter weights and is
compiled by ``optimize()`` (causal-only SDPA: the batches are unpadded rows of random tokens).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    from qlora_nb_utils import env, models, optimize
    from qlora_nb_utils.distributed.big_model import build_named_qlora
    from qlora_nb_utils.training.loop import TrainConfig, load_trainable_state, train, trainable_state
    from qlora_nb_utils.training.parity import judge, permute_rows

    device = torch.device(args.device)
    model, _ = build_named_qlora(args.model, device=device, dtype=torch.bfloat16, quant_storage=torch.uint8, seed=0)
    vocab = min(models.model_config(args.model).vocab_size, 49152)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.rows, args.seq_len), generator=gen)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    start = trainable_state(model)
    cfg = TrainConfig(steps=args.steps, lr=2e-4, seed=0, progress=False)
    runs, times, kernels = {}, {}, {}
    for label, kernel, data in (("flash", "default", batches), ("flash_permuted1", "default", permute_rows(batches, 1)),
                                ("flash_permuted2", "default", permute_rows(batches, 2)), ("cudnn", "cudnn", batches)):
        load_trainable_state(model, start)
        torch._dynamo.reset()
        opt = optimize(model, batches=data, sdpa_kernel=kernel)
        try:
            kernels[label] = opt.choices["sdpa_kernel"]
            hist = train(model, data, cfg, forward=opt.forward, label=label)
        finally:
            opt.undo()
        runs[label] = [float(x) for x in hist["loss"]]
        times[label] = statistics.median(float(x) for x in hist["step_ms"][1:])
        print(label, kernels[label], runs[label], f"{times[label]:.1f} ms", flush=True)
    verdict = judge(runs["flash"], [runs["flash_permuted1"], runs["flash_permuted2"]], runs["cudnn"])
    rec = {"kind": "cudnn_parity", "what": __doc__.split("\n")[0], "model": args.model, "rows": args.rows,
           "seq_len": args.seq_len, "steps": args.steps, "kernels": kernels, "losses": runs, **verdict,
           "median_step_ms": times, "speedup_cudnn_vs_flash": times["flash"] / times["cudnn"],
           "device": env.device_info(device), "versions": env.versions(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python lab/gpu/attention/cudnn_parity.py " + " ".join(sys.argv[1:])}
    json.dump(rec, open(args.out, "w"), indent=1)
    print({k: rec[k] for k in ("within_floor", "max_abs_loss_diff", "floor_max_abs_loss_diff", "speedup_cudnn_vs_flash")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
