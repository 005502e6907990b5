"""Our compiled QLoRA against its peers: same checkpoint, same batches, same seed, one GPU.

Why it exists: "faster than X" only means something when X ran on the same GPU, the same
checkpoint and the same batches, in the same session, and when X is set up the way its own
users set it up. Each peer here builds its model its library's way and trains for N steps:

* ``hf-eager``: the HF default QLoRA recipe, ``prepare_model_for_kbit_training`` +
  ``get_peft_model`` (bitsandbytes NF4, double quantization), eager.
* ``ours-default-compile``: the same model under plain ``torch.compile``.
* ``trl-sft-compile``: the same model through TRL ``SFTTrainer(torch_compile=True)``.
* ``torchao-nf4``: torchtune's recipe (torchao ``NF4Tensor`` + LoRA, bf16, compiled), see
  :mod:`qlora_nb_utils.bench.peers.torchao`.
* ``unsloth``: Unsloth's ``FastLanguageModel``, run by ``qlora_nb_utils.bench.peers.unsloth`` in its
  own process (Unsloth patches transformers on import).
* ``ours``: the HF recipe, then every non-LoRA float weight cast back to the compute dtype
  (``prepare_model_for_kbit_training`` upcasts embeddings, the tied head and the norms to
  fp32, which turns the whole residual stream fp32), the loss computed by
  :func:`qlora_nb_utils.ops.losses.chunked_cross_entropy` (no full fp32 logits), and the whole
  model compiled with :func:`qlora_nb_utils.compile.prepare_for_compile`; optional gradient
  checkpointing (the package's must-recompute policy) and Inductor's
  ``activation_memory_budget``. Variants (:data:`OURS_VARIANTS`) are named ``ours-<variant>``;
  :func:`pick_ours` names the fastest one within Unsloth's peak memory ``ours``.

:func:`run_peer` runs one peer in this process (the notebooks use it on a CPU);
:func:`run_peers` runs each in a fresh subprocess (one process per library: Unsloth and torchao
patch things, and each peer's peak memory must be its own), with the batches written once to a
``.pt`` file that every process reads, a time limit per peer, and the results file rewritten
after every peer so that a timeout loses only the peer that ran out. A peer that fails is a
run with an ``error`` string, never a missing row.

Each run dict: ``name``, ``batch_size``, ``seq_len``, ``steps``, ``warmup``, ``median_step_ms``,
``tokens_per_s`` (real, non-padding tokens, median), ``mfu`` (model FLOPs of
:func:`qlora_nb_utils.bench.flops.train_step_flops`, the same for every peer, over the measured
matmul rate), ``peak_mem_gib``, ``compile_s`` (first step minus the median step: compilation
and first-call costs), ``losses``, ``step_ms``, ``notes``, ``options``; or ``error``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ... import env, models
from ...env import resolve_device_dtype as _resolve_device_dtype

__all__ = [
    "PEERS",
    "OURS_OPTIONS",
    "OURS_VARIANTS",
    "UNSLOTH_SITE_ENV",
    "TORCHAO_SITE_ENV",
    "peer_names",
    "validate_ours_options",
    "cast_non_lora",
    "ChunkedLossLM",
    "run_peer",
    "run_peers",
    "pick_ours",
    "summarize_run",
]

PEERS = ("hf-eager", "ours-default-compile", "trl-sft-compile", "torchao-nf4", "unsloth", "ours")
UNSLOTH_SITE_ENV = "QLORA_NB_UNSLOTH_SITE"
TORCHAO_SITE_ENV = "QLORA_NB_TORCHAO_SITE"

#: The options of ``ours`` and their defaults.
OURS_OPTIONS: dict[str, Any] = {
    "cast_bf16": True,      # cast non-LoRA float weights back to the compute dtype
    "ce_chunks": 4,         # chunked cross-entropy over this many pieces; 0 = the model's own loss
    "grad_ckpt": False,     # gradient checkpointing with the must-recompute policy
    "memory_budget": None,  # torch._functorch.config.activation_memory_budget (0..1), None = default
    "mode": None,           # inductor mode
    "backend": "inductor",
    "autocast": False,      # run the step under torch.autocast(compute dtype): LoRA matmuls in bf16, fp32 master weights
    "causal_attn": False,   # causal-only SDPA (qlora_nb_utils.ops.attention): flash kernel + GQA; right padding only
    "ckpt_layers": None,    # with grad_ckpt: checkpoint only the first N decoder layers (None = all)
}
_FAST = {"autocast": True, "causal_attn": True}
#: Named variants of ``ours`` (changes from :data:`OURS_OPTIONS`); ``ours`` alone is "chunked".
OURS_VARIANTS: dict[str, dict[str, Any]] = {
    "chunked": {},
    "cast": {"ce_chunks": 0},
    "budget": {"memory_budget": 0.5},
    "ckpt": {"grad_ckpt": True},
    "max-autotune": {"mode": "max-autotune-no-cudagraphs"},
    "reduce-overhead": {"mode": "reduce-overhead"},
    # bf16 LoRA compute (autocast) + the flash/GQA attention path the compiled HF model never takes,
    # then checkpointing on the first N layers, then the same under CUDA graphs (the small LoRA
    # kernels make the compiled step launch-bound)
    "fast": dict(_FAST),
    **{f"fast-ckpt{n}": {**_FAST, "grad_ckpt": True, "ckpt_layers": n} for n in (4, 8, 12)},
    "fast-ckpt": {**_FAST, "grad_ckpt": True},
    "fast-ro": {**_FAST, "mode": "reduce-overhead"},
    **{f"fast-ckpt{n}-ro": {**_FAST, "grad_ckpt": True, "ckpt_layers": n, "mode": "reduce-overhead"} for n in (8, 12)},
    "fast-ckpt-ro": {**_FAST, "grad_ckpt": True, "mode": "reduce-overhead"},
}
DEFAULT_VARIANT = "chunked"


# ----------------------------------------------------------------------------- names and options
def peer_names(peers: Sequence[str], variants: dict[str, dict] | None = None) -> list[str]:
    """Check peer names: :data:`PEERS`, or ``ours-<variant>`` for a known variant.

    Raises:
        ValueError: an unknown name (the message lists the valid ones) or a duplicate.
    """
    variants = {**OURS_VARIANTS, **(variants or {})}
    valid = list(PEERS) + [f"ours-{v}" for v in variants]
    if isinstance(peers, str):
        peers = [p for p in peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in valid]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; valid: {valid}")
    if len(set(peers)) != len(peers):
        raise ValueError(f"duplicate peers in {list(peers)}")
    return list(peers)


def validate_ours_options(options: dict[str, Any]) -> dict[str, Any]:
    """Fill in defaults and check every option of ``ours``.

    Returns:
        The full options dict.

    Raises:
        ValueError: an unknown key or a bad value; the message lists the valid ones.
    """
    from ...compile import valid_backends, valid_modes

    unknown = set(options) - set(OURS_OPTIONS)
    if unknown:
        raise ValueError(f"unknown option(s) of ours {sorted(unknown)}; valid: {sorted(OURS_OPTIONS)}")
    opts = {**OURS_OPTIONS, **options}
    for key in ("cast_bf16", "grad_ckpt", "autocast", "causal_attn"):
        if not isinstance(opts[key], bool):
            raise ValueError(f"{key} must be True or False, got {opts[key]!r}")
    chunks = opts["ce_chunks"]
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 0:
        raise ValueError(f"ce_chunks must be an integer >= 0 (0 = the model's own loss), got {chunks!r}")
    budget = opts["memory_budget"]
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not 0.0 <= budget <= 1.0):
        raise ValueError(f"memory_budget must be None or a number in [0, 1], got {budget!r}")
    layers = opts["ckpt_layers"]
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
        raise ValueError(f"ckpt_layers must be None (all layers) or an integer >= 0, got {layers!r}")
    if layers is not None and not opts["grad_ckpt"]:
        raise ValueError("ckpt_layers picks which layers gradient checkpointing covers; it needs grad_ckpt=True")
    if opts["backend"] not in valid_backends():
        raise ValueError(f"backend must be one of {valid_backends()}, got {opts['backend']!r}")
    if opts["mode"] is not None and opts["mode"] not in valid_modes():
        raise ValueError(f"mode must be None or one of {valid_modes()}, got {opts['mode']!r}")
    if opts["mode"] is not None and opts["backend"] != "inductor":
        raise ValueError(f"mode is an inductor option; with backend={opts['backend']!r} pass mode=None")
    return opts


def _variant_options(name: str, variants: dict[str, dict] | None) -> tuple[str, dict[str, Any]]:
    table = {**OURS_VARIANTS, **(variants or {})}
    variant = DEFAULT_VARIANT if name == "ours" else name[len("ours-"):]
    return variant, validate_ours_options(table[variant])


# ----------------------------------------------------------------------------- building blocks
def cast_non_lora(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Cast every floating, non-LoRA parameter to ``dtype`` (undoing kbit-prep's fp32 upcast).

    LoRA weights (names with ``lora_``) keep their dtype (PEFT keeps them fp32), 4-bit packed
    weights (integer storage) are untouched, and nothing changes ``requires_grad``.

    Returns:
        How many parameters were cast.
    """
    cast = 0
    for name, param in model.named_parameters():
        if "lora_" in name or not param.is_floating_point() or param.dtype == dtype:
            continue
        param.data = param.data.to(dtype)
        cast += 1
    return cast


