"""How far the ring's bf16 attention is from the exact result, beside the whole-row kernel's own distance.

Wrote: lab/results/long_context/ring_precision_cpu.json (2 CPU processes, the defaults), ring_precision_h200.json
  (2 x H200: --seq-len 8192 --heads 8 --kv-heads 2 --head-dim 128), ring_precision_h200_1b_shape.json (--seq-len 2048
  --heads 32 --kv-heads 8 --head-dim 64); each row also the relative L2 distance and the error's share along the
  truth (a bias), by chunk of the row
Rerun: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m lab.ring_precision
  --out lab/results/long_context/ring_precision_cpu.json   (gloo on a CPU; NCCL where there are GPUs)

Why: context parallel's loss check (``lab/context_parallel.py``) sets the 2-GPU run against the same
code on one GPU, beside a floor made of two one-GPU runs that differ only in their attention kernel,
and the 2-GPU run lands a little above that floor. This says whether the ring itself loses precision
the whole-row kernel does not, with no training and no GPU: one attention shape with grouped K/V heads
in bf16, the ring (``qlora_nb_utils.distributed.ring_attention``, torch's ring functions) and SDPA over
the whole row, each set against the same attention in float64 (the truth), for the output and the three
gradients. Each block of the ring returns its partial K/V gradients in bf16 and the ring sums them in
float32; the whole-row kernel rounds each gradient once.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

NAMES = ("out", "dq", "dk", "dv")


def measure(seq_len: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> dict:
    """Every rank calls this together (a process group is up): the worst absolute error over the ranks'
    positions, against float64, of bf16 SDPA over the whole row and of the bf16 ring."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from qlora_nb_utils.distributed.context_parallel import shard_positions
    from qlora_nb_utils.distributed.ring_attention import ring_attention

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    gen = torch.Generator().manual_seed(seed)
    q, g = (torch.randn(1, heads, seq_len, head_dim, generator=gen) for _ in "qg")
    k, v = (torch.randn(1, kv_heads, seq_len, head_dim, generator=gen) for _ in "kv")
    # inputs exactly representable in bf16: every path starts from the same values, only the arithmetic differs
    q, k, v = (t.to(torch.bfloat16).to(device) for t in (q, k, v))
    g = g.to(device)
    idx = shard_positions(seq_len, world, rank, True).to(device)

    def whole(dtype):
        ins = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*ins, is_causal=True, enable_gqa=True)
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        (out.to(wide) * g.to(wide)).sum().backward()
        return [out.detach()[:, :, idx]] + [t.grad[:, :, idx] for t in ins]

    truth = whole(torch.float64)
    bf16 = whole(torch.bfloat16)
    local = [t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group_name=dist.group.WORLD.group_name)
    (out.float() * g[:, :, idx]).sum().backward()
    ring = [out.detach()] + [t.grad for t in local]

    def worst(got):
        return [float((a.double() - b).abs().max()) for a, b in zip(got, truth)]

    def sums(got):  # per tensor and per chunk of the shard (head, tail): sum err^2, sum truth^2, sum err*truth
        rows = []
        for a, b in zip(got, truth):
            for part_a, part_b in zip(a.double().chunk(2, dim=2), b.chunk(2, dim=2)):
                err = part_a - part_b
                rows += [float(err.pow(2).sum()), float(part_b.pow(2).sum()), float((err * part_b).sum())]
        return rows

    t = torch.tensor(worst(bf16) + worst(ring), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    errs = t.tolist()
    # the sums by chunk of the whole row (rank r holds chunks r and 2W-1-r): a slot per chunk, summed over ranks
    slots = torch.zeros(2, len(NAMES), 2 * world, 3, dtype=torch.float64, device=device)
    for i, got in enumerate((bf16, ring)):
        local = torch.tensor(sums(got), dtype=torch.float64, device=device).view(len(NAMES), 2, 3)
        slots[i, :, rank] = local[:, 0]
        slots[i, :, 2 * world - 1 - rank] = local[:, 1]
    dist.all_reduce(slots)
    whole_row, ring_err = dict(zip(NAMES, errs[:4])), dict(zip(NAMES, errs[4:]))

    def l2(kind: int) -> dict:  # relative L2 distance and the error's share along the truth (a bias: rounding has none)
        out = {}
        for j, n in enumerate(NAMES):
            e2, t2, et = slots[kind, j].sum(0).tolist()
            out[n] = {"rel_l2": (e2 / t2) ** 0.5 if t2 else None, "bias": et / t2 if t2 else None,
                      "rel_l2_by_chunk": [(a / b) ** 0.5 if b else None for a, b, _ in slots[kind, j].tolist()],
                      "bias_by_chunk": [c / b if b else None for _, b, c in slots[kind, j].tolist()]}
        return out

    return {"seq_len": seq_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "world_size": world,
            "dtype": "bfloat16", "whole_row_vs_float64": {f"{n}_diff": e for n, e in whole_row.items()},
            "ring_vs_float64": {f"{n}_diff": e for n, e in ring_err.items()},
            "ring_over_whole_row": {f"{n}_ratio": ring_err[n] / whole_row[n] if whole_row[n] else None for n in NAMES},
            "whole_row_l2": l2(0), "ring_l2": l2(1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seeds", type=int, default=3, help="random inputs measured (each its own row)")
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    from qlora_nb_utils import env

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    rows = [measure(args.seq_len, args.heads, args.kv_heads, args.head_dim, seed) | {"seed": seed}
            for seed in range(args.seeds)]
    if dist.get_rank() == 0:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        rec = {"what": __doc__.split("\n\n")[0], "rows": rows,
               "ring_over_whole_row_max": {f"{n}_ratio": max(r["ring_over_whole_row"][f"{n}_ratio"] for r in rows)
                                            for n in NAMES},
               "device": env.device_info(device), "versions": env.versions(),
               "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
               "command": "torchrun --standalone --nproc-per-node 2 -m lab.ring_precision " + " ".join(
                   sys.argv[1:] if argv is None else argv)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rec, indent=1) + "\n")
        print(json.dumps(rec["ring_over_whole_row_max"]))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from qlora_nb_utils.distributed.runs import exit_after_run

    exit_after_run(main())  # gloo's threads may abort a finished run's exit (runs.exit_after_run says why)
