"""The FSDP2 fine-tune through ``transformers.Trainer`` or ``trl.SFTTrainer`` instead of our loop.

Why this module exists: most people fine-tune through the HF ``Trainer`` or TRL, not through
an explicit loop, so ``fsdp_train --trainer hf|trl`` runs the same model, data and options
through them with accelerate's FSDP2 settings, and each decoder layer compiled by a callback
(:func:`run_trainer` says what accelerate does and does not shard, and why not on CPU). It is
kept apart from :mod:`qlora_nb_utils.distributed.fsdp_train` because it pulls in the
Trainer, TRL and ``datasets`` (the callback class is built from ``transformers.TrainerCallback``
when this module is imported), which the explicit loop never needs; ``fsdp_train.main`` imports
it only for ``--trainer hf|trl``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path

import torch

from .global_batches import make_global_batches

__all__ = ["run_trainer"]


def run_trainer(args: argparse.Namespace) -> dict | None:
    """The same fine-tune through ``transformers.Trainer`` (``hf``) or ``trl.SFTTrainer`` (``trl``)
    with accelerate's FSDP2 (``fsdp=True``, ``fsdp_config={"version": 2, ...}``; transformers
    5.17 deprecates the string form ``fsdp="full_shard"``, and its key is ``version``).

    Launch it with torchrun like the explicit loop. On GPUs the Trainer wraps each decoder
    layer and the root with ``fully_shard`` through accelerate's ``fsdp2_prepare_model``,
    which puts uint8 ``Params4bit`` into ``ignored_params`` (replicated, like
    ``nf4="replicate"``) and shards a floating quant storage. ``--nf4 shard`` (the default on
    CPU; ``auto`` replicates on NCCL) stores the packed words as float32 and turns the
    Trainer's bf16/fp16 mixed precision off, so accelerate's FSDP2 policy casts nothing and no
    unit all-gathers packed words in a 16-bit float (:mod:`.packed_words`; the 4-bit matmuls
    still run in the compute dtype); the callback attaches the quant states to the sharded
    weights as :func:`.fsdp.apply_fsdp2` does. ``--nf4 replicate`` loads uint8 storage. With ``--compile`` each decoder
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
    from .packed_words import sharded_nf4_precision
    from .runs import compute_dtype
    from .setup import init_distributed, load_qlora, resolve_nf4_mode, resolve_quant_storage

    info = init_distributed(args.device)
    out = Path(args.out)
    dtype = compute_dtype(args.dtype, info.device)
    nf4 = resolve_nf4_mode(args.nf4, info.backend)
    if nf4 == "shard":  # float32 words, no accelerate mixed precision: no bf16 all-gather of packed words
        storage = sharded_nf4_precision(dtype, args.quant_storage)[1]
    else:  # accelerate replicates uint8 Params4bit (ignored_params)
        storage = resolve_quant_storage("uint8" if args.quant_storage == "auto" else args.quant_storage, None, dtype)
    args.trainer_mixed_precision = dtype if nf4 != "shard" else None
    model, tok = load_qlora(args.model, quant=args.quant, dtype=dtype, device=info.device,
                            quant_storage=storage, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                            seed=args.seed)
    batches = make_global_batches(tok, args)
    rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["input_ids"]))]
    snapshot = None
    if args.check_bytes and nf4 == "shard":  # every packed byte, compared once accelerate has sharded
        from .packed_words import snapshot_packed

        snapshot = snapshot_packed(model)
    trainer = _build_trainer(args, info, model, tok, rows, dtype, out, snapshot)
    result = trainer.train()
    bytes_check = next(c.bytes_check for c in trainer.callback_handler.callbacks
                       if isinstance(c, _RegionalCompileCallback))
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
                   "fsdp_version": 2, "quant_storage": str(storage).replace("torch.", ""), "nf4": nf4,
                   "bytes_check": bytes_check,
                   "device": env.device_info(info.device), "versions": env.versions(),
                   "date": _dt.datetime.now(_dt.timezone.utc).isoformat()}
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    trainer.save_model(str(out / "adapter"))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return summary


def _build_trainer(args, info, model, tok, rows, dtype, out: Path, snapshot: dict | None = None):
    from transformers import Trainer, TrainingArguments

    local = args.global_batch_size // info.world_size
    common = dict(
        output_dir=str(out / "trainer"), per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=local // args.micro_batch_size, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
        max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else 0.0, seed=args.seed,
        save_strategy="no", report_to=[], use_cpu=info.device.type == "cpu",
        bf16=args.trainer_mixed_precision == torch.bfloat16, fp16=args.trainer_mixed_precision == torch.float16,
        dataloader_num_workers=0,
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
    callbacks = [_RegionalCompileCallback(args.backend, args.fullgraph, args.compile, snapshot)]
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
    """Once training starts: give sharded 4-bit weights their quant state (as ``apply_fsdp2``
    does, so bitsandbytes never re-creates the parameter), with ``snapshot`` compare every packed
    byte after accelerate's all-gather with the bytes before sharding (``bytes_check``; None where
    accelerate did not shard them), and compile each decoder layer."""

    def __init__(self, backend: str, fullgraph: bool, compile_layers: bool = True, snapshot: dict | None = None):
        self.backend, self.fullgraph, self.compile_layers, self.prepared = backend, fullgraph, compile_layers, None
        self.snapshot, self.bytes_check = snapshot, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        from ..compile import prepare_for_compile
        from .fsdp import attach_quant_states, fsdp_modules, linear4bit_modules

        if model is not None and fsdp_modules(model) and any(
                isinstance(m.weight, DTensor) for m in linear4bit_modules(model)):
            # accelerate sharded the float32-stored 4-bit weights
            self.bytes_check = attach_quant_states(model, snapshot=self.snapshot)
            self.snapshot = None
        if model is not None and self.compile_layers and self.prepared is None:
            self.prepared = prepare_for_compile(model, grad_ckpt=None, scope="regional",
                                                backend=self.backend, fullgraph=self.fullgraph)