class ChunkedLossLM(torch.nn.Module):
    """A PEFT causal LM whose loss is :func:`~qlora_nb_utils.ops.losses.chunked_cross_entropy`.

    ``forward(input_ids, attention_mask, labels)`` runs the decoder stack, then the chunked
    head + loss; it returns a ``CausalLMOutputWithPast`` holding only ``loss``, so it drops into
    :func:`qlora_nb_utils.training.train` and :func:`qlora_nb_utils.compile.prepare_for_compile`.
    """

    def __init__(self, model: torch.nn.Module, chunks: int = 4) -> None:
        super().__init__()
        self.model = model
        self.chunks = chunks

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        from ...ops.losses import chunked_cross_entropy

        causal_lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        hidden = causal_lm.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        weight = causal_lm.get_output_embeddings().weight
        return CausalLMOutputWithPast(loss=chunked_cross_entropy(hidden, weight, labels, chunks=self.chunks))


def summarize_run(name: str, *, losses: Sequence[float], step_ms: Sequence[float], tokens: Sequence[int],
                  peak_mem_gib: float, batch_size: int, seq_len: int, warmup: int,
                  flops_per_step: float | None = None, peak_tflops: float | None = None,
                  notes: str = "", options: dict | None = None) -> dict[str, Any]:
    """Build the run dict of the schema from per-step records.

    Raises:
        ValueError: no step after ``warmup`` or lists of different lengths.
    """
    if not len(losses) == len(step_ms) == len(tokens):
        raise ValueError(f"per-step lists differ in length: {len(losses)}, {len(step_ms)}, {len(tokens)}")
    steady_ms = list(step_ms)[warmup:]
    if not steady_ms:
        raise ValueError(f"no step left after warmup={warmup} (ran {len(step_ms)})")
    median_ms = statistics.median(steady_ms)
    tps = statistics.median(t / (ms / 1e3) for t, ms in list(zip(tokens, step_ms))[warmup:])
    mfu = None
    if flops_per_step and peak_tflops:
        from ..flops import mfu as _mfu

        mfu = _mfu(flops_per_step, median_ms / 1e3, peak_tflops * 1e12)
    return {
        "name": name, "batch_size": batch_size, "seq_len": seq_len, "steps": len(step_ms),
        "warmup": warmup, "median_step_ms": median_ms, "tokens_per_s": tps, "mfu": mfu,
        "peak_mem_gib": float(peak_mem_gib), "compile_s": max(0.0, (step_ms[0] - median_ms) / 1e3),
        "first_step_s": step_ms[0] / 1e3, "losses": [float(x) for x in losses],
        "step_ms": [float(x) for x in step_ms], "notes": notes, "options": options or {},
    }


