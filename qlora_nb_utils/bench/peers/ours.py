"""Our recipe as a peer (``ours`` and ``ours-<variant>``): load, apply the recipe, train, record.

Why it exists: the recipe itself is product code (:mod:`qlora_nb_utils.compile.recipe`), so a
user trains with it without the benchmark. What the benchmark adds is kept here: loading the
model the way every HF-recipe peer does, training it on the shared batches, and a run dict
whose ``notes`` say exactly what the variant did (how many weights were cast, the loss, how
many layers checkpoint, the memory budget, autocast, the attention path, the mode and how many
compilations) and whose ``options`` are the variant's full options.
"""

from __future__ import annotations

from typing import Any

from ... import env, models
from .common import _train_cfg
from .results import _from_history


def _peer_ours(ctx: dict, batches: list, variant: str, opts: dict) -> dict[str, Any]:
    from ...compile.recipe import activation_memory_budget, prepare_fast
    from ...training.loop import train

    grad_ckpt = opts["grad_ckpt"] or ctx["grad_ckpt"]
    model, _ = models.load_model(
        ctx["model"], quant="nf4", lora=True, lora_r=ctx["lora_r"], lora_alpha=ctx["lora_alpha"],
        dtype=ctx["dtype"], device=ctx["device"], prepare_kbit=True, gradient_checkpointing=grad_ckpt,
        seed=ctx["seed"])
    device = env.resolve_device(ctx["device"])
    dtype = env.resolve_dtype(ctx["dtype"], device)
    fast = prepare_fast(model, dtype=dtype, device=device, batches=batches, cast_bf16=opts["cast_bf16"],
                        ce_chunks=opts["ce_chunks"], grad_ckpt=grad_ckpt, ckpt_layers=opts["ckpt_layers"],
                        autocast=opts["autocast"], causal_attn=opts["causal_attn"], mode=opts["mode"],
                        backend=opts["backend"])
    try:
        with activation_memory_budget(opts["memory_budget"]):
            hist = train(model, batches, _train_cfg(ctx), forward=fast.forward, label=ctx["name"])
    finally:
        fast.undo()
    stats = fast.counter.to_dict()
    notes = (f"variant {variant}: {fast.cast} non-LoRA weights cast to {str(dtype).replace('torch.', '')}; "
             f"{'chunked CE x' + str(opts['ce_chunks']) if opts['ce_chunks'] else 'model loss'}; "
             f"grad ckpt on {fast.ckpt_layers}/{fast.layers} layers; memory budget {opts['memory_budget']}; "
             f"{'autocast ' + str(dtype).replace('torch.', '') + ' (LoRA matmuls in it, fp32 LoRA weights)' if fast.autocast else 'no autocast'}; "
             f"attention {'causal-only sdpa (right-padded batches checked)' if opts['causal_attn'] else 'sdpa with mask'}; "
             f"mode {opts['mode'] or 'default'}; {stats.get('compilations')} compilation(s)")
    run = _from_history(ctx["name"], hist, ctx, notes, {**opts, "variant": variant})
    run["variant"] = variant
    run["compilations"] = stats.get("compilations")
    run["dynamo_compile_s"] = stats.get("compile_s")
    return run
