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
  inputs offloaded to host memory, the MLP in pieces. The estimate counts one rank's share of
  the sharded weights and the ring's attention (the whole row's keys and values of one head group,
  float32 merges and gradients) in place of one GPU's (``compile.memory_estimate.estimate_layout``).

Rows of one causal sequence each (padded on the right, or packed without per-document masks): the
ring applies no padding mask, document mask or sliding window, and refuses a model that needs one.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

import torch

from .runs import RankRun, add_common_arguments, add_sharding_arguments, check_common, run_main, world_size_from_env

__all__ = ["head_tail_order", "shard_positions", "shard_multiple", "shift_targets", "target_count", "shard_batch",
           "ContextParallel", "optimize_context_parallel", "shard_lora_rows", "train_step", "eval_loss", "build_parser", "add_arguments",
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

    Every decoder layer is checkpointed when the row is split over more than one rank: a plan
    that leaves some layers unchecked (what ``optimize()`` picks when a memory target is met
    without them) has not been shown to give one GPU's gradients on a GPU, while the plan that
    checkpoints every layer has; so ``grad_ckpt`` is True and ``ckpt_layers`` all of them there.

    Raises:
        ValueError: an option the ring replaces (``grad_ckpt=False`` or ``ckpt_layers`` on more than
            one rank among them); a model whose attention the ring cannot replace.
    """
    import torch.distributed as dist

    from ..compile.memory_estimate import estimate_layout
    from .fast import optimize_sharded
    from .ring_attention import head_groups, use_ring_attention

    for key in ("world_size", "one_scope", "vocab_head", "keep_attention", "sdpa_kernel"):
        if key in kwargs:  # the ring runs the flash kernel and keeps nothing for a recompute
            raise ValueError(f"optimize_context_parallel sets {key!r} itself")
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world > 1:
        kwargs = {**kwargs, **every_layer_checkpointed(kwargs)}
        if "lora_min_rows" not in kwargs:  # each rank takes the LoRA route one GPU takes for the whole rows
            kwargs["lora_min_rows"] = shard_lora_rows(next(model.parameters()).device.type, world)
    pad_multiple = int(kwargs.get("pad_multiple", 8))
    cfg = getattr(model, "config", None)
    pad_id = int(getattr(cfg, "pad_token_id", None) or 0)
    sample = [shard_batch(b, rank, world, load_balance=load_balance, pad_multiple=pad_multiple, pad_id=pad_id)
              for b in batches]
    # the estimate counts the ring's attention, in the head groups it will run
    layout = {"ring_groups": head_groups, "ring_world": world} if world > 1 else {}
    with estimate_layout(**layout):
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


def shard_lora_rows(device_type: str, world_size: int) -> int:
    """The row threshold of the fused NF4 LoRA route on a rank that holds ``1/world_size`` of each row.

    The route runs for calls of more rows than a threshold (``optimize(lora_min_rows=)``; by default
    bitsandbytes' own on CUDA), and below it the update is added after bitsandbytes' kernels, which
    rounds a small update where the fused route keeps it: the loss after the first updates from a
    zero LoRA B differs between the two by more than bf16 noise. Split over the ranks, a call has
    ``1/world_size`` of one GPU's rows; the threshold divided the same way puts every rank on the
    route one GPU takes for the whole rows.
    """
    from ..compile.patches.nf4_dequant import own_rows

    return own_rows(device_type) // max(1, world_size)


def every_layer_checkpointed(options: dict) -> dict:
    """The checkpointing options of a row split over several ranks (:func:`optimize_context_parallel`):
    every decoder layer; ``grad_ckpt=False`` or a ``ckpt_layers`` asked for is refused."""
    if options.get("grad_ckpt") is False or options.get("ckpt_layers") is not None:
        raise ValueError("context parallelism over several ranks checkpoints every decoder layer: drop "
                         "grad_ckpt=false and ckpt_layers (a plan with layers left unchecked is not yet shown "
                         "to give one GPU's gradients)")
    return {"grad_ckpt": True}


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
    names; here one row per step of 1024 tokens by default), FSDP2's, the memory target and the
    shards (``launch --layout context`` takes them)."""
    add_common_arguments(p, global_batch_size=1, seq_len=1024, timing_warmup=1)
    add_sharding_arguments(p)
    p.add_argument("--limit", type=int, default=None, help="read only the first N examples of the data")
    p.add_argument("--max-memory-gib", type=float, default=None,
                   help="optimize()'s peak-memory target per GPU, met for each rank's shard of a row")
    p.add_argument("--no-load-balance", dest="load_balance", action="store_false",
                   help="contiguous shards instead of head-tail ones (uneven causal work)")


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
    """Check the options (before any model loads); returns them with ``micro_batch_size`` and
    ``optimize_knobs`` filled in.

    Raises:
        ValueError: with what to change.
    """
    args = _settings(args)
    if args.max_memory_gib is not None and args.max_memory_gib <= 0:
        raise ValueError(f"--max-memory-gib must be > 0; got {args.max_memory_gib}")
    # what optimize_context_parallel hands optimize() itself, checked with --optimize's options
    check_common(args, layout="context",
                 fixed={"scope": "regional", "cast": False, "backend": args.backend, "keep_attention": False,
                        "sdpa_kernel": "default", "max_memory_gib": args.max_memory_gib},
                 flags={"backend": "--backend", "max_memory_gib": "--max-memory-gib"})
    if world_size > 1:
        every_layer_checkpointed(args.optimize_knobs)
    micro = args.micro_batch_size or args.global_batch_size
    if args.global_batch_size % micro:
        raise ValueError(f"--micro-batch-size {micro} must divide --global-batch-size {args.global_batch_size}")
    need = shard_multiple(world_size, args.optimize_knobs.get("pad_multiple", 8), args.load_balance)
    if args.seq_len < need:
        raise ValueError(f"--seq-len {args.seq_len} is shorter than {need}: {world_size} ranks need at least that "
                         "many positions (rows are padded to a multiple of it)")
    args.micro_batch_size = micro
    return args


def _batches(tok, args) -> list[dict]:
    from ..data import build_batches

    need = args.steps * args.global_batch_size * (max(1, args.seq_len // 64) if args.pack else 1)
    return build_batches(tok, batch_size=args.global_batch_size, steps=args.steps, max_len=args.seq_len,
                         padding="fixed", data=args.data, limit=args.limit or min(4000, max(64, need)),
                         pack=args.pack, seed=args.seed)


def _setup(args, info, dtype):
    """Load (or build), then :func:`optimize_context_parallel`. Returns ``(cp, batches)``."""
    from .packed_words import sharded_nf4_precision
    from .setup import load_qlora, resolve_frozen_mode, resolve_nf4_mode

    mp, storage = sharded_nf4_precision(dtype, "auto")  # no 16-bit all-gather of packed words
    if args.build == "layerwise":
        from .big_model import build_named_qlora

        model, tok = build_named_qlora(args.model, device=info.device, dtype=dtype, quant_storage=storage,
                                       lora_r=args.lora_r, lora_alpha=args.lora_alpha, seed=args.seed)
    else:
        model, tok = load_qlora(args.model, dtype=dtype, device=info.device, quant_storage=storage,
                                lora_r=args.lora_r, lora_alpha=args.lora_alpha, seed=args.seed)
    batches = _batches(tok, args)
    knobs = dict(args.optimize_knobs)
    if args.max_memory_gib is not None:
        knobs["max_memory_gib"] = args.max_memory_gib
    micro = [{k: v[:args.micro_batch_size] for k, v in b.items()} for b in batches[:2]]
    cp = optimize_context_parallel(model, batches=micro, load_balance=args.load_balance, mp_policy=mp,
                                   nf4=resolve_nf4_mode(args.nf4, info.backend),
                                   frozen=resolve_frozen_mode(args.frozen, info.backend),
                                   cpu_offload=args.cpu_offload, backend=args.backend,
                                   verify="exact" if args.check_bytes else True, **knobs)
    return cp, batches


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

    from ..training.device import reset_peak
    from .checkpoint import save_adapter
    from .fsdp import clip_grad_norm

    if not hasattr(args, "optimize_knobs"):  # not checked yet (launch and main check before they call this)
        args = validate(args, world_size_from_env())
    job = RankRun(args, tag="context_parallel", module="qlora_nb_utils.distributed.context_parallel")
    info, out = job.info, job.out
    job.reset_log()
    cp, batches = _setup(args, info, job.dtype)
    root = cp.fast.root
    params = [p for p in root.parameters() if p.requires_grad]
    opt, sched = job.optimizer(params)
    dist.barrier()
    reset_peak(info.device)
    root.train()
    records = []
    for step in range(args.steps):
        batch = batches[step % len(batches)]
        t0 = job.clock()
        rec = train_step(cp, batch, args.micro_batch_size, info.device)
        grad_norm, lr = job.optimizer_step(opt, sched, lambda max_norm: clip_grad_norm(params, max_norm))
        rec["step_ms"] = (job.clock() - t0) * 1e3
        rec.update(step=step, grad_norm=grad_norm, lr=lr, tokens_padded=int(batch["input_ids"].numel()),
                   seq_len=int(batch["input_ids"].shape[1]))
        records.append(job.log(rec))
    final_eval = eval_loss(cp, batches[0], args.micro_batch_size, info.device) if args.eval else None
    if not args.no_adapter:
        save_adapter(cp.fast.peft, out / "adapter", is_main=info.is_main)
    summary = _summary(job, records, cp, final_eval) if info.is_main else None
    job.finish(summary, seq_len=args.seq_len)
    return summary


def _summary(job: RankRun, records: list[dict], cp: ContextParallel, final_eval: float | None) -> dict:
    """The shared fields (:func:`.runs.summary_fields`) and the context layout's: the row length, the
    shards, the 4-bit weights' sharding and byte check, ``optimize()``'s choices, the ring."""
    args = job.args
    summary = {"layout": "context", **job.summary(records)}
    summary["graph_breaks"].update(compiled_layers=len(cp.fast.layers), fullgraph=True)
    summary.update(seq_len=args.seq_len, load_balance=args.load_balance, nf4=cp.fast.nf4, eval_loss=final_eval,
                   compile=cp.fast.compile_stats(), bytes_check=cp.fast.bytes_check,
                   choices={k: str(v) for k, v in cp.fast.opt.choices.items()},
                   ring_attention=None if cp.ring is None else dict(cp.ring.details))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate (before any model loads), run. Returns the exit status."""
    return run_main(build_parser(), validate, run, argv)


if __name__ == "__main__":
    from .runs import exit_after_run

    exit_after_run(main())  # gloo's threads may abort a finished run's exit: runs.exit_after_run
