"""The global batches of a sharded run, the rows each rank takes, and the loss they normalise to.

Why this module exists: "N ranks give the loss of one" holds only when every rank trains on
its part of the very same global batch and the loss is normalised the same way. Every rank
builds the same list of global batches from the shipped data (same seed, fixed padding) and
takes rows ``[rank*B/N, (rank+1)*B/N)`` of each. The loss is summed over each rank's target
tokens and divided by the *global* count of target tokens (known to every rank without
communication), so the all-reduced loss is exactly the one-process loss; the backward in
:mod:`qlora_nb_utils.distributed.fsdp_train` uses the same loss times N because FSDP2 averages
gradients over ranks. The explicit loop and the HF ``Trainer`` run
(:mod:`qlora_nb_utils.distributed.trainer`) share these helpers.
"""

from __future__ import annotations

import torch

__all__ = ["make_global_batches", "target_count", "loss_sum", "local_micro_batches"]


def make_global_batches(tok, args) -> list[dict]:
    """The list of global batches every rank builds identically (``--data`` or the shipped set, fixed padding)."""
    from ..data import build_batches

    need = args.steps * args.global_batch_size * (max(1, args.seq_len // 64) if args.pack else 1)
    batches = build_batches(tok, batch_size=args.global_batch_size, steps=args.steps, max_len=args.seq_len,
                            padding="fixed", data=getattr(args, "data", None), limit=min(4000, max(64, need)),
                            pack=args.pack, seed=args.seed)
    if getattr(args, "permute_rows", None) is not None:  # the floor run: same examples, other row order
        from ..training.parity import permute_rows

        batches = permute_rows(batches, seed=args.permute_rows)
    return batches


def target_count(batch: dict) -> int:
    """The next-token targets of a batch: the denominator of its mean loss."""
    return int((batch["labels"][:, 1:] != -100).sum())


def loss_sum(model, micro: dict) -> torch.Tensor:
    """Summed next-token cross-entropy of a micro-batch (HF's shift, fp32 logits)."""
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    logits = logits[:, :-1].float()
    targets = micro["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum")


def local_micro_batches(batch: dict, info, args) -> list[dict]:
    """This rank's rows of a global batch, in micro-batches of ``args.micro_batch_size``, on its device."""
    local = args.global_batch_size // info.world_size
    lo = info.rank * local
    rows = {k: v[lo:lo + local] for k, v in batch.items()}
    m = args.micro_batch_size
    return [{k: v[i:i + m].to(info.device) for k, v in rows.items()} for i in range(0, local, m)]
