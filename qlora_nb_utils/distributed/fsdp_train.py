"""The ``torchrun`` entry point: QLoRA fine-tuning sharded with FSDP2, compiled per layer.

    torchrun --nproc-per-node N -m qlora_nb_utils.distributed.fsdp_train --model tiny --steps 8 \\
        --global-batch-size 4 --seq-len 128 --out runs/fsdp2

Why a script of its own and not :func:`qlora_nb_utils.training.train`: a sharded run is N
processes that must agree on every batch, every loss normalisation and every checkpoint, and
the comparison that matters ("N ranks give the loss of one") only holds when the loop is
written for it:

* **Same global batch.** Every rank builds the same list of global batches from the shipped
  data (same seed) and takes rows ``[rank*B/N, (rank+1)*B/N)`` of each. The loss is summed
  over each rank's target tokens and divided by the *global* count of target tokens (known
  to every rank without communication), so the all-reduced loss is exactly the one-process
  loss; the backward uses the same loss times N because FSDP2 averages gradients over ranks.
* **One log, one summary.** Rank 0 appends one JSON line per step to ``OUT/log.jsonl`` (step,
  loss, step_ms, tokens, peak_mem_gib: the maximum over ranks) and writes ``OUT/summary.json``
  with world size, tokens/s (median of the per-step rates after ``--timing-warmup`` steps), peak memory per GPU,
  graph breaks, compilations, versions, device, command and date.
* **Nothing lost.** ``--save-every K`` writes a resumable checkpoint (sharded LoRA weights +
  optimizer state with ``torch.distributed.checkpoint``, step, scheduler, RNG) atomically;
  ``--resume`` continues from the newest complete one with the same subsequent losses. At the
  end the adapter is gathered to rank 0 and saved as a plain PEFT adapter (``OUT/adapter``).

``--trainer hf|trl`` runs the same fine-tune through ``transformers.Trainer`` /
``trl.SFTTrainer`` with accelerate's FSDP2 settings instead (see :func:`run_trainer`).
Bad input (a global batch not divisible by the world size, ...) stops every rank before any
model is loaded, with a message that says what to change.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["resolve_nf4_mode", "build_parser", "validate", "main", "run", "run_trainer", "read_log", "launch", "compare_runs"]

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
TRAINERS = ("none", "hf", "trl")


# ----------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    """The command-line options (see ``--help``)."""
    from .fsdp import FROZEN_MODES, NF4_MODES, QUANT_STORAGE_CHOICES

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
    p.add_argument("--frozen", default="shard", choices=FROZEN_MODES,
                   help="shard or replicate the other frozen weights (embeddings, LM head, norms): "
                        "replicate trades memory for no all-gather traffic")
    p.add_argument("--nf4", default="auto", choices=("auto",) + tuple(NF4_MODES),
                   help="shard or replicate the 4-bit weights; auto: shard on CPU (gloo), replicate on "
                        "CUDA (NCCL's all-gather rewrote NaN-patterned packed words on 2 H200s)")
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
    p.add_argument("--trainer", default="none", choices=TRAINERS,
                   help="run through transformers.Trainer (hf) or trl.SFTTrainer (trl) with FSDP2")
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
    args.micro_batch_size = micro
    args.grad_accum = local // micro
    return args


# ----------------------------------------------------------------------------- data
def make_global_batches(tok, args) -> list[dict]:
    """The list of global batches every rank builds identically (shipped data, fixed padding)."""
    from ..data import build_batches

    need = args.steps * args.global_batch_size * (max(1, args.seq_len // 64) if args.pack else 1)
    return build_batches(tok, batch_size=args.global_batch_size, steps=args.steps, max_len=args.seq_len,
                         padding="fixed", limit=min(4000, max(64, need)), pack=args.pack, seed=args.seed)


def _target_count(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def _loss_sum(model, micro: dict) -> torch.Tensor:
    """Summed next-token cross-entropy of a micro-batch (HF's shift, fp32 logits)."""
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    logits = logits[:, :-1].float()
    targets = micro["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum")


# ----------------------------------------------------------------------------- measuring
def _max_over_ranks(value: float, device: torch.device) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _graph_break_total() -> tuple[int, list[str]]:
    try:
        from torch._dynamo.utils import counters

        breaks = counters["graph_break"]
        return int(sum(breaks.values())), [str(r).splitlines()[0] for r in breaks]
    except Exception:  # private counters moved: report unknown
        return -1, []


def read_log(path: str | Path) -> list[dict]:
    """The per-step records of a ``log.jsonl`` (later lines win for a repeated step)."""
    path = Path(path)
    if not path.is_file():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def _truncate_log(path: Path, start: int) -> None:
    if path.is_file():
        keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < start]
        path.write_text("".join(ln + "\n" for ln in keep))


