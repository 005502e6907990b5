"""Context parallelism: one long row split by position over the ranks, FSDP2 and the fast path on each.

    torchrun --nproc-per-node 2 -m qlora_nb_utils.distributed.context_parallel \\
        --model llama-3.1-8b-shape --build layerwise --seq-len 262144 --max-memory-gib 22 --steps 20 --out runs/cp

Why: on one GPU the longest row that trains is bound by that GPU's memory, even with every layer
checkpointed, the checkpoints offloaded to host memory, the MLP run in pieces and the loss chunked
(``compile.optimize(max_memory_gib=...)``). Activations grow with the positions a GPU holds, so
splitting the positions over N GPUs lets a row N times as long train in the same memory per GPU.
What every rank does, and why it gives the one-process loss:

* **The same row on every rank, a shard of its positions each.** Every rank builds the same global
  batches (:mod:`.global_batches`) and keeps its positions of every row. The labels are shifted
  *before* the split (``shift_labels[s] = labels[s + 1]``): a shard's last position predicts the
  next shard's first token, which a shift inside the shard would lose. ``position_ids`` are the
  global positions of the shard, so the rotary embedding sees what one process sees.
* **Head-tail shards.** Under a causal mask the last positions attend to the most keys; with the
  row cut into ``2N`` chunks, rank ``r`` holds chunks ``r`` and ``2N - 1 - r`` (torch's load
  balance for causal context parallelism), so each rank computes the same share of attention.
  Lengths are padded (positions that attend to nothing that matters and carry no target) to a
  multiple of ``2N`` times the fast path's padding multiple, so no shard is padded again.
* **Ring attention** (:mod:`.ring_attention`): torch's context-parallel ring in place of the fast
  path's causal-only SDPA, an opaque operator inside each compiled decoder layer.
* **The loss over each rank's labelled rows.** Each rank computes the chunked loss over its
  shard's labelled rows (the fast path's loss, given ``shift_labels``), times its target count
  over the row's: the all-reduced sum is the one-process mean. FSDP2 averages gradients over the
  ranks, and the ring's backward sends each key's gradient back to its rank, so each rank's
  backward runs on ``N`` times its part (as in :mod:`.fsdp_train`).
* **FSDP2 over the same ranks.** The 4-bit weights, LoRA weights, gradients and optimizer state are
  sharded as in :mod:`.fast` (the same units, the same byte check of the packed words); every rank
  runs every decoder layer on its own positions.
* **Memory as on one GPU.** ``optimize`` sees the shard (``1 x L/N`` positions) and makes the
  choices it makes for that length on one GPU under ``max_memory_gib``: checkpointed layers, their
  inputs offloaded to host memory, the MLP in pieces. The ring adds the gathered keys and values
  of the whole row and float32 merges of the attention output per layer call, which the estimate
  does not count.

Rows of one causal sequence each (padded on the right, or packed without per-document masks): the
ring applies no padding mask, document mask or sliding window, and refuses a model that needs one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["head_tail_order", "shard_positions", "shard_multiple", "shift_targets", "target_count", "shard_batch",
           "ContextParallel", "optimize_context_parallel", "train_step", "eval_loss", "build_parser", "add_arguments",
           "validate", "run", "main"]

IGNORE = -100


# ----------------------------------------------------------------------------- sharding a row
def head_tail_order(seq_len: int, world_size: int) -> torch.Tensor:
    """The positions of a row in shard order: rank ``r``'s shard is chunks ``r`` and ``2N-1-r`` of ``2N``.

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 * world_size``.
    """
    if world_size < 1 or seq_len % (2 * world_size):
        raise ValueError(f"a head-tail split needs a length divisible by 2 x {world_size}; got {seq_len}")
    n = seq_len // (2 * world_size)
    return torch.cat([torch.cat([torch.arange(r * n, (r + 1) * n), torch.arange(seq_len - (r + 1) * n, seq_len - r * n)])
                      for r in range(world_size)])


def shard_positions(seq_len: int, world_size: int, rank: int, load_balance: bool = True) -> torch.Tensor:
    """The global positions rank ``rank`` holds (head-tail chunks, or one contiguous block)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if seq_len % (2 * world_size if load_balance else world_size):
        raise ValueError(f"length {seq_len} does not split evenly over {world_size} ranks")
    order = head_tail_order(seq_len, world_size) if load_balance else torch.arange(seq_len)
    per = seq_len // world_size
    return order[rank * per:(rank + 1) * per]


