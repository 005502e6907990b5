"""Our recipe as a peer (``ours`` and ``ours-<variant>``): load, apply the recipe, train, record.

Why it exists: the recipe itself is product code, reached through
:func:`qlora_nb_utils.optimize` (the one fast path every user gets), so a user trains with it
without the benchmark; a variant only passes its choices to ``optimize`` explicitly. What the benchmark adds is kept here: loading the
model the way every HF-recipe peer does, training it on the shared batches, and a run dict
whose ``notes`` say exactly what the variant did (``optimize``'s description: how many weights
were cast, the loss, how many layers checkpoint, autocast, the attention path, the mode, and
how many compilations) and whose ``options`` are the variant's full options.

On the packing benchmark's ``ours-packed`` run (:mod:`lab.peers.packed`) the
same process also checks the two things the issue asks of packed training (:func:`_packing_checks`):
the compilations over every packed batch of one epoch (a forward and backward each, target 1),
and the per-step loss against the same recipe uncompiled (``Optimized.eager``) on the first
steps' batches from the same LoRA start, judged against the bf16 floor of
:mod:`qlora_nb_utils.training.parity` (that eager run again with the rows of each batch permuted).
"""

from __future__ import annotations

from typing import Any

from lab.peers.common import _train_cfg
from lab.peers.results import _from_history
from qlora_nb_utils import env, models


def _peer_ours(ctx: dict, batches: list, variant: str, opts: dict) -> dict[str, Any]:
    from qlora_nb_utils.compile.fast_path import optimize
    from qlora_nb_utils.training.loop import train

    grad_ckpt = opts["grad_ckpt"] or ctx["grad_ckpt"]
    model, _ = models.load_model(
        ctx["model"], quant="nf4", lora=True, lora_r=ctx["lora_r"], lora_alpha=ctx["lora_alpha"],
        dtype=ctx["dtype"], device=ctx["device"], prepare_kbit=True, gradient_checkpointing=grad_ckpt,
        seed=ctx["seed"])
    device = env.resolve_device(ctx["device"])
    dtype = env.resolve_dtype(ctx["dtype"], device)
    epoch = None
    if ctx.get("epoch_batches"):  # the epoch checked later is shown too, as qlora-nb train shows all it trains on
        import torch

        epoch = list(torch.load(ctx["epoch_batches"]))
    shown = list(batches) + epoch if epoch else batches
    if opts["auto"]:  # every choice optimize() can make, made by it
        opt = optimize(model, batches=shown, dtype=dtype, grad_ckpt=True if grad_ckpt else "auto",
                       max_memory_gib=opts["max_memory_gib"], scope=opts["scope"])
    else:  # the variant's choices, each stated
        opt = optimize(model, batches=shown, dtype=dtype, cast=opts["cast_bf16"], ce_chunks=opts["ce_chunks"],
                       grad_ckpt=grad_ckpt, ckpt_layers=opts["ckpt_layers"], autocast=opts["autocast"],
                       attention="causal" if opts["causal_attn"] else "mask", mode=opts["mode"] or "default",
                       backend=opts["backend"], memory_budget=opts["memory_budget"], dynamic=False,
                       scope=opts["scope"])
    from qlora_nb_utils.training.loop import trainable_state

    start = trainable_state(model) if ctx.get("parity_steps") else None
    checks: dict[str, Any] = {}
    try:
        hist = train(model, batches, _train_cfg(ctx), forward=opt.forward, label=ctx["name"])
        if epoch or start is not None:
            checks = _packing_checks(model, opt, ctx, batches, start, list(hist["loss"]), epoch)
    finally:
        opt.undo()
    stats = opt.counter.to_dict()
    notes = (f"variant {variant}: {opt.description}; {stats.get('compilations')} compilation(s)")
    run = _from_history(ctx["name"], hist, ctx, notes, {**opts, "variant": variant})
    run["variant"] = variant
    run["optimize"] = {k: str(v) for k, v in opt.choices.items()}
    run["compilations"] = stats.get("compilations")
    run["dynamo_compile_s"] = stats.get("compile_s")
    run.update(checks)
    return run


def _packing_checks(model, opt, ctx: dict, batches: list, start: dict | None, losses: list,
                    epoch: list | None) -> dict[str, Any]:
    """Compilations over one epoch of packed batches (``epoch``, None: not checked), and the loss
    against the uncompiled recipe."""
    from qlora_nb_utils.training.loop import TrainConfig, load_trainable_state, train
    from qlora_nb_utils.training.parity import judge, permute_rows

    out: dict[str, Any] = {}
    if epoch:
        device = next(p.device for p in model.parameters() if p.requires_grad)
        for batch in epoch:  # a forward and backward of each; the weights do not change
            opt.forward(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
            model.zero_grad(set_to_none=True)
        out["epoch_batches"] = len(epoch)
        out["epoch_compilations"] = opt.counter.to_dict().get("compilations")
        out["epoch_how"] = ("after the timed steps, a forward and backward of every packed batch of the epoch "
                            "through the same compiled step, optimize() having been shown the epoch's batches with "
                            "the timed ones (as qlora-nb train shows every batch it trains on); compilations counted "
                            "by optimize()'s counter over the whole process (timed steps included)")
    if start is not None:
        k = min(int(ctx["parity_steps"]), len(losses))
        cfg = TrainConfig(steps=k, lr=ctx["lr"], seed=ctx["seed"], progress=False)
        runs = []
        for these in (batches[:k], permute_rows(batches[:k])):
            load_trainable_state(model, start)
            runs.append(list(train(model, these, cfg, forward=opt.eager, label="eager")["loss"]))
        verdict = judge(runs[0], runs[1], losses[:k])
        out["parity"] = {key: verdict[key] for key in (
            "max_abs_loss_diff", "mean_abs_loss_diff", "floor_max_abs_loss_diff", "floor_mean_abs_loss_diff",
            "within_floor", "steps_over_floor", "diffs", "floor_diffs")} | {
            "steps": k, "eager_losses": runs[0],
            "how": "the same recipe uncompiled (Optimized.eager) from the same LoRA start on the first steps' "
                   "packed batches; floor: that eager run with the rows of each batch permuted "
                   "(training.parity.judge)"}
        out["max_abs_loss_diff"] = verdict["max_abs_loss_diff"]
    return out