# ----------------------------------------------------------------------------- the run
def _setup(args, info):
    """Load, shard and (optionally) compile the model; returns (sharded, tok, dtype, mp, storage)."""
    from .fsdp import apply_fsdp2, load_qlora, mixed_precision, resolve_quant_storage

    dtype = (torch.bfloat16 if info.device.type == "cuda" else torch.float32) if args.dtype == "auto" \
        else getattr(torch, args.dtype)
    mp = mixed_precision(dtype)
    storage = resolve_quant_storage(args.quant_storage, mp.param_dtype, dtype)
    model, tok = load_qlora(args.model, quant=args.quant, dtype=dtype, device=info.device,
                            quant_storage=storage, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                            seed=args.seed)
    sharded = apply_fsdp2(model, mp_policy=mp, nf4=resolve_nf4_mode(args.nf4, info.backend),
                          frozen=args.frozen, cpu_offload=args.cpu_offload,
                          reshard_after_forward=args.reshard_after_forward, grad_ckpt=args.grad_ckpt,
                          compile_layers=args.compile, backend=args.backend, fullgraph=args.fullgraph)
    return sharded, tok, dtype, mp, storage


def resolve_nf4_mode(mode: str, backend: str) -> str:
    """``--nf4 auto``: ``"shard"`` on gloo, ``"replicate"`` on NCCL.

    Why: on 2 H200s (torch 2.11, NCCL) sharding the packed NF4 bytes in bf16 storage changed
    0.07% of the 16-bit words: every word that reads as a bf16 NaN came back as the canonical
    NaN 0x7fff (tools/fsdp_diag.py, results/fsdp2_h200_diag.json), so the 2-GPU model computed
    with different weights. Replicated 4-bit weights were bit-exact. On CPU/gloo sharding is exact
    (tests/test_fsdp.py), and :func:`qlora_nb_utils.distributed.fsdp.apply_fsdp2` checks it on every run.
    """
    if mode == "auto":
        return "replicate" if backend == "nccl" else "shard"
    return mode


def _local_micro_batches(batch: dict, info, args) -> list[dict]:
    local = args.global_batch_size // info.world_size
    lo = info.rank * local
    rows = {k: v[lo:lo + local] for k, v in batch.items()}
    m = args.micro_batch_size
    return [{k: v[i:i + m].to(info.device) for k, v in rows.items()} for i in range(0, local, m)]


def _train_step(model, params, opt, sched, batch, info, args) -> dict:
    import torch.distributed as dist

    from .fsdp import clip_grad_norm
    from ..training.loop import _sync

    _sync(info.device)
    t0 = time.perf_counter()
    n_targets = max(1, _target_count(batch))
    loss_sum = torch.zeros((), device=info.device)
    micro_batches = _local_micro_batches(batch, info, args)
    for i, micro in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        model.set_requires_gradient_sync(last)  # one reduce-scatter per step, after the last micro
        loss = _loss_sum(model, micro) / n_targets
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
    _sync(info.device)
    elapsed = time.perf_counter() - t0
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"loss is {loss_value}")
    return {"loss": loss_value, "step_ms": elapsed * 1e3, "grad_norm": grad_norm, "lr": lr,
            "tokens": int(batch["attention_mask"].sum()), "tokens_padded": int(batch["attention_mask"].numel())}