def shard_multiple(world_size: int, pad_multiple: int = 8, load_balance: bool = True) -> int:
    """Rows are padded to a multiple of this: ``2N`` head-tail chunks (``N`` shards), each a multiple of the
    fast path's padding, so that no shard is padded again (which would put positions in the middle of the row)."""
    return (2 if load_balance else 1) * world_size * max(1, pad_multiple)


def shift_targets(batch: dict) -> torch.Tensor:
    """Each position's next-token target (``labels[s + 1]``; the last position and padding: ignored)."""
    labels = batch.get("labels", batch["input_ids"])
    mask = batch.get("attention_mask")
    if mask is not None:
        labels = labels.masked_fill(mask == 0, IGNORE)
    out = torch.full_like(labels, IGNORE)
    out[:, :-1] = labels[:, 1:]
    return out


def target_count(batch: dict) -> int:
    """How many targets a (whole, unsharded) batch has: the denominator of its mean loss."""
    return int((shift_targets(batch) != IGNORE).sum())


def shard_batch(batch: dict, rank: int, world_size: int, *, load_balance: bool = True, pad_multiple: int = 8,
                pad_id: int = 0) -> dict:
    """This rank's part of a whole batch: ``input_ids``, ``position_ids`` and ``shift_labels`` of its positions.

    Args:
        batch: ``input_ids`` ``(B, S)``, ``labels`` (default: the ids), ``attention_mask`` (right padding only).
        rank, world_size: this rank and the ranks sharing the rows.
        load_balance: head-tail shards (:func:`head_tail_order`); False: contiguous blocks.
        pad_multiple: the fast path's padding multiple (``optimize(pad_multiple=)``): a shard is never padded again.
        pad_id: the id of the padding positions added.

    Raises:
        ValueError: left padding or holes in ``attention_mask``; packed rows with ``document_ids``.
    """
    from ..ops.attention import check_right_padded

    if "document_ids" in batch:
        raise ValueError("context parallelism splits causal rows; packed rows with a per-document mask "
                         "(document_ids) are not supported: pack without it, or pad")
    check_right_padded([batch])
    ids = batch["input_ids"]
    targets = shift_targets(batch)
    b, s = ids.shape
    extra = -s % shard_multiple(world_size, pad_multiple, load_balance)
    if extra:
        ids = torch.nn.functional.pad(ids, (0, extra), value=pad_id)
        targets = torch.nn.functional.pad(targets, (0, extra), value=IGNORE)
    positions = torch.arange(s + extra, device=ids.device).expand(b, -1)
    idx = shard_positions(s + extra, world_size, rank, load_balance).to(ids.device)
    return {"input_ids": ids[:, idx], "position_ids": positions[:, idx], "shift_labels": targets[:, idx]}