def error_run(name: str, error: str, *, batch_size: int, seq_len: int, notes: str = "") -> dict[str, Any]:
    """The run dict of a peer that could not run: ``error`` says why."""
    return {"name": name, "batch_size": batch_size, "seq_len": seq_len, "error": error, "notes": notes}


def _from_history(name: str, hist, ctx: dict, notes: str, options: dict) -> dict[str, Any]:
    return summarize_run(name, losses=list(hist["loss"]), step_ms=list(hist["step_ms"]),
                         tokens=list(hist["tokens"]), peak_mem_gib=float(hist["peak_mem_gib"].max()),
                         batch_size=ctx["batch_size"], seq_len=ctx["seq_len"], warmup=ctx["warmup"],
                         flops_per_step=ctx.get("flops_per_step"), peak_tflops=ctx.get("peak_tflops"),
                         notes=notes, options=options)


def _hf_model(ctx: dict):
    model, tok = models.load_model(
        ctx["model"], quant="nf4", lora=True, lora_r=ctx["lora_r"], lora_alpha=ctx["lora_alpha"],
        dtype=ctx["dtype"], device=ctx["device"], prepare_kbit=True,
        gradient_checkpointing=ctx["grad_ckpt"], seed=ctx["seed"])
    return model, tok


def _train_cfg(ctx: dict):
    from ...training.loop import TrainConfig

    return TrainConfig(steps=ctx["steps"], lr=ctx["lr"], seed=ctx["seed"], progress=ctx.get("progress", False))


# ----------------------------------------------------------------------------- the peers
def _peer_hf(ctx: dict, batches: list, compiled: bool) -> dict[str, Any]:
    from ...training.loop import train

    model, _ = _hf_model(ctx)
    forward, notes = model, "prepare_model_for_kbit_training + get_peft_model, eager"
    if compiled:
        forward = torch.compile(model)
        notes = "prepare_model_for_kbit_training + get_peft_model, plain torch.compile(model)"
    hist = train(model, batches, _train_cfg(ctx), forward=forward, label=ctx["name"])
    return _from_history(ctx["name"], hist, ctx, notes, {"compiled": compiled})


