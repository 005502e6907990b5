"""The two-minute experiment that decides the cause of the sharded-NF4 corruption on a GPU.

Why this module exists: the cause in :mod:`qlora_nb_utils.distributed.packed_words` was read
from the torch source and matches the committed signature (every changed word a bf16 NaN,
rewritten to 0x7FFF), but CPUs cannot run the CUDA kernel. This probe runs the upstream
reproducer of ``docs/fsdp2.md`` where the kernel runs:

* ``foreach_copy``: every one of the 65,536 16-bit patterns as bf16 and as fp16, copied with
  ``torch._foreach_copy_`` and with ``Tensor.copy_`` on one device. The hypothesis predicts
  253 changed bf16 words (the NaNs other than 0x7FFF), all now 0x7FFF, on CUDA sm80+; 0
  changed with ``copy_``.
* ``fsdp2`` (under ``torchrun``, 2 or more ranks): a frozen bf16 ``nn.Linear`` holding those
  patterns, ``fully_shard``-ed with no policy, unsharded, compared word for word; and the same
  patterns held as float32 words, which the hypothesis predicts exact.

    torchrun --nproc-per-node 2 -m qlora_nb_utils.distributed.nf4_probe --out probe.json

On a CPU (gloo) every count is 0, which is what CI sees.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from typing import Sequence

import torch

__all__ = ["all_words", "foreach_copy_probe", "fsdp2_probe", "main"]


def all_words() -> torch.Tensor:
    """Every 16-bit pattern once, as int16."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)


def _changed(before: torch.Tensor, after: torch.Tensor) -> dict:
    b, a = before.view(torch.int16).reshape(-1).cpu(), after.contiguous().view(torch.int16).reshape(-1).cpu()
    diff = a != b
    return {"changed": int(diff.sum()), "to": sorted({f"{int(w) & 0xFFFF:04x}" for w in a[diff][:4096]})[:8]}


def foreach_copy_probe(device: torch.device) -> dict:
    """``_foreach_copy_`` vs ``copy_`` of all 16-bit patterns in bf16 and fp16 on ``device``."""
    words = all_words()
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        src = words.view(dtype).to(device)
        a, b = torch.empty_like(src), torch.empty_like(src)
        torch._foreach_copy_([a], [src])
        b.copy_(src)
        name = str(dtype).replace("torch.", "")
        out[name] = {"foreach_copy": _changed(words, a), "copy": _changed(words, b),
                     "nan_words": int(torch.isnan(src.float()).sum())}
    return out


def fsdp2_probe(device: torch.device) -> dict:
    """Under an initialised process group: shard a frozen Linear holding every 16-bit pattern
    (as bf16 words, and as the same bytes in float32 words) and compare after the all-gather."""
    from torch.distributed.fsdp import fully_shard

    words = all_words()
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        data = words.view(dtype)  # float32: the same 131,072 bytes as 32,768 words
        n = int(data.numel() ** 0.5)
        while data.numel() % n:
            n -= 1
        lin = torch.nn.Linear(data.numel() // n, n, bias=False, dtype=dtype, device=device)
        lin.weight.requires_grad_(False)
        with torch.no_grad():
            lin.weight.copy_(data.view(n, -1).to(device))
        fully_shard(lin)
        lin.unshard()
        out[str(dtype).replace("torch.", "")] = _changed(words, lin.weight.detach())
        lin.reshard()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run both probes (``fsdp2`` only under torchrun) and write ``--out``."""
    p = argparse.ArgumentParser(prog="python -m qlora_nb_utils.distributed.nf4_probe")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = p.parse_args(argv)
    from .. import env

    record: dict = {}
    info = None
    if "RANK" in os.environ:
        from .setup import init_distributed

        info = init_distributed(args.device)
        device = info.device
    else:
        device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    record["foreach_copy"] = foreach_copy_probe(device)
    if info is not None:
        record["fsdp2"] = fsdp2_probe(device)
        record["world_size"] = info.world_size
        record["backend"] = info.backend
    if info is None or info.is_main:
        record.update(device=env.device_info(device), versions=env.versions(),
                      nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
                      command=" ".join(sys.argv), date=_dt.datetime.now(_dt.timezone.utc).isoformat())
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2, default=str)
        print(f"[nf4_probe] {json.dumps({k: record[k] for k in ('foreach_copy', 'fsdp2') if k in record})}")
    if info is not None:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from .runs import exit_after_run

    exit_after_run(main())  # gloo's threads may abort a finished run's exit: runs.exit_after_run
