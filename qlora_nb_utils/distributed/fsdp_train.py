"""The ``torchrun`` entry point: QLoRA fine-tuning sharded with FSDP2, compiled per layer.

    torchrun --nproc-per-node N -m qlora_nb_utils.distributed.fsdp_train --model tiny --steps 8 \\
        --global-batch-size 4 --seq-len 128 --out runs/fsdp2

Why a script of its own and not :func:`qlora_nb_utils.training.train`: a sharded run is N
processes that must agree on every batch, every loss normalisation and every checkpoint, and
the comparison that matters ("N ranks give the loss of one") only holds when the loop is
written for it:

* **Same global batch.** Every rank takes its rows of the same global batches, and the loss
  is normalised so that the all-reduced loss is the one-process loss
  (:mod:`qlora_nb_utils.distributed.global_batches` says how).
* **One log, one summary.** Rank 0 appends one JSON line per step to ``OUT/log.jsonl`` and
  writes ``OUT/summary.json`` (:mod:`qlora_nb_utils.distributed.summary` lists the fields).
* **Nothing lost.** ``--save-every K`` writes a resumable checkpoint (sharded LoRA weights +
  optimizer state with ``torch.distributed.checkpoint``, step, scheduler, RNG) atomically;
  ``--resume`` continues from the newest complete one with the same subsequent losses. At the
  end the adapter is gathered to rank 0 and saved as a plain PEFT adapter (``OUT/adapter``).

``--trainer hf|trl`` runs the same fine-tune through ``transformers.Trainer`` /
``trl.SFTTrainer`` with accelerate's FSDP2 settings instead
(:func:`qlora_nb_utils.distributed.trainer.run_trainer`). The parent-process side, ``launch``,
``read_log`` and ``compare_runs``, is in :mod:`qlora_nb_utils.distributed.runs`.
Bad input (a global batch not divisible by the world size, ...) stops every rank before any
model is loaded, with a message that says what to change.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from .fast import optimize_options
from .global_batches import _local_micro_batches, _loss_sum, _target_count, make_global_batches
from .runs import read_log
from .setup import resolve_nf4_mode  # defined with the other load-time rules; imported from here too
from .summary import _graph_break_total, _max_over_ranks, _summary

__all__ = ["resolve_nf4_mode", "build_parser", "validate", "main", "run"]

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
TRAINERS = ("none", "hf", "trl")


# ----------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    """The command-line options (see ``--help``)."""
    from .fsdp import FROZEN_MODES, NF4_MODES
    from .setup import QUANT_STORAGE_CHOICES

    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m qlora_nb_utils.distributed.fsdp_train",
                                description="QLoRA + FSDP2 + per-layer torch.compile.")
    p.add_argument("--model", default="tiny", help="a named model (models.MODEL_NAMES), a folder or a hub id")
    p.add_argument("--quant", default="nf4", choices=("nf4", "none"))
    p.add_argument("--steps", type=int, default=8, help="optimizer steps in total")
    p.add_argument("--global-batch-size", type=int, default=4, help="rows per optimizer step, all ranks together")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="rows per forward on one rank (default: the whole local batch, no accumulation)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--pack", action="store_true", help="pack examples into full --seq-len windows")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="compute dtype; auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile each decoder layer (default on)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend ('eager' traces only)")
    p.add_argument("--fullgraph", action=argparse.BooleanOptionalAction, default=True,
                   help="a graph break inside a layer is an error (default); --no-fullgraph counts them")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPUOffloadPolicy")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--frozen", default="auto", choices=("auto",) + tuple(FROZEN_MODES),
                   help="the other frozen weights (embeddings, LM head, norms): shard splits them over the "
                        "ranks; replicate keeps them whole on every rank (more memory, no all-gather traffic "
                        "for them); auto: replicate on CUDA, shard on CPU")
    p.add_argument("--nf4", default="auto", choices=("auto",) + tuple(NF4_MODES),
                   help="the 4-bit base weights: shard (what auto means, on every device) splits them over "
                        "the ranks, the words stored as float32 (--quant-storage auto) so that no 16-bit all-gather changes a byte, and "
                        "checksums them after the first all-gather; replicate keeps them whole on every rank "
                        "(no all-gather traffic for them, no memory saved)")
    p.add_argument("--check-bytes", action="store_true",
                   help="compare every packed 4-bit byte after the first all-gather with a copy taken "
                        "before sharding (summary: bytes_check)")
    p.add_argument("--permute-rows", type=int, default=None, metavar="SEED",
                   help="permute the rows of every global batch (the bf16 floor run, training/parity.py)")
    p.add_argument("--eval", action="store_true",
                   help="after training, the mean loss over the first global batch (summary: eval_loss)")
    p.add_argument("--quant-storage", default="auto", choices=QUANT_STORAGE_CHOICES)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=0, help="linear learning-rate warm-up steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="<= 0 disables clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-warmup", type=int, default=3, help="steps left out of the tokens/s median")
    p.add_argument("--out", required=True, help="output folder (log.jsonl, summary.json, adapter/, ckpt/)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT/ckpt")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this many steps as if killed (tests the resume path)")
    p.add_argument("--probe", action="store_true",
                   help="save the logits of the first global batch after training (OUT/probe.pt)")
    p.add_argument("--no-adapter", action="store_true", help="do not save the adapter at the end")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="profile this many steps after --timing-warmup (torch.profiler): where each rank's "
                        "step time goes, as tables in OUT/profile_rank<R>.txt")
    p.add_argument("--trainer", default="none", choices=TRAINERS,
                   help="run through transformers.Trainer (hf) or trl.SFTTrainer (trl) with FSDP2")
    p.add_argument("--fast-path", action="store_true",
                   help="compile.optimize()'s recipe on every rank, then FSDP2 (distributed/fast.py); on one "
                        "process the plain single-GPU fast path, nothing sharded")
    p.add_argument("--vocab-parallel-head", action="store_true",
                   help="with --fast-path on several ranks: the LM head split by vocabulary rows over the ranks, "
                        "the loss vocabulary-parallel (ops.vocab_parallel): no rank gathers the whole head")
    p.add_argument("--optimize", action="append", default=[], metavar="KEY=VALUE",
                   help="with --fast-path, an optimize() option (e.g. nf4_dequant=true, lora_addmm=unfused); repeatable")
    p.add_argument("--one-gpu-scope", default="whole", choices=("whole", "regional"),
                   help="with --fast-path on one process: optimize()'s scope (distributed/fast.py)")
    p.add_argument("--build", default="load", choices=("load", "layerwise"),
                   help="load: from_pretrained of the built checkpoint; layerwise: the named shape with random "
                        "NF4 weights made one linear layer at a time on the device (distributed/big_model.py)")
    return p


def validate(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the options against each other and the world size; fill in defaults.

    Returns:
        ``args`` with ``micro_batch_size`` and ``grad_accum`` set.

    Raises:
        ValueError: with a message that says what to change.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1; got {world_size}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1; got {args.steps}")
    if args.seq_len < 8:
        raise ValueError(f"--seq-len must be >= 8; got {args.seq_len}")
    g = args.global_batch_size
    if g < 1:
        raise ValueError(f"--global-batch-size must be >= 1; got {g}")
    if g % world_size:
        raise ValueError(f"--global-batch-size {g} is not divisible by the world size {world_size}: "
                         f"every rank takes the same number of rows; use a multiple of {world_size}")
    local = g // world_size
    micro = args.micro_batch_size or local
    if micro < 1 or local % micro:
        raise ValueError(f"--micro-batch-size {micro} must divide the per-rank batch {local} "
                         f"(= global {g} / world size {world_size})")
    if args.save_every < 0:
        raise ValueError(f"--save-every must be >= 0; got {args.save_every}")
    if args.stop_at is not None and not 1 <= args.stop_at < args.steps:
        raise ValueError(f"--stop-at must be between 1 and --steps - 1 ({args.steps - 1}); got {args.stop_at}")
    if args.timing_warmup < 0:
        raise ValueError(f"--timing-warmup must be >= 0; got {args.timing_warmup}")
    if args.trainer != "none" and (args.resume or args.stop_at or args.save_every):
        raise ValueError("--trainer runs do not take --resume/--stop-at/--save-every "
                         "(the Trainer has its own save_steps / resume_from_checkpoint)")
    if getattr(args, "fast_path", False) and (args.resume or args.stop_at or args.save_every or args.probe
                                              or args.trainer != "none" or not args.compile):
        raise ValueError("--fast-path does not take --resume/--stop-at/--save-every/--probe/--trainer/--no-compile "
                         "(its checkpoints and logits probe are not written yet)")
    if getattr(args, "vocab_parallel_head", False) and not getattr(args, "fast_path", False):
        raise ValueError("--vocab-parallel-head splits the fast path's chunked loss: it needs --fast-path")
    optimize_options(getattr(args, "optimize", []))  # a malformed pair stops here, before any model
    if getattr(args, "build", "load") == "layerwise" and args.quant != "nf4":
        raise ValueError("--build layerwise makes NF4 weights; it needs --quant nf4")
    args.micro_batch_size = micro
    args.grad_accum = local // micro
    return args


def _truncate_log(path: Path, start: int) -> None:
    if path.is_file():
        keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < start]
        path.write_text("".join(ln + "\n" for ln in keep))


# ----------------------------------------------------------------------------- the run
def _setup(args, info):
    """Load, shard and (optionally) compile the model.

    Returns:
        ``(sharded, tok, dtype, mp, storage, batches)``; ``batches`` (the global batches) only
        with ``--fast-path``, whose choices are made from them (None otherwise).
    """
    from .fsdp import apply_fsdp2
    from .packed_words import sharded_nf4_precision
    from .setup import load_qlora, mixed_precision, resolve_quant_storage

    dtype = (torch.bfloat16 if info.device.type == "cuda" else torch.float32) if args.dtype == "auto" \
        else getattr(torch, args.dtype)
    nf4 = resolve_nf4_mode(args.nf4, info.backend)
    fast = getattr(args, "fast_path", False)
    if (nf4 == "shard" or fast) and args.quant == "nf4":
        mp, storage = sharded_nf4_precision(dtype, args.quant_storage)  # no 16-bit all-gather of packed words
    else:
        mp = mixed_precision(dtype)
        storage = resolve_quant_storage(args.quant_storage, mp.param_dtype, dtype)
    if getattr(args, "build", "load") == "layerwise":
        from .big_model import build_named_qlora

        model, tok = build_named_qlora(args.model, device=info.device, dtype=dtype, quant_storage=storage,
                                       lora_r=args.lora_r, lora_alpha=args.lora_alpha, seed=args.seed)
    else:
        model, tok = load_qlora(args.model, quant=args.quant, dtype=dtype, device=info.device,
                                quant_storage=storage, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                                seed=args.seed)
    frozen = frozen_mode(args, info)
    if fast:
        from .fast import optimize_sharded

        batches = make_global_batches(tok, args)
        sample = [m for b in batches[:4] for m in _local_micro_batches(b, info, args)]
        sharded = optimize_sharded(model, batches=sample, world_size=info.world_size, mp_policy=mp, nf4=nf4,
                                   frozen=frozen, cpu_offload=args.cpu_offload,
                                   reshard_after_forward=args.reshard_after_forward,
                                   grad_ckpt=True if args.grad_ckpt else "auto", backend=args.backend, verify="exact" if args.check_bytes else True,
                                   one_scope=args.one_gpu_scope, vocab_head=args.vocab_parallel_head,
                                   **optimize_options(args.optimize))
        return sharded, tok, dtype, mp, storage, batches
    sharded = apply_fsdp2(model, mp_policy=mp, nf4=nf4, verify="exact" if args.check_bytes else True,
                          frozen=frozen, cpu_offload=args.cpu_offload,
                          reshard_after_forward=args.reshard_after_forward, grad_ckpt=args.grad_ckpt,
                          compile_layers=args.compile, backend=args.backend, fullgraph=args.fullgraph)
    return sharded, tok, dtype, mp, storage, None


def _train_step(model, params, opt, sched, batch, info, args, fast=None) -> dict:
    import torch.distributed as dist

    from ..training.device import sync
    from .fsdp import clip_grad_norm

    sync(info.device)
    t0 = time.perf_counter()
    n_targets = max(1, _target_count(batch))
    loss_sum = torch.zeros((), device=info.device)
    micro_batches = _local_micro_batches(batch, info, args)
    for i, micro in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        (fast or model).set_requires_gradient_sync(last)  # one reduce-scatter per step, after the last micro
        loss = (fast.loss(micro) * _target_count(micro) if fast is not None else _loss_sum(model, micro)) / n_targets
        (loss * info.world_size).backward()  # FSDP2 averages over ranks; the loss is a global mean
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum)
    max_norm = args.max_grad_norm if args.max_grad_norm > 0 else None
    grad_norm = clip_grad_norm(params, max_norm)
    lr = float(opt.param_groups[0]["lr"])
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    loss_value = float(loss_sum)
    sync(info.device)
    elapsed = time.perf_counter() - t0
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"loss is {loss_value}")
    return {"loss": loss_value, "step_ms": elapsed * 1e3, "grad_norm": grad_norm, "lr": lr,
            "tokens": int(batch["attention_mask"].sum()), "tokens_padded": int(batch["attention_mask"].numel())}


def run(args: argparse.Namespace) -> dict | None:
    """Train as ``args`` says on this rank (called by :func:`main` under torchrun).

    Returns:
        The summary dict on rank 0 (None elsewhere, and None when stopped by ``--stop-at``).
    """
    import torch.distributed as dist

    from ..training.device import peak_mem_gib, reset_peak
    from .checkpoint import latest_checkpoint, load_checkpoint, save_adapter, save_checkpoint
    from .setup import init_distributed

    info = init_distributed(args.device)
    out = Path(args.out)
    log_path = out / "log.jsonl"
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    breaks_before, _ = _graph_break_total()
    sharded, tok, dtype, mp, storage, batches = _setup(args, info)
    model = sharded.model
    fast = sharded if getattr(args, "fast_path", False) else None
    if info.is_main:
        from .fsdp import sharding_report

        (out / "sharding.json").write_text(json.dumps(sharding_report(model), indent=1) + "\n")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warm = max(args.warmup, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    start = 0
    if args.resume:
        found = latest_checkpoint(out / "ckpt")
        if found is not None:
            meta = load_checkpoint(found[1], model, opt, scheduler=sched, info=info)
            start = int(meta["step"])
            if info.is_main:
                print(f"[fsdp_train] resumed from {found[1]} at step {start}", flush=True)
        elif info.is_main:
            print(f"[fsdp_train] --resume: no checkpoint in {out / 'ckpt'}; starting at step 0", flush=True)
    if info.is_main:
        if start:
            _truncate_log(log_path, start)
        elif log_path.exists():
            log_path.unlink()
    dist.barrier()
    if batches is None:
        batches = make_global_batches(tok, args)
    reset_peak(info.device)
    model.train()
    peak = 0.0
    profiler = None
    for step in range(start, args.steps):
        if getattr(args, "profile", 0) and step == start + args.timing_warmup:
            profiler = _start_profiler(info)
        rec = _train_step(model, params, opt, sched, batches[step % len(batches)], info, args, fast)
        if profiler is not None and step == start + args.timing_warmup + args.profile - 1:
            _write_profile(profiler, out, info)
            profiler = None
        peak = max(peak, _max_over_ranks(peak_mem_gib(info.device), info.device))
        rec.update(step=step, peak_mem_gib=peak, world_size=info.world_size, run_start=start)
        if info.is_main:
            with log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        done = step + 1
        if args.save_every and done % args.save_every == 0 and done < args.steps:
            save_checkpoint(out / "ckpt", done, model, opt, scheduler=sched, info=info,
                            extra={"model": args.model, "global_batch_size": args.global_batch_size})
        if args.stop_at is not None and done == args.stop_at:
            if info.is_main:
                print(f"[fsdp_train] stopped after step {done} (--stop-at)", flush=True)
            dist.barrier()
            dist.destroy_process_group()
            return None
    if args.probe:
        _save_probe(model, batches[0], info, out)
    eval_loss = _eval_loss(model, batches[0], info, args, fast) if args.eval else None
    if not args.no_adapter:
        save_adapter(fast.peft if fast is not None else model, out / "adapter", is_main=info.is_main)
    summary = None
    ranks = None
    if fast is not None:  # what optimize() chose on every rank, gathered to rank 0
        ranks = [None] * info.world_size
        dist.all_gather_object(ranks, _fast_record(fast, info))
    if info.is_main:
        records = read_log(log_path)
        for r in records:
            r.setdefault("run_start", 0)
        summary = _summary(args, info, records, sharded, storage, dtype, start, breaks_before, peak)
        if fast is not None:
            summary["fast_path"] = {**ranks[0], "ranks": ranks}
        summary.update(eval_loss=eval_loss, bytes_check=sharded.bytes_check, frozen=frozen_mode(args, info),
                       vocab_parallel_head=bool(getattr(args, "vocab_parallel_head", False) and info.world_size > 1),
                       mp_param_dtype=str(mp.param_dtype).replace("torch.", "") if mp.param_dtype else None)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        print(f"[fsdp_train] world_size={info.world_size} steps={len(records)} "
              f"final_loss={records[-1]['loss']:.6f} tokens/s={summary['tokens_per_s']} "
              f"graph_breaks={summary['graph_breaks']['total']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _start_profiler(info):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    prof = profile(activities=acts)
    prof.__enter__()
    return prof


def _write_profile(prof, out: Path, info) -> None:
    """Two tables per rank: the ops by device time, by CPU time (collectives show as ``nccl:*``)."""
    prof.__exit__(None, None, None)
    table = prof.key_averages()
    text = []
    if info.device.type == "cuda":
        text += ["# by device time", table.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)]
    text += ["# by CPU time", table.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_rank{info.rank}.txt").write_text("\n".join(text) + "\n")


def frozen_mode(args, info) -> str:
    """``--frozen auto``: replicate on NCCL, shard on gloo."""
    return args.frozen if args.frozen != "auto" else ("replicate" if info.backend == "nccl" else "shard")


def _fast_record(fast, info) -> dict:
    """What ``optimize()`` chose on this rank, and its compilations (the summary holds every rank's)."""
    opt = fast.opt
    return {"ran": True, "rank": info.rank, "sharded": fast.sharded is not None, "world_size": info.world_size,
            "compile": fast.compile_stats(),
            "choices": {k: str(v) for k, v in opt.choices.items()},
            "reasons": dict(opt.reasons)}


def _eval_loss(model, batch: dict, info, args, fast=None) -> float:
    """Mean next-token loss over ``batch`` (every rank its rows, summed over ranks), under no
    grad in train mode (LoRA dropout is 0; see :func:`_save_probe` for why not eval mode)."""
    import torch.distributed as dist

    n_targets = max(1, _target_count(batch))
    total = torch.zeros((), device=info.device)
    # the fast path's step runs in grad mode (its in-place LoRA Function is traced for training
    # only); the graph it builds is dropped unused
    with torch.no_grad() if fast is None else torch.enable_grad():
        for micro in _local_micro_batches(batch, info, args):
            loss = fast.loss(micro) * _target_count(micro) if fast is not None else _loss_sum(model, micro)
            total += loss.detach().float()
    dist.all_reduce(total)
    return float(total) / n_targets


def _save_probe(model, batch: dict, info, out: Path, positions: int = 256) -> None:
    """Logits of the first row of the first global batch (its first ``positions`` positions, so
    that an 8B model's 128k-vocabulary logits stay small), every rank running the same row.
    Train mode under no grad: bitsandbytes' CPU eval path would repack the sharded weights."""
    ids, mask = batch["input_ids"][:1], batch["attention_mask"][:1]
    with torch.no_grad():
        logits = model(input_ids=ids.to(info.device), attention_mask=mask.to(info.device)).logits
    if info.is_main:
        torch.save({"input_ids": ids, "attention_mask": mask,
                    "logits": logits[:, :positions].float().cpu()}, out / "probe.pt")


# ----------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate (before any model is loaded), run. Returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate(args, world_size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.trainer != "none":
        from .trainer import run_trainer

        run_trainer(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