def _summary(args, info, records, sharded, storage, dtype, start_step, breaks_before,
             peak) -> dict:
    from .. import env
    from .fsdp import sharding_report

    breaks_after, reasons = _graph_break_total()
    timed = [r for r in records if r["step"] >= start_step + args.timing_warmup and r.get("run_start") == start_step]
    med = lambda xs: float(sorted(xs)[len(xs) // 2]) if xs else None  # noqa: E731
    step_ms = med([r["step_ms"] for r in timed])
    # Medians of per-step rates, not total tokens / total time: one late recompilation (an
    # 8.9 s step among 0.3 s ones on the GPU) must not set the throughput.
    rate = med([r["tokens"] / (r["step_ms"] / 1e3) for r in timed if r["step_ms"] > 0])
    rate_padded = med([r["tokens_padded"] / (r["step_ms"] / 1e3) for r in timed if r["step_ms"] > 0])
    report = sharding_report(sharded.model)
    kinds: dict[str, dict[str, int]] = {}
    for row in report:
        key = "+".join(row["placements"]) or "not sharded"
        kinds.setdefault(row["kind"], {}).setdefault(key, 0)
        kinds[row["kind"]][key] += 1
    compile_stats = sharded.compile_stats()
    return {
        "world_size": info.world_size,
        "backend": info.backend,
        "model": args.model,
        "options": {k: v for k, v in vars(args).items()},
        "dtype": str(dtype).replace("torch.", ""),
        "quant_storage": str(storage).replace("torch.", ""),
        "nf4": sharded.nf4,
        "steps": len(records),
        "resumed_from": start_step or None,
        "losses": [r["loss"] for r in records],
        "tokens_per_s": rate,
        "tokens_per_s_padded": rate_padded,
        "step_ms": [r["step_ms"] for r in records],
        "median_step_ms": step_ms,
        "timed_steps": len(timed),
        "first_step_s": next((r["step_ms"] / 1e3 for r in records if r["step"] == start_step), None),
        "peak_mem_gib_per_gpu": peak,
        "graph_breaks": {
            "total": breaks_after - breaks_before if breaks_after >= 0 else None,
            "reasons": reasons,
            "compiled_layers": len(sharded.layers) if args.compile else 0,
            "fullgraph": bool(args.compile and args.fullgraph),
            "fsdp_boundary": 0 if args.compile else None,
            "fsdp_boundary_note": ("FSDP2's pre/post-forward hooks are torch._dynamo.disable'd and run "
                                   "eagerly around each compiled layer's forward frame: no break "
                                   "is taken there"),
        },
        "compile": compile_stats,
        "sharding": kinds,
        "device": env.device_info(info.device),
        "versions": env.versions(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, "-m", "qlora_nb_utils.distributed.fsdp_train", *sys.argv[1:]]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }


def run(args: argparse.Namespace) -> dict | None:
    """Train as ``args`` says on this rank (called by :func:`main` under torchrun).

    Returns:
        The summary dict on rank 0 (None elsewhere, and None when stopped by ``--stop-at``).
    """
    import torch.distributed as dist

    from .fsdp import init_distributed, latest_checkpoint, load_checkpoint, save_adapter, save_checkpoint
    from ..training.loop import _peak_mem_gib

    info = init_distributed(args.device)
    out = Path(args.out)
    log_path = out / "log.jsonl"
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    breaks_before, _ = _graph_break_total()
    sharded, tok, dtype, mp, storage = _setup(args, info)
    model = sharded.model
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
    batches = make_global_batches(tok, args)
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    model.train()
    peak = 0.0
    for step in range(start, args.steps):
        rec = _train_step(model, params, opt, sched, batches[step % len(batches)], info, args)
        peak = max(peak, _max_over_ranks(_peak_mem_gib(info.device), info.device))
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
    if not args.no_adapter:
        save_adapter(model, out / "adapter", is_main=info.is_main)
    summary = None
    if info.is_main:
        records = read_log(log_path)
        for r in records:
            r.setdefault("run_start", 0)
        summary = _summary(args, info, records, sharded, storage, dtype, start, breaks_before, peak)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        print(f"[fsdp_train] world_size={info.world_size} steps={len(records)} "
              f"final_loss={records[-1]['loss']:.6f} tokens/s={summary['tokens_per_s']} "
              f"graph_breaks={summary['graph_breaks']['total']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return summary


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


# ----------------------------------------------------------------------------- HF Trainer / TRL
def run_trainer(args: argparse.Namespace) -> dict | None:
    """The same fine-tune through ``transformers.Trainer`` (``hf``) or ``trl.SFTTrainer`` (``trl``)
    with accelerate's FSDP2 (``fsdp=True``, ``fsdp_config={"version": 2, ...}``; transformers
    5.17 deprecates the string form ``fsdp="full_shard"``, and its key is ``version``).

    Launch it with torchrun like the explicit loop. On GPUs the Trainer wraps each decoder
    layer and the root with ``fully_shard`` through accelerate's ``fsdp2_prepare_model``,
    which puts uint8 ``Params4bit`` into ``ignored_params`` (replicated, like
    ``nf4="replicate"``) and shards a floating quant storage. With ``--compile`` each decoder
    layer of the prepared model is compiled (``prepare_for_compile(scope="regional")``) in a
    callback at the start of training; the Trainer's own ``torch_compile`` compiles the whole
    model instead.

    **Not on CPU.** accelerate 1.15 turns the FSDP plugin on only when its distributed type
    is one of the accelerator kinds (``MULTI_GPU``, ``MULTI_XPU``, ``MULTI_NPU``, ...;
    ``AcceleratorState.__init__`` in ``accelerate/state.py``); a gloo CPU run is
    ``MULTI_CPU``, so the ``fsdp_config`` is ignored and the model is wrapped in DDP (its log
    says ``find_unused_parameters=True was specified in DDP constructor``). The run still
    trains; the summary records ``distributed_type`` and ``fsdp_wrapped`` so that CI checks
    the gap (a strict xfail) rather than assuming FSDP2 happened. The Trainer's loss is also
    normalised differently (per-rank mean, its own shuffling), so its losses are not compared
    with the explicit loop's.

    Returns:
        The summary on rank 0 (also written to ``OUT/summary.json``), None elsewhere.
    """
    from .. import env
    from .fsdp import init_distributed, load_qlora, mixed_precision, resolve_quant_storage

    info = init_distributed(args.device)
    out = Path(args.out)
    dtype = (torch.bfloat16 if info.device.type == "cuda" else torch.float32) if args.dtype == "auto" \
        else getattr(torch, args.dtype)
    storage = resolve_quant_storage(args.quant_storage, mixed_precision(dtype).param_dtype, dtype)
    model, tok = load_qlora(args.model, quant=args.quant, dtype=dtype, device=info.device,
                            quant_storage=storage, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                            seed=args.seed)
    batches = make_global_batches(tok, args)
    rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["input_ids"]))]
    trainer = _build_trainer(args, info, model, tok, rows, dtype, out)
    result = trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    from torch.distributed.fsdp import FSDPModule

    distributed_type = str(getattr(trainer.accelerator.distributed_type, "value", trainer.accelerator.distributed_type))
    fsdp_wrapped = any(isinstance(m, FSDPModule) for m in trainer.model_wrapped.modules())
    if info.is_main and not fsdp_wrapped:
        print(f"[fsdp_train] WARNING: the Trainer did not shard with FSDP2 (accelerate chose "
              f"{distributed_type}); accelerate 1.15 enables FSDP only on accelerators, not on CPU",
              flush=True)
    summary = None
    if info.is_main:
        summary = {"world_size": info.world_size, "trainer": args.trainer, "model": args.model,
                   "distributed_type": distributed_type, "fsdp_wrapped": fsdp_wrapped,
                   "losses": [float(h["loss"]) for h in logs], "train_runtime_s": result.metrics.get("train_runtime"),
                   "fsdp_version": 2, "quant_storage": str(storage).replace("torch.", ""),
                   "device": env.device_info(info.device), "versions": env.versions(),
                   "date": _dt.datetime.now(_dt.timezone.utc).isoformat()}
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    trainer.save_model(str(out / "adapter"))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return summary


