"""The MLP in pieces, checked against the model's own forward with every LoRA weight non-zero.

Wrote: lab/results/long_context/tile_check_<gpu>.json
Rerun: python -m lab.tile_check --out $OUT/tile_check_<gpu>.json   (one GPU; --model tiny runs on a CPU)

Why: the one-GPU fast path at 65,536 tokens on the 8B shape, with the MLP in pieces (``tile_mlp``),
reached a loss after its first AdamW step 0.063 above the same path with the MLP whole, while the
first step's gradients of the two agreed as closely as two attention kernels do
(``lab/tile_grads.py``). At that first step every LoRA B is zero, so the LoRA path adds nothing; after
it, it does. Here every B is non-zero from the start (as after training), and the loss and the
gradients' norm of one batch are taken with the model's own forward (transformers' eager attention,
under the autocast the fast path uses: the reference) and with ``optimize()`` in several settings,
each undone before the next: the MLP whole, in pieces, and in pieces with one of the LoRA routes the
plan chose switched off in turn, so that the setting that departs from the reference names itself.

What its first GPU calls read (``lab/results/long_context/tile_check_h200/``) was not the MLP's pieces:
the model is built with its packed 4-bit words in float32 storage (as the layer-by-layer builder stores
them for FSDP2), and plain ``optimize()`` casts the non-LoRA float weights to the compute dtype, which
then included those words (gradient norms of 1e5 to 4e7 against the reference's 1.65, illegal memory
accesses). The cast now leaves bitsandbytes' quantized weights alone (``compile.recipe.is_quantized_weight``).
The first call after that fix (``lab/results/long_context/tile_check_h200_after_cast_fix/``, every setting in its
own process) read each setting's loss within 6.1e-4 of the reference's and no weight's gradient norm more than
1.2% above the reference's: with B non-zero from the start, the pieces' forward and gradients are the model's own. What moved the
loss after a first step from zero B was where the small LoRA update is rounded (``lab/wide_check.py``), and
the pieces' forward running without gradients, so on PEFT's path (``lab/tile_grads.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import sys
import time
from pathlib import Path


def settings_for(tile: int, cuda: bool) -> dict:
    """Each setting's ``optimize()`` options over the shared base: the MLP whole, in pieces, and in pieces
    with one LoRA route (or the autocast, the offload, the NF4 patch) switched off in turn."""
    return {
        "whole": {"tile_mlp": False},
        "whole, not offloaded": {"tile_mlp": False, "offload": False},
        "whole, not checkpointed": {"tile_mlp": False, "grad_ckpt": False, "offload": False},
        "whole, other attention kernel": {"tile_mlp": False, "sdpa_kernel": "cudnn" if cuda else "auto"},
        "pieces": {"tile_mlp": tile},
        "pieces, LoRA groups narrow": {"tile_mlp": tile, "lora_addmm": "narrow"},
        "pieces, LoRA ungrouped": {"tile_mlp": tile, "lora_addmm": "ungrouped"},
        "pieces, LoRA unfused": {"tile_mlp": tile, "lora_addmm": "unfused"},
        "pieces, no NF4 dequant patch": {"tile_mlp": tile, "nf4_dequant": False},
        "pieces, not offloaded": {"tile_mlp": tile, "offload": False},
        "pieces, no autocast": {"tile_mlp": tile, "autocast": False},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.tile_check")
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--lora-r", type=int, default=32)
    p.add_argument("--storage", default="try", choices=("try", "builder"),
                   help="the NF4 words' storage: as lab.context_parallel's tries build it, or the builder's default")
    p.add_argument("--only", default=None, help="run only this setting (each in a fresh process is what counts: a setting's cast of the weights stays)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the model's own forward (its value from another process is the reference then)")
    p.add_argument("--list", action="store_true", help="print the settings' names, ';'-separated, and stop")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.list:
        print(";".join(settings_for(args.tile, cuda=False)))
        return 0

    import torch

    from lab.long_context import make_row
    from qlora_nb_utils import env, models, optimize
    from qlora_nb_utils.distributed.big_model import build_named_qlora
    from qlora_nb_utils.distributed.packed_words import sharded_nf4_precision

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    storage = sharded_nf4_precision(dtype, "auto")[1] if args.storage == "try" else None
    model, _ = build_named_qlora(args.model, device=device, dtype=dtype, lora_r=args.lora_r, lora_alpha=2 * args.lora_r,
                                 seed=0, **({"quant_storage": storage} if storage is not None else {}))
    gen = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():  # every B non-zero: the LoRA path adds to every projection, as after training
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    row = {k: v.to(device) for k, v in make_row(args.seq_len, min(models.model_config(args.model).vocab_size, 49152)).items()}

    def measure(fwd) -> dict:
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        loss = fwd()
        loss.backward()
        by_name = {n: float(p.grad.float().norm()) for n, p in model.named_parameters()  # read now: a setting
                   if p.requires_grad and p.grad is not None}  # may have replaced parameters
        norm = sum(v * v for v in by_name.values()) ** 0.5
        return {"loss": float(loss.detach()), "grad_norm": norm, "seconds": round(time.perf_counter() - t, 2),
                "grad_norms": by_name}

    base = {"scope": "regional", "grad_ckpt": True, "offload": cuda, "ce_chunks": 8}
    settings = settings_for(args.tile, cuda)
    rec = {"what": __doc__.split("\n\n")[2].replace("\n", " "), "model": args.model, "seq_len": args.seq_len,
           "tile": args.tile, "lora_r": args.lora_r, "storage": args.storage, "runs": {}}
    configs = list({id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values())
    old = [cfg._attn_implementation for cfg in configs]
    for cfg in configs:
        cfg._attn_implementation = "eager"
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    with amp:
        rec["runs"]["reference"] = ({"loss": float("nan"), "grad_norm": float("nan"), "grad_norms": {}, "settings": "not run"}
                                    if args.no_reference else
                                    {**measure(lambda: model(**row).loss), "settings": "the model's own forward, eager attention"})
    for cfg, impl in zip(configs, old):
        cfg._attn_implementation = impl
    print(f"[tile_check] reference: loss {rec['runs']['reference']['loss']:.6f}, grad norm "
          f"{rec['runs']['reference']['grad_norm']:.6f}", flush=True)
    for name, knobs in settings.items():
        if args.only and name != args.only:
            continue
        try:
            opt = optimize(model, batches=[row], **{**base, **knobs})
        except ValueError as exc:  # a setting this device refuses: said, not run
            rec["runs"][name] = {"refused": str(exc), "settings": knobs}
            print(f"[tile_check] {name}: refused: {exc}", flush=True)
            continue
        try:
            run = measure(lambda opt=opt: opt.forward(**row).loss)
            run["choices"] = {k: str(opt.choices[k]) for k in ("tile_mlp", "nf4_lora_linear", "lora_groups", "lora_wide",
                                                               "nf4_dequant", "autocast", "offload", "sdpa_kernel")
                              if k in opt.choices}
        finally:
            opt.undo()
            torch.compiler.reset()  # each setting compiles the layer anew, none counted against the next
        run["settings"] = knobs
        run["loss_minus_reference"] = run["loss"] - rec["runs"]["reference"]["loss"]
        ref = rec["runs"]["reference"]["grad_norms"]
        ratios = sorted(((v / ref[n] if ref.get(n) else float("inf"), n) for n, v in run["grad_norms"].items()), reverse=True)
        run["largest_over_reference"] = [[n, r] for r, n in ratios[:8]]
        run["names_not_in_reference"] = sorted(set(run["grad_norms"]) - set(ref))[:20]
        rec["runs"][name] = run
        print(f"[tile_check] {name}: loss {run['loss']:.6f} ({run['loss_minus_reference']:+.2e} from the reference), "
              f"grad norm {run['grad_norm']:.6f}; largest over the reference {run['largest_over_reference'][:3]}; "
              f"not in it {run['names_not_in_reference'][:3]}; {run['choices']}", flush=True)
    rec.update(device=env.device_info(device), versions=env.versions(), date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join(["python -m lab.tile_check", *(argv if argv is not None else sys.argv[1:])]))
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
