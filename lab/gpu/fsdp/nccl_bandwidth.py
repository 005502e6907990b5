"""All-gather bandwidth between the GPUs of one host (run under torchrun): what FSDP2's per-layer
all-gathers can move per second, so a step's communication time can be set beside its compute.

Writes OUT (JSON, rank 0): per size, the median time of ``all_gather_into_tensor`` and its bus
bandwidth (nccl-tests' definition: output bytes x (n-1)/n over the time).
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main(out: str) -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rows = []
    for mib in (16, 104, 512):  # 104 MiB: one 8B decoder layer's NF4 words
        shard = torch.empty(mib * 2**20 // world, dtype=torch.uint8, device="cuda")
        full = torch.empty(shard.numel() * world, dtype=torch.uint8, device="cuda")
        times = []
        for i in range(25):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(full, shard)
            torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        rows.append({"mib_gathered": mib, "median_ms": t * 1e3,
                     "bus_gb_s": full.numel() * (world - 1) / world / t / 1e9})
    if rank == 0:
        rec = {"world_size": world, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
               "torch": torch.__version__, "device": torch.cuda.get_device_name(), "all_gather": rows}
        with open(out, "w") as f:
            json.dump(rec, f, indent=1)
        print("[nccl]", json.dumps(rec))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