def _peer_ours(ctx: dict, batches: list, variant: str, opts: dict) -> dict[str, Any]:
    from ...ops.attention import check_right_padded, use_causal_sdpa
    from ...compile import decoder_layers, prepare_for_compile
    from ...training.loop import train

    grad_ckpt = opts["grad_ckpt"] or ctx["grad_ckpt"]
    model, _ = models.load_model(
        ctx["model"], quant="nf4", lora=True, lora_r=ctx["lora_r"], lora_alpha=ctx["lora_alpha"],
        dtype=ctx["dtype"], device=ctx["device"], prepare_kbit=True, gradient_checkpointing=grad_ckpt,
        seed=ctx["seed"])
    device = env.resolve_device(ctx["device"])
    dtype = env.resolve_dtype(ctx["dtype"], device)
    cast = cast_non_lora(model, dtype) if opts["cast_bf16"] else 0
    attn = None
    if opts["causal_attn"]:
        check_right_padded(batches)
        attn = use_causal_sdpa(model)
    target = ChunkedLossLM(model, opts["ce_chunks"]) if opts["ce_chunks"] else model
    prepared = prepare_for_compile(target, grad_ckpt=True if grad_ckpt else False, mode=opts["mode"],
                                   backend=opts["backend"])
    layers = decoder_layers(model)
    n_ckpt = len(layers) if grad_ckpt else 0
    if grad_ckpt and opts["ckpt_layers"] is not None:
        n_ckpt = min(opts["ckpt_layers"], len(layers))
        for layer in layers[n_ckpt:]:  # prepared.undo() restores every layer's original flag
            layer.gradient_checkpointing = False
    forward = prepared.forward
    use_autocast = opts["autocast"] and dtype in (torch.bfloat16, torch.float16)  # fp32 runs: nothing to do
    if use_autocast:
        def forward(**batch):
            with torch.autocast(device.type, dtype=dtype):
                return prepared.forward(**batch)
    budget = {} if opts["memory_budget"] is None else {"activation_memory_budget": float(opts["memory_budget"])}
    try:
        with torch._functorch.config.patch(**budget):
            hist = train(model, batches, _train_cfg(ctx), forward=forward, label=ctx["name"])
    finally:
        prepared.undo()
        if attn is not None:
            attn.undo()
    stats = prepared.counter.to_dict()
    notes = (f"variant {variant}: {cast} non-LoRA weights cast to {str(dtype).replace('torch.', '')}; "
             f"{'chunked CE x' + str(opts['ce_chunks']) if opts['ce_chunks'] else 'model loss'}; "
             f"grad ckpt on {n_ckpt}/{len(layers)} layers; memory budget {opts['memory_budget']}; "
             f"{'autocast ' + str(dtype).replace('torch.', '') + ' (LoRA matmuls in it, fp32 LoRA weights)' if use_autocast else 'no autocast'}; "
             f"attention {'causal-only sdpa (right-padded batches checked)' if opts['causal_attn'] else 'sdpa with mask'}; "
             f"mode {opts['mode'] or 'default'}; {stats.get('compilations')} compilation(s)")
    run = _from_history(ctx["name"], hist, ctx, notes, {**opts, "variant": variant})
    run["variant"] = variant
    run["compilations"] = stats.get("compilations")
    run["dynamo_compile_s"] = stats.get("compile_s")
    return run


