"""A 70B-shape QLoRA model with random NF4 weights, built one linear layer at a time, and its run.

Why this module exists: the point of sharding NF4 weights is a model that does not fit on one
GPU, and the reference result (Answer.AI's FSDP-QLoRA) is a 70B model on two 24 GB cards. A
Llama-3.1-70B checkpoint cannot be downloaded here, and building one in bf16 first would need
140 GB of memory for weights that are thrown away after quantization. :func:`build_nf4_model`
instead creates the model on the ``meta`` device and materialises each linear layer of each
decoder layer as random bf16 (std 0.02), quantizes it to NF4 at once (double quantization,
like ``load_qlora``) and drops the bf16 tensor before the next one: at most one linear layer
(the 70B MLP's 28672 x 8192, 0.47 GB) exists in bf16 at a time. Embeddings and the LM head are
bf16 as in any QLoRA model. The weights are random, so losses are meaningless; memory and
speed are those of the real shape.

Built on the GPU, every rank holds the whole 4-bit model until sharding (about 37 GiB at 70B),
more than a 24 GB card. ``nf4_device="cpu"`` (``--host-build``) moves each layer's packed words
to host memory as soon as they are quantized (the quantization still runs on the GPU, one
linear layer at a time); ``fully_shard`` then moves one decoder layer's words at a time back to
the GPU, keeps this rank's shard and frees the rest, and the check of the packed bytes after
sharding gathers one layer at a time (:func:`.fsdp.apply_fsdp2`). With ``--cpu-offload`` the
shards go back to host memory, so the GPU holds at most a layer, the embedding and the LM head.

    torchrun --nproc-per-node 2 -m qlora_nb_utils.distributed.big_model --layers 20 --out big.json

runs a few sharded training steps (NF4 sharded with the float32-word plan of
:mod:`.packed_words`, activation checkpointing, optional CPU offload) and writes the per-GPU
peak, tokens/s and, for a layer slice, the extrapolation to all layers (:func:`extrapolate`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import sys
import time
from typing import Callable, Collection, Sequence

import torch
from torch import nn

__all__ = ["SHAPES", "LINEARS", "llama_config", "build_nf4_model", "build_named_base", "build_named_qlora", "extrapolate",
           "cpu_ram_gib", "main"]

#: Llama-3.1-70B's published config (hidden 8192, 80 layers, GQA 64/8, vocab 128256).
SHAPES = {
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                          rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                          tie_word_embeddings=False),
    # the same structure at a size a CPU test runs (a CI dry run of the script's Python part)
    "llama-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False),
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def llama_config(shape: str | dict = "llama-3.1-70b", layers: int | None = None):
    """A ``LlamaConfig`` of ``shape`` (a name in :data:`SHAPES` or a dict), cut to ``layers``."""
    from transformers import LlamaConfig

    fields = dict(SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    if layers is not None:
        if not 1 <= layers <= fields["num_hidden_layers"]:
            raise ValueError(f"layers must be in 1..{fields['num_hidden_layers']}; got {layers}")
        fields["num_hidden_layers"] = layers
    return LlamaConfig(**fields, use_cache=False, attn_implementation="sdpa")


def _nf4_linear(in_f: int, out_f: int, device, compute_dtype, storage, gen) -> nn.Module:
    import bitsandbytes as bnb

    lin = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=compute_dtype, compress_statistics=True,
                            quant_type="nf4", quant_storage=storage, device="meta")
    w = torch.empty(out_f, in_f, dtype=compute_dtype, device=device).normal_(0.0, 0.02, generator=gen)
    lin.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4",
                                   quant_storage=storage).to(device)  # quantized here; w is dropped
    lin.quant_state = lin.weight.quant_state  # the module's copy, which sharding re-attaches (fsdp.py)
    return lin


def build_nf4_model(config, *, device: torch.device | str = "cpu", compute_dtype: torch.dtype = torch.bfloat16,
                    quant_storage: torch.dtype = torch.float32, seed: int = 0,
                    on_linear: Callable[[str], None] | None = None,
                    nf4_device: torch.device | str | None = None,
                    keep_layers: Collection[int] | None = None,
                    placeholder: Callable[[int], nn.Module] | None = None) -> nn.Module:
    """A ``LlamaForCausalLM`` of ``config`` with random NF4 linear layers (module docstring).

    Args:
        config: from :func:`llama_config`.
        device: where every weight is made (each rank: its GPU).
        compute_dtype: bf16 weights before quantization, embeddings, norms, LM head.
        quant_storage: the packed words' dtype (float32: the sharding plan of ``packed_words``).
        seed: the same seed gives the same weights on every rank.
        on_linear: called with each quantized layer's name (tests measure memory there).
        nf4_device: where each layer's packed 4-bit words wait once quantized (default: ``device``);
            ``"cpu"`` keeps the whole 4-bit model off the GPU until sharding (module docstring).
            Their quant state stays on ``device``.
        keep_layers: build only these decoder layers (a pipeline rank's); each other one becomes
            ``placeholder(index)`` and is never materialised. Given (even with every layer), each
            layer's weights come from a generator seeded by ``seed`` and its index, and the
            embedding and head from their own, so a layer has the same weights whichever others are
            built (a pipeline stage and one process on the same model agree).
        placeholder: what stands in for a layer not kept (required with ``keep_layers``).

    Returns:
        The model, frozen (no parameter requires grad), in train mode.
    """
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    device = torch.device(device)
    park = torch.device(nf4_device) if nf4_device is not None else device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if keep_layers is not None and placeholder is None:
        raise ValueError("keep_layers needs a placeholder for the layers not kept")
    for i, layer in enumerate(model.model.layers):
        if keep_layers is not None:
            if i not in keep_layers:
                model.model.layers[i] = placeholder(i)
                continue
            gen.manual_seed(seed * 1_000_003 + i + 1)  # this layer's weights whatever else is built
        for name in LINEARS:
            parent_name, attr = name.split(".")
            parent = getattr(layer, parent_name)
            old = getattr(parent, attr)
            lin = _nf4_linear(old.in_features, old.out_features, device, compute_dtype, quant_storage, gen)
            if park != device:
                lin.weight.data = lin.weight.data.to(park)
            setattr(parent, attr, lin)
            if on_linear is not None:
                on_linear(f"model.layers.{i}.{name}")
    if keep_layers is not None:
        gen.manual_seed(seed)
    for module in (model.model.embed_tokens, model.lm_head):
        module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=compute_dtype, device=device)
                                     .normal_(0.0, 0.02, generator=gen))
    for name, p in list(model.named_parameters()):
        if p.is_meta:  # the RMSNorm weights
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            owner.weight = nn.Parameter(torch.ones(p.shape, dtype=compute_dtype, device=device))
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config).to(device)
    model.requires_grad_(False)
    return model.train()


def build_named_base(name: str, *, device, dtype: torch.dtype = torch.bfloat16,
                     quant_storage: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """The NF4 base of :func:`build_named_qlora` alone (the same seeded weights, no LoRA): the
    base a run's saved adapter loads onto."""
    from .. import models

    config = models.model_config(name)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return build_nf4_model(config, device=torch.device(device), compute_dtype=dtype, quant_storage=quant_storage,
                           seed=seed)


def build_named_qlora(name: str, *, device, dtype: torch.dtype = torch.bfloat16,
                      quant_storage: torch.dtype = torch.float32, lora_r: int = 16, lora_alpha: float = 32,
                      seed: int = 0):
    """A named random-init model (``models.MODEL_NAMES``, e.g. ``llama-3.1-8b-shape``) built like
    :func:`build_nf4_model` (no bf16 copy of the model, no checkpoint on disk), with LoRA on every
    linear layer of the decoder (fp32, seeded) as ``setup.load_qlora`` gives it.

    Returns:
        ``(model, tokenizer)``.
    """
    from peft import LoraConfig, get_peft_model

    from .. import models

    device = torch.device(device)
    base = build_named_base(name, device=device, dtype=dtype, quant_storage=quant_storage, seed=seed)
    lora = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=[n.split(".")[-1] for n in LINEARS])
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return get_peft_model(base, lora), models.load_tokenizer(name)


