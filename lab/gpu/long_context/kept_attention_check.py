"""The kept-attention operator on a GPU against SDPA's math kernel: output and q/k/v gradients.

Run: python3 lab/gpu/long_context/kept_attention_check.py OUT.json  (before any long run: seconds, and it says at
once whether cuDNN's forward and backward take the operator's arguments).
Writes: {"ok", "shapes": [{"shape", "max_abs_out", "flash_max_abs_out", "max_abs_grad", "flash_max_abs_grad"}],
device, versions, date, command} ("error" and "traceback" where the kernel refused).
The reference is float32 math SDPA; the floor is bf16 flash SDPA against the same reference.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from qlora_nb_utils.compile.patches import kept_attention  # noqa: F401  (registers the operator)


def one(b: int, h: int, length: int, d: int) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16)
    out = torch.ops.qlora_nb.kept_sdpa(q, k, v, d ** -0.5)[0]
    got = torch.autograd.grad(out, (q, k, v), g)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    want = torch.autograd.grad(ref, (qf, kf, vf), g.float())
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        fl = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        flg = torch.autograd.grad(fl, (q, k, v), g)
    return {"shape": [b, h, length, d],
            "max_abs_out": (out.float() - ref).abs().max().item(),
            "flash_max_abs_out": (fl.float() - ref).abs().max().item(),
            "max_abs_grad": max((a.float() - w).abs().max().item() for a, w in zip(got, want)),
            "flash_max_abs_grad": max((a.float() - w).abs().max().item() for a, w in zip(flg, want))}


def main(path: str) -> int:
    rec: dict = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
                 "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                              "cudnn": torch.backends.cudnn.version()},
                 "command": "python3 lab/gpu/long_context/kept_attention_check.py " + path, "shapes": []}
    try:
        for shape in [(1, 32, 2048, 128), (1, 8, 4096, 64)]:
            rec["shapes"].append(one(*shape))
        # within 2x the bf16 flash kernel's own distance from the fp32 reference (and a small absolute slack)
        rec["ok"] = all(s["max_abs_out"] <= 2 * s["flash_max_abs_out"] + 1e-2
                        and s["max_abs_grad"] <= 2 * s["flash_max_abs_grad"] + 1e-2 for s in rec["shapes"])
    except Exception as e:  # the point of the check: say what the kernel refused
        rec["ok"] = False
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()[-4000:]
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    print("[kept_attention check]", json.dumps({k: rec[k] for k in ("ok", "shapes")} | {"error": rec.get("error")}))
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