# ----------------------------------------------------------------------------- the model
@dataclasses.dataclass
class ContextParallel:
    """What :func:`optimize_context_parallel` made: the fast path sharded with FSDP2, ring attention.

    Attributes:
        fast: the :class:`~qlora_nb_utils.distributed.fast.FastSharded` (``opt``, ``root``, ``peft``).
        group: the process group sharing each row (also FSDP2's).
        rank, world_size: in ``group``.
        load_balance: head-tail shards.
        pad_multiple, pad_id: how rows are padded before the split.
        ring: the ring attention's handle (None on one rank: plain attention).
    """

    fast: Any
    group: Any
    rank: int
    world_size: int
    load_balance: bool
    pad_multiple: int
    pad_id: int
    ring: Any = None

    def shard(self, batch: dict, device: torch.device | str | None = None) -> dict:
        """This rank's part of ``batch`` (:func:`shard_batch`), on ``device``."""
        local = shard_batch(batch, self.rank, self.world_size, load_balance=self.load_balance,
                            pad_multiple=self.pad_multiple, pad_id=self.pad_id)
        return local if device is None else {k: v.to(device, non_blocking=True) for k, v in local.items()}

    def loss_sum(self, local: dict) -> torch.Tensor:
        """This rank's summed loss over its shard (every rank calls it together: attention communicates)."""
        count = int((local["shift_labels"] != IGNORE).sum())
        return self.fast.loss(local) * count

    def set_requires_gradient_sync(self, flag: bool) -> None:
        self.fast.set_requires_gradient_sync(flag)

    def undo(self) -> None:
        """Put the attention back and undo ``optimize`` (the model stays sharded)."""
        if self.ring is not None:
            self.ring.undo()
        self.fast.opt.undo()


def optimize_context_parallel(model: torch.nn.Module, *, batches: Sequence[dict], group=None,
                              load_balance: bool = True, **kwargs: Any) -> ContextParallel:
    """``optimize()`` on this rank's shard of ``batches``, FSDP2 over ``group``, ring attention over it.

    Args:
        model: a PEFT QLoRA causal LM on this rank's device, as for :func:`.fast.optimize_sharded`.
        batches: whole batches (every rank the same), or a sample: ``optimize`` decides from this
            rank's shards of them (their length is what the memory target is met for).
        group: the ranks that share each row (default: the whole world).
        load_balance: head-tail shards (default) or contiguous ones.
        **kwargs: :func:`.fast.optimize_sharded`'s options and ``optimize()``'s (not ``scope``, ``cast``,
            ``vocab_head``; ``keep_attention`` and ``sdpa_kernel`` are the ring's).

    Raises:
        ValueError: an option the ring replaces; a model whose attention the ring cannot replace.
    """
    import torch.distributed as dist

    from .fast import optimize_sharded
    from .ring_attention import use_ring_attention

    for key in ("world_size", "one_scope", "vocab_head", "keep_attention", "sdpa_kernel"):
        if key in kwargs:  # the ring runs the flash kernel and keeps nothing for a recompute
            raise ValueError(f"optimize_context_parallel sets {key!r} itself")
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    pad_multiple = int(kwargs.get("pad_multiple", 8))
    cfg = getattr(model, "config", None)
    pad_id = int(getattr(cfg, "pad_token_id", None) or 0)
    sample = [shard_batch(b, rank, world, load_balance=load_balance, pad_multiple=pad_multiple, pad_id=pad_id)
              for b in batches]
    fast = optimize_sharded(model, batches=sample, world_size=world, one_scope="regional", keep_attention=False,
                            sdpa_kernel="default", **kwargs)
    ring = None
    if world > 1:
        try:
            ring = use_ring_attention(fast.peft, group, load_balance=load_balance)
        except BaseException:
            fast.opt.undo()
            raise
    return ContextParallel(fast=fast, group=group, rank=rank, world_size=world, load_balance=load_balance,
                           pad_multiple=pad_multiple, pad_id=pad_id, ring=ring)