@contextlib.contextmanager
def layers_visit_device(model: nn.Module, device: torch.device):
    """While open, a forward through ``model`` moves each decoder layer's host-held 4-bit words to
    ``device`` for that layer's forward and drops the copy after it: ``optimize()``'s probe forward
    (it reads what the LM head does) on a host build, one layer on the GPU at a time."""
    from ..compile import decoder_layers
    from .fsdp import nf4_params

    held: dict[int, torch.Tensor] = {}

    def arrive(layer: nn.Module, _args) -> None:
        for q in (q for q in nf4_params(layer) if q.device.type == "cpu"):
            held[id(q)] = q.data
            q.data = q.data.to(device)

    def leave(layer: nn.Module, _args, _out) -> None:
        for q in layer.parameters():
            if id(q) in held:
                q.data = held.pop(id(q))

    hooks = [h for layer in decoder_layers(model)
             for h in (layer.register_forward_pre_hook(arrive), layer.register_forward_hook(leave))]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def cpu_ram_gib() -> dict:
    """This process's peak resident memory, and the machine's memory in use, in GiB (Linux)."""
    import resource

    used = None
    try:
        info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        kib = lambda key: int(info[key].split()[0])  # noqa: E731
        used = (kib("MemTotal") - kib("MemAvailable")) / 2**20
    except (OSError, KeyError, ValueError):
        pass
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "machine_used": used}