def _peer_torchao(ctx: dict, batches: list) -> dict[str, Any]:
    from .torchao import build_torchao_qlora, torchao_status
    from ...training.loop import train

    ok, why = torchao_status()
    if not ok:
        return error_run(ctx["name"], why, batch_size=ctx["batch_size"], seq_len=ctx["seq_len"])
    device, dtype = _resolve_device_dtype(ctx["device"], ctx["dtype"])
    model, info = build_torchao_qlora(_model_dir(ctx["model"]), dtype=dtype, device=device,
                                      lora_r=ctx["lora_r"], lora_alpha=ctx["lora_alpha"], seed=ctx["seed"])
    if ctx["grad_ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hist = train(model, batches, _train_cfg(ctx), forward=torch.compile(model), label=ctx["name"])
    notes = (f"{why}; {info['quantized']} projections as NF4Tensor (block 64, scaler block "
             f"{info['scaler_block_size']}) + LoRA in {str(dtype).replace('torch.', '')}; HF loss; torch.compile(model)")
    return _from_history(ctx["name"], hist, ctx, notes, {"compiled": True})


def _peer_trl(ctx: dict, batches: list) -> dict[str, Any]:
    import datasets
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from ...training.hf_trainer import trainer_patches
    from ...training.loop import _peak_mem_gib, _reset_peak, _sync

    device, dtype = _resolve_device_dtype(ctx["device"], ctx["dtype"])
    model, tok = _hf_model(ctx)
    keys = ("input_ids", "attention_mask", "labels")
    order = [batches[i % len(batches)] for i in range(ctx["steps"])]
    rows = {k: [row.tolist() for b in order for row in b[k]] for k in keys}
    dataset = datasets.Dataset.from_dict(rows)

    def collate(features):
        return {k: torch.tensor([f[k] for f in features], dtype=torch.long) for k in keys}

    class Timer(TrainerCallback):
        def __init__(self):
            self.ms, self.losses, self.t0, self.peak = [], [], 0.0, 0.0

        def on_train_begin(self, args, state, control, **kw):
            _reset_peak(device)

        def on_step_begin(self, args, state, control, **kw):
            _sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            self.ms.append((time.perf_counter() - self.t0) * 1e3)
            self.peak = max(self.peak, _peak_mem_gib(device))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    class InOrderSFTTrainer(SFTTrainer):  # the batches in the given order, like every other peer
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    timer = Timer()
    with tempfile.TemporaryDirectory() as out, trainer_patches(model):
        args = SFTConfig(
            output_dir=out, max_steps=ctx["steps"], per_device_train_batch_size=ctx["batch_size"],
            learning_rate=ctx["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, optim="adamw_torch", logging_steps=1, report_to="none", save_strategy="no",
            gradient_checkpointing=ctx["grad_ckpt"], torch_compile=True, bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16, use_cpu=device.type == "cpu", remove_unused_columns=False,
            dataset_kwargs={"skip_prepare_dataset": True}, seed=ctx["seed"], dataloader_num_workers=0,
            disable_tqdm=not ctx.get("progress", False), max_length=None)
        trainer = InOrderSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok,
                                    data_collator=collate, callbacks=[timer])
        trainer.train()
    tokens = [int(b["attention_mask"].sum()) for b in order]
    if len(timer.losses) != len(timer.ms):
        raise RuntimeError(f"TRL logged {len(timer.losses)} losses for {len(timer.ms)} steps")
    notes = ("TRL SFTTrainer(torch_compile=True) on the same pre-tokenized batches in order; "
             "constant lr, AdamW (torch), grad-norm clip 1.0; loss as logged by the Trainer")
    return summarize_run(ctx["name"], losses=timer.losses, step_ms=timer.ms, tokens=tokens,
                         peak_mem_gib=timer.peak, batch_size=ctx["batch_size"], seq_len=ctx["seq_len"],
                         warmup=ctx["warmup"], flops_per_step=ctx.get("flops_per_step"),
                         peak_tflops=ctx.get("peak_tflops"), notes=notes, options={"compiled": True})


def _model_dir(model: str) -> str:
    """A local checkpoint folder for ``model`` (built into the cache for a named model)."""
    if model in models.MODEL_NAMES:
        return str(models.materialize(model))
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    raise ValueError(f"peers need a local checkpoint: use one of {list(models.MODEL_NAMES)} or a folder; "
                     f"got {model!r}")


def _peer_unsloth(ctx: dict, batches: list | None, batches_path: str | None = None,
                  timeout_s: float | None = None) -> dict[str, Any]:
    """Run ``python -m qlora_nb_utils.bench.peers.unsloth`` (always a subprocess) and read its run."""
    shape = {"batch_size": ctx["batch_size"], "seq_len": ctx["seq_len"]}
    site = os.environ.get(UNSLOTH_SITE_ENV, "").strip()
    if site and not Path(site).is_dir():
        return error_run("unsloth", f"${UNSLOTH_SITE_ENV}={site} is not a folder", **shape)
    if importlib.util.find_spec("qlora_nb_utils.bench.peers.unsloth") is None:
        return error_run("unsloth", "module qlora_nb_utils.bench.peers.unsloth is missing", **shape)
    with tempfile.TemporaryDirectory() as tmp:
        if batches_path is None:
            batches_path = str(Path(tmp) / "batches.pt")
            torch.save(batches, batches_path)
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "qlora_nb_utils.bench.peers.unsloth", "--model-dir", _model_dir(ctx["model"]),
               "--batches", batches_path, "--steps", str(ctx["steps"]), "--warmup", str(ctx["warmup"]),
               "--lr", str(ctx["lr"]), "--seed", str(ctx["seed"]), "--lora-r", str(ctx["lora_r"]),
               "--lora-alpha", str(ctx["lora_alpha"]), "--out", str(out)]
        if ctx["grad_ckpt"]:
            cmd.append("--grad-ckpt")
        code, tail = _run_child(cmd, _child_env("unsloth", Path(tmp) / "inductor"), timeout_s,
                                Path(tmp) / "unsloth.log")
        if not out.is_file():
            why = f"timed out after {timeout_s:.0f} s" if code is None else f"exit code {code}"
            return error_run("unsloth", f"peer_unsloth wrote no run ({why}): {tail}", **shape)
        run = json.loads(out.read_text())
    run.setdefault("name", "unsloth")
    run.update(shape)
    if "error" not in run and ctx.get("flops_per_step") and ctx.get("peak_tflops") and run.get("median_step_ms"):
        from ..flops import mfu

        run["mfu"] = mfu(ctx["flops_per_step"], run["median_step_ms"] / 1e3, ctx["peak_tflops"] * 1e12)
    return run


