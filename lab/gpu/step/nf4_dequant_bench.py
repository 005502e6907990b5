"""The one-pass NF4 dequantize on a GPU: correctness, a microbenchmark against bitsandbytes and Unsloth, an A/B step.

Wrote: lab/results/step/nf4_dequant_h100.json (copied from $OUT/nf4_dequant.json)
Rerun: bash lab/gpu/step/gpu_nf4_dequant.sh OUT [BUDGET_S]  (on the GPU machine; carry .whl .gpucache .unsloth)

Three parts, each recorded even when another fails:

* ``correctness``: ``torch.ops.qlora_nb.dequantize_nf4_fused`` (``ops/nf4_triton.py``) against
  ``bitsandbytes.functional.dequantize_4bit`` on Llama-3.1-8B weight shapes, NF4, blocks of 64,
  double quantization on and off, bfloat16 and float16: bit-equal or not, max abs difference;
  the op under ``torch.compile`` (Inductor launching the kernel itself) too.
* ``microbench``: per shape (bf16, double quant, the model's configuration), median us per call
  and GB/s (packed codes read + output written) of bitsandbytes' ``dequantize_4bit``, our op
  called eagerly, our kernel launched bare into a kept buffer (several tile sizes), and
  Unsloth's ``fast_dequantize`` (in its own process: Unsloth patches on import). Two clocks:
  ``call_us``, CUDA events around back-to-back eager calls (what an eager caller pays, Python
  included), and ``kernel_us``, the same calls captured in a CUDA graph and replayed (the GPU
  time alone, as inside a compiled, graphed step).
* ``ab_step``: the 1B shape trained through ``optimize()`` with the patch
  (``compile.patches.nf4_dequant``) applied before ``optimize()`` and not, each arm in a fresh
  process, same batches, same seed: median step ms, losses, and the profiler's NF4-dequantize
  kernel time per step.

    python3 lab/gpu/step/nf4_dequant_bench.py main OUT.json BUDGET_S [all|ab]   (ab: the A/B step alone)
    python3 lab/gpu/step/nf4_dequant_bench.py unsloth PART.json     (Unsloth's process)
    python3 lab/gpu/step/nf4_dequant_bench.py arm PART.json 0|1     (one A/B arm's process)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
TILES = [(1024, 4), (2048, 4), (4096, 4), (8192, 4), (8192, 8), (16384, 8)]
SEED = 0
AB_MODEL, AB_BATCH, AB_SEQ, AB_STEPS = "llama-3.2-1b-shape", 4, 512, 25


# ----------------------------------------------------------------------------- helpers (both processes)
def nf4_weight(shape, dtype=None, nested=True, seed=SEED):
    """A random weight (0.02 * N(0, 1)) quantized by bitsandbytes: NF4, blocks of 64."""
    import torch
    from bitsandbytes.functional import quantize_4bit

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(shape, device="cuda", dtype=dtype or torch.bfloat16, generator=g) * 0.02
    return quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")


def call_us(fn, per_round: int = 10, rounds: int = 60) -> float:
    """Median us per call over ``rounds`` rounds of ``per_round`` eager calls between CUDA events."""
    import torch

    for _ in range(10):
        fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_round):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per_round)
    return statistics.median(times)


def kernel_us(fn, per_graph: int = 10, rounds: int = 60) -> float:
    """Median us per call with ``per_graph`` calls captured in one CUDA graph, replayed ``rounds`` times."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per_graph)
    return statistics.median(times)


