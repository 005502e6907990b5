"""The ``torchrun`` entry of the pipeline layout: QLoRA with the decoder split into stages over the ranks.

    torchrun --nproc-per-node 2 -m qlora_nb_utils.distributed.launch --layout pipeline \\
        --model llama-3.1-8b-shape --build layerwise --schedule 1f1b --seq-len 2048 --pack \\
        --global-batch-size 8 --micro-batch-size 1 --steps 200 --out runs/pipeline

Why a loop of its own and not ``fsdp_train``'s: a pipeline step is one call of the schedule over
the whole global batch (it runs every micro-batch's forward and backward in its own order), every
rank holds different weights (no rank holds the whole adapter, and none of its optimizer state is
shared), and the loss exists only on the rank of the last stage. What stays the same is what a
user reads: ``OUT/log.jsonl`` (one line per step), ``OUT/summary.json`` (every layout's fields, :mod:`.runs`,
plus the schedule, the stages and their layers), ``OUT/adapter/`` (one plain PEFT adapter, the
ranks' LoRA weights gathered to rank 0 under their global layer names: it loads into a
single-process model) and, with ``--eval``, the loss of the first global batch after training.

Every rank builds the same global batches from the same data (``--data``, the shipped set by
default; ``--pack``: whole examples packed into rows with per-document attention), and builds
only its own decoder layers (:mod:`.pipeline`). Bad input (a global batch the micro-batch size
does not divide, fewer layers than stages, an unknown schedule) stops every rank before any model
is loaded.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Sequence

import torch

from .runs import OPTIMIZERS, RankRun, add_common_arguments, check_common, run_main

__all__ = ["build_parser", "validate", "run", "main", "load_stage_model", "make_batches", "save_pipeline_adapter"]


def build_parser() -> argparse.ArgumentParser:
    """The pipeline layout's options (see ``--help``): the layouts' shared ones and the stages'."""
    from .pipeline import SCHEDULES

    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m qlora_nb_utils.distributed.launch --layout pipeline",
                                description="QLoRA with the decoder layers split into pipeline stages over the ranks "
                                            "(torch.distributed.pipelining), each stage compiled.")
    add_common_arguments(p)
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES),
                   help="gpipe, 1f1b, or a zero-bubble one (zbv, interleaved-zb: two stages per rank)")
    p.add_argument("--layers-per-stage", default=None, metavar="N,N,...",
                   help="decoder layers of each stage, comma-separated (default: an even split)")
    p.add_argument("--layers", type=int, default=None,
                   help="with --build layerwise: the named shape with this many decoder layers (random weights)")
    p.add_argument("--max-mem-gib", type=float, default=None,
                   help="cap this process's GPU memory (torch.cuda.set_per_process_memory_fraction): a smaller card")
    p.add_argument("--dump-grads", action="store_true",
                   help="write each rank's LoRA gradients of the first step (OUT/grads_rank<R>.pt), for checks")
    p.add_argument("--permute-rows", type=int, default=None, metavar="SEED",
                   help="permute the rows of every global batch (the bf16 floor run, training/parity.py)")
    p.add_argument("--optim", default="adamw", choices=OPTIMIZERS,
                   help="adamw (torch, fp32 moments) or adamw8bit (bitsandbytes, 8-bit moments: a smaller LoRA "
                        "state on each stage, room for the allocator where the weights fill the GPU)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="profile this many steps after --timing-warmup (torch.profiler): where each rank's step "
                        "time goes, in OUT/profile_rank<R>.txt and .json")
    return p


