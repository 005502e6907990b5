#!/usr/bin/env bash
# Writes: $OUT_DIR/offload_<gpu>.json (committed as results/offload_<gpu>.json), offload_log.txt
# Rerun: bash lab/gpu/memory/gpu_offload.sh "$OUT" 540   (on the lent GPU machine, repository root;
#   carry .whl .gpucache)
# Issue 20, deliverable 3: what offloading the checkpointed layers' inputs to CPU memory
# (qlora_nb_utils.compile.offload) costs and saves at llama-3.1-8b-shape, 8 x 1024, bf16 NF4, LoRA r 16.
# One process, one model load; each setting goes through optimize() in regional scope (offloading
# needs it, and one decoder layer compiles in a fraction of the whole graph's 150-200 s), its LoRA
# weights reset to the same start and a fresh AdamW, torch._dynamo.reset() between settings (the
# FX-graph cache makes the later compiles warm). Per setting: the compiling step's seconds, then
# WARMUP steps, then TIMED steps (median ms after a device sync), peak allocated and reserved GiB
# over the steps after the compile, MFU (bench/flops.py: counted FLOPs over a measured bf16 matmul
# rate), the losses. Settings, most needed first (skipped when the deadline is near):
#   ckpt_all (every layer checkpointed), ckpt_all_offload (ours), ckpt_all_offload_ce16 (and the
#   chunked loss in 16 pieces instead of 4: the loss chunk is the next term), ckpt_all_save_on_cpu (torch's
#   save_on_cpu(pin_memory=True) around the same checkpoint: the alternative), ckpt_half,
#   no_ckpt, ckpt_all_offload_no_prefetch.
# Also: optimize()'s own choice for a few max_memory_gib targets (no steps), and a probe of this
# torch: does Dynamo trace saved_tensors_hooks under fullgraph=True, has it the partitioner offload.
#
# Usage: bash lab/gpu/memory/gpu_offload.sh OUT_DIR [DEADLINE_S=540] [MODEL=llama-3.1-8b-shape] [BATCH=8] [SEQ=1024]
set -uo pipefail
out=${1:?usage: lab/gpu/memory/gpu_offload.sh OUT_DIR [DEADLINE_S] [MODEL] [BATCH] [SEQ]}
export OFF_DEADLINE=${2:-540} OFF_MODEL=${3:-llama-3.1-8b-shape} OFF_BATCH=${4:-8} OFF_SEQ=${5:-1024}
export OFF_OUT=$out OFF_CMD="bash lab/gpu/memory/gpu_offload.sh \$OUT ${2:-540} ${3:-llama-3.1-8b-shape} ${4:-8} ${5:-1024}"
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L
python3 - <<'PY' 2>&1 | tee "$out/offload_log.txt"
import datetime as dt, gc, json, os, statistics, time, traceback
from pathlib import Path

import torch

from qlora_nb_utils import env, models
from qlora_nb_utils.bench.flops import measure_matmul_tflops, mfu, train_step_flops
from qlora_nb_utils.bench.main_job import make_bench_batches
from qlora_nb_utils.compile import decoder_layers
from qlora_nb_utils.compile.fast_path import optimize
from qlora_nb_utils.reversible import PatchHandle, set_attribute

T0 = time.time()
DEADLINE = T0 + float(os.environ["OFF_DEADLINE"]) - 15
MODEL, B, S = os.environ["OFF_MODEL"], int(os.environ["OFF_BATCH"]), int(os.environ["OFF_SEQ"])
R, ALPHA, LR, WARMUP, TIMED = 16, 32, 2e-4, 2, 6
GIB = 2**30
name = torch.cuda.get_device_name()
gpu = next((t.lower() for t in ("H100", "H200", "A100") if t in name), "gpu")
path = Path(os.environ["OFF_OUT"]) / f"offload_{gpu}.json"
res = {"kind": "offload", "what": "checkpointing with and without the checkpointed inputs offloaded to CPU memory "
       "(qlora_nb_utils.compile.offload), regional scope, through optimize()",
       "device": env.device_info("cuda"), "versions": env.versions(),
       "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": os.environ["OFF_CMD"],
       "model": MODEL, "batch_size": B, "seq_len": S, "lora": {"r": R, "alpha": ALPHA}, "lr": LR,
       "steps": {"compile": 1, "warmup": WARMUP, "timed": TIMED}, "runs": [], "skipped": []}


