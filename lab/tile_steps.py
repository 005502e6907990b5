"""The MLP in pieces against the MLP whole over AdamW steps, in one process, with the model's own forward
at the weights each first step wrote.

Wrote: lab/results/long_context/tile_steps_<gpu>.json
Rerun: python -m lab.tile_steps --out $OUT/tile_steps_<gpu>.json   (one GPU, carry .whl .gpucache;
  --model tiny --seq-len 256 --tile 64 runs on a CPU)

Why: the one-GPU fast path with the MLP in pieces (``tile_mlp``) took a loss after its first AdamW step
0.063 above the same path with the MLP whole at 65,536 tokens on the 8B shape, and 0.033 above it at
16,384 tokens on the 1B shape (pieces of 2,048), while the first step's gradients of the two agree as
closely as two attention kernels make them (``lab/tile_grads.py``) and, from a fresh compile, the pieces'
forward and gradients at non-zero LoRA weights agree with the model's own (``lab/tile_check.py``). Either
the first step writes other weights in the two runs, or the pieces' forward after a step does not see the
weights the step wrote. Here both runs start from the same weights, in one process (each compiled anew,
undone after), every step as ``lab.context_parallel``'s one-GPU try takes it (the gradients clipped to
norm 1, AdamW); the weights after the first step are kept, compared element by element, and the model's
own forward (the patches undone, SDPA attention, under the same autocast) is taken at each run's weights:
``loss_at_step1`` (the fast path's second loss) against ``own_loss_at_step1`` says whether the run's
forward saw its weights.

What it read (``lab/results/long_context/tile_steps_h200/``, H200, 1B shape, 16,384 tokens): the weights the
first step wrote were as close between the two runs as the gradients (about 2e-3 of the LoRA B elements moved
opposite ways), and the MLP in pieces was within 4e-3 of the model's own forward at its weights, while the MLP
whole took a loss 0.037 below it. With the narrow, ungrouped or unfused LoRA routes, or with every B non-zero
before the compile, both runs agreed with the model's own forward; Inductor was not the cause (aot_eager read
the same). ``lab/wide_check.py`` took it from there. After the pieces' forward kept gradients on, the two runs
took the same loss after the first step (``tile_steps_h200/plain_after_pieces_fix.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import sys
from pathlib import Path

from lab.tile_grads import _kind, build_try


def weights_apart(a: dict, b: dict, lr: float) -> dict:
    """By kind of weight: the largest difference of two runs' weights after one step, and the share of
    elements that moved apart by more than the learning rate (an AdamW first step moved them opposite ways)."""
    out: dict = {}
    for name in a:
        d = (a[name].float() - b[name].float()).abs()
        k = out.setdefault(_kind(name), {"max_abs": 0.0, "apart": 0, "elements": 0})
        k["max_abs"] = max(k["max_abs"], float(d.max()))
        k["apart"] += int((d > lr).sum())
        k["elements"] += d.numel()
    for k in out.values():
        k["share_apart"] = k["apart"] / k["elements"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.tile_steps")
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--tile", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ce-chunks", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--optimize", action="append", default=[], metavar="KEY=VALUE",
                   help="an optimize() option for both runs (repeatable), e.g. lora_addmm=narrow")
    p.add_argument("--b-start", default="zero", choices=("zero", "random"),
                   help="every LoRA B as PEFT starts it (zero) or non-zero before the compile (random, 0.02 scale)")
    p.add_argument("--backend", default="inductor", help="the compile backend of both runs (aot_eager: no Inductor)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    from qlora_nb_utils import env
    from qlora_nb_utils.distributed.fast import optimize_options, optimize_sharded

    model, row, device = build_try(args.model, args.seq_len)
    cuda = device.type == "cuda"
    trainable = {n: q for n, q in model.named_parameters() if q.requires_grad}
    if args.b_start == "random":
        gen = torch.Generator(device="cpu").manual_seed(1)
        with torch.no_grad():
            for n, q in trainable.items():
                if "lora_B" in n:
                    q.copy_(torch.randn(q.shape, generator=gen) * 0.02)
    start = {n: q.detach().clone() for n, q in trainable.items()}
    extra = optimize_options(args.optimize)
    rec = {"what": __doc__.split("\n\n")[2].replace("\n", " "), "model": args.model, "seq_len": args.seq_len,
           "tile": args.tile, "steps": args.steps, "lr": args.lr, "optimize": args.optimize, "b_start": args.b_start,
           "backend": args.backend, "runs": {}}
    after_first: dict = {}

    def own_loss(weights: dict) -> float:
        """The model's own forward (no patch), SDPA attention, under the autocast the fast path uses."""
        with torch.no_grad():
            for n, q in trainable.items():
                q.copy_(weights[n])
            amp = torch.autocast(device.type, dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
            with amp:
                return float(model(**row).loss)

    for name, tile in (("whole", False), ("pieces", args.tile)):
        with torch.no_grad():
            for n, q in trainable.items():
                q.copy_(start[n])
        fast = optimize_sharded(model, batches=[row], world_size=1, one_scope="regional", keep_attention=False,
                                sdpa_kernel="auto", grad_ckpt=True, offload=cuda, tile_mlp=tile,
                                ce_chunks=args.ce_chunks, backend=args.backend, **extra)
        try:
            params = [q for q in fast.root.parameters() if q.requires_grad]
            adam = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
            losses, norms = [], []
            for step in range(args.steps):
                loss = fast.loss(row)
                loss.backward()
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
                adam.step()
                adam.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
                if step == 0:
                    after_first[name] = {n: q.detach().clone() for n, q in trainable.items()}
            run = {"losses": losses, "grad_norms": norms,
                   "choices": {k: str(v) for k, v in fast.opt.choices.items()}}
        finally:
            fast.opt.undo()
            torch.compiler.reset()
        rec["runs"][name] = run
        print(f"[tile_steps] {name}: losses {losses}", flush=True)
    rec["own_loss_at_start"] = own_loss(start)
    print(f"[tile_steps] the model's own forward at the start {rec['own_loss_at_start']}", flush=True)
    for name, run in rec["runs"].items():
        run["own_loss_at_step1"] = own_loss(after_first[name])
        run["loss_at_step1"] = run["losses"][1] if len(run["losses"]) > 1 else None
        print(f"[tile_steps] {name}: its fast path at the weights its first step wrote {run['loss_at_step1']}, "
              f"the model's own forward there {run['own_loss_at_step1']}", flush=True)
    rec["weights_apart_after_step0"] = weights_apart(after_first["whole"], after_first["pieces"], args.lr)
    for k, v in sorted(rec["weights_apart_after_step0"].items()):
        print(f"[tile_steps] apart after step 0: {k}: max {v['max_abs']:.3e}, share {v['share_apart']:.2e}", flush=True)
    rec.update(device=env.device_info(device), versions=env.versions(),
               date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join(["python -m lab.tile_steps", *(argv if argv is not None else sys.argv[1:])]))
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