def validate(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the options against each other and the world size; fill in ``micro_batch_size``,
    ``micro_batches``, ``stage_counts`` and ``optimize_knobs``.

    Raises:
        ValueError: with a message that says what to change.
    """
    from .pipeline import SCHEDULES, schedule_class, zero_bubble_backend_error

    # what build_pipeline hands optimize() itself, checked with --optimize's options
    check_common(args, layout="pipeline", fixed={"scope": "regional", "cast": True, "backend": args.backend},
                 flags={"backend": "--backend"})
    g = args.global_batch_size
    micro = args.micro_batch_size or 1
    if g % micro:
        raise ValueError(f"--micro-batch-size {micro} must divide --global-batch-size {g} (both >= 1): every "
                         "micro-batch has the same shape")
    schedule_class(args.schedule)  # refused here when this torch lacks it
    per_rank = SCHEDULES[args.schedule][1]
    refused = zero_bubble_backend_error(args.schedule, args.backend)
    if refused:
        raise ValueError(refused)
    n_micro = g // micro
    if args.schedule == "1f1b" and n_micro < world_size:
        raise ValueError(f"--schedule 1f1b needs at least one micro-batch per stage ({world_size}); "
                         f"got {n_micro} (= {g} / {micro})")
    rounds = max(1, n_micro // world_size)
    if per_rank > 1 and n_micro % rounds:
        raise ValueError(f"--schedule {args.schedule} needs a micro-batch count that its {rounds} rounds divide "
                         f"(a multiple of {world_size}, or fewer); got {n_micro}")
    counts = None
    if args.layers_per_stage:
        try:
            counts = [int(x) for x in args.layers_per_stage.split(",")]
        except ValueError as err:
            raise ValueError(f"--layers-per-stage takes integers separated by commas; got {args.layers_per_stage!r}") from err
        if len(counts) != world_size * per_rank:
            raise ValueError(f"--layers-per-stage names {len(counts)} stages; --schedule {args.schedule} on "
                             f"{world_size} ranks has {world_size * per_rank}")
    if args.layers is not None and (args.build != "layerwise" or args.layers < 1):
        raise ValueError("--layers N (>= 1) sets the layer count of a shape built with --build layerwise")
    if args.max_mem_gib is not None and args.max_mem_gib <= 0:
        raise ValueError(f"--max-mem-gib must be > 0; got {args.max_mem_gib}")
    if args.profile < 0 or (args.profile and args.timing_warmup + args.profile > args.steps):
        raise ValueError(f"--profile {args.profile} steps after --timing-warmup {args.timing_warmup} need "
                         f"--steps >= {args.timing_warmup + max(args.profile, 0)}; got {args.steps}")
    args.micro_batch_size, args.micro_batches, args.stage_counts = micro, n_micro, counts
    return args


# ----------------------------------------------------------------------------- the model of one rank
def _reset_lora(peft: torch.nn.Module, seed: int) -> None:
    """Each LoRA A drawn from a generator seeded by ``seed`` and its name (PEFT's init: Kaiming
    uniform, B zero), so a layer's adapter starts the same whichever other layers this rank built."""
    import zlib

    for name, p in peft.named_parameters():
        if "lora_A" in name and p.requires_grad:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5)) as nn.Linear and PEFT
            with torch.no_grad():
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1).mul_(bound).to(p.device, p.dtype))


def load_stage_model(args, device: torch.device, dtype: torch.dtype, keep: set[int]):
    """The PEFT QLoRA model of one rank: the decoder layers in ``keep`` built, the others
    :class:`~.pipeline.SkippedLayer` placeholders. Returns ``(peft, tokenizer)``.

    ``--build load`` reads the whole checkpoint and then drops the layers it does not keep (the
    weights and the LoRA initialisation are one process's); ``layerwise`` never makes them.
    """
    from .. import models
    from .pipeline import SkippedLayer

    if args.build == "layerwise":
        from peft import LoraConfig, get_peft_model

        from .big_model import LINEARS, SHAPES, build_nf4_model

        config = _layerwise_config(args)
        config.use_cache = False
        config._attn_implementation = "sdpa"
        base = build_nf4_model(config, device=device, compute_dtype=dtype, quant_storage=torch.uint8, seed=args.seed,
                               keep_layers=keep, placeholder=SkippedLayer)
        lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=[n.split(".")[-1] for n in LINEARS])
        peft = get_peft_model(base, lora)
        _reset_lora(peft, args.seed)
        return peft, models.load_tokenizer("tiny" if args.model in SHAPES else args.model)  # the shared tokenizer
    peft, tok = models.load_model(args.model, quant="nf4", dtype=dtype, device=device, lora_r=args.lora_r,
                                  lora_alpha=args.lora_alpha, seed=args.seed)
    from ..ops.lm_head import causal_lm_of, decoder_of

    layers = decoder_of(causal_lm_of(peft)).layers
    for i in range(len(layers)):
        if i not in keep:
            layers[i] = SkippedLayer(i)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peft, tok


