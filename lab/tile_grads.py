"""The MLP in pieces against the MLP whole: the first step's LoRA gradients, element by element.

Wrote: lab/results/long_context/tile_grads_<gpu>.json (``compare`` of three ``run`` files)
Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_tile_grads.sh   (a lent GPU machine; carry .whl .gpucache)

Why: at 65,536 tokens on the 8B shape, the one-GPU fast path with every choice held but the MLP's
pieces (``tile_mlp``) reached a loss after its first AdamW step 0.063 apart (MLP whole: 12.4235; in
pieces of 4,096: 12.4864), where two runs that differ in the attention kernel stay within 2.5e-4.
AdamW's first step moves every weight by about the learning rate in the direction of its gradient's
sign, so an element whose sign differs between two runs moves the other way: the share of the
gradient's L1 mass whose sign differs is what that step feels. ``run`` makes one process's step-0
gradients (every layer checkpointed and offloaded, the loss in 32 chunks, ``--tile`` positions per
MLP piece, 0: whole; ``--sdpa-kernel`` the attention kernel) and saves them; ``compare`` sets a pair
that differs in the attention kernel only (the floor) beside the pair that differs in the pieces,
by kind of module and by layer.

What came of it: the gradients agree, and so do the weights the first step writes; the losses after it part
because the compiled MLP whole keeps more of an update far below a bf16 unit than the pieces' forward did, the
whole nearer a forward with fp32 sums (``lab/tile_steps.py``, ``lab/wide_check.py``). The pieces' forward ran
without gradients, where the fused NF4 LoRA route stands aside for PEFT's own path (the base output rounded
before the update is added); it now keeps gradients on (``tests/test_tiled_mlp.py``), and on a GPU the pieces
and the whole then took the same loss after the first step (``lab/results/long_context/plan_knobs_h200_after_pieces_fix/``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path


def build_try(model_name: str, seq_len: int):
    """``(model, row, device)``: the model as ``lab.context_parallel``'s one-GPU try builds it (bf16 on a GPU with
    its packed words in the sharded storage, fp32 on a CPU; LoRA r=32, alpha 64) and one made-up row on its device."""
    import torch

    from lab.long_context import make_row
    from qlora_nb_utils import models
    from qlora_nb_utils.distributed.big_model import build_named_qlora
    from qlora_nb_utils.distributed.packed_words import sharded_nf4_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _, storage = sharded_nf4_precision(dtype, "auto")
    model, _ = build_named_qlora(model_name, device=device, dtype=dtype, quant_storage=storage, lora_r=32,
                                 lora_alpha=64, seed=0)
    row = make_row(seq_len, min(models.model_config(model_name).vocab_size, 49152))
    return model, {k: v.to(device) for k, v in row.items()}, device


def run(args) -> None:
    import torch

    from qlora_nb_utils import env
    from qlora_nb_utils.distributed.fast import optimize_sharded

    model, row, device = build_try(args.model, args.seq_len)
    fast = optimize_sharded(model, batches=[row], world_size=1, one_scope="regional", keep_attention=False,
                            sdpa_kernel=args.sdpa_kernel, grad_ckpt=True, offload=device.type == "cuda",
                            tile_mlp=args.tile or False, ce_chunks=args.ce_chunks)
    t = time.perf_counter()
    loss = fast.loss(row)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in fast.root.named_parameters() if p.requires_grad}
    torch.save({"loss": float(loss.detach()), "seconds": time.perf_counter() - t, "grads": grads,
                "choices": {k: str(v) for k, v in fast.opt.choices.items()}, "tile": args.tile,
                "sdpa_kernel": args.sdpa_kernel, "seq_len": args.seq_len, "model": args.model,
                "device": env.device_info(device), "versions": env.versions()}, args.out)
    print(f"[tile_grads] {args.out}: loss {float(loss.detach()):.6f}, {len(grads)} gradients")


def _kind(name: str) -> str:
    proj = re.search(r"\.(\w+_proj)\.", name)
    ab = "lora_A" if "lora_A" in name else "lora_B" if "lora_B" in name else "other"
    return f"{proj.group(1) if proj else 'other'}.{ab}"


def _layer(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _pair(a: dict, b: dict) -> dict:
    """How far ``b``'s gradients are from ``a``'s: relative L2 and the share of ``a``'s L1 mass whose sign
    ``b`` does not share, over all, by kind of module and by layer (where ``a`` is not all zero)."""
    import torch

    groups: dict[str, list[str]] = {"all": list(a)}
    for name in a:
        groups.setdefault(_kind(name), []).append(name)
        groups.setdefault(f"layer {_layer(name)}", []).append(name)
    out = {}
    for key, names in groups.items():
        x = torch.cat([a[n].flatten().double() for n in names])
        y = torch.cat([b[n].flatten().double() for n in names])
        mass = float(x.abs().sum())
        if mass == 0:
            continue
        out[key] = {"rel_l2": float((x - y).norm() / x.norm()),
                    "sign_mass": float(x.abs()[torch.sign(x) != torch.sign(y)].sum() / mass),
                    "norm_ratio": float(y.norm() / x.norm()), "zero_a": int((x == 0).sum()),
                    "zero_b": int((y == 0).sum()), "elements": x.numel()}
    return out


def compare(args) -> dict:
    import torch

    base, floor, tiled = (torch.load(p, weights_only=False) for p in (args.base, args.floor, args.tiled))
    rec = {"what": "step-0 LoRA gradients, one GPU: the MLP whole (base) against the attention kernel changed "
                   "(floor) and against the MLP in pieces (tiled); relative L2, and the share of base's L1 mass "
                   "whose sign the other does not share",
           "seq_len": base["seq_len"], "model": base["model"],
           "runs": {k: {"loss": r["loss"], "tile": r["tile"], "sdpa_kernel": r["sdpa_kernel"], "choices": r["choices"],
                        "backward_s": r["seconds"]} for k, r in (("base", base), ("floor", floor), ("tiled", tiled))},
           "floor": _pair(base["grads"], floor["grads"]), "tiled": _pair(base["grads"], tiled["grads"]),
           "device": base["device"], "versions": base["versions"], "command": args.command}
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    for key in ("all", *sorted(k for k in rec["tiled"] if k != "all" and not k.startswith("layer"))):
        f, t = rec["floor"].get(key, {}), rec["tiled"].get(key, {})
        print(f"[tile_grads] {key:>16}: floor rel {f.get('rel_l2', 0):.2e} sign {f.get('sign_mass', 0):.2e} | "
              f"tiled rel {t.get('rel_l2', 0):.2e} sign {t.get('sign_mass', 0):.2e} norm {t.get('norm_ratio', 0):.4f}")
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.tile_grads")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seq-len", type=int, default=65536)
    r.add_argument("--model", default="llama-3.1-8b-shape")
    r.add_argument("--tile", type=int, default=0)
    r.add_argument("--ce-chunks", type=int, default=32)
    r.add_argument("--sdpa-kernel", default="auto", choices=("auto", "cudnn", "default"))
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("base")
    c.add_argument("floor")
    c.add_argument("tiled")
    c.add_argument("--command", default="")
    c.add_argument("--out", required=True)
    args = p.parse_args(argv)
    run(args) if args.cmd == "run" else compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