# ----------------------------------------------------------------------------- the command
def build_parser() -> argparse.ArgumentParser:
    """The command-line options (:func:`add_arguments`)."""
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m qlora_nb_utils.distributed.context_parallel",
                                description="QLoRA on long rows split by position over N processes "
                                            "(context parallelism: ring attention, FSDP2, the fast path).")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options: the layouts' shared model, data, batch and output options (``qlora-nb train``'s
    names), the memory target, the shards and the FSDP2 ones (``launch --layout context`` takes them)."""
    from .fsdp import FROZEN_MODES, NF4_MODES

    p.add_argument("--model", default="tiny", help="a named model (models.MODEL_NAMES), a folder or a hub id")
    p.add_argument("--data", default=None, help="a JSONL file or a save_to_disk folder (default: the shipped set)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--out", required=True, help="output folder (log.jsonl, summary.json, adapter/)")
    p.add_argument("--global-batch-size", "--batch-size", dest="global_batch_size", type=int, default=1,
                   help="rows per optimizer step; every rank holds a shard of every row")
    p.add_argument("--micro-batch-size", type=int, default=None, help="rows per forward (default: all)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per row, split over the ranks")
    p.add_argument("--pack", action="store_true", help="pack examples into full --seq-len rows (no document mask)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N examples of the data")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--build", default="load", choices=("load", "layerwise"),
                   help="layerwise: the named shape with random NF4 weights, built one linear layer at a time")
    p.add_argument("--max-memory-gib", type=float, default=None,
                   help="optimize()'s peak-memory target per GPU, met for each rank's shard of a row")
    p.add_argument("--no-load-balance", dest="load_balance", action="store_false",
                   help="contiguous shards instead of head-tail ones (uneven causal work)")
    p.add_argument("--nf4", default="auto", choices=("auto",) + tuple(NF4_MODES))
    p.add_argument("--frozen", default="auto", choices=("auto",) + tuple(FROZEN_MODES))
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPUOffloadPolicy")
    p.add_argument("--check-bytes", action="store_true", help="compare every packed byte after the first all-gather")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--optimize", action="append", default=[], metavar="KEY=VALUE", help="an optimize() option")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", "--warmup-steps", dest="warmup", type=int, default=0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-warmup", type=int, default=1, help="steps left out of the tokens/s median")
    p.add_argument("--eval", action="store_true", help="the mean loss over the first batch after training")
    p.add_argument("--no-adapter", action="store_true")


_DEFAULTS = {name: a.default for a in build_parser()._actions for name in [a.dest] if name != "help"}


def _settings(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every option this run reads (a launcher's namespace may name fewer, or by their
    ``qlora-nb train`` names: ``batch_size``, ``warmup_steps``, ``packing``)."""
    out = dict(_DEFAULTS)
    given = vars(args)
    out.update({k: v for k, v in given.items() if k in out and v is not None or k not in out})
    if "global_batch_size" not in given and given.get("batch_size"):
        out["global_batch_size"] = given["batch_size"]
    if "warmup" not in given and given.get("warmup_steps") is not None:
        out["warmup"] = given["warmup_steps"]
    if "pack" not in given and given.get("packing") in ("on", True):
        out["pack"] = True
    return argparse.Namespace(**out)