# ----------------------------------------------------------------------------- one peer, in process
def run_peer(name: str, batches: list, *, model: str = "tiny", steps: int | None = None, warmup: int = 3,
             lr: float = 2e-4, seed: int = 0, lora_r: int = 16, lora_alpha: float = 32, device: Any = "auto",
             dtype: Any = "auto", grad_ckpt: bool = False, peak_tflops: float | None = None,
             variants: dict[str, dict] | None = None, progress: bool = False) -> dict[str, Any]:
    """Train one peer for ``steps`` steps on ``batches`` in this process and return its run dict.

    A failure inside the peer becomes a run with ``error`` (the exception's type and message),
    so a comparison always has one row per peer.

    Args:
        name: a peer of :data:`PEERS` or ``ours-<variant>``.
        batches: the micro-batches (dicts of CPU int64 tensors), cycled if fewer than ``steps``.
        model: a named model or a local checkpoint folder.
        steps: optimizer steps (default: ``len(batches)``).
        warmup: steps left out of the medians.
        lr: AdamW learning rate (constant).
        seed: seeds LoRA initialisation and training.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        device: ``auto``, ``cpu``, ``cuda``...
        dtype: ``auto`` (bf16 on SM80+, fp32 on a CPU) or a dtype name.
        grad_ckpt: gradient checkpointing for every peer (off: what the issue's targets use).
        peak_tflops: the device's measured matmul rate, for MFU (None: no MFU).
        variants: extra ``ours`` variants (name -> options).
        progress: progress bars.

    Returns:
        The run dict (see the module docstring).

    Raises:
        ValueError: unknown peer, bad options, ``warmup >= steps``.
    """
    peer_names([name], variants)
    steps = len(batches) if steps is None else steps
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup ({warmup}) must be >= 0 and smaller than steps ({steps})")
    opts = _variant_options(name, variants) if name.startswith("ours") and name != "ours-default-compile" else None
    b, s = (int(x) for x in batches[0]["input_ids"].shape)
    dev, dt = _resolve_device_dtype(device, dtype)
    ctx = {"name": name, "model": model, "steps": steps, "warmup": warmup, "lr": lr, "seed": seed,
           "lora_r": lora_r, "lora_alpha": lora_alpha, "device": str(dev), "dtype": str(dt).replace("torch.", ""),
           "grad_ckpt": grad_ckpt,
           "batch_size": b, "seq_len": s, "peak_tflops": peak_tflops, "progress": progress}
    ctx["flops_per_step"] = _flops_per_step(model, b, s, lora_r)
    torch.manual_seed(seed)
    try:
        if name == "unsloth":
            return _peer_unsloth(ctx, batches)
        if name in ("hf-eager", "ours-default-compile"):
            return _peer_hf(ctx, batches, compiled=name != "hf-eager")
        if name == "trl-sft-compile":
            return _peer_trl(ctx, batches)
        if name == "torchao-nf4":
            return _peer_torchao(ctx, batches)
        return _peer_ours(ctx, batches, *opts)
    except Exception as exc:  # the comparison records it; the traceback goes to the log
        traceback.print_exc()
        return error_run(name, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                         batch_size=b, seq_len=s)
    finally:
        import gc

        torch.compiler.reset()
        gc.collect()  # the peer's model goes now, not at some later collection: peaks stay per peer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _flops_per_step(model: str, batch_size: int, seq_len: int, lora_r: int) -> int | None:
    from transformers import AutoConfig

    from ..flops import train_step_flops

    try:
        config = AutoConfig.from_pretrained(_model_dir(model))
    except (ValueError, OSError):
        return None
    return train_step_flops(config, batch_size, seq_len, lora_r=lora_r).total


# ----------------------------------------------------------------------------- many peers, one process each
def _child_env(peer: str, cache_dir: str | Path | None = None) -> dict[str, str]:
    """The environment of a peer's process: the extra site of unsloth / torchao prepended, and
    a fresh ``TORCHINDUCTOR_CACHE_DIR`` (when given) so no peer compiles from another's cache."""
    child = dict(os.environ)
    if cache_dir is not None:
        child["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
        child["TRITON_CACHE_DIR"] = str(Path(cache_dir) / "triton")
    site = {"unsloth": UNSLOTH_SITE_ENV, "torchao-nf4": TORCHAO_SITE_ENV}.get(peer)
    extra = os.environ.get(site, "").strip() if site else ""
    repo = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in (extra, repo, child.get("PYTHONPATH", "")) if p]
    child["PYTHONPATH"] = os.pathsep.join(paths)
    child.setdefault("PYTHONUNBUFFERED", "1")
    return child


