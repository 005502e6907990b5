"""Where the time and memory go at 8B, 8 x 1024: ours (optimize()) and Unsloth, one process each.

Why a driver of its own: the 8B step must be profiled for four configurations (ours and Unsloth,
checkpointing off and on) plus an NF4 dequantize microbench inside one GPU call of at most ten
minutes, and ours alone takes 150-200 s to compile. So the processes run side by side, and a
lock keeps what is measured apart from everything else: loads hold it shared, every measured
window (warm-up after the compile, timed steps, profiled steps, the memory step, the microbench)
holds it exclusively. What cannot be locked is ours' first step (the compile, whose GPU work is
its first execution): the JSON's ``timeline`` says for each measured window which first steps
ran beside it. Ours without checkpointing (45 GiB) does not start its first step before
Unsloth without checkpointing (36 GiB) has exited, so the two never share the 80 GB card.
Every child writes its part after each stage, and the driver rewrites the results file each
time a child ends, so a timeout keeps what finished.

    python3 lab/gpu/step/profile_8b.py driver OUT_DIR [--deadline S]   (lab/gpu/step/gpu_profile_8b.sh)
    python3 lab/gpu/step/profile_8b.py ours SPEC.json PART.json [--grad-ckpt]
    python3 lab/gpu/step/profile_8b.py dequant SPEC.json PART.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "llama-3.1-8b-shape"
BATCH, SEQ, LORA_R, LORA_ALPHA, LR, SEED = 8, 1024, 16, 32, 2e-4, 0
WARMUP, TIMED, PROFILED = 3, 8, 3


@contextlib.contextmanager
def gpu_lock(path: str, shared: bool):
    """Shared (loads) or exclusive (measured windows) hold of the one GPU."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_part(path: str | Path, part: dict) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(part, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def mark(part: dict, name: str) -> None:
    part.setdefault("phases", {})[name] = time.time()


# ---------------------------------------------------------------- one marked step (ours and Unsloth's)
def marked_step(forward, optimizer):
    """A training step on one batch with the phase markers ``bench.profile.memory_breakdown`` reads."""
    from lab.profile import phase_marker

    def step(batch):
        phase_marker("step_start")
        loss = forward(**batch).loss
        phase_marker("forward_end")
        loss.backward()
        phase_marker("backward_end")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phase_marker("optimizer_end")
        return loss.detach()

    return step


# ---------------------------------------------------------------- ours