def _build_trainer(args, info, model, tok, rows, dtype, out: Path):
    from transformers import Trainer, TrainingArguments

    local = args.global_batch_size // info.world_size
    common = dict(
        output_dir=str(out / "trainer"), per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=local // args.micro_batch_size, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
        max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else 0.0, seed=args.seed,
        save_strategy="no", report_to=[], use_cpu=info.device.type == "cpu",
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, dataloader_num_workers=0,
        remove_unused_columns=False, optim="adamw_torch", weight_decay=0.0,
        gradient_checkpointing=args.grad_ckpt,
        gradient_checkpointing_kwargs={"use_reentrant": False} if args.grad_ckpt else None,
        fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": args.reshard_after_forward,
                                        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                        "cpu_offload": args.cpu_offload},
    )
    from ..data import PaddingCollator

    collator = PaddingCollator(pad_token_id=tok.pad_token_id, policy="fixed", max_length=args.seq_len)
    from datasets import Dataset

    ds = Dataset.from_list([{"input_ids": r["input_ids"].tolist(), "labels": r["labels"].tolist()} for r in rows])
    callbacks = [_RegionalCompileCallback(args.backend, args.fullgraph)] if args.compile else []
    if args.trainer == "trl":
        from trl import SFTConfig, SFTTrainer

        cfg = SFTConfig(**common, max_length=args.seq_len, packing=False, dataset_kwargs={"skip_prepare_dataset": True})
        return SFTTrainer(model=model, args=cfg, train_dataset=ds, data_collator=collator,
                          processing_class=tok, callbacks=callbacks)
    return Trainer(model=model, args=TrainingArguments(**common), train_dataset=ds, data_collator=collator,
                   callbacks=callbacks)


def _regional_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class _RegionalCompileCallback(_regional_callback_base()):
    """Compile each decoder layer of the model the Trainer sharded, once training starts."""

    def __init__(self, backend: str, fullgraph: bool):
        self.backend, self.fullgraph, self.prepared = backend, fullgraph, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from ..compile import prepare_for_compile

        if model is not None and self.prepared is None:
            self.prepared = prepare_for_compile(model, grad_ckpt=None, scope="regional",
                                                backend=self.backend, fullgraph=self.fullgraph)



