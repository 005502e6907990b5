"""Worker of ``tests/test_context_parallel.py``: ring attention on this rank's shard against SDPA over the whole row.

Run by ``torchrun --nproc-per-node N``; rank 0 writes the largest differences (output and the three
gradients: head-tail shards, contiguous shards, head-tail shards one K/V head per ring call) as JSON to ``argv[1]``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from qlora_nb_utils.distributed import ring_attention as ring
from qlora_nb_utils.distributed.context_parallel import shard_positions
from qlora_nb_utils.distributed.ring_attention import ring_attention

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
gen = torch.Generator().manual_seed(0)
seq = 8 * 2 * world
q, k, v, g = (torch.randn(2, h, seq, 16, generator=gen, dtype=torch.float64).float() for h in (4, 2, 2, 4))
ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
(ref * g).sum().backward()
diffs = {}
for kind, balance in (("balanced", True), ("contiguous", False), ("head_groups", True)):
    if kind == "head_groups":  # one ring call per K/V head, as long shards run
        ring.GROUP_ELEMENTS = 1
    idx = shard_positions(seq, world, rank, balance)
    local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group_name=dist.group.WORLD.group_name, load_balance=balance)
    (out * g[:, :, idx]).sum().backward()
    pairs = [(out, ref)] + [(a.grad, b.grad) for a, b in zip(local, ref_in)]
    worst = torch.tensor([float((a - b[:, :, idx]).abs().max()) for a, b in pairs])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    diffs[kind] = dict(zip(("out", "dq", "dk", "dv"), worst.tolist()))
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(diffs, f)
dist.barrier()  # every rank's ring sends and receives done before any rank tears gloo down
dist.destroy_process_group()
# gloo's threads can abort the interpreter's own exit ("terminate called without an active exception")
# after a finished run: leave without the C++ destructors, everything written and flushed above
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