def _run_child(cmd: list[str], child_env: dict, timeout_s: float | None, log_path: Path) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; returns (exit code or None on timeout, log tail)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the peer's process group, which we started
            proc.wait()
            code = None
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    return code, " | ".join(lines[-3:])[-600:]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def pick_ours(runs: list[dict]) -> list[dict]:
    """Name the best ``ours`` variant ``ours`` at each shape; the others ``ours-<variant>``.

    The best is the fastest (median step) whose peak memory is at or below Unsloth's at the
    same shape when Unsloth ran; else the fastest. Runs with an error never win. The winner
    gets ``memory_cap_gib`` (the cap it was held to, or None).

    Args:
        runs: run dicts; variants carry ``variant``.

    Returns:
        The same runs (modified in place), in the same order.
    """
    shapes = {(r["batch_size"], r["seq_len"]) for r in runs}
    for shape in shapes:
        here = [r for r in runs if (r["batch_size"], r["seq_len"]) == shape]
        ours = [r for r in here if r.get("variant") and (r["name"] == "ours" or r["name"].startswith("ours-"))]
        for r in ours:
            r["name"] = f"ours-{r['variant']}"
        unsloth = next((r for r in here if r["name"] == "unsloth" and "error" not in r), None)
        cap = unsloth["peak_mem_gib"] if unsloth else None
        ok = [r for r in ours if "error" not in r]
        within = [r for r in ok if cap is None or r["peak_mem_gib"] <= cap]
        pool = within or ok
        if pool:
            best = min(pool, key=lambda r: r["median_step_ms"])
            best["name"] = "ours"
            best["memory_cap_gib"] = cap
            best["within_memory_cap"] = bool(within)
    return runs


def _one_line(run: dict) -> str:
    """A run in one log line (an error, or speed, memory and compile time when there was one)."""
    if "error" in run:
        return f"ERROR {run['error']}"
    compiled = "no compile" if run.get("compile_s") is None else f"compile {run['compile_s']:.1f} s"
    return f"{run['median_step_ms']:.1f} ms/step, {run['peak_mem_gib']:.2f} GiB, {compiled}"