def timed_row(name: str, fn, ref, shape, note: str) -> dict:
    """Both clocks for one way of dequantizing, with its max abs difference from ``ref``."""
    n = shape[0] * shape[1]
    moved = n // 2 + n * 2  # packed codes read + bf16 written (block scales left out, < 1%)
    row = {"name": name, "note": note}
    try:
        out = fn()
        row["max_abs_diff_vs_bnb"] = float((out.float() - ref.float()).abs().max())
        row["bitwise_equal_bnb"] = bool(torch_equal(out, ref))
        row["call_us"] = round(call_us(fn), 2)
        row["call_gb_s"] = round(moved / row["call_us"] / 1e3, 1)
    except Exception as exc:  # recorded per row
        row["error"] = f"{type(exc).__name__}: {exc}"[:600]
        return row
    try:
        row["kernel_us"] = round(kernel_us(fn), 2)
        row["kernel_gb_s"] = round(moved / row["kernel_us"] / 1e3, 1)
    except Exception as exc:  # a call that cannot be graph-captured keeps its eager clock
        row["kernel_error"] = f"{type(exc).__name__}: {exc}"[:600]
    return row


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def versions() -> dict:
    import importlib

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "bitsandbytes", "transformers", "peft", "unsloth"):
        try:
            if name == "unsloth" and "unsloth" not in sys.modules:
                continue
            out[name] = str(importlib.import_module(name).__version__)
        except Exception:
            pass
    import torch

    out["cuda"] = torch.version.cuda
    return out