def _layerwise_config(args):
    """The config of a shape built with random weights: a named model, or one of ``big_model.SHAPES``
    (the 70B shape)."""
    from .. import models
    from .big_model import SHAPES, llama_config

    config = llama_config(args.model) if args.model in SHAPES else models.model_config(args.model)
    if getattr(args, "layers", None):
        config.num_hidden_layers = int(args.layers)
    return config


def make_batches(tok, args) -> list[dict]:
    """The global batches every rank builds identically: padded rows (``build_batches``) or, with
    ``--pack``, whole examples packed per document (``build_packed_batches``), cycled to ``--steps``."""
    from ..data import build_batches, build_packed_batches

    if args.pack:
        batches, _ = build_packed_batches(tok, batch_size=args.global_batch_size, max_len=args.seq_len,
                                          data=args.data, seed=args.seed)
        batches = [b for b in batches if b["input_ids"].shape[0] == args.global_batch_size]
    else:
        batches = build_batches(tok, batch_size=args.global_batch_size, steps=args.steps, max_len=args.seq_len,
                                padding="fixed", data=args.data, limit=min(4000, max(64, args.steps * args.global_batch_size)),
                                seed=args.seed)
    if not batches:
        raise ValueError(f"the data gives no batch of {args.global_batch_size} rows of {args.seq_len}")
    if getattr(args, "permute_rows", None) is not None:
        from ..training.parity import permute_rows

        batches = permute_rows(batches, seed=args.permute_rows)
    return [batches[i % len(batches)] for i in range(args.steps)]


# ----------------------------------------------------------------------------- the run
def _real_tokens(batch: dict) -> int:
    from ..data import real_tokens

    return int(real_tokens(batch))


def _layer_count(args) -> int:
    """The decoder layers of the model to build (a named model or shape: from its config, without loading)."""
    from .. import models
    from .big_model import SHAPES

    if args.model in (*models.MODEL_NAMES, *SHAPES):
        return int(_layerwise_config(args).num_hidden_layers)
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(args.model).num_hidden_layers)


def run(args: argparse.Namespace) -> dict | None:
    """Train as ``args`` says on this rank (under torchrun). Returns the summary on rank 0."""
    import torch.distributed as dist

    from ..training.device import peak_mem_gib, reset_peak
    from .pipeline import SCHEDULES, build_pipeline, owned_layers, pipeline_clip_grad_norm, split_layers, stage_ids
    from .profiling import start_profiler, write_profile
    from .runs import graph_break_total, max_over_ranks

    job = RankRun(args, tag="pipeline", module="qlora_nb_utils.distributed.launch")
    info, out, dtype = job.info, job.out, job.dtype
    if args.max_mem_gib is not None and info.device.type == "cuda":
        total = torch.cuda.get_device_properties(info.device).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.max_mem_gib / total), info.device)
    job.reset_log()
    per_rank = SCHEDULES[args.schedule][1]
    ranges = split_layers(_layer_count(args), info.world_size * per_rank, args.stage_counts)
    mine = stage_ids(args.schedule, info.rank, info.world_size)
    t0 = time.perf_counter()
    peft, tok = load_stage_model(args, info.device, dtype, owned_layers(ranges, mine))
    batches = make_batches(tok, args)
    build_peak = max_over_ranks(peak_mem_gib(info.device), info.device)
    pipe = build_pipeline(peft, schedule=args.schedule, ranges=ranges, rank=info.rank, world_size=info.world_size,
                          micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                          seq_len=args.seq_len, device=info.device, batches=batches[:4], dtype=dtype,
                          backend=args.backend, **args.optimize_knobs)
    build_s = time.perf_counter() - t0
    opt, sched = job.optimizer(pipe.params)
    reset_peak(info.device)
    records, profiler = [], None
    for step in range(args.steps):
        batch = batches[step]
        if args.profile and step == args.timing_warmup:
            profiler = start_profiler(info)
        t = job.clock()
        loss = pipe.step(batch, info.device)
        if args.dump_grads and step == 0:
            torch.save({n: p.grad.detach().cpu().clone() for n, p in peft.named_parameters()
                        if p.requires_grad and p.grad is not None}, out / f"grads_rank{info.rank}.pt")
        grad_norm, lr = job.optimizer_step(opt, sched, lambda max_norm: pipeline_clip_grad_norm(pipe.params, max_norm))
        value = float(loss)
        ms = (job.clock() - t) * 1e3
        if profiler is not None and step == args.timing_warmup + args.profile - 1:
            write_profile(profiler, out, info, args.profile)
            profiler = None
        records.append(job.log({"step": step, "loss": value, "step_ms": ms, "grad_norm": grad_norm, "lr": lr,
                                "tokens": _real_tokens(batch), "tokens_padded": int(batch["input_ids"].numel()),
                                **_allocator_retries(info.device)}))
    eval_loss = None
    if args.eval:
        eval_loss = float(pipe.step(batches[0], info.device))
        opt.zero_grad(set_to_none=True)
    if not args.no_adapter:
        save_pipeline_adapter(peft, out / "adapter", info)
    breaks_after = graph_break_total()[0]
    ranks = [None] * info.world_size
    dist.all_gather_object(ranks, {"rank": info.rank, "stages": mine,
                                   "layers": [list(ranges[s]) for s in mine],
                                   "compile": pipe.compile_stats(),
                                   "graph_breaks": breaks_after - job.breaks_before if breaks_after >= 0 else None,
                                   "optimizer": type(opt).__name__,
                                   "choices": {k: str(v) for k, v in pipe.opt.choices.items()}})
    summary = _pipeline_summary(job, records, ranks, build_peak, build_s, eval_loss) if info.is_main else None
    job.finish(summary, schedule=args.schedule)
    return summary


