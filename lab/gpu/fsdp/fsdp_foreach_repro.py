"""The upstream reproducer of docs/fsdp2.md, run as filed: CUDA's same-dtype ``_foreach_copy_``
against ``copy_`` over every 16-bit pattern, in bf16 and fp16, with the versions it ran on."""
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0),
      "capability", torch.cuda.get_device_capability(0))
words = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)  # every 16-bit pattern
for dtype in (torch.bfloat16, torch.float16):
    src = words.view(dtype).cuda()
    a, b = torch.empty_like(src), torch.empty_like(src)
    torch._foreach_copy_([a], [src])
    b.copy_(src)
    for name, out in (("_foreach_copy_", a), ("copy_", b)):
        got = out.view(torch.int16).cpu()
        changed = got != words
        values = sorted({f"{int(v) & 0xFFFF:04x}" for v in got[changed].tolist()})
        print(str(dtype).replace("torch.", ""), name, int(changed.sum()), "words changed; now", values[:4])
