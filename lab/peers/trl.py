"""TRL's ``SFTTrainer`` as a peer, on the HF recipe's model: compiled TRL's way, or through ``optimize()``.

Why it exists: many users train QLoRA through TRL rather than a loop of their own, and TRL
turns on ``torch.compile`` with one flag; ``trl-sft-compile`` is what that flag gives, and
``trl-sft-optimize`` the same trainer under
:func:`~qlora_nb_utils.training.hf_trainer.optimized_trainer` (what a TRL user gets from us). It trains the same
pre-tokenized batches in the same order as every other peer (a sequential sampler, constant
learning rate, AdamW, grad-norm clip 1.0) and times each step with a ``TrainerCallback``; its
losses are the ones the Trainer logs.

``trl-sft-packed`` is TRL's padding-free training (``SFTConfig(padding_free=True)``, eager, TRL's
own ``DataCollatorForLanguageModeling``; a custom collator is refused with padding-free) on
the packing benchmark's packed batches: each dataset example is one packed row's documents
concatenated with their ``seq_lengths`` (:func:`~lab.peers.packed_batches.row_documents`),
``per_device_train_batch_size`` is the rows per batch, so each step is one of the packed
batches, flattened by TRL into one row with position ids restarting per document: the same
documents and real tokens per step as every packed peer. TRL 1.16 checks no attention
implementation for padding-free; the model keeps SDPA (no flash-attn package on the GPU machine),
on which transformers builds the document mask from the restarting positions.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from typing import Any

import torch

from lab.peers.common import _hf_model
from lab.peers.packed_batches import row_documents
from lab.peers.results import summarize_run
from qlora_nb_utils.data.packing import real_tokens
from qlora_nb_utils.env import resolve_device_dtype as _resolve_device_dtype


def _peer_trl(ctx: dict, batches: list) -> dict[str, Any]:
    import datasets
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from qlora_nb_utils.training.device import peak_mem_gib, reset_peak, sync
    from qlora_nb_utils.training.hf_trainer import optimized_trainer, trainer_patches

    device, dtype = _resolve_device_dtype(ctx["device"], ctx["dtype"])
    model, tok = _hf_model(ctx)
    packed = ctx["name"] == "trl-sft-packed"
    keys = ("input_ids", "attention_mask", "labels")
    order = [batches[i % len(batches)] for i in range(ctx["steps"])]
    collate = None  # padding-free: TRL's own collator (it refuses another)
    if packed:
        docs = [row_documents(b) for b in order]
        if any(len(d) != ctx["batch_size"] for d in docs):
            raise ValueError("trl-sft-packed needs batches without all-padding rows (every step one packed batch)")
        dataset = datasets.Dataset.from_list([row for d in docs for row in d])
    else:
        rows = {k: [row.tolist() for b in order for row in b[k]] for k in keys}
        dataset = datasets.Dataset.from_dict(rows)

        def collate(features):
            return {k: torch.tensor([f[k] for f in features], dtype=torch.long) for k in keys}

    class Timer(TrainerCallback):
        def __init__(self):
            self.ms, self.losses, self.t0, self.peak = [], [], 0.0, 0.0

        def on_train_begin(self, args, state, control, **kw):
            reset_peak(device)

        def on_step_begin(self, args, state, control, **kw):
            sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync(device)
            self.ms.append((time.perf_counter() - self.t0) * 1e3)
            self.peak = max(self.peak, peak_mem_gib(device))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    class InOrderSFTTrainer(SFTTrainer):  # the batches in the given order, like every other peer
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    timer = Timer()
    ours = ctx["name"] == "trl-sft-optimize"
    compile_ = not ours and not packed
    description = None
    with tempfile.TemporaryDirectory() as out, (trainer_patches(model) if compile_ else contextlib.nullcontext()):
        args = SFTConfig(
            output_dir=out, max_steps=ctx["steps"], per_device_train_batch_size=ctx["batch_size"],
            learning_rate=ctx["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, optim="adamw_torch", logging_steps=1, report_to="none", save_strategy="no",
            gradient_checkpointing=ctx["grad_ckpt"], torch_compile=compile_, padding_free=packed, bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16, use_cpu=device.type == "cpu", remove_unused_columns=False,
            dataset_kwargs={"skip_prepare_dataset": True}, seed=ctx["seed"], dataloader_num_workers=0,
            disable_tqdm=not ctx.get("progress", False), max_length=None)
        trainer = InOrderSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok,
                                    data_collator=collate, callbacks=[timer])
        if ours:
            with optimized_trainer(trainer) as opt:
                description = opt.description
                trainer.train()
        else:
            trainer.train()
    tokens = [real_tokens(b) for b in order]
    if len(timer.losses) != len(timer.ms):
        raise RuntimeError(f"TRL logged {len(timer.losses)} losses for {len(timer.ms)} steps")
    how = f"through optimized_trainer ({description})" if ours else "(torch_compile=True)"
    if packed:
        how = ("(padding_free=True, eager, TRL's collator; each step one packed batch's documents flattened into "
               "one row, position_ids restarting per document; SDPA)")
    notes = (f"TRL SFTTrainer {how} on the same pre-tokenized batches in order; "
             "constant lr, AdamW (torch), grad-norm clip 1.0; loss as logged by the Trainer")
    return summarize_run(ctx["name"], losses=timer.losses, step_ms=timer.ms, tokens=tokens,
                         peak_mem_gib=timer.peak, batch_size=ctx["batch_size"], seq_len=ctx["seq_len"],
                         warmup=ctx["warmup"], flops_per_step=ctx.get("flops_per_step"),
                         peak_tflops=ctx.get("peak_tflops"), notes=notes,
                         options={"compiled": compile_ or ours, "packed": packed})
