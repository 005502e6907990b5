"""Worker of ``tests/test_context_parallel.py``: the LoRA gradients of one context-parallel step, whole.

Run by ``torchrun --nproc-per-node N`` (N = 1: the same code, nothing sharded, plain attention).
The tiny model with every ``lora_B`` set to seeded random values (so ``lora_A`` has a gradient), one
row, one ``train_step``; rank 0 writes ``{name: full gradient}`` and the clipped norm
(``fsdp.clip_grad_norm``) to ``argv[1]`` (``torch.save``). ``argv[2:]``: ``optimize()`` options as
``KEY=VALUE`` and ``dtype=bfloat16`` for the model's compute dtype.
"""

import os
import sys

import torch
import torch.distributed as dist

from qlora_nb_utils.distributed.big_model import build_named_qlora
from qlora_nb_utils.distributed.context_parallel import optimize_context_parallel, train_step
from qlora_nb_utils.distributed.fast import optimize_options
from qlora_nb_utils.distributed.fsdp import clip_grad_norm
from qlora_nb_utils.distributed.packed_words import sharded_nf4_precision

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
knobs = {"backend": "eager", **optimize_options(sys.argv[2:])}
dtype = getattr(torch, knobs.pop("dtype", "float32"))
seq = int(knobs.pop("seq", 64))
mp, storage = sharded_nf4_precision(dtype, "auto")
model, _ = build_named_qlora("tiny", device="cpu", dtype=dtype, quant_storage=storage, lora_r=8, lora_alpha=16, seed=0)
gen = torch.Generator().manual_seed(1)
with torch.no_grad():
    for name, p in sorted(model.named_parameters()):
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
ids = torch.randint(3, 200, (1, seq), generator=gen)
row = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
cp = optimize_context_parallel(model, batches=[row], mp_policy=mp, nf4="shard", frozen="shard",
                               **knobs)
named = [(n, p) for n, p in cp.fast.root.named_parameters() if p.requires_grad]
names = [n[n.index("layers."):].replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "") for n, _ in named]
params = [p for _, p in named]
loss = train_step(cp, row, 1, "cpu")["loss"]
grads = {}
for name, p in zip(names, params):
    g = p.grad
    grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().float().clone()
norm = clip_grad_norm(params, 1e-6)  # clipped far below the norm: the clip's scale is checked too
clipped = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().float().clone()
           for name, p in zip(names, params)}
if rank == 0:
    torch.save({"loss": loss, "grads": grads, "norm": norm, "clipped": clipped, "world": world}, sys.argv[1])
dist.barrier()  # every rank's ring sends and receives done before any rank tears gloo down
dist.destroy_process_group()
# gloo's threads can abort the interpreter's own exit ("terminate called without an active exception")
# after a finished run: leave without the C++ destructors, everything written and flushed above
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