def validate(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the options (before any model loads); returns them with ``micro_batch_size`` filled in.

    Raises:
        ValueError: with what to change.
    """
    args = _settings(args)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1; got {args.steps}")
    if args.global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1; got {args.global_batch_size}")
    micro = args.micro_batch_size or args.global_batch_size
    if micro < 1 or args.global_batch_size % micro:
        raise ValueError(f"--micro-batch-size {micro} must divide --global-batch-size {args.global_batch_size}")
    need = shard_multiple(world_size, 8, args.load_balance)
    if args.seq_len < need:
        raise ValueError(f"--seq-len {args.seq_len} is shorter than {need}: {world_size} ranks need at least that "
                         "many positions (rows are padded to a multiple of it)")
    if args.max_memory_gib is not None and args.max_memory_gib <= 0:
        raise ValueError(f"--max-memory-gib must be > 0; got {args.max_memory_gib}")
    from .fast import optimize_options

    optimize_options(args.optimize)
    args.micro_batch_size = micro
    return args


def _batches(tok, args) -> list[dict]:
    from ..data import build_batches

    need = args.steps * args.global_batch_size * (max(1, args.seq_len // 64) if args.pack else 1)
    return build_batches(tok, batch_size=args.global_batch_size, steps=args.steps, max_len=args.seq_len,
                         padding="fixed", data=args.data, limit=args.limit or min(4000, max(64, need)),
                         pack=args.pack, seed=args.seed)


def _setup(args, info):
    """Load (or build), then :func:`optimize_context_parallel`. Returns ``(cp, batches, dtype)``."""
    from .fast import optimize_options
    from .fsdp_train import frozen_mode
    from .packed_words import sharded_nf4_precision
    from .setup import load_qlora, resolve_nf4_mode

    dtype = (torch.bfloat16 if info.device.type == "cuda" else torch.float32) if args.dtype == "auto" \
        else getattr(torch, args.dtype)
    mp, storage = sharded_nf4_precision(dtype, "auto")  # no 16-bit all-gather of packed words
    if args.build == "layerwise":
        from .big_model import build_named_qlora

        model, tok = build_named_qlora(args.model, device=info.device, dtype=dtype, quant_storage=storage,
                                       lora_r=args.lora_r, lora_alpha=args.lora_alpha, seed=args.seed)
    else:
        model, tok = load_qlora(args.model, dtype=dtype, device=info.device, quant_storage=storage,
                                lora_r=args.lora_r, lora_alpha=args.lora_alpha, seed=args.seed)
    batches = _batches(tok, args)
    knobs = optimize_options(args.optimize)
    if args.max_memory_gib is not None:
        knobs["max_memory_gib"] = args.max_memory_gib
    micro = [{k: v[:args.micro_batch_size] for k, v in b.items()} for b in batches[:2]]
    cp = optimize_context_parallel(model, batches=micro, load_balance=args.load_balance, mp_policy=mp,
                                   nf4=resolve_nf4_mode(args.nf4, info.backend), frozen=frozen_mode(args, info),
                                   cpu_offload=args.cpu_offload, backend=args.backend,
                                   verify="exact" if args.check_bytes else True, **knobs)
    return cp, batches, dtype


def train_step(cp: ContextParallel, batch: dict, micro_batch_size: int, device) -> dict:
    """Forward and backward of one whole batch on this rank (optimizer step not included).

    Returns:
        ``{"loss": the batch's mean loss (all-reduced), "tokens": real tokens of the batch}``.
    """
    import torch.distributed as dist

    n = max(1, target_count(batch))
    total = torch.zeros((), device=device)
    rows = batch["input_ids"].shape[0]
    for start in range(0, rows, micro_batch_size):
        micro = {k: v[start:start + micro_batch_size] for k, v in batch.items()}
        cp.set_requires_gradient_sync(start + micro_batch_size >= rows)  # one reduce-scatter per step
        loss = cp.loss_sum(cp.shard(micro, device)) / n
        (loss * cp.world_size).backward()  # FSDP2 averages over ranks; the loss is the row's sum over them
        total += loss.detach()
    dist.all_reduce(total, group=cp.group)
    mask = batch.get("attention_mask")
    tokens = int(mask.sum()) if mask is not None else batch["input_ids"].numel()
    return {"loss": float(total), "tokens": tokens}


def eval_loss(cp: ContextParallel, batch: dict, micro_batch_size: int, device) -> float:
    """Mean loss of ``batch`` without an update (grad mode: the fast path's step is traced for training)."""
    import torch.distributed as dist

    n = max(1, target_count(batch))
    total = torch.zeros((), device=device)
    for start in range(0, batch["input_ids"].shape[0], micro_batch_size):
        micro = {k: v[start:start + micro_batch_size] for k, v in batch.items()}
        total += (cp.loss_sum(cp.shard(micro, device)) / n).detach().float()
    dist.all_reduce(total, group=cp.group)
    return float(total)


def run(args: argparse.Namespace) -> dict | None:
    """Train as ``args`` say on this rank (under ``torchrun``). Returns the summary on rank 0, None elsewhere."""
    import torch.distributed as dist

    from ..training.device import peak_mem_gib, reset_peak, sync
    from .checkpoint import save_adapter
    from .fsdp import clip_grad_norm
    from .setup import init_distributed
    from .summary import _graph_break_total, _max_over_ranks

    args = validate(args, int(os.environ.get("WORLD_SIZE", "1")))
    info = init_distributed(args.device)
    out = Path(args.out)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "log.jsonl").unlink(missing_ok=True)
    torch.manual_seed(args.seed)
    breaks_before, _ = _graph_break_total()
    cp, batches, dtype = _setup(args, info)
    root = cp.fast.root
    params = [p for p in root.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warm = max(args.warmup, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    dist.barrier()
    reset_peak(info.device)
    root.train()
    records, peak = [], 0.0
    for step in range(args.steps):
        batch = batches[step % len(batches)]
        sync(info.device)
        t0 = time.perf_counter()
        rec = train_step(cp, batch, args.micro_batch_size, info.device)
        grad_norm = clip_grad_norm(params, args.max_grad_norm if args.max_grad_norm > 0 else None)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        sync(info.device)
        rec["step_ms"] = (time.perf_counter() - t0) * 1e3
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss is {rec['loss']} at step {step}")
        peak = max(peak, _max_over_ranks(peak_mem_gib(info.device), info.device))
        rec.update(step=step, grad_norm=grad_norm, peak_mem_gib=peak, world_size=info.world_size,
                   seq_len=int(batch["input_ids"].shape[1]))
        records.append(rec)
        if info.is_main:
            with (out / "log.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")
    final_eval = eval_loss(cp, batches[0], args.micro_batch_size, info.device) if args.eval else None
    if not args.no_adapter:
        save_adapter(cp.fast.peft, out / "adapter", is_main=info.is_main)
    summary = None
    if info.is_main:
        summary = _summary(args, info, records, cp, dtype, breaks_before, peak, final_eval)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        print(f"[context_parallel] world_size={info.world_size} seq_len={args.seq_len} steps={len(records)} "
              f"final_loss={records[-1]['loss']:.6f} tokens/s={summary['tokens_per_s']} "
              f"graph_breaks={summary['graph_breaks']['total']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _summary(args, info, records, cp, dtype, breaks_before, peak, final_eval) -> dict:
    import datetime as _dt

    from .. import env
    from .summary import _graph_break_total

    after, reasons = _graph_break_total()
    timed = [r for r in records if r["step"] >= args.timing_warmup] or records[-1:]
    rates = sorted(r["tokens"] / (r["step_ms"] / 1e3) for r in timed if r["step_ms"] > 0)
    return {
        "layout": "context", "world_size": info.world_size, "backend": info.backend, "model": args.model,
        "seq_len": args.seq_len, "load_balance": args.load_balance, "options": vars(args),
        "dtype": str(dtype).replace("torch.", ""), "nf4": cp.fast.nf4, "steps": len(records),
        "losses": [r["loss"] for r in records], "eval_loss": final_eval,
        "tokens_per_s": rates[len(rates) // 2] if rates else None,
        "step_ms": [r["step_ms"] for r in records], "peak_mem_gib_per_gpu": peak,
        "graph_breaks": {"total": after - breaks_before if after >= 0 else None, "reasons": reasons,
                         "compiled_layers": len(cp.fast.layers), "fullgraph": True},
        "compile": cp.fast.compile_stats(), "bytes_check": cp.fast.bytes_check,
        "choices": {k: str(v) for k, v in cp.fast.opt.choices.items()},
        "ring_attention": None if cp.ring is None else dict(cp.ring.details),
        "device": env.device_info(info.device), "versions": env.versions(),
        "command": " ".join(shlex.quote(a) for a in
                            [sys.executable, "-m", "qlora_nb_utils.distributed.context_parallel", *sys.argv[1:]]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate (before any model loads), run. Returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate(args, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as exc:
        parser.error(str(exc))
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