def extrapolate(measured: dict, layers_run: int, layers_total: int) -> dict:
    """Per-GPU peak and tokens/s of all layers from a slice: the per-layer part of the peak
    (sharded NF4 + LoRA state + one checkpointed activation per layer) scales with the layer
    count, the rest (embeddings, LM head, logits, one layer's working set) does not; step
    time is taken as proportional to the layer count (the LM head is ignored: optimistic)."""
    per_layer = measured["per_layer_gib_per_gpu"]
    peak = measured["peak_mem_gib_per_gpu"] + per_layer * (layers_total - layers_run)
    return {"layers": layers_total, "peak_mem_gib_per_gpu": peak,
            "tokens_per_s": measured["tokens_per_s"] * layers_run / layers_total,
            "fits_24gb": peak <= 24 * 1e9 / 2**30, "method": extrapolate.__doc__.split(":", 1)[1].strip()}


def _per_layer_gib(model: nn.Module, layer: nn.Module, tokens_per_rank: int, hidden: int) -> float:
    local = sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in layer.parameters())
    lora = sum(getattr(p, "_local_tensor", p).numel() * 4 * 3 for p in layer.parameters() if p.requires_grad)
    return (local + lora + tokens_per_rank * hidden * 2) / 2**30  # + Adam states; + the checkpointed input