def run_peers(model_name: str, peers: Sequence[str], batch_size: int, seq_len: int, steps: int, warmup: int,
              out: str | Path, *, lr: float = 2e-4, seed: int = 0, lora_r: int = 16, lora_alpha: float = 32,
              device: Any = "auto", dtype: Any = "auto", grad_ckpt: bool = False,
              variants: dict[str, dict] | None = None, timeout_s: float | dict[str, float] = 600,
              budget_s: float | None = None, data: str | None = None, peak_tflops: float | None = None,
              work_dir: str | Path | None = None, command: str | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run each peer in a fresh process on the same batches; append the runs to ``out``.

    ``out`` is rewritten after every peer (a timeout or a crash loses only that peer). An
    existing ``out`` with the same model keeps its runs, so two shapes can share one file.

    Args:
        model_name: a named model (built into the cache first) or a local checkpoint folder.
        peers: names from :data:`PEERS` or ``ours-<variant>`` (a list or a comma-separated string).
        batch_size: rows per batch.
        seq_len: fixed padded length.
        steps: optimizer steps per peer.
        warmup: steps left out of the medians.
        out: the results JSON.
        lr: AdamW learning rate.
        seed: data order, LoRA initialisation, training.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        device: run device (``auto``: CUDA when there).
        dtype: ``auto`` or a dtype name.
        grad_ckpt: gradient checkpointing for every peer.
        variants: extra ``ours`` variants (name -> options).
        timeout_s: seconds per peer (a number, or peer name -> seconds with ``"default"``).
        budget_s: seconds for this whole call; a peer that would start with less than 30 s
            left is recorded as skipped.
        data: a JSONL data file (default: the shipped KJV set).
        peak_tflops: the device's matmul rate; measured here when None.
        work_dir: where the batches file and per-peer logs go (default: next to ``out``).
        command: the command line to record.
        log: progress messages.

    Returns:
        The results dict as written.

    Raises:
        ValueError: unknown peers or bad options (before anything runs).
    """
    from transformers import AutoConfig

    from .. import main_job as bench
    from ..flops import measure_matmul_tflops, train_step_flops

    peers = peer_names(peers, variants)
    for p in peers:
        if p.startswith("ours") and p != "ours-default-compile":
            _variant_options(p, variants)
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup ({warmup}) must be >= 0 and smaller than steps ({steps})")
    t_start = time.monotonic()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else out.parent / f"{out.stem}_work"
    work.mkdir(parents=True, exist_ok=True)
    dev, dt = _resolve_device_dtype(device, dtype)
    model_dir = _model_dir(model_name)
    tok = models.load_tokenizer(model_name)
    batches, pad = bench.make_bench_batches(tok, batch_size=batch_size, seq_len=seq_len, steps=steps,
                                            padding="fixed", data=data, seed=seed)
    batches_path = work / f"batches_{batch_size}x{seq_len}.pt"
    torch.save(batches, batches_path)
    if peak_tflops is None:
        peak_tflops = measure_matmul_tflops(dev, dt)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    flops = train_step_flops(AutoConfig.from_pretrained(model_dir), batch_size, seq_len, lora_r=lora_r)
    results = json.loads(out.read_text()) if out.is_file() else {}
    if results.get("model") not in (None, model_name):
        raise ValueError(f"{out} holds runs of {results['model']!r}, not {model_name!r}: use another file")
    results.update({
        "device": env.device_info(dev), "versions": env.versions(),
        "command": command or (shlex.join(sys.argv) if sys.argv and sys.argv[0] else "run_peers()"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "model": model_name,
        "dtype": str(dt).replace("torch.", ""), "peak_tflops": peak_tflops,
        "peak_tflops_how": f"median of 3 rounds of n x n matmuls in {str(dt).replace('torch.', '')} "
                           "(qlora_nb_utils.bench.flops.measure_matmul_tflops)",
        "options": {"lr": lr, "seed": seed, "lora_r": lora_r, "lora_alpha": lora_alpha, "grad_ckpt": grad_ckpt,
                    "padding": "fixed", "variants": {**OURS_VARIANTS, **(variants or {})}},
    })
    # a file may gather several invocations (shapes, peers a budget left out): keep each one
    results.setdefault("calls", []).append({k: results[k] for k in ("command", "date")} | {
        "device": results["device"].get("name"), "shape": f"{batch_size}x{seq_len}", "peers": list(peers)})
    results.setdefault("shapes", {})[f"{batch_size}x{seq_len}"] = {
        "flops_per_step": flops.to_dict(), "padding": pad, "steps": steps, "warmup": warmup}
    runs = [r for r in results.get("runs", []) if (r["batch_size"], r["seq_len"]) != (batch_size, seq_len)
            or r["name"] not in peers]
    results["runs"] = runs
    ctx = {"model": model_name, "steps": steps, "warmup": warmup, "lr": lr, "seed": seed, "lora_r": lora_r,
           "lora_alpha": lora_alpha, "device": str(dev), "dtype": str(dt).replace("torch.", ""),
           "grad_ckpt": grad_ckpt, "peak_tflops": peak_tflops, "variants": variants or {},
           "batch_size": batch_size, "seq_len": seq_len, "flops_per_step": flops.total}
    shape = {"batch_size": batch_size, "seq_len": seq_len}
    for peer in peers:
        limit = timeout_s.get(peer, timeout_s.get("default", 600)) if isinstance(timeout_s, dict) else timeout_s
        if budget_s is not None:
            left = budget_s - (time.monotonic() - t_start)
            if left < 30:
                runs.append(error_run(peer, f"skipped: {left:.0f} s of the {budget_s:.0f} s budget left", **shape))
                _write_json(out, results)
                continue
            limit = min(limit, left)
        log(f"==> {peer} at {batch_size} x {seq_len} (limit {limit:.0f} s)")
        t0 = time.monotonic()
        run = _run_peer_process(peer, ctx, batches, batches_path, limit, work)
        run["wall_s"] = time.monotonic() - t0
        run["invocation_date"] = results["date"]  # which of results["calls"] this row comes from
        runs.append(run)
        log(f"    {peer}: " + _one_line(run))
        pick_ours(runs)
        _write_json(out, results)
    return results


def _run_peer_process(peer: str, ctx: dict, batches: list, batches_path: Path, limit: float, work: Path) -> dict:
    shape = {"batch_size": ctx["batch_size"], "seq_len": ctx["seq_len"]}
    if peer == "unsloth":
        return _peer_unsloth({**ctx, "name": peer}, batches, str(batches_path), limit)
    spec = work / f"spec_{peer}_{ctx['batch_size']}x{ctx['seq_len']}.json"
    run_path = spec.with_name(spec.name.replace("spec_", "run_"))
    run_path.unlink(missing_ok=True)
    _write_json(spec, {**ctx, "name": peer, "batches": str(batches_path)})
    cmd = [sys.executable, "-m", "qlora_nb_utils.bench.peers", "--spec", str(spec), "--out", str(run_path)]
    tag = f"{peer}_{ctx['batch_size']}x{ctx['seq_len']}"
    cache = Path(tempfile.mkdtemp(prefix=f"inductor_{tag}_", dir=work))
    code, tail = _run_child(cmd, _child_env(peer, cache), limit, work / f"log_{tag}.txt")
    if run_path.is_file():
        return json.loads(run_path.read_text())
    why = f"timed out after {limit:.0f} s" if code is None else f"its process exited with code {code}"
    return error_run(peer, f"{why}: {tail}", **shape)


def _child_main(argv: Sequence[str] | None = None) -> int:
    """``python -m qlora_nb_utils.bench.peers --spec SPEC.json --out RUN.json``: one peer, one process."""
    parser = argparse.ArgumentParser(description=_child_main.__doc__)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    batches = torch.load(spec["batches"])
    run = run_peer(spec["name"], batches, model=spec["model"], steps=spec["steps"], warmup=spec["warmup"],
                   lr=spec["lr"], seed=spec["seed"], lora_r=spec["lora_r"], lora_alpha=spec["lora_alpha"],
                   device=spec["device"], dtype=spec["dtype"], grad_ckpt=spec["grad_ckpt"],
                   peak_tflops=spec["peak_tflops"], variants=spec.get("variants") or None)
    _write_json(Path(args.out), run)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
