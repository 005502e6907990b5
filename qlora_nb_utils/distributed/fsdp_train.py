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
  writes ``OUT/summary.json``: every layout's fields (:mod:`qlora_nb_utils.distributed.runs`) and
  FSDP2's (the 4-bit weights' storage, each kind of weight's sharding, compilations, the byte check).
* **Nothing lost.** ``--save-every K`` writes a resumable checkpoint (sharded LoRA weights +
  optimizer state with ``torch.distributed.checkpoint``, step, scheduler, RNG) atomically;
  ``--resume`` continues from the newest complete one with the same subsequent losses. At the
  end the adapter is gathered to rank 0 and saved as a plain PEFT adapter (``OUT/adapter``).

``--trainer hf|trl`` runs the same fine-tune through ``transformers.Trainer`` /
``trl.SFTTrainer`` with accelerate's FSDP2 settings instead
(:func:`qlora_nb_utils.distributed.trainer.run_trainer`). The options, checks and steps every
layout shares, and the parent-process side (``launch``, ``read_log``, ``compare_runs``), are in
:mod:`qlora_nb_utils.distributed.runs`; this module keeps what is FSDP2's own.
Bad input (a global batch not divisible by the world size, ...) stops every rank before any
model is loaded, with a message that says what to change.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import torch

from .global_batches import local_micro_batches, loss_sum, make_global_batches, target_count
from .profiling import start_profiler, write_profile
from .runs import (
    DTYPE_CHOICES,
    RankRun,
    add_common_arguments,
    add_sharding_arguments,
    check_common,
    read_log,
    run_main,
)

# the load-time rules (resolve_nf4_mode is imported from here too)
from .setup import resolve_frozen_mode, resolve_nf4_mode

__all__ = ["resolve_nf4_mode", "build_parser", "validate", "main", "run", "DTYPE_CHOICES", "TRAINERS"]

TRAINERS = ("none", "hf", "trl")
MODULE = "qlora_nb_utils.distributed.fsdp_train"


# ----------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    """The command-line options (see ``--help``): the layouts' shared ones, FSDP2's and this loop's."""
    from .setup import QUANT_STORAGE_CHOICES

    p = argparse.ArgumentParser(prog=f"torchrun --nproc-per-node N -m {MODULE}",
                                description="QLoRA + FSDP2 + per-layer torch.compile.")
    add_common_arguments(p)
    add_sharding_arguments(p)
    p.add_argument("--quant", default="nf4", choices=("nf4", "none"))
    p.add_argument("--quant-storage", default="auto", choices=QUANT_STORAGE_CHOICES)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile each decoder layer (default on)")
    p.add_argument("--fullgraph", action=argparse.BooleanOptionalAction, default=True,
                   help="a graph break inside a layer is an error (default); --no-fullgraph counts them")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--permute-rows", type=int, default=None, metavar="SEED",
                   help="permute the rows of every global batch (the bf16 floor run, training/parity.py)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps in OUT/ckpt (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT/ckpt")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this many steps as if killed (tests the resume path)")
    p.add_argument("--probe", action="store_true",
                   help="save the logits of the first global batch after training (OUT/probe.pt)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="profile this many steps after --timing-warmup (torch.profiler): where each rank's "
                        "step time goes, as tables in OUT/profile_rank<R>.txt")
    p.add_argument("--trainer", default="none", choices=TRAINERS,
                   help="run through transformers.Trainer (hf) or trl.SFTTrainer (trl) with FSDP2")
    p.add_argument("--fast-path", action="store_true",
                   help="compile.optimize()'s recipe on every rank, then FSDP2 (distributed/fast.py); on one "
                        "process the plain single-GPU fast path, nothing sharded; --optimize sets its options")
    p.add_argument("--vocab-parallel-head", action="store_true",
                   help="with --fast-path on several ranks: the LM head split by vocabulary rows over the ranks, "
                        "the loss vocabulary-parallel (ops.vocab_parallel): no rank gathers the whole head")
    p.add_argument("--one-gpu-scope", default="whole", choices=("whole", "regional"),
                   help="with --fast-path on one process: optimize()'s scope (distributed/fast.py)")
    return p