def main(argv: Sequence[str] | None = None) -> int:
    """Build, shard and train a few steps on random tokens; rank 0 writes ``--out``."""
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m qlora_nb_utils.distributed.big_model")
    p.add_argument("--shape", default="llama-3.1-70b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="a slice of the decoder layers (default: all)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1, help="rows per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--host-build", action="store_true",
                   help="keep the packed 4-bit words in host memory until sharding (module docstring): no GPU "
                        "ever holds the whole 4-bit model")
    p.add_argument("--compile", action="store_true", help="compile each decoder layer (inductor)")
    p.add_argument("--fast-path", action="store_true",
                   help="compile.optimize()'s recipe on every rank, then FSDP2 (distributed/fast.py)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from .. import env
    from ..training.device import peak_mem_gib, reset_peak, sync
    from .fsdp import apply_fsdp2, clip_grad_norm
    from .packed_words import sharded_nf4_precision
    from .runs import graph_break_total, max_over_ranks
    from .setup import init_distributed

    info = init_distributed(args.device)
    dtype = torch.bfloat16 if info.device.type == "cuda" else torch.float32
    plan, storage = sharded_nf4_precision(dtype)
    config = llama_config(args.shape, args.layers)
    t0 = time.perf_counter()
    model = build_nf4_model(config, device=info.device, compute_dtype=dtype, quant_storage=storage,
                            nf4_device="cpu" if args.host_build else None)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
        n.split(".")[-1] for n in LINEARS], task_type="CAUSAL_LM"))
    if args.host_build:  # PEFT made the adapters beside their base weights, in host memory: to the GPU
        for q in model.parameters():
            if q.requires_grad:
                q.data = q.data.to(info.device)
    build_s = time.perf_counter() - t0
    build_peak = max_over_ranks(peak_mem_gib(info.device), info.device)
    gen = torch.Generator().manual_seed(info.rank)
    make = lambda: torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=gen)  # noqa: E731
    fast = None
    if args.fast_path:
        from .fast import optimize_sharded

        ids = make()
        sample = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}]
        with layers_visit_device(model, info.device) if args.host_build else contextlib.nullcontext():
            fast = optimize_sharded(model, batches=sample, world_size=info.world_size, mp_policy=plan,
                                    nf4="shard", frozen="shard", cpu_offload=args.cpu_offload, grad_ckpt=True,
                                    shard_one=True)
        sharded, model = fast.sharded, fast.root
    else:
        sharded = apply_fsdp2(model, mp_policy=plan, nf4="shard", grad_ckpt=True, cpu_offload=args.cpu_offload,
                              compile_layers=args.compile, fullgraph=False, frozen="shard")
    shard_peak = max_over_ranks(peak_mem_gib(info.device), info.device)  # the build's and the sharding's
    breaks_before = graph_break_total()[0]
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    reset_peak(info.device)
    times = []
    for _ in range(args.steps):
        ids = make().to(info.device)
        sync(info.device)
        t = time.perf_counter()
        if fast is not None:
            loss = fast.loss({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip_grad_norm(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(info.device)
        times.append(time.perf_counter() - t)
    timed = sorted(times[1:] or times)
    step_s = timed[len(timed) // 2]
    peak = max_over_ranks(peak_mem_gib(info.device), info.device)
    ram = cpu_ram_gib()
    rss = torch.tensor([ram["peak_rss"]], dtype=torch.float64, device=info.device)
    dist.all_reduce(rss)  # every rank's peak resident memory, summed: what the run asked of the host
    machine = max_over_ranks(ram["machine_used"] or 0.0, info.device)
    measured = {"peak_mem_gib_per_gpu": peak, "tokens_per_s": args.batch * args.seq_len * info.world_size / step_s,
                "median_step_s": step_s, "first_step_s": times[0], "build_s": build_s,
                "build_peak_mem_gib_per_gpu": build_peak, "shard_peak_mem_gib_per_gpu": shard_peak,
                "run_peak_mem_gib_per_gpu": max(peak, shard_peak),
                "run_peak_note": "the most any GPU held from the build to the last step (build and sharding "
                                 "included; peak_mem_gib_per_gpu: the training steps alone)",
                "cpu_ram_gib": float(rss),
                "cpu_ram_note": "sum over ranks of each process's peak resident memory (pinned CPU shards "
                                "included); machine_used_gib: MemTotal - MemAvailable at the end, max over ranks",
                "machine_used_gib": machine, "step_s": times,
                "per_layer_gib_per_gpu": _per_layer_gib(model, sharded.layers[0], args.batch * args.seq_len,
                                                        config.hidden_size)}
    total = SHAPES[args.shape]["num_hidden_layers"]
    record = {"shape": args.shape, "layers_run": config.num_hidden_layers, "layers_total": total,
              "world_size": info.world_size, "seq_len": args.seq_len, "batch_per_gpu": args.batch,
              "nf4": sharded.nf4, "quant_storage": str(storage).replace("torch.", ""), "grad_ckpt": True,
              "cpu_offload": args.cpu_offload, "host_build": args.host_build, "compile": args.compile or args.fast_path, "steps": args.steps,
              **measured, "fast_path": fast is not None,
              "optimize_choices": {k: str(v) for k, v in fast.opt.choices.items()} if fast is not None else None,
              "compile_stats": fast.compile_stats() if fast is not None else None,
              "graph_breaks": graph_break_total()[0] - breaks_before,
              "extrapolated": config.num_hidden_layers < total,
              "extrapolation": extrapolate(measured, config.num_hidden_layers, total)
              if config.num_hidden_layers < total else None,
              "losses_note": "random weights and tokens: the loss is not meaningful",
              "device": env.device_info(info.device), "versions": env.versions(), "command": " ".join(sys.argv),
              "date": _dt.datetime.now(_dt.timezone.utc).isoformat()}
    if info.is_main:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2, default=str)
        print(f"[big_model] {json.dumps({k: record[k] for k in ('layers_run', 'peak_mem_gib_per_gpu', 'tokens_per_s')})}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from .runs import exit_after_run

    exit_after_run(main())  # gloo's threads may abort a finished run's exit: runs.exit_after_run