def log(msg):
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def save():
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")


# --- what this torch offers (the choice of mechanism in compile/offload.py)
import torch._functorch.config  # a submodule: not an attribute until imported
probe = {"functorch_enable_activation_offloading": hasattr(torch._functorch.config, "enable_activation_offloading"),
         "checkpoint_policies": [p.name for p in torch.utils.checkpoint.CheckpointPolicy]}
def _hooked(x):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return (x * x).sum()
try:
    torch.compile(_hooked, backend="eager", fullgraph=True)(torch.ones(4, device="cuda", requires_grad=True))
    probe["dynamo_traces_saved_tensors_hooks"] = True
except Exception as exc:
    probe["dynamo_traces_saved_tensors_hooks"] = False
    probe["dynamo_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
torch._dynamo.reset()
res["torch_probe"] = probe
log(f"probe {probe}")

model_dir = models.materialize(MODEL)
tok = models.load_tokenizer(MODEL)
batches, pad = make_bench_batches(tok, batch_size=B, seq_len=S, steps=WARMUP + TIMED + 1, padding="fixed", seed=0)
res["padding"] = pad
from transformers import AutoConfig
config = AutoConfig.from_pretrained(model_dir)
res["flops_per_step"] = train_step_flops(config, B, S, lora_r=R).total
res["peak_tflops"] = measure_matmul_tflops("cuda", torch.bfloat16)
torch.cuda.empty_cache()
log(f"batches ready, {res['peak_tflops']:.0f} TFLOP/s")
t = time.perf_counter()
model, _ = models.load_model(MODEL, quant="nf4", lora=True, lora_r=R, lora_alpha=ALPHA, dtype="bfloat16",
                             device="cuda", prepare_kbit=True, gradient_checkpointing=True, seed=0)
res["load_s"] = time.perf_counter() - t
res["model_gib"] = torch.cuda.memory_allocated() / GIB
n_layers = len(decoder_layers(model))
start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
log(f"loaded in {res['load_s']:.0f} s, {n_layers} layers, {res['model_gib']:.2f} GiB")
save()

# --- optimize()'s own choice for memory targets (nothing runs)
res["auto_choices"] = []
for target in (8.1, 10.0, 14.0, 30.0):
    try:
        opt = optimize(model, batches=batches, max_memory_gib=target)
        res["auto_choices"].append({"max_memory_gib": target, "ckpt_layers": opt.choices["ckpt_layers"],
                                    "offload": opt.choices["offload"], "scope": opt.choices["scope"],
                                    "description": opt.description})
        opt.undo()
    except Exception as exc:
        res["auto_choices"].append({"max_memory_gib": target, "error": f"{type(exc).__name__}: {exc}"[:500]})
save()


def save_on_cpu_patch(m):
    """torch's save_on_cpu(pin_memory=True) around each layer's (non-reentrant) checkpoint."""
    handle = PatchHandle("save_on_cpu", {})
    for layer in decoder_layers(m):
        if layer.gradient_checkpointing:
            inner = layer._gradient_checkpointing_func
            def run(fn, *a, _inner=inner, **k):
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    return _inner(fn, *a, **k)
            set_attribute(handle, layer, "_gradient_checkpointing_func", run)
    return handle


SETTINGS = [  # name, optimize kwargs, extra patch
    ("ckpt_all", dict(grad_ckpt=True, offload=False), None),
    ("ckpt_all_offload", dict(grad_ckpt=True, offload=True), None),
    ("ckpt_all_offload_ce16", dict(grad_ckpt=True, offload=True, ce_chunks=16), None),
    ("ckpt_all_save_on_cpu", dict(grad_ckpt=True, offload=False), save_on_cpu_patch),
    ("ckpt_half", dict(grad_ckpt=True, ckpt_layers=n_layers // 2, offload=False), None),
    ("no_ckpt", dict(grad_ckpt=False, offload=False), None),
    ("ckpt_all_offload_no_prefetch", dict(grad_ckpt=True, offload=True), "no_prefetch"),
    ("ckpt_all_offload_ce32", dict(grad_ckpt=True, offload=True, ce_chunks=32), None),
    ("ckpt_all_offload_ce64", dict(grad_ckpt=True, offload=True, ce_chunks=64), None),
]
if os.environ.get("ONLY"):  # ONLY=name,name: just those settings, in this order
    _by = {s_[0]: s_ for s_ in SETTINGS}
    SETTINGS = [_by[n_] for n_ in os.environ["ONLY"].split(",")]
else:
    SETTINGS = [s_ for s_ in SETTINGS if not s_[0].endswith(("ce32", "ce64"))]
for name_, kwargs, extra in SETTINGS:
    if time.time() > DEADLINE - 45:
        res["skipped"].append(name_)
        log(f"skip {name_}: deadline")
        continue
    run = {"name": name_, "scope": "regional", **{k: v for k, v in kwargs.items()}}
    opt = handle = None
    try:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in start:
                    p.copy_(start[n])
        torch._dynamo.reset()
        opt = optimize(model, batches=batches, scope="regional", **kwargs)
        run["optimize"] = opt.description
        if extra == "no_prefetch":
            opt.fast.offload.offloader.prefetch = False
        elif extra is not None:
            handle = extra(model)
        params = [p for p in model.parameters() if p.requires_grad]
        adam = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        gpu_batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
        losses, times = [], []

        def step(b):
            loss = opt.forward(**b).loss
            loss.backward()
            adam.step()
            adam.zero_grad(set_to_none=True)
            return loss.detach()

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        losses.append(float(step(gpu_batches[0])))
        torch.cuda.synchronize()
        run["compile_s"] = time.perf_counter() - t
        run["compile_step_peak_alloc_gib"] = torch.cuda.max_memory_allocated() / GIB
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for i, b in enumerate(gpu_batches[1:]):
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = step(b)
            torch.cuda.synchronize()
            if i >= WARMUP:
                times.append((time.perf_counter() - t) * 1e3)
            losses.append(float(loss))
        run["median_step_ms"] = statistics.median(times)
        run["step_ms"] = times
        run["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / GIB
        run["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        run["mfu"] = mfu(res["flops_per_step"], run["median_step_ms"] / 1e3, res["peak_tflops"] * 1e12)
        run["losses"] = losses
        run["compilations"] = opt.counter.to_dict().get("compilations")
        if opt.fast.offload is not None:
            st = opt.fast.offload.offloader.stats
            run["offload_stats"] = {"packed": st.packed, "unpacked": st.unpacked, "gib_out": st.bytes_out / GIB,
                                    "prefetched": st.prefetched, "stored_on": sorted(st.stored_on),
                                    "freed_before_unpack": sum(f for _, f in st.unpacks), "unpacks_seen": len(st.unpacks)}
        log(f"{name_}: {run['median_step_ms']:.1f} ms, {run['peak_alloc_gib']:.2f} / {run['peak_reserved_gib']:.2f} GiB, "
            f"MFU {run['mfu']:.2f}, compile {run['compile_s']:.0f} s")
        adam = gpu_batches = None
    except BaseException as exc:
        run["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        run["traceback_tail"] = traceback.format_exc()[-2500:]
        log(f"{name_} failed: {run['error'][:300]}")
    finally:
        if handle is not None:
            handle.undo()
        if opt is not None:
            opt.undo()
        gc.collect()
        torch.cuda.empty_cache()
    res["runs"].append(run)
    save()

by = {r["name"]: r for r in res["runs"] if "losses" in r}
ref = by.get("ckpt_all")
if ref:
    res["loss_vs_ckpt_all"] = {n: max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
                               for n, r in by.items() if n != "ckpt_all"}
res["wall_s"] = time.time() - T0
save()
log(f"wrote {path}")
PY