def run_ours(spec: dict, out: str, grad_ckpt: bool) -> None:
    import torch

    from lab.profile import profile_training
    from qlora_nb_utils import models
    from qlora_nb_utils.compile.fast_path import optimize

    part = {"library": "ours", "grad_ckpt": grad_ckpt}
    mark(part, "start")
    try:
        batches = torch.load(spec["batches"])
        with gpu_lock(spec["lock"], shared=True):
            mark(part, "load_start")
            model, _ = models.load_model(MODEL, quant="nf4", lora=True, lora_r=LORA_R, lora_alpha=LORA_ALPHA,
                                         dtype="bfloat16", device="cuda", prepare_kbit=True,
                                         gradient_checkpointing=grad_ckpt, seed=SEED)
            mark(part, "loaded")
        # mode="default": under CUDA graphs the profiler ties every kernel to cudaGraphLaunch, so no
        # kernel could be split into base and LoRA matmuls; the kernels are the same Inductor kernels
        opt = optimize(model, batches=batches, grad_ckpt=grad_ckpt, mode="default",
                       **({"scope": spec["scope"]} if spec.get("scope") else {}))
        part["optimize"] = opt.description
        params = [p for p in model.parameters() if p.requires_grad]
        adam = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)

        step = marked_step(opt.forward, adam)

        gate = spec.get("gate") if not grad_ckpt else None
        while gate and not Path(gate).exists() and time.time() < spec["deadline"]:
            time.sleep(1)  # the 45 GiB first step waits for Unsloth's 36 GiB run to end
        mark(part, "compile_start")
        first = {k: v.cuda() for k, v in batches[0].items()}
        t0 = time.perf_counter()
        step(first)
        torch.cuda.synchronize()
        part["compile_s"] = time.perf_counter() - t0
        mark(part, "compile_end")
        part["compilations"] = opt.counter.to_dict().get("compilations")
        write_part(out, part)
        with gpu_lock(spec["lock"], shared=False):
            mark(part, "measure_start")
            res = profile_training(step, batches, warmup=WARMUP - 1, timed=TIMED, profiled=PROFILED,
                                   lora_r=LORA_R, vocab=spec["vocab"],
                                   on_stage=lambda s, r: write_part(out, {**part, **r, "stage": s}))
            mark(part, "measure_end")
        part.update(res)
        opt.undo()
    except BaseException as exc:  # recorded: the driver tabulates a failed run
        import traceback

        part["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        part["traceback_tail"] = traceback.format_exc()[-3000:]
    write_part(out, part)


# ---------------------------------------------------------------- the NF4 dequantize microbench


def bench_us(fn, iters: int = 50, rounds: int = 5) -> float:
    """Median microseconds per call: ``rounds`` rounds of ``iters`` calls between CUDA events."""
    import torch

    for _ in range(5):
        fn()
    per = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) * 1e3 / iters)
    return sorted(per)[len(per) // 2]


def nf4_weight(shape=(14336, 4096), seed: int = 0):
    """A random bf16 weight quantized by bitsandbytes (NF4, blocks of 64, double quantization)."""
    import torch
    from bitsandbytes.functional import quantize_4bit

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    packed, state = quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    return packed, state


def dequant_row(name: str, fn, ref, n: int, note: str) -> dict:
    out = fn()
    us = bench_us(fn)
    moved = n // 2 + n * 2  # packed codes read + bf16 written (block scales left out)
    return {"name": name, "us": round(us, 2), "gb_s": round(moved / us / 1e3, 1),
            "max_abs_diff_vs_bnb": float((out.float() - ref.float()).abs().max()), "note": note}


def run_dequant(spec: dict, out: str) -> None:
    import torch
    from bitsandbytes.functional import dequantize_4bit

    from qlora_nb_utils.ops.nf4 import absmax_of, dequantize_nf4_reference

    part = {"library": "dequant", "shape": [14336, 4096], "dtype": "bfloat16", "blocksize": 64,
            "double_quant": True, "rows": []}
    mark(part, "start")
    try:
        with gpu_lock(spec["lock"], shared=False):
            mark(part, "measure_start")
            packed, st = nf4_weight()
            shape, n = tuple(st.shape), st.shape[0] * st.shape[1]
            ref = dequantize_4bit(packed, st)
            rows = part["rows"]
            rows.append(dequant_row("bitsandbytes dequantize_4bit", lambda: dequantize_4bit(packed, st), ref, n,
                                    "CUDA kernel; the double-quantized scales dequantized first (a second kernel)"))
            absmax = absmax_of(st)
            op = torch.ops.qlora_nb.dequantize_nf4
            rows.append(dequant_row("ours qlora_nb::dequantize_nf4 (eager)",
                                    lambda: op(packed, absmax, 64, list(shape), torch.bfloat16), ref, n,
                                    "the custom op's pure-torch body run eagerly; scales already dequantized"))
            ref_fn = torch.compile(lambda p, a: dequantize_nf4_reference(p, a, 64, shape, torch.bfloat16))
            rows.append(dequant_row("ours pure-torch dequant, Inductor-compiled", lambda: ref_fn(packed, absmax),
                                    ref, n, "scales already dequantized (fp32)"))
            code2, absmax2, off = st.state2.code, st.state2.absmax, st.offset

            def full(p, a8):  # the scales' own 8-bit dequantization inside the same compiled function
                scales = (code2[a8.long()].view(-1, 256) * absmax2.view(-1, 1)).reshape(-1)[: a8.numel()] + off
                return dequantize_nf4_reference(p, scales, 64, shape, torch.bfloat16)

            full_fn = torch.compile(full)
            rows.append(dequant_row("ours pure-torch dequant incl. double-quant scales, Inductor-compiled",
                                    lambda: full_fn(packed, st.absmax), ref, n,
                                    "what bitsandbytes' call does, as one compiled function"))
            write_part(out, part)
            mark(part, "measure_end")
    except BaseException as exc:
        part["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    write_part(out, part)


# ---------------------------------------------------------------- the driver


def _overlaps(parts: dict) -> list[dict]:
    """For each measured window, the first steps (compiles, not locked) of others that ran beside it."""
    rows = []
    for name, p in parts.items():
        ph = p.get("phases") or {}
        if "measure_start" not in ph:
            continue
        a, b = ph["measure_start"], ph.get("measure_end", ph["measure_start"] + 1e9)
        beside = []
        for other, q in parts.items():
            qh = q.get("phases") or {}
            if other != name and "compile_start" in qh:
                c, d = qh["compile_start"], qh.get("compile_end", 1e18)
                if c < b and d > a:
                    beside.append({"run": other, "overlap_s": round(min(b, d) - max(a, c), 1)})
        rows.append({"run": name, "window_s": round(b - a, 1) if b < 1e17 else None, "first_steps_beside": beside})
    return rows


def driver(out_dir: str, deadline_s: float) -> None:
    import torch
    from transformers import AutoConfig

    from lab.peers.process import _child_env
    from qlora_nb_utils import env, models
    from qlora_nb_utils.bench.flops import measure_matmul_tflops, mfu, train_step_flops
    from qlora_nb_utils.bench.main_job import make_bench_batches

    t_start = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="profile8b_"))
    name = torch.cuda.get_device_name()
    gpu = next((t.lower() for t in ("H100", "H200", "A100") if t in name), "gpu")
    # PROFILE_JOBS (comma list of the jobs below; default all), PROFILE_SCOPE (ours' optimize() scope;
    # default optimize's choice), PROFILE_TAG (file suffix: profile_8b_<gpu>_<tag>.json)
    only = [j for j in os.environ.get("PROFILE_JOBS", "").split(",") if j]
    scope, tag = os.environ.get("PROFILE_SCOPE") or None, os.environ.get("PROFILE_TAG", "")
    path = out / (f"profile_8b_{gpu}_{tag}.json" if tag else f"profile_8b_{gpu}.json")
    res = {"device": env.device_info("cuda"), "versions": env.versions(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": os.environ.get("QLORA_NB_PROFILE_CMD", " ".join(sys.argv)), "model": MODEL,
           "shape": {"batch_size": BATCH, "seq_len": SEQ}, "lora": {"r": LORA_R, "alpha": LORA_ALPHA},
           "steps": {"warmup": WARMUP, "timed": TIMED, "profiled": PROFILED, "memory": 1}, "libraries": {}}

    def log(msg):
        print(f"[{time.time() - t_start:6.1f} s] {msg}", flush=True)

    def save():
        write_part(path, res)

    model_dir = models.materialize(MODEL)
    log(f"materialized {model_dir}")
    tok = models.load_tokenizer(MODEL)
    batches, pad = make_bench_batches(tok, batch_size=BATCH, seq_len=SEQ, steps=16, padding="fixed", seed=SEED)
    torch.save(batches, work / "batches.pt")
    config = AutoConfig.from_pretrained(model_dir)
    res["peak_tflops"] = measure_matmul_tflops("cuda", torch.bfloat16)
    torch.cuda.empty_cache()
    res["flops_per_step"] = train_step_flops(config, BATCH, SEQ, lora_r=LORA_R).total
    res["padding"] = pad
    save()
    log(f"batches, {res['peak_tflops']:.0f} TFLOP/s measured")
    spec = {"batches": str(work / "batches.pt"), "lock": str(work / "gpu.lock"), "gate": str(work / "unsloth_off.done"),
            "vocab": int(config.vocab_size), "model_dir": str(model_dir), "deadline": t_start + deadline_s - 20,
            "scope": scope}
    (work / "spec.json").write_text(json.dumps(spec))
    me = str(Path(__file__).resolve())
    here = str(Path(__file__).resolve().parent / "profile_unsloth.py")
    jobs = {  # name: (command, time limit s)
        "unsloth_ckpt_off": ([sys.executable, here, str(work / "spec.json"), str(work / "unsloth_ckpt_off.json")], 300),
        "ours_ckpt_off": ([sys.executable, me, "ours", str(work / "spec.json"), str(work / "ours_ckpt_off.json")], 540),
        "ours_ckpt_on": ([sys.executable, me, "ours", str(work / "spec.json"), str(work / "ours_ckpt_on.json"),
                          "--grad-ckpt"], 540),
        "unsloth_ckpt_on": ([sys.executable, here, str(work / "spec.json"), str(work / "unsloth_ckpt_on.json"),
                             "--grad-ckpt"], 400),
        "dequant": ([sys.executable, me, "dequant", str(work / "spec.json"), str(work / "dequant.json")], 200),
    }
    if only:
        jobs = {job: v for job, v in jobs.items() if job in only}
        res["jobs"] = sorted(jobs)
    res["ours_scope"] = scope or "optimize()'s choice"
    if "unsloth_ckpt_off" not in jobs:  # nothing to wait for: ours' first job starts at once
        Path(spec["gate"]).touch()
    procs = {}
    for job, (cmd, limit) in jobs.items():
        child = _child_env("unsloth" if job.startswith("unsloth") else "ours", work / f"inductor_{job}")
        child["TORCHINDUCTOR_COMPILE_THREADS"] = "6"
        log_f = open(work / f"{job}.log", "w")
        procs[job] = (subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, env=child,
                                       start_new_session=True), time.time() + limit, log_f)
        log(f"started {job}")
    parts: dict[str, dict] = {}
    while procs:
        time.sleep(2)
        for job in list(procs):
            proc, until, log_f = procs[job]
            late = time.time() > min(until, t_start + deadline_s)
            if proc.poll() is None and not late:
                continue
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # the child's own process group, started above
                proc.wait()
            log_f.close()
            del procs[job]
            if job == "unsloth_ckpt_off":
                Path(spec["gate"]).touch()
            f = work / f"{job}.json"
            part = json.loads(f.read_text()) if f.is_file() else {"error": "no part written"}
            if late:
                part.setdefault("error", f"killed at its time limit (stage reached: {part.get('stage')})")
            tail = (work / f"{job}.log").read_text(errors="replace").splitlines()[-25:]
            part["log_tail"] = [ln[-300:] for ln in tail]
            parts[job] = part
            if job == "dequant":
                res["dequant"] = part
            else:
                if part.get("median_step_ms"):
                    part["mfu"] = mfu(res["flops_per_step"], part["median_step_ms"] / 1e3, res["peak_tflops"] * 1e12)
                res["libraries"][job] = part
            res["timeline"] = _overlaps(parts)
            save()
            log(f"{job} ended: {part.get('error') or 'ok'} (median {part.get('median_step_ms')} ms, "
                f"peak {part.get('peak_mem_gib')} GiB)")
    subprocess.run(["tar", "-czf", str(out / "children_logs.tar.gz"), "-C", str(work),
                    *[p.name for p in work.glob("*.log")], *[p.name for p in work.glob("*.json")]], check=False)
    log(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("driver", "ours", "dequant"))
    ap.add_argument("args", nargs="+")
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--deadline", type=float, default=560)
    a = ap.parse_args(argv)
    if a.what == "driver":
        driver(a.args[0], a.deadline)
        return 0
    spec = json.loads(Path(a.args[0]).read_text())
    if a.what == "ours":
        run_ours(spec, a.args[1], a.grad_ckpt)
    else:
        run_dequant(spec, a.args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
