"""Our recipe as a peer (``ours`` and ``ours-<variant>``): load, apply the recipe, train, record.

Why it exists: the recipe itself is product code, reached through
:func:`qlora_nb_utils.optimize` (the one fast path every user gets), so a user trains with it
without the benchmark; a variant only passes its choices to ``optimize`` explicitly. What the benchmark adds is kept here: loading the
model the way every HF-recipe peer does, training it on the shared batches, and a run dict
whose ``notes`` say exactly what the variant did (``optimize``'s description: how many weights
were cast, the loss, how many layers checkpoint, autocast, the attention path, the mode, and
how many compilations) and whose ``options`` are the variant's full options.
"""

from __future__ import annotations

from typing import Any

from ... import env, models
from .common import _train_cfg
from .results import _from_history


def _peer_ours(ctx: dict, batches: list, variant: str, opts: dict) -> dict[str, Any]:
    from ...compile.fast_path import optimize
    from ...training.loop import train

    grad_ckpt = opts["grad_ckpt"] or ctx["grad_ckpt"]
    model, _ = models.load_model(
        ctx["model"], quant="nf4", lora=True, lora_r=ctx["lora_r"], lora_alpha=ctx["lora_alpha"],
        dtype=ctx["dtype"], device=ctx["device"], prepare_kbit=True, gradient_checkpointing=grad_ckpt,
        seed=ctx["seed"])
    device = env.resolve_device(ctx["device"])
    dtype = env.resolve_dtype(ctx["dtype"], device)
    if opts["auto"]:  # every choice optimize() can make, made by it
        opt = optimize(model, batches=batches, dtype=dtype, grad_ckpt=True if grad_ckpt else "auto")
    else:  # the variant's choices, each stated
        opt = optimize(model, batches=batches, dtype=dtype, cast=opts["cast_bf16"], ce_chunks=opts["ce_chunks"],
                       grad_ckpt=grad_ckpt, ckpt_layers=opts["ckpt_layers"], autocast=opts["autocast"],
                       attention="causal" if opts["causal_attn"] else "mask", mode=opts["mode"] or "default",
                       backend=opts["backend"], memory_budget=opts["memory_budget"], dynamic=False)
    try:
        hist = train(model, batches, _train_cfg(ctx), forward=opt.forward, label=ctx["name"])
    finally:
        opt.undo()
    stats = opt.counter.to_dict()
    notes = (f"variant {variant}: {opt.description}; {stats.get('compilations')} compilation(s)")
    run = _from_history(ctx["name"], hist, ctx, notes, {**opts, "variant": variant})
    run["variant"] = variant
    run["optimize"] = {k: str(v) for k, v in opt.choices.items()}
    run["compilations"] = stats.get("compilations")
    run["dynamo_compile_s"] = stats.get("compile_s")
    return run
