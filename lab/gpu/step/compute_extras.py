"""Issue 20's three small GPU measurements in one call: the NF4 patch in a step, warm start, parity.

Wrote: lab/results/step/nf4_dequant_step_h100.json, lab/results/compute/compute_extras_h100.json (from OUT/*.json)
Rerun: bash lab/gpu/step/gpu_compute_extras.sh OUT [BUDGET_S=540]  (GPU machine, repo root; carry .whl .gpucache)

Why one script: each question needs its own processes on the same batches, and one 8B process
can answer two of them, so a GPU lease is spent once:

* ``8b_ours_cold``: ``optimize(scope="regional")`` at Llama-3.1-8B shape, 2 x 1024, no
  checkpointing, with an empty ``TORCHINDUCTOR_CACHE_DIR``. It is the A/B's unpatched arm, the
  cold start, and "ours" in the parity check.
* ``8b_ours_patched``: the same with ``compile.patches.nf4_dequant`` applied before
  ``optimize()`` (its own empty cache): the A/B's patched arm.
* ``8b_ours_warm``: the unpatched run again with the cold run's cache folder: the warm start
  (time to the first step, and Inductor's / AOTAutograd's cache hit counters), and a second
  unpatched sample, so the A/B's difference can be set against a repeat's.
* ``8b_hf_eager``: the HF recipe, eager (PEFT model, no recipe, no compile), on the first
  ``PARITY_STEPS`` batches: as is, again (is eager deterministic?), and with the rows of every
  batch in two seeded orders (``training.parity``'s floor). Ours is judged with
  ``training.parity.judge`` against that floor.
* ``8b8_*`` (part ``8b8``): the A/B again at 8 x 1024 (14 steps), where the GPU, not the CPU, is
  the bottleneck: the two arms only.
* ``cast`` (part ``cast``): ``optimize()`` as it is and with ``cast=False`` (k-bit prep's fp32
  embeddings, norms and head kept), each judged against HF eager's floor (``hf-eager`` and two
  row permutations) on the first ``PARITY_STEPS`` batches: what the recipe's bf16 cast costs in
  loss against HF, and in step time.
* ``fp32`` (part ``fp32``): the same with ``cast=False, autocast=False`` (HF eager's numerics:
  the residual stream, norms, head and LoRA matmuls in fp32, bitsandbytes' base matmuls in bf16)
  in place of ``cast=False`` alone: whether the compiled recipe is within HF eager's floor when
  it computes what HF eager computes, and at what step time and memory.
* ``1b_*``: ``nf4_dequant_bench.py``'s ``ab`` part (1B shape, 4 x 512, whole scope, CUDA graphs,
  25 steps). The two arms compile at the same time (each 90-150 s cold), wait at a barrier, and
  are then timed one after the other, so neither step is timed while the other process works.

Every process loads the model the HF way with the same seed and trains from the same LoRA start
(checksummed) on the same batches (built once here, saved to a file). The patch is verified in
each arm: the functions ``bitsandbytes.matmul_4bit`` / ``functional.dequantize_4bit`` resolve to,
and the dequantize kernels a profiler window counts (``_nf4_dequant_kernel``: ours;
``kDequantize*``: bitsandbytes). Median step times leave out the first ``WARMUP`` steps.

    python3 lab/gpu/step/compute_extras.py main OUT_DIR BUDGET_S [--parts 8b,1b,8b8,fasteager,cast,fp32] [--model8 M] [--model1 M] [--device D] [--backend B]
    python3 lab/gpu/step/compute_extras.py ours|eager SPEC.json RUN.json   (one child process)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nf4_dequant_bench import AB_BATCH, AB_MODEL, AB_SEQ, AB_STEPS, _profile  # noqa: E402

SEED, LR, LORA_R, LORA_ALPHA = 0, 2e-4, 16, 32
B8 = {"model": "llama-3.1-8b-shape", "batch_size": 2, "seq_len": 1024, "steps": 30, "scope": "regional"}
B8x8 = {**B8, "batch_size": 8, "steps": 14}
B1 = {"model": AB_MODEL, "batch_size": AB_BATCH, "seq_len": AB_SEQ, "steps": AB_STEPS, "scope": "whole"}
SHAPES = {"8b": B8, "1b": B1, "8b8": B8x8}
WARMUP = 5
EAGER_LABELS = ("hf-eager", "hf-eager-again", "hf-eager-permuted1", "hf-eager-permuted2")
PARITY_STEPS = 6
#: Seconds a phase needs left in the budget to start (else it is recorded as skipped).
NEEDS = {"8b_ours": 75, "8b_hf_eager": 80, "1b_pair": 150}
#: Parts that judge ``optimize()`` variants against HF eager's floor: part -> (results key, [(label, run, options)]).
JUDGED = {
    "cast": ("cast_parity", [("default", "8b_ours", {}), ("cast_false", "8b_ours_no_cast", {"cast": False})]),
    # HF eager's numerics (k-bit prep's fp32 embeddings, norms, head and LoRA weights, no autocast): on the
    # CPU they give HF eager's step-0 loss bit for bit and stay within its floor (lab/results/parity/parity_split_cpu.json)
    "fp32": ("fp32_parity", [("default", "8b_ours", {}),
                             ("fp32", "8b_ours_fp32", {"cast": False, "autocast": False})]),
}


def write(path, data: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def cache_counters() -> dict:
    """Inductor's and AOTAutograd's cache counters in this process (hits, misses, bypasses)."""
    from torch._dynamo.utils import counters

    return {group: {k: int(v) for k, v in counters[group].items() if "cache" in k or "bypass" in k}
            for group in ("inductor", "aot_autograd")}


def _files(folder: str | None) -> int:
    return sum(len(f) for _, _, f in os.walk(folder)) if folder and os.path.isdir(folder) else 0


def _load(spec: dict):
    from qlora_nb_utils import models

    t = time.monotonic()
    model, _ = models.load_model(spec["model"], quant="nf4", lora=True, lora_r=LORA_R, lora_alpha=LORA_ALPHA,
                                 dtype=spec["dtype"], device=spec["device"], seed=SEED, prepare_kbit=True)
    _sync(spec["device"])
    checksum = float(sum(p.detach().double().sum() for p in model.parameters() if p.requires_grad))
    return model, round(time.monotonic() - t, 2), checksum


def _summary(hist) -> dict:
    ms = [float(x) for x in hist["step_ms"]]
    return {"median_step_ms": round(statistics.median(ms[WARMUP:] or ms), 3), "step_ms": [round(x, 3) for x in ms],
            "losses": [float(x) for x in hist["loss"]], "peak_mem_gib": round(float(hist["peak_mem_gib"].max()), 3)}


# ----------------------------------------------------------------------------- child: ours
def _barrier(spec: dict, opt, model, batches, run: dict) -> None:
    """Compile and record before the barrier (fwd + bwd of one batch, 3 times, grads dropped), then wait for go."""
    t = time.monotonic()
    batch = {k: v.to(spec["device"]) for k, v in batches[0].items()}
    import torch

    for _ in range(3):  # a new CUDA-graph step each time; grads dropped (no accumulation into graph outputs)
        torch.compiler.cudagraph_mark_step_begin()
        opt(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
    _sync(spec["device"])
    run["warmup_s"] = round(time.monotonic() - t, 2)
    run["warmup_note"] = "compile and CUDA-graph recording, before the barrier (in parallel with the other arm)"
    folder = Path(spec["barrier"])
    (folder / f"ready_{spec['name']}").touch()
    t = time.monotonic()
    while not (folder / f"go_{spec['name']}").exists():
        time.sleep(0.1)
    run["waited_s"] = round(time.monotonic() - t, 2)


def ours_child(spec: dict) -> dict:
    t0 = time.time()
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    run = {"name": spec["name"], "patched": spec["patched"], "inductor_cache_dir": cache,
           "cache_files_at_start": _files(cache), "spawn_to_main_s": round(t0 - spec["t_spawn"], 2)}
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnbF
        import torch

        from lab.profile import group_kernels, kernel_records
        from qlora_nb_utils.compile.fast_path import optimize
        from qlora_nb_utils.compile.patches import nf4_dequant
        from qlora_nb_utils.training.loop import TrainConfig, train

        run["import_s"] = round(time.time() - t0, 2)
        model, run["load_s"], run["lora_start_checksum"] = _load(spec)
        batches = torch.load(spec["batches"])
        handle = nf4_dequant.apply() if spec["patched"] else None  # before optimize(): Dynamo reads bnb.matmul_4bit
        name = lambda f: f"{f.__module__}.{f.__qualname__}"  # noqa: E731
        run["patch"] = {"applied": handle is not None, "bitsandbytes.matmul_4bit": name(bitsandbytes.matmul_4bit),
                        "bitsandbytes.functional.dequantize_4bit": name(bnbF.dequantize_4bit),
                        **({"details": handle.details} if handle is not None else {})}
        try:
            t = time.monotonic()
            opt = optimize(model, batches=batches, **spec["optimize"])
            run["optimize_s"] = round(time.monotonic() - t, 2)
            try:
                if spec.get("barrier"):
                    _barrier(spec, opt, model, batches, run)
                first: dict = {}

                def on_step(step, row):
                    if step == 0:
                        first.update(t=time.time(), counters=cache_counters())

                hist = train(model, batches, TrainConfig(steps=spec["steps"], lr=LR, seed=SEED, progress=False),
                             forward=opt.forward, on_step=on_step)
                run.update(_summary(hist))
                run["first_step_s"] = round(run["step_ms"][0] / 1e3, 2)
                run["compile_s"] = round((run["step_ms"][0] - run["median_step_ms"]) / 1e3, 2)
                run["time_to_first_step_s"] = round(first["t"] - spec["t_spawn"], 2)
                run["cache_counters_after_first_step"] = first["counters"]
                stats = opt.counter.to_dict()
                run.update(compilations=stats.get("compilations"), dynamo_compile_s=stats.get("compile_s"),
                           description=opt.description)
                if spec.get("profile"):
                    run["dequant_kernels"] = _profile(opt, model, batches[:3], kernel_records, group_kernels,
                                                      spec["device"])
            finally:
                opt.undo()
        finally:
            if handle is not None:
                handle.undo()
    except BaseException as exc:  # recorded: the parent reads the run file
        run["error"] = f"{type(exc).__name__}: {exc}"[:1500]
        run["traceback_tail"] = traceback.format_exc()[-2500:]
    return run


# ----------------------------------------------------------------------------- child: HF eager
def eager_child(spec: dict) -> dict:
    run = {"name": spec["name"], "spawn_to_main_s": round(time.time() - spec["t_spawn"], 2), "runs": {}}
    try:
        import torch

        from qlora_nb_utils.training.loop import TrainConfig, load_trainable_state, train, trainable_state
        from qlora_nb_utils.training.parity import permute_rows

        model, run["load_s"], run["lora_start_checksum"] = _load(spec)
        batches = torch.load(spec["batches"])[:spec["steps"]]
        start = trainable_state(model)
        cfg = TrainConfig(steps=spec["steps"], lr=LR, seed=SEED, progress=False)
        opt = None
        try:
            for label in spec.get("labels", EAGER_LABELS):  # HF labels first: optimize() casts the weights
                data = permute_rows(batches, SEED + int(label[-1])) if "permuted" in label else batches
                if label.startswith("fast-eager") and opt is None:
                    from qlora_nb_utils.compile.fast_path import optimize

                    opt = optimize(model, batches=batches, **spec["optimize"])
                    run["description"] = opt.description
                load_trainable_state(model, start)
                forward = opt.eager if label.startswith("fast-eager") else None
                run["runs"][label] = _summary(train(model, data, cfg, forward=forward, label=label))
        finally:
            if opt is not None:
                opt.undo()
    except BaseException as exc:
        run["error"] = f"{type(exc).__name__}: {exc}"[:1500]
        run["traceback_tail"] = traceback.format_exc()[-2500:]
    return run


# ----------------------------------------------------------------------------- the parent
class Children:
    """Child processes of this script: spec file, own process group, own Inductor cache folder, log."""

    def __init__(self, work: Path):
        self.work = work

    def spawn(self, kind: str, spec: dict, cache: Path | None = None) -> tuple:
        spec = {**spec, "t_spawn": time.time()}
        spec_path, out = self.work / f"spec_{spec['name']}.json", self.work / f"run_{spec['name']}.json"
        out.unlink(missing_ok=True)
        write(spec_path, spec)
        env = dict(os.environ)
        if cache is not None:
            env.update(TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))
        log = open(self.work / f"log_{spec['name']}.txt", "w")
        proc = subprocess.Popen([sys.executable, __file__, kind, str(spec_path), str(out)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return proc, out, log, spec["name"]

    def finish(self, child: tuple, limit: float) -> dict:
        proc, out, log, name = child
        try:
            code = proc.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group this script started
            proc.wait()
            code = None
        log.close()
        if out.is_file():
            return json.loads(out.read_text())
        tail = (self.work / f"log_{name}.txt").read_text(errors="replace")[-1500:]
        return {"name": name, "error": f"timed out after {limit:.0f} s" if code is None else f"exit code {code}",
                "log_tail": tail}

    def run(self, kind: str, spec: dict, limit: float, cache: Path | None = None) -> dict:
        return self.finish(self.spawn(kind, spec, cache), limit)


def _diff(a: list, b: list) -> dict:
    n = min(len(a), len(b))
    d = [abs(x - y) for x, y in zip(a[:n], b[:n])]
    return {"steps": n, "max_abs": max(d), "per_step": d, "bit_equal": all(x == 0 for x in d)}


def _ab(runs: dict, a: str, b: str) -> dict:
    x, y = runs.get(a, {}), runs.get(b, {})
    if not (x.get("median_step_ms") and y.get("median_step_ms")):
        return {"error": f"{a} or {b} has no step time"}
    return {"step_ratio": round(x["median_step_ms"] / y["median_step_ms"], 4),
            "ms_diff": round(x["median_step_ms"] - y["median_step_ms"], 3),
            "peak_gib_diff": round(x["peak_mem_gib"] - y["peak_mem_gib"], 3), "loss": _diff(x["losses"], y["losses"])}


def _parity(eager: dict, ours: dict, patched: dict) -> dict:
    from qlora_nb_utils.training.parity import judge

    runs = eager.get("runs", {})
    if "error" in eager or len(runs) < 4 or not ours.get("losses"):
        return {"error": eager.get("error") or ours.get("error") or "missing runs"}
    n, ref = PARITY_STEPS, runs["hf-eager"]["losses"]
    repeat = _diff(ref, runs["hf-eager-again"]["losses"])
    floor_runs = [runs["hf-eager-permuted1"]["losses"], runs["hf-eager-permuted2"]["losses"]]
    res = {"steps": n, "eager_repeat": repeat, "eager_deterministic": repeat["bit_equal"],
           "floor_how": "eager again with the rows of each batch permuted, two seeded orders, the larger difference "
                        "per step (training.parity.judge; qlora-nb bench's floor)"
                        + ("; two plain eager runs were bit-identical, so they give no floor" if repeat["bit_equal"]
                           else ""),
           "losses": {k: v["losses"] for k, v in runs.items()} | {"ours": ours["losses"][:n]},
           "verdict": judge(ref, floor_runs, ours["losses"][:n])}
    if not repeat["bit_equal"]:
        res["verdict_vs_repeat_floor"] = judge(ref, runs["hf-eager-again"]["losses"], ours["losses"][:n])
    if patched.get("losses"):
        res["losses"]["ours_patched"] = patched["losses"][:n]
        res["verdict_patched"] = judge(ref, floor_runs, patched["losses"][:n])
    res["eager_median_step_ms"] = runs["hf-eager"]["median_step_ms"]
    res["eager_peak_mem_gib"] = runs["hf-eager"]["peak_mem_gib"]
    return res


def _warm(cold: dict, warm: dict) -> dict:
    keys = ("inductor_cache_dir", "cache_files_at_start", "spawn_to_main_s", "import_s", "load_s", "optimize_s",
            "first_step_s", "compile_s", "dynamo_compile_s", "time_to_first_step_s",
            "cache_counters_after_first_step", "median_step_ms", "compilations", "error")
    res = {"cold": {k: cold.get(k) for k in keys if k in cold}, "warm": {k: warm.get(k) for k in keys if k in warm},
           "target_s": 20, "time_to_first_step": "from the parent starting the process to the end of the first "
           "optimizer step: Python start and imports, model load and NF4 quantization, optimize(), first step",
           "compile_s_how": "first step minus the median step"}
    if warm.get("time_to_first_step_s") is not None:
        res["warm_compile_under_target"] = warm["compile_s"] < 20
        res["warm_time_to_first_step_under_target"] = warm["time_to_first_step_s"] < 20
        hits = warm["cache_counters_after_first_step"]
        res["warm_cache_hits"] = {g: {k: v for k, v in c.items() if "hit" in k} for g, c in hits.items()}
    return res


def main(out_dir: str, budget_s: float, a) -> int:
    t_start = time.monotonic()
    end = t_start + budget_s
    left = lambda: end - time.monotonic()  # noqa: E731
    out, work = Path(out_dir), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    import torch

    from qlora_nb_utils import env, models
    from qlora_nb_utils.bench.main_job import make_bench_batches

    parts = [x for x in a.parts.split(",") if x]
    dev = env.resolve_device(a.device)
    head = {"device": env.device_info(dev), "versions": env.versions(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": os.environ.get("QLORA_NB_EXTRAS_CMD", " ".join(sys.argv)), "parts": parts,
            "tool": "lab/gpu/step/compute_extras.py", "lora": {"r": LORA_R, "alpha": LORA_ALPHA}, "lr": LR,
            "seed": SEED, "median_over": f"steps {WARMUP + 1}..N (the first {WARMUP} left out)"}
    step_res = {"kind": "nf4_dequant_step", **head, "phases_s": {}}
    extras = {"kind": "compute_extras", **head}
    step_path, extras_path = out / "nf4_dequant_step.json", out / "compute_extras.json"
    ch = Children(work)
    shapes = {k: {**v, "model": a.model1 if k == "1b" else a.model8} for k, v in SHAPES.items()
              if k in parts or (k == "8b" and ("fasteager" in parts or any(p in JUDGED for p in parts)))}
    for key, sh in shapes.items():
        t = time.monotonic()
        if sh["model"] in models.MODEL_NAMES:
            models.materialize(sh["model"])
        batches, pad = make_bench_batches(models.load_tokenizer(sh["model"]), batch_size=sh["batch_size"],
                                          seq_len=sh["seq_len"], steps=sh["steps"], padding="fixed", seed=SEED)
        torch.save(batches, work / f"batches_{key}.pt")
        sh["padding"] = pad
        step_res["phases_s"][f"build_and_batches_{key}"] = round(time.monotonic() - t, 1)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    dtype = "bfloat16" if dev.type == "cuda" else "float32"

    def spec(key: str, name: str, patched: bool, **kw) -> dict:
        sh = shapes[key]
        return {"name": name, "model": sh["model"], "device": str(dev), "dtype": dtype, "patched": patched,
                "steps": sh["steps"], "batches": str(work / f"batches_{key}.pt"), "profile": True,
                "optimize": {"scope": sh["scope"], "grad_ckpt": False, **({"backend": a.backend} if a.backend else {})},
                **kw}

    def meta(key: str) -> dict:
        return {k: shapes[key][k] for k in ("model", "batch_size", "seq_len", "steps", "scope", "padding")}

    def save() -> None:
        step_res["phases_s"]["total"] = round(time.monotonic() - t_start, 1)
        write(step_path, step_res)
        if len(extras) > len(head) + 1:
            write(extras_path, extras)

    def sequential(key: str, order: list) -> dict:
        runs: dict = {}
        step_res[key] = {**meta(key), "grad_ckpt": False, "runs": runs}
        for name, patched, cache in order:
            t = time.monotonic()
            if left() < NEEDS["8b_ours"]:
                runs[name] = {"name": name, "skipped": f"budget: {left():.0f} s left"}
            else:
                runs[name] = ch.run("ours", spec(key, name, patched, profile=not name.endswith("_warm")),
                                    min(240, left()), work / f"inductor_{cache}")
            runs[name]["wall_s"] = round(time.monotonic() - t, 1)
            print(name, {k: runs[name].get(k) for k in ("median_step_ms", "peak_mem_gib", "first_step_s",
                                                        "time_to_first_step_s", "error", "skipped")}, flush=True)
            step_res[key]["patched_vs_unpatched"] = _ab(runs, f"{key}_ours_patched", f"{key}_ours_cold")
            if any(n.endswith("_warm") for n, _, _ in order):
                step_res[key]["patched_vs_unpatched_warm"] = _ab(runs, f"{key}_ours_patched", f"{key}_ours_warm")
                step_res[key]["unpatched_warm_vs_cold"] = _ab(runs, f"{key}_ours_warm", f"{key}_ours_cold")
                extras["warm_start"] = {**meta(key), **_warm(runs[f"{key}_ours_cold"], runs.get(f"{key}_ours_warm", {}))}
            save()
        return runs

    pending: list = []

    def finish_pending() -> None:
        while pending:
            key, t, child = pending.pop()
            fe = ch.finish(child, max(5.0, min(200, left())))
            fe["wall_s"] = round(time.monotonic() - t, 1)
            extras["fast_eager"] = {**meta(key), "steps": PARITY_STEPS, "optimize": spec(key, "", False)["optimize"],
                                    "what": "hf-eager once (ties this call to the last), then optimize()'s recipe "
                                    "uncompiled (opt.eager), again, and rows permuted", **fe}
            save()

    for part in parts:
        if part == "fasteager":  # eager only: runs beside the 1B arms' compilation, done before they are timed
            key = "8b"
            pending.append((key, time.monotonic(), ch.spawn("eager", {**spec(key, "8b_fast_eager", False),
                            "steps": PARITY_STEPS, "labels": ["hf-eager", "fast-eager", "fast-eager-again",
                                                              "fast-eager-permuted1"]})))
        elif part in JUDGED:  # optimize() variants against HF eager's floor (cast: the bf16 cast; fp32: HF's numerics)
            key_name, variants = JUDGED[part]
            judged = {}
            for _label, name, extra in variants:
                sp = spec("8b", name, False, profile=False)
                sp["optimize"] = {**sp["optimize"], **extra}
                judged[name] = ch.run("ours", sp, min(300, left()), work / f"inductor_{name}")
                print(name, {k: judged[name].get(k) for k in ("median_step_ms", "peak_mem_gib", "error")}, flush=True)
            eager = ch.run("eager", {**spec("8b", "8b_hf_eager", False), "steps": PARITY_STEPS}, min(200, left()))
            extras[key_name] = {
                **meta("8b"), "steps": PARITY_STEPS, "eager_process": {k: v for k, v in eager.items() if k != "runs"},
                "variants": {label: {"run": name, "optimize": extra} for label, name, extra in variants},
                "runs": {n: {k: r.get(k) for k in ("median_step_ms", "peak_mem_gib", "compile_s", "compilations",
                                                    "description", "error")} for n, r in judged.items()},
                **{label: _parity(eager, judged[name], {}) for label, name, _ in variants}}
            save()
            for label, _, _ in variants:
                print(part, "parity", label, {x: y for x, y in extras[key_name][label].get("verdict", {}).items()
                                              if x != "diffs"}, extras[key_name][label].get("error"), flush=True)
        elif part == "8b8":
            sequential("8b8", [("8b8_ours_cold", False, "c"), ("8b8_ours_patched", True, "d")])
        elif part == "8b":
            r8 = sequential("8b", [("8b_ours_cold", False, "a"), ("8b_ours_patched", True, "b"),
                                   ("8b_ours_warm", False, "a")])
            t = time.monotonic()
            if left() < NEEDS["8b_hf_eager"]:
                eager = {"skipped": f"budget: {left():.0f} s left"}
            else:
                eager = ch.run("eager", {**spec("8b", "8b_hf_eager", False), "steps": PARITY_STEPS}, min(200, left()))
            eager["wall_s"] = round(time.monotonic() - t, 1)
            extras["parity"] = {**meta("8b"), "steps": PARITY_STEPS, "ours": "8b_ours_cold (optimize(scope='regional'))",
                                "eager_process": {k: v for k, v in eager.items() if k != "runs"},
                                **_parity(eager, r8.get("8b_ours_cold", {}), r8.get("8b_ours_patched", {}))}
            save()
            print("parity", {k: extras["parity"].get(k) for k in ("eager_deterministic", "error")},
                  {k: v for k, v in extras["parity"].get("verdict", {}).items() if k != "diffs"}, flush=True)
        elif part == "1b":
            pair_1b(ch, spec, meta, step_res, work, left, finish_pending)
            save()
            print("1b", step_res["1b"].get("patched_vs_unpatched"), step_res["1b"].get("skipped"), flush=True)
    finish_pending()
    save()
    return 0


def pair_1b(ch: Children, spec, meta, step_res: dict, work: Path, left, before_timing) -> None:
    """The 1B arms: compiled at the same time up to a barrier, then timed one after the other."""
    r1: dict = {}
    step_res["1b"] = {**meta("1b"), "grad_ckpt": False, "runs": r1, "same_as": "nf4_dequant_bench.py ab"}
    t = time.monotonic()
    if left() < NEEDS["1b_pair"]:
        step_res["1b"]["skipped"] = f"budget: {left():.0f} s left"
        return
    bar = work / "barrier"
    bar.mkdir(exist_ok=True)
    arms = [ch.spawn("ours", spec("1b", n, p, barrier=str(bar)), work / f"inductor_{n}")
            for n, p in (("1b_ours_unpatched", False), ("1b_ours_patched", True))]
    while (time.monotonic() - t < 220 and left() > 40 and any(arm[0].poll() is None for arm in arms)
           and not all((bar / f"ready_{arm[3]}").exists() for arm in arms)):
        time.sleep(0.5)
    before_timing()  # nothing else on the GPU or the CPU while the arms are timed
    step_res["1b"]["barrier_s"] = round(time.monotonic() - t, 1)
    for arm in arms:
        (bar / f"go_{arm[3]}").touch()
        r1[arm[3]] = ch.finish(arm, max(5.0, min(120, left() - 5)))
    step_res["1b"]["patched_vs_unpatched"] = _ab(r1, "1b_ours_patched", "1b_ours_unpatched")
    step_res["1b"]["wall_s"] = round(time.monotonic() - t, 1)


if __name__ == "__main__":
    if sys.argv[1] in ("ours", "eager"):
        child_spec = json.loads(Path(sys.argv[2]).read_text())
        write(sys.argv[3], (ours_child if sys.argv[1] == "ours" else eager_child)(child_spec))
        sys.exit(0)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cmd", choices=["main"])
    p.add_argument("out_dir")
    p.add_argument("budget_s", type=float)
    p.add_argument("--parts", default="8b,1b", help="of 8b (A/B, warm start, parity), 1b (A/B), 8b8 (A/B at 8 x 1024), fasteager "
                   "(the recipe uncompiled at 8B, beside the 1B compile: put it before 1b), cast or fp32 (optimize() "
                   "variants judged against HF eager's floor at 8B)")
    p.add_argument("--model8", default=B8["model"])
    p.add_argument("--model1", default=B1["model"])
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default=None, help="optimize()'s backend (a CPU dry run: aot_eager)")
    p.add_argument("--work", default="/tmp/compute_extras_work")
    args = p.parse_args()
    sys.exit(main(args.out_dir, args.budget_s, args))