def _allocator_retries(device) -> dict:
    """Each rank's count, so far, of the times its CUDA allocator found no room for a block and released
    its cache to try again (each time it waits for the GPU), and each rank's peak so far: a step under a
    memory cap that does this often spends its time there, not in its kernels, and the ranks' peaks say
    which stage is the tight one. Every rank calls this together. Nothing off CUDA."""
    if device.type != "cuda":
        return {}
    import torch.distributed as dist

    from ..training.device import peak_mem_gib

    mine = torch.tensor([float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)),
                         peak_mem_gib(device)], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {"alloc_retries": [int(t[0]) for t in every], "peak_mem_gib_per_rank": [float(t[1]) for t in every]}


def save_pipeline_adapter(peft, folder: Path, info) -> None:
    """One PEFT adapter from every rank's LoRA weights (gathered to rank 0 under their global names)."""
    import torch.distributed as dist

    own = {n: p.detach().cpu() for n, p in peft.named_parameters() if p.requires_grad}
    parts = [None] * info.world_size
    dist.all_gather_object(parts, own)
    if info.is_main:
        from safetensors.torch import save_file

        peft.save_pretrained(str(folder))  # the config (and rank 0's weights, replaced below)
        name = f".{peft.active_adapter}."
        full = {k.replace(name, "."): v.contiguous() for part in parts for k, v in part.items()}
        save_file(full, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def _pipeline_summary(job: RankRun, records, ranks, build_peak, build_s, eval_loss) -> dict:
    """The shared fields (:func:`.runs.summary_fields`; graph breaks summed over the ranks) and the
    pipeline's: the schedule, each rank's stages and layers, the build's peak and time, compilations."""
    args = job.args
    breaks = [r["graph_breaks"] for r in ranks]
    summary = {"layout": "pipeline", **job.summary(records)}
    summary["graph_breaks"].update(total=sum(b for b in breaks if b is not None) if None not in breaks else None,
                                   per_rank=breaks, fullgraph=True)
    summary.update(schedule=args.schedule, micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                   stages={str(r["rank"]): {"stages": r["stages"], "layers": r["layers"]} for r in ranks},
                   build_peak_mem_gib_per_gpu=build_peak, build_s=build_s, eval_loss=eval_loss,
                   compile={str(r["rank"]): r["compile"] for r in ranks}, choices=ranks[0]["choices"],
                   optimizer={str(r["rank"]): r["optimizer"] for r in ranks})
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate (before any model is loaded), run. Returns the exit status."""
    return run_main(build_parser(), validate, run, argv)


if __name__ == "__main__":
    from .runs import exit_after_run

    exit_after_run(main())  # gloo's threads may abort a finished run's exit: runs.exit_after_run
