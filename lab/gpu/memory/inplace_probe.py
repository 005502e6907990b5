"""Does this torch's Inductor run ops.lora_update's in-place LoRA update without a copy, on CUDA in bf16?

Wrote: the printed lines only (the A/B that asked: lab/results/compute/peers_compute_h100.json, lora_addmm rows).
Rerun: source lab/gpu/gpu_env.sh && python3 lab/gpu/memory/inplace_probe.py   (GPU machine, repo root)
Compiles base + 2 * (x @ A^T) @ B^T through add_lora_ and through torch.addmm, forward and backward,
and prints every generated line that calls a matmul, the custom op, a copy or a clone.
"""
import torch
from torch._inductor.utils import run_and_get_code

from qlora_nb_utils.ops.lora_update import add_lora_

dev, dt = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
x = torch.randn(8, 1024, 512, device=dev, dtype=dt, requires_grad=True)
w = torch.randn(2048, 512, device=dev, dtype=dt)
a = torch.randn(16, 512, device=dev, dtype=dt, requires_grad=True)
b = torch.randn(2048, 16, device=dev, dtype=dt, requires_grad=True)


def inplace(x, w, a, b):
    return torch.nn.functional.silu(add_lora_(x @ w.t(), x @ a.t(), b, 2.0))


def outofplace(x, w, a, b):
    base = (x @ w.t()).reshape(-1, 2048)
    return torch.nn.functional.silu(torch.addmm(base, (x @ a.t()).reshape(-1, 16), b.t(), alpha=2.0))


print("torch", torch.__version__, dev, dt)
for fn in (inplace, outofplace):
    torch.compiler.reset()
    cf = torch.compile(fn, fullgraph=True)
    _, codes = run_and_get_code(lambda cf=cf: cf(x, w, a, b).float().sum().backward())
    for i, code in enumerate(codes):
        for line in code.splitlines():
            s = line.strip()
            if any(k in s for k in ("extern_kernels", "lora_addmm_", "copy_", "clone", "auto_functionalized")) \
                    and not s.startswith(("from ", "import ", "#")):
                print(fn.__name__, ("fwd", "bwd")[min(i, 1)], s[:170])