# ----------------------------------------------------------------------------- driving runs
def launch(nproc: int, args: Sequence[str], *, timeout: float | None = None, echo: bool = True):
    """Run ``torchrun --standalone --nproc-per-node nproc -m qlora_nb_utils.distributed.fsdp_train args``.

    What the notebook and ``tools/gpu_fsdp.sh`` call. ``OMP_NUM_THREADS`` is left to torchrun
    (1 per process when nproc > 1) unless already set.

    Returns:
        The ``subprocess.CompletedProcess`` (stdout and stderr captured as text).

    Raises:
        RuntimeError: the run failed; the message holds the tail of its output.
    """
    import subprocess

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "qlora_nb_utils.distributed.fsdp_train", *map(str, args)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if echo:
        for line in result.stdout.splitlines():
            if line.startswith("[fsdp_train]"):
                print(line, flush=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {result.returncode}:\n"
                           f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result


def _load_summary(folder: str | Path) -> dict:
    path = Path(folder) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"no summary.json in {folder}: did the run finish?")
    return json.loads(path.read_text())


def compare_runs(parity_one: str | Path, parity_n: str | Path, scaling_one: str | Path | None = None) -> dict:
    """The FSDP2 results record from finished runs (``results/fsdp2_<device>.json``).

    Args:
        parity_one: a 1-rank run at global batch G.
        parity_n: an N-rank run at the same global batch G and seed (per-rank batch G/N).
        scaling_one: a 1-rank run at global batch G/N (the N-rank run's per-rank batch), for
            the throughput comparison at the same per-GPU batch; None uses ``parity_one``.

    Returns:
        ``world_size``, ``tokens_per_s`` (``{"1": ..., "N": ...}``), ``scaling``,
        ``peak_mem_gib_per_gpu`` (same keys), ``max_abs_loss_diff`` (over the common steps),
        ``losses``, ``graph_breaks`` and ``compile`` per world size, ``per_gpu_batch``,
        ``device``, ``versions``, ``commands``, ``date``.

    Raises:
        ValueError: the parity runs differ in steps or global batch, or are not 1 and N ranks.
    """
    one, many = _load_summary(parity_one), _load_summary(parity_n)
    speed_one = _load_summary(scaling_one) if scaling_one is not None else one
    n = many["world_size"]
    if one["world_size"] != 1 or speed_one["world_size"] != 1 or n < 2:
        raise ValueError(f"need 1-rank runs and an N>=2-rank run; got {one['world_size']}, "
                         f"{speed_one['world_size']} and {n}")
    g1, gn = one["options"]["global_batch_size"], many["options"]["global_batch_size"]
    if g1 != gn or len(one["losses"]) != len(many["losses"]):
        raise ValueError(f"parity runs differ: global batch {g1} vs {gn}, steps "
                         f"{len(one['losses'])} vs {len(many['losses'])}")
    diffs = [abs(a - b) for a, b in zip(one["losses"], many["losses"])]
    key_n = str(n)
    tps = {"1": speed_one["tokens_per_s"], key_n: many["tokens_per_s"]}
    return {
        "world_size": n,
        "per_gpu_batch": {"1": speed_one["options"]["global_batch_size"], key_n: gn // n},
        "global_batch_for_parity": g1,
        "seq_len": many["options"]["seq_len"],
        "model": many["model"],
        "dtype": many["dtype"],
        "nf4": many["nf4"],
        "quant_storage": many["quant_storage"],
        "tokens_per_s": tps,
        "scaling": (tps[key_n] / tps["1"]) if tps["1"] and tps[key_n] else None,
        "peak_mem_gib_per_gpu": {"1": speed_one["peak_mem_gib_per_gpu"], key_n: many["peak_mem_gib_per_gpu"]},
        "max_abs_loss_diff": max(diffs) if diffs else None,
        "losses": {"1": one["losses"], key_n: many["losses"]},
        "graph_breaks": {"1": one["graph_breaks"], key_n: many["graph_breaks"]},
        "compile": {"1": one["compile"], key_n: many["compile"]},
        "first_step_s": {"1": one["first_step_s"], key_n: many["first_step_s"]},
        "device": many["device"],
        "versions": many["versions"],
        "commands": {"parity_1": one["command"], f"parity_{n}": many["command"],
                     "scaling_1": speed_one["command"]},
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }


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
        run_trainer(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