def write(path: str, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


# ----------------------------------------------------------------------------- Unsloth's process
def unsloth_main(out: str) -> int:
    part = {"library": "unsloth", "rows": []}
    try:
        from lab.peers.unsloth import import_unsloth

        import_unsloth()
        import torch  # noqa: F401
        from bitsandbytes.functional import dequantize_4bit
        from unsloth.kernels.utils import fast_dequantize

        part["versions"] = versions()
        for shape in SHAPES:
            packed, st = nf4_weight(shape)
            ref = dequantize_4bit(packed, st)
            for name, kw in (("unsloth fast_dequantize", {}),
                             ("unsloth fast_dequantize (global buffer)", {"use_global_buffer": True})):
                row = timed_row(name, lambda kw=kw, p=packed, s=st: fast_dequantize(p, s, **kw), ref, shape,
                                "Unsloth's NF4 path as its LoRA kernels call it")
                part["rows"].append({"shape": list(shape), **row})
                write(out, part)
    except BaseException as exc:  # recorded; the main process reads the part
        part["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        part["traceback_tail"] = traceback.format_exc()[-3000:]
    write(out, part)
    return 0


# ----------------------------------------------------------------------------- the main process
def correctness() -> list[dict]:
    import torch
    from bitsandbytes.functional import dequantize_4bit

    from qlora_nb_utils.ops import nf4_triton

    rows = []
    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float16) + ((torch.float32,) if shape == SHAPES[1] else ()):
            for nested in (True, False):
                packed, st = nf4_weight(shape, dtype, nested)
                ref = dequantize_4bit(packed, st)
                ours = nf4_triton.dequantize_state(packed, st)
                rows.append({"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "double_quant": nested,
                             "bitwise_equal": torch_equal(ours, ref),
                             "max_abs_diff": float((ours.float() - ref.float()).abs().max())})
    packed, st = nf4_weight(SHAPES[0])
    args = nf4_triton.op_args(packed, st)
    compiled = torch.compile(lambda *a: torch.ops.qlora_nb.dequantize_nf4_fused(*a) * 1, fullgraph=True)
    ref = dequantize_4bit(packed, st)
    rows.append({"shape": list(SHAPES[0]), "dtype": "bfloat16", "double_quant": True, "under": "torch.compile (inductor)",
                 "bitwise_equal": torch_equal(compiled(*args), ref)})
    return rows


def microbench() -> list[dict]:
    import torch
    from bitsandbytes.functional import dequantize_4bit

    from qlora_nb_utils.ops import nf4_triton

    rows = []
    for shape in SHAPES:
        packed, st = nf4_weight(shape)
        ref = dequantize_4bit(packed, st)
        found = [timed_row("bitsandbytes dequantize_4bit", lambda p=packed, s=st: dequantize_4bit(p, s), ref, shape,
                           "two CUDA kernels: the double-quantized scales to float32, then NF4"),
                 timed_row("ours qlora_nb::dequantize_nf4_fused (op, eager)", lambda p=packed, s=st: nf4_triton.dequantize_state(p, s),
                           ref, shape, f"one Triton kernel, {nf4_triton.ELEMS_PER_PROGRAM} values per program, "
                                       "through the torch.library op")]
        out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        args = nf4_triton.op_args(packed, st)[:8]
        for elems, warps in TILES:
            found.append(timed_row(f"ours kernel, bare launch, {elems} values/program, {warps} warps",
                                   lambda e=elems, w=warps, a=args, o=out: nf4_triton.launch(*a, o, elems=e, num_warps=w),
                                   ref, shape, "into a kept output buffer"))
        rows += [{"shape": list(shape), **r} for r in found]
    return rows


def ab_arm(patched: bool, *, model_name: str = AB_MODEL, device: str = "cuda", dtype: str = "bfloat16",
           batch_size: int = AB_BATCH, seq_len: int = AB_SEQ, steps: int = AB_STEPS) -> dict:
    """One arm of the A/B in this process: load, (patch,) ``optimize()``, train ``steps`` steps, profile."""
    from lab.profile import group_kernels, kernel_records
    from qlora_nb_utils import models
    from qlora_nb_utils.bench.main_job import make_bench_batches
    from qlora_nb_utils.compile.fast_path import optimize
    from qlora_nb_utils.compile.patches import nf4_dequant
    from qlora_nb_utils.training.loop import TrainConfig, train

    run = {"name": "nf4_dequant patch" if patched else "bnb (unpatched)", "patched": patched}
    t0 = time.monotonic()
    model, tok = models.load_model(model_name, quant="nf4", lora=True, lora_r=16, lora_alpha=32, dtype=dtype,
                                   device=device, seed=SEED, prepare_kbit=True)
    batches, _ = make_bench_batches(tok, batch_size=batch_size, seq_len=seq_len, steps=steps)
    run["load_s"] = round(time.monotonic() - t0, 1)
    handle = nf4_dequant.apply() if patched else None  # before optimize(): Dynamo reads bnb.matmul_4bit
    try:
        t1 = time.monotonic()
        opt = optimize(model, batches=batches)
        try:
            hist = train(model, batches, TrainConfig(steps=steps, progress=False, seed=SEED), forward=opt.forward)
            ms = [float(x) for x in hist["step_ms"]]
            run.update(median_step_ms=round(statistics.median(ms[5:]), 3), first_step_s=round(ms[0] / 1e3, 1),
                       step_ms=[round(x, 3) for x in ms], losses=[float(x) for x in hist["loss"]],
                       compilations=opt.counter.compilations, description=opt.description,
                       wall_s=round(time.monotonic() - t1, 1))
            run["dequant_kernels"] = _profile(opt, model, batches[:3], kernel_records, group_kernels, device)
        finally:
            opt.undo()
    except Exception as exc:  # recorded per run
        run["error"] = f"{type(exc).__name__}: {exc}"[:1500]
        run["traceback_tail"] = traceback.format_exc()[-2500:]
    finally:
        if handle is not None:
            handle.undo()
    return run


def ab_step(budget_end: float) -> dict:
    """Both arms, each in a fresh process (nothing of one, casts or caches in memory, reaches the other)."""
    res = {"model": AB_MODEL, "batch_size": AB_BATCH, "seq_len": AB_SEQ, "steps": AB_STEPS, "dtype": "bfloat16",
           "median_over": "steps 6..N (the first five: compile, CUDA-graph recording)", "runs": []}
    for patched in (False, True):
        left = budget_end - time.monotonic()
        if left < 110:
            res["runs"].append({"patched": patched, "skipped": f"budget: {left:.0f} s left"})
            continue
        part = f"/tmp/nf4_ab_{int(patched)}.json"
        try:
            child = subprocess.run([sys.executable, __file__, "arm", part, str(int(patched))], timeout=left,
                                   capture_output=True, text=True)
            res["runs"].append(json.loads(Path(part).read_text()) if Path(part).is_file() else {
                "patched": patched, "error": f"no part written; rc {child.returncode}",
                "stderr_tail": child.stderr[-2000:]})
        except subprocess.TimeoutExpired:
            res["runs"].append({"patched": patched, "error": f"timed out after {left:.0f} s"})
    done = [r for r in res["runs"] if "median_step_ms" in r]
    if len(done) == 2:
        a, b = done
        res["patched_vs_unpatched_step"] = round(a["median_step_ms"] / b["median_step_ms"], 4)
        res["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    return res


def _profile(opt, model, batches, kernel_records, group_kernels, device: str) -> dict:
    """Forward + backward of ``batches`` under the profiler: the NF4-dequantize group per step.

    ``device`` may name an index (``cuda:0``): the profiler's kind is its type. Each call starts
    a new CUDA-graph step and drops the gradients after its backward (a second backward would
    otherwise accumulate into the first one's CUDA-graph outputs).
    """
    import torch

    kind = str(device).split(":")[0]
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if kind == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for batch in batches:
            torch.compiler.cudagraph_mark_step_begin()
            opt(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
            model.zero_grad(set_to_none=True)
        if kind == "cuda":
            torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    grouped = group_kernels(kernel_records(prof.events(), device=kind), steps=len(batches))
    g = grouped["groups"]["nf4_dequantize"]
    return {"ms_per_step": g["ms"], "count_per_step": g["count"], "top": g["top"],
            "total_kernel_ms_per_step": grouped["total_ms"], "note": "forward + backward, no optimizer step"}


def main(out: str, budget_s: float, parts: str = "all") -> int:
    import torch

    t_start = time.monotonic()
    budget_end = t_start + budget_s
    props = torch.cuda.get_device_properties(0)
    device = {"type": "cuda", "name": props.name, "capability": [props.major, props.minor],
              "total_mem_gib": round(props.total_memory / 2**30, 2)}
    res = {"kind": "nf4_dequant", "device": device, "versions": versions(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": os.environ.get("QLORA_NB_NF4_CMD", " ".join(sys.argv)),
           "weights": "0.02 * N(0,1) bf16 (fp16 for the fp16 rows), bitsandbytes quantize_4bit NF4, blocksize 64",
           "clocks": {"call_us": "CUDA events around 10 back-to-back eager calls, median of 60 rounds (10 warm-up)",
                      "kernel_us": "10 calls captured in one CUDA graph, replayed; median of 60 replays"},
           "gb_s": "(n/2 packed bytes read + 2n bytes written) / time"}
    child = None
    if os.environ.get("QLORA_NB_UNSLOTH_SITE"):  # Unsloth's process, run after ours (one GPU user at a time)
        part = str(Path(out).with_name("unsloth_part.json"))
        env = {**os.environ, "PYTHONPATH": f"{os.environ['QLORA_NB_UNSLOTH_SITE']}:{os.environ.get('PYTHONPATH', '')}"}
    for key, fn in (("correctness", correctness), ("microbench", microbench)) if parts == "all" else ():
        try:
            res[key] = fn()
        except Exception as exc:
            res[key] = {"error": f"{type(exc).__name__}: {exc}"[:1500], "traceback_tail": traceback.format_exc()[-2500:]}
        write(out, res)
    if parts != "all":
        res["unsloth"] = {"skipped": f"parts={parts}"}
    elif os.environ.get("QLORA_NB_UNSLOTH_SITE"):
        t1 = time.monotonic()
        child = subprocess.run([sys.executable, __file__, "unsloth", part], env=env, timeout=240,
                               capture_output=True, text=True)
        res["unsloth"] = json.loads(Path(part).read_text()) if Path(part).is_file() else {
            "error": f"no part written; rc {child.returncode}", "stderr_tail": child.stderr[-2000:]}
        res["unsloth"]["wall_s"] = round(time.monotonic() - t1, 1)
    else:
        res["unsloth"] = {"error": "QLORA_NB_UNSLOTH_SITE not set: .unsloth was not carried"}
    res["phases_s"] = {"micro_and_unsloth": round(time.monotonic() - t_start, 1)}
    write(out, res)
    try:
        res["ab_step"] = ab_step(budget_end)
    except Exception as exc:
        res["ab_step"] = {"error": f"{type(exc).__name__}: {exc}"[:1500], "traceback_tail": traceback.format_exc()[-2500:]}
    res["phases_s"]["total"] = round(time.monotonic() - t_start, 1)
    write(out, res)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "unsloth":
        sys.exit(unsloth_main(sys.argv[2]))
    if sys.argv[1] == "arm":  # one A/B arm, in its own process
        write(sys.argv[2], ab_arm(sys.argv[3] == "1"))
        sys.exit(0)
    sys.exit(main(sys.argv[2], float(sys.argv[3]), *sys.argv[4:5]))