def validate(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the options against each other and the world size; fill in defaults.

    Returns:
        ``args`` with ``micro_batch_size``, ``grad_accum`` and ``optimize_knobs`` set.

    Raises:
        ValueError: with a message that says what to change.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1; got {world_size}")
    if args.optimize and not args.fast_path:
        raise ValueError("--optimize sets options of optimize(), which runs with --fast-path: add --fast-path")
    # what --fast-path hands optimize() itself (distributed/fast.py), checked with --optimize's options
    fixed = {"scope": "regional" if world_size > 1 else args.one_gpu_scope, "cast": False, "backend": args.backend,
             "grad_ckpt": True if args.grad_ckpt else "auto"}
    check_common(args, layout="fsdp", fixed=fixed,
                 flags={"backend": "--backend", "grad_ckpt": "--grad-ckpt", "scope": "--one-gpu-scope"})
    g = args.global_batch_size
    if g % world_size:
        raise ValueError(f"--global-batch-size {g} is not divisible by the world size {world_size}: "
                         f"every rank takes the same number of rows; use a multiple of {world_size}")
    local = g // world_size
    micro = args.micro_batch_size or local
    if local % micro:
        raise ValueError(f"--micro-batch-size {micro} must divide the per-rank batch {local} "
                         f"(= global {g} / world size {world_size})")
    if args.save_every < 0:
        raise ValueError(f"--save-every must be >= 0; got {args.save_every}")
    if args.stop_at is not None and not 1 <= args.stop_at < args.steps:
        raise ValueError(f"--stop-at must be between 1 and --steps - 1 ({args.steps - 1}); got {args.stop_at}")
    if args.trainer != "none" and (args.resume or args.stop_at or args.save_every):
        raise ValueError("--trainer runs do not take --resume/--stop-at/--save-every "
                         "(the Trainer has its own save_steps / resume_from_checkpoint)")
    if args.fast_path and (args.resume or args.stop_at or args.save_every or args.probe
                           or args.trainer != "none" or not args.compile):
        raise ValueError("--fast-path does not take --resume/--stop-at/--save-every/--probe/--trainer/--no-compile "
                         "(its checkpoints and logits probe are not written yet)")
    if args.vocab_parallel_head and not args.fast_path:
        raise ValueError("--vocab-parallel-head splits the fast path's chunked loss: it needs --fast-path")
    if args.build == "layerwise" and args.quant != "nf4":
        raise ValueError("--build layerwise makes NF4 weights; it needs --quant nf4")
    args.micro_batch_size = micro
    args.grad_accum = local // micro
    return args


# ----------------------------------------------------------------------------- the run
def _setup(args, info, dtype):
    """Load, shard and (optionally) compile the model.

    Returns:
        ``(sharded, tok, mp, storage, batches)``; ``batches`` (the global batches) only with
        ``--fast-path``, whose choices are made from them (None otherwise).
    """
    from .fsdp import apply_fsdp2
    from .packed_words import sharded_nf4_precision
    from .setup import load_qlora, mixed_precision, resolve_quant_storage

    nf4 = resolve_nf4_mode(args.nf4, info.backend)
    if (nf4 == "shard" or args.fast_path) and args.quant == "nf4":
        mp, storage = sharded_nf4_precision(dtype, args.quant_storage)  # no 16-bit all-gather of packed words
    else:
        mp = mixed_precision(dtype)
        storage = resolve_quant_storage(args.quant_storage, mp.param_dtype, dtype)
    if args.build == "layerwise":
        from .big_model import build_named_qlora

        model, tok = build_named_qlora(args.model, device=info.device, dtype=dtype, quant_storage=storage,
                                       lora_r=args.lora_r, lora_alpha=args.lora_alpha, seed=args.seed)
    else:
        model, tok = load_qlora(args.model, quant=args.quant, dtype=dtype, device=info.device,
                                quant_storage=storage, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                                seed=args.seed)
    frozen = resolve_frozen_mode(args.frozen, info.backend)
    verify = "exact" if args.check_bytes else True
    if args.fast_path:
        from .fast import optimize_sharded

        batches = make_global_batches(tok, args)
        sample = [m for b in batches[:4] for m in local_micro_batches(b, info, args)]
        sharded = optimize_sharded(model, batches=sample, world_size=info.world_size, mp_policy=mp, nf4=nf4,
                                   frozen=frozen, cpu_offload=args.cpu_offload,
                                   reshard_after_forward=args.reshard_after_forward,
                                   grad_ckpt=True if args.grad_ckpt else "auto", backend=args.backend, verify=verify,
                                   one_scope=args.one_gpu_scope, vocab_head=args.vocab_parallel_head,
                                   **args.optimize_knobs)
        return sharded, tok, mp, storage, batches
    sharded = apply_fsdp2(model, mp_policy=mp, nf4=nf4, verify=verify, frozen=frozen, cpu_offload=args.cpu_offload,
                          reshard_after_forward=args.reshard_after_forward, grad_ckpt=args.grad_ckpt,
                          compile_layers=args.compile, backend=args.backend, fullgraph=args.fullgraph)
    return sharded, tok, mp, storage, None


def _train_step(job: RankRun, model, params, opt, sched, batch, fast=None) -> dict:
    import torch.distributed as dist

    from .fsdp import clip_grad_norm

    info, args = job.info, job.args
    t0 = job.clock()
    n_targets = max(1, target_count(batch))
    total = torch.zeros((), device=info.device)
    micro_batches = local_micro_batches(batch, info, args)
    for i, micro in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        (fast or model).set_requires_gradient_sync(last)  # one reduce-scatter per step, after the last micro
        loss = (fast.loss(micro) * target_count(micro) if fast is not None else loss_sum(model, micro)) / n_targets
        (loss * info.world_size).backward()  # FSDP2 averages over ranks; the loss is a global mean
        total += loss.detach()
    dist.all_reduce(total)
    grad_norm, lr = job.optimizer_step(opt, sched, lambda max_norm: clip_grad_norm(params, max_norm))
    loss_value = float(total)
    elapsed = job.clock() - t0
    return {"loss": loss_value, "step_ms": elapsed * 1e3, "grad_norm": grad_norm, "lr": lr,
            "tokens": int(batch["attention_mask"].sum()), "tokens_padded": int(batch["attention_mask"].numel())}


def run(args: argparse.Namespace) -> dict | None:
    """Train as ``args`` says on this rank (called by :func:`main` under torchrun).

    Returns:
        The summary dict on rank 0 (None elsewhere, and None when stopped by ``--stop-at``).
    """
    import torch.distributed as dist

    from ..training.device import reset_peak
    from .checkpoint import latest_checkpoint, load_checkpoint, save_adapter, save_checkpoint
    from .fsdp import sharding_report

    job = RankRun(args, tag="fsdp_train", module=MODULE)
    info, out = job.info, job.out
    sharded, tok, mp, storage, batches = _setup(args, info, job.dtype)
    model = sharded.model
    fast = sharded if args.fast_path else None
    if info.is_main:
        (out / "sharding.json").write_text(json.dumps(sharding_report(model), indent=1) + "\n")
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sched = job.optimizer(params)
    start = 0
    if args.resume:
        found = latest_checkpoint(out / "ckpt")
        if found is not None:
            meta = load_checkpoint(found[1], model, opt, scheduler=sched, info=info)
            start = int(meta["step"])
            job.say(f"resumed from {found[1]} at step {start}")
        else:
            job.say(f"--resume: no checkpoint in {out / 'ckpt'}; starting at step 0")
    job.reset_log(start)
    dist.barrier()
    if batches is None:
        batches = make_global_batches(tok, args)
    reset_peak(info.device)
    model.train()
    profiler = None
    for step in range(start, args.steps):
        if args.profile and step == start + args.timing_warmup:
            profiler = start_profiler(info)
        rec = _train_step(job, model, params, opt, sched, batches[step % len(batches)], fast)
        if profiler is not None and step == start + args.timing_warmup + args.profile - 1:
            write_profile(profiler, out, info, args.profile)
            profiler = None
        job.log({**rec, "step": step, "run_start": start})
        done = step + 1
        if args.save_every and done % args.save_every == 0 and done < args.steps:
            save_checkpoint(out / "ckpt", done, model, opt, scheduler=sched, info=info,
                            extra={"model": args.model, "global_batch_size": args.global_batch_size})
        if args.stop_at is not None and done == args.stop_at:
            job.say(f"stopped after step {done} (--stop-at)")
            job.stop()
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
        records = read_log(job.log_path)
        for r in records:
            r.setdefault("run_start", 0)
        summary = _summary(job, records, sharded, storage, start)
        if fast is not None:
            summary["fast_path"] = {**ranks[0], "ranks": ranks}
        summary.update(eval_loss=eval_loss, bytes_check=sharded.bytes_check,
                       frozen=resolve_frozen_mode(args.frozen, info.backend),
                       vocab_parallel_head=bool(args.vocab_parallel_head and info.world_size > 1),
                       mp_param_dtype=str(mp.param_dtype).replace("torch.", "") if mp.param_dtype else None)
    job.finish(summary)
    return summary


def _summary(job: RankRun, records: list[dict], sharded, storage, start: int) -> dict:
    """The shared fields (:func:`.runs.summary_fields`; no tokens/s before ``--timing-warmup`` steps) and
    FSDP2's: the 4-bit weights' storage and sharding, each kind of weight's placements, compilations."""
    from .fsdp import sharding_report

    args = job.args
    kinds: dict[str, dict[str, int]] = {}
    for row in sharding_report(sharded.model):
        key = "+".join(row["placements"]) or "not sharded"
        kinds.setdefault(row["kind"], {}).setdefault(key, 0)
        kinds[row["kind"]][key] += 1
    summary = job.summary(records, start=start, or_last=False)
    summary["graph_breaks"].update(
        compiled_layers=len(sharded.layers) if args.compile else 0,
        fullgraph=bool(args.compile and args.fullgraph),
        fsdp_boundary=0 if args.compile else None,
        fsdp_boundary_note=("FSDP2's pre/post-forward hooks are torch._dynamo.disable'd and run eagerly around "
                            "each compiled layer's forward frame: no break is taken there"))
    summary.update(quant_storage=str(storage).replace("torch.", ""), nf4=sharded.nf4, resumed_from=start or None,
                   compile=sharded.compile_stats(), sharding=kinds)
    return summary


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

    n_targets = max(1, target_count(batch))
    total = torch.zeros((), device=info.device)
    # the fast path's step runs in grad mode (its in-place LoRA Function is traced for training
    # only); the graph it builds is dropped unused
    with torch.no_grad() if fast is None else torch.enable_grad():
        for micro in local_micro_batches(batch, info, args):
            loss = fast.loss(micro) * target_count(micro) if fast is not None else loss_sum(model, micro)
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
def _run_or_trainer(args: argparse.Namespace) -> None:
    if args.trainer != "none":
        from .trainer import run_trainer

        run_trainer(args)
    else:
        run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate (before any model is loaded), run. Returns the exit status."""
    return run_main(build_parser(), validate, _run_or_trainer, argv)


if __name__ == "__main__":
    from .runs import exit_after_run

    exit_after_run(main())  # gloo's threads may abort a finished run's exit: runs.exit_after_run
