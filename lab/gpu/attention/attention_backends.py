"""Causal attention at long lengths, fwd + bwd, by SDPA backend: which kernel is fastest on this GPU, and does it agree.

Wrote: lab/results/long_context/attention_backends_h200.json
Rerun: python lab/gpu/attention/attention_backends.py --out $OUT/attention_backends.json   (one GPU, from the repository root)

Why: at 16k-32k tokens of an 8B QLoRA step, causal attention (forward, its recompute, backward) is a
large share of the time, and SDPA's default choice is its flash kernel. Llama-3.1-8B's shape: 32
query heads, 8 key/value heads (grouped, ``enable_gqa=True``, as the causal path calls it), head
dim 128, bf16, batch 1. Each backend is timed alone (median of ``--reps`` after warm-up, CUDA
events), and its output and gradients are compared with the flash kernel's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def run(backend: str, q, k, v, gqa: bool, reps: int) -> dict:
    kk, vv = (k, v) if gqa else (k.repeat_interleave(q.shape[1] // k.shape[1], 1),
                                v.repeat_interleave(q.shape[1] // v.shape[1], 1))
    grad = torch.randn_like(q)

    def step():
        for t in (q, k, v):
            t.grad = None
        with sdpa_kernel([BACKENDS[backend]]):
            out = sdpa(q, kk if gqa else kk, vv, is_causal=True, enable_gqa=gqa)
        out.backward(grad, retain_graph=False)
        return out

    try:
        out = step()
        torch.cuda.synchronize()
    except Exception as exc:  # the backend refuses these inputs: recorded
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return {"ok": True, "ms": statistics.median(times), "ms_all": times, "out": out.detach().clone(),
            "grads": [t.grad.detach().clone() for t in (q, k, v)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--lengths", default="16384,32768")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for L in [int(x) for x in args.lengths.split(",")]:
        q = torch.randn(1, 32, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for gqa in (True, False):
            ref = None
            for name in BACKENDS:
                r = run(name, q, k, v, gqa, args.reps)
                row = {"name": f"{name} L{L} {'gqa' if gqa else 'kv repeated'}", "seq_len": L, "gqa": gqa,
                       "backend": name, "ok": r["ok"], "error": r.get("error"), "fwd_bwd_ms": r.get("ms"),
                       "ms_all": r.get("ms_all")}
                if r["ok"]:
                    if ref is None and name == "flash":
                        ref = r
                    if ref is not None:
                        # against the flash kernel's: the largest differences, and flash's time over this one's
                        row["out_max_abs_diff"] = float((r["out"].float() - ref["out"].float()).abs().max())
                        row["grad_max_abs_diff"] = max(float((a.float() - b.float()).abs().max())
                                                       for a, b in zip(r["grads"], ref["grads"]))
                        row["speedup"] = ref["ms"] / r["ms"]
                rows.append(row)
                print({k: v for k, v in row.items() if k != "ms_all"}, flush=True)
                del r
                torch.cuda.empty_cache()
    from qlora_nb_utils import env

    rec = {"kind": "attention_backends", "what": __doc__.split("\n")[0], "rows": rows,
           "device": env.device_info(torch.device("cuda")), "versions": env.versions(),
           "cudnn": torch.backends.cudnn.version(), "date": __import__("datetime").datetime.now(
               __import__("datetime").timezone.utc).isoformat(timespec="seconds"),
           "command": "python lab/gpu/attention/attention_backends.py " + " ".join(sys.argv[1:])}
    json.dump(rec, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
