"""Does ``optimize(model, batches=..., max_memory_gib=X)`` keep the training peak under X?

Wrote: lab/results/memory/memory_target_h200.json
Rerun: source lab/gpu/gpu_env.sh && python3 lab/gpu/memory/memory_target.py --out OUT/memory_target.json
  (on the lent GPU machine, from the repository root; carry .whl .gpucache); defaults: the 1B
  shape, 16 x 1024 at no target, 20, 14 and 10 GiB, 4 x 512 at no target, 4 and 3.5 GiB, 8 steps.

Why: with a memory target, :func:`qlora_nb_utils.optimize` checkpoints the fewest first decoder
layers whose :func:`~qlora_nb_utils.compile.fast_path.estimate_peak_gib` fits the target. That
estimate was calibrated on two 4 x 512 peaks and never checked against a target. This loads the
model the way the main job does (``qlora-nb bench``: NF4, bf16, kbit prep, LoRA r 16), builds
the bench's batches, calls ``optimize`` with each target, trains a few steps and records the
choice, the estimate for it and the measured peaks (``max_memory_allocated``, the figure the
estimate was fitted to, and ``max_memory_reserved``, what the device must really hold: under
CUDA graphs the graph pool stays reserved while its blocks count as free).

One process per target, so that each peak is that run's alone (a process's allocator keeps
what earlier runs cached). The processes run side by side to share the compile time; the GPU
is shared through ``$QLORA_NB_GPU_LOCK`` (:mod:`qlora_nb_utils.training.gpulock`): each step,
and each child's model load and ``optimize`` call, holds the lock, released while Inductor
compiles. Peaks are per process and do not see the others; step times (median of the steps
after the compiling step and the CUDA-graph recording step) share the CPU with the others'
compiles and are a side figure, noisier than the main job's.

Last, the estimate is refitted to the measured peaks (:func:`fit`): in the form ``constants``
only its two calibration constants are free (``c``, the saved elements per token and layer of
an un-checkpointed layer, ``memory_estimate._ACT_PER_TOKEN`` times hidden and intermediate, and the
overhead, ``_OVERHEAD_GIB``); in the form ``extended`` also a factor on its loss-chunk term and
a transient paid once any layer is checkpointed. Least squares, then the overhead that puts
every measured peak under its estimate, and the layers each target would then get.
``--refit`` recomputes the fits of a written file without a GPU:
  python3 lab/gpu/memory/memory_target.py --refit --out lab/results/memory/memory_target_h200.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_RUNS = ("16x1024:none,20,14,10", "4x512:none,4,3.5")
_GIB = 2**30


def _parse_runs(specs: list[str]) -> list[tuple[int, int, float | None]]:
    runs = []
    for spec in specs:
        shape, _, targets = spec.partition(":")
        b, s = (int(x) for x in shape.split("x"))
        for t in (targets or "none").split(","):
            runs.append((b, s, None if t == "none" else float(t)))
    return runs


# -- one run (a child process) ---------------------------------------------------------------


def _estimate_terms(model, b: int, s: int, act_bytes: int, cast_dtype, ce_chunks: int = 4) -> dict:
    """The terms of ``estimate_peak_gib`` apart (GiB), so the constants can be refitted."""
    from qlora_nb_utils.compile import memory_estimate

    terms = memory_estimate.estimate_terms(model, b, s, ce_chunks=ce_chunks, act_bytes=act_bytes,
                                           cast_dtype=cast_dtype)
    per = memory_estimate._ACT_PER_TOKEN
    return {**terms, "elems_per_token_layer": per[0] * terms["hidden"] + per[1] * terms["intermediate"]}


def child(model_name: str, b: int, s: int, target: float | None, steps: int, out: Path) -> None:
    import torch

    from qlora_nb_utils import env, models
    from qlora_nb_utils.bench.main_job import make_bench_batches, resolve_device_dtype
    from qlora_nb_utils.compile import fast_path
    from qlora_nb_utils.training.gpulock import step_lock
    from qlora_nb_utils.training.loop import TrainConfig, train

    device, dtype = resolve_device_dtype("auto", "auto")
    cuda = device.type == "cuda"
    with step_lock():  # the load quantizes on the GPU: keep it off the others' timed steps
        model, tok = models.load_model(model_name, quant="nf4", lora=True, lora_r=16, lora_alpha=32, dtype=dtype,
                                       device=device, attn_implementation="sdpa", seed=0, prepare_kbit=True)
    batches, _ = make_bench_batches(tok, batch_size=b, seq_len=s, steps=steps, padding="fixed", seed=0)
    shapes = {tuple(x["input_ids"].shape) for x in batches}
    if shapes != {(b, s)}:
        raise RuntimeError(f"expected every batch {b} x {s}, got {sorted(shapes)}")
    act_bytes = torch.finfo(dtype).bits // 8
    # what optimize() counts: the weights at their size after its cast to the compute dtype
    terms = _estimate_terms(model, b, s, act_bytes, dtype)
    table = [fast_path.estimate_peak_gib(model, b, s, n, ce_chunks=4, act_bytes=act_bytes, cast_dtype=dtype)
             for n in range(terms["layers"] + 1)]
    from qlora_nb_utils.compile.memory_estimate import peak_from_terms

    mine = [peak_from_terms(terms, n) for n in range(terms["layers"] + 1)]
    if max(abs(x - y) for x, y in zip(table, mine)) > 1e-6:
        raise RuntimeError(f"the terms do not add up to estimate_peak_gib: {table} vs {mine}")

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    with step_lock():
        opt = fast_path.optimize(model, batches=batches, max_memory_gib=target)
    ckpt = int(str(opt.choices["ckpt_layers"]).split("/")[0])
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # the cast freed the fp32 copies: let the reserved figure start clean
    before = {"allocated_gib": torch.cuda.memory_allocated() / _GIB if cuda else None,
              "reserved_gib": torch.cuda.memory_reserved() / _GIB if cuda else None}
    reserved: list[float | None] = []

    def on_step(step, row):  # train() resets the peaks at each step's start: this is the step's
        reserved.append(torch.cuda.max_memory_reserved() / _GIB if cuda else None)

    cfg = TrainConfig(steps=steps, lr=2e-4, seed=0, progress=False)
    try:
        hist = train(model, batches, cfg, forward=opt.forward, label=f"{b}x{s}@{target}", on_step=on_step)
    finally:
        opt.undo()
    step_ms = [float(x) for x in hist["step_ms"]]
    alloc = [float(x) for x in hist["step_peak_mem_gib"]]
    steady = step_ms[2:] if len(step_ms) > 2 else step_ms  # step 0 compiles, step 1 records the graph
    peak_alloc = max(alloc) if cuda else None
    peak_res = max(reserved) if cuda else None
    result = {
        "batch_size": b, "seq_len": s, "target_gib": target,
        "ckpt_layers": ckpt, "n_layers": terms["layers"], "reason": opt.reasons["ckpt_layers"],
        "estimate_gib": table[ckpt], "estimate_by_ckpt_layers": table, "estimate_terms": terms,
        "peak_allocated_gib": peak_alloc, "peak_reserved_gib": peak_res,
        "met_target_allocated": None if target is None or not cuda else peak_alloc <= target,
        "met_target_reserved": None if target is None or not cuda else peak_res <= target,
        "estimate_error_allocated_gib": None if not cuda else peak_alloc - table[ckpt],
        "median_step_ms": statistics.median(steady), "first_step_s": step_ms[0] / 1e3,
        "after_optimize": before,
        "step_ms": step_ms, "step_peak_allocated_gib": alloc, "step_peak_reserved_gib": reserved,
        "losses": [float(x) for x in hist["loss"]],
        "compilations": opt.counter.to_dict()["compilations"],
        "optimize": opt.description,
        "device": env.device_info(device), "versions": env.versions(),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")


# -- the fit -----------------------------------------------------------------------------------

#: The forms fitted. "constants": only the two constants (``c`` = _ACT_PER_TOKEN's elements per
#: token and layer, ``overhead`` = _OVERHEAD_GIB) free. "extended": also a factor on the loss
#: chunk's term (``logits_factor``) and a transient paid once any layer is checkpointed
#: (``ckpt_transient``, in hidden-sized vectors per token: the recomputed layer and its backward).
FORMS = {"constants": ("c", "overhead"), "extended": ("c", "logits_factor", "ckpt_transient", "overhead")}


def _refit_estimate(t: dict, n: int, p: dict) -> float:
    """The estimate with refitted numbers; ``logits_factor`` multiplies the current loss-chunk term
    and ``ckpt_transient`` (hidden-sized vectors per token) replaces the current checkpointing one."""
    act = t["tokens"] * t["act_bytes"] / _GIB
    return (t["static_gib"] + n * t["kept_per_layer_gib"] + (t["layers"] - n) * act * p["c"]
            + p.get("logits_factor", 1.0) * t["logits_gib"] + (n > 0) * act * t["hidden"] * p.get("ckpt_transient", 0.0)
            + p["overhead"])


def fit(runs: list[dict], key: str, form: str = "constants") -> dict:
    """Fit the estimate's free numbers (:data:`FORMS`) to the measured peaks ``key``, by least squares.

    Returns:
        The numbers, the residuals (measured - refitted estimate), ``overhead_covering`` (the
        overhead that puts every measured peak at or under its estimate) and, with that overhead,
        the layers the refitted estimate would checkpoint for each target that was run.
    """
    import numpy as np

    names = FORMS[form]
    pts = [r for r in runs if r.get(key) is not None]
    if len({(r["ckpt_layers"], r["estimate_terms"]["tokens"]) for r in pts}) < len(names):
        return {"form": form, "points": len(pts), "note": "too few distinct points to fit"}
    rows, y = [], []
    for r in pts:
        t, n = r["estimate_terms"], r["ckpt_layers"]
        act = t["tokens"] * t["act_bytes"] / _GIB
        col = {"c": (t["layers"] - n) * act, "logits_factor": t["logits_gib"],
               "ckpt_transient": (n > 0) * act * t["hidden"], "overhead": 1.0}
        rows.append([col[k] for k in names])
        fixed = _refit_estimate(t, n, {"c": 0.0, "overhead": 0.0, "logits_factor": 0.0 if "logits_factor" in names
                                       else 1.0})
        y.append(r[key] - fixed)
    sol, *_ = np.linalg.lstsq(np.array(rows), np.array(y), rcond=None)
    p = {k: float(v) for k, v in zip(names, sol)}
    resid = [r[key] - _refit_estimate(r["estimate_terms"], r["ckpt_layers"], p) for r in pts]
    cover = {**p, "overhead": p["overhead"] + max(resid)}
    t0 = pts[0]["estimate_terms"]
    ratio = p["c"] / t0["elems_per_token_layer"]
    choose = []
    for r in pts:
        if r["target_gib"] is None:
            continue
        t = r["estimate_terms"]
        n = next((n for n in range(t["layers"] + 1) if _refit_estimate(t, n, cover) <= r["target_gib"]), None)
        choose.append({"shape": f"{r['batch_size']}x{r['seq_len']}", "target_gib": r["target_gib"], "ckpt_layers": n,
                       "estimate_gib": _refit_estimate(t, t["layers"] if n is None else n, cover)})
    return {
        "form": form, "measured": key, "points": len(pts), **p,
        "was_c": t0["elems_per_token_layer"],
        "act_per_token": [round(x * ratio, 3) for x in _current_act_per_token()],
        "overhead_covering": cover["overhead"], "residuals_gib": resid,
        "would_choose_with_covering_overhead": choose,
        "note": "_ACT_PER_TOKEN = act_per_token (both scaled by one factor: one model cannot tell hidden from "
                "intermediate apart); _OVERHEAD_GIB = overhead_covering keeps every measured peak <= its estimate; "
                "static_gib counts the weights at their size after optimize()'s cast (estimate_terms' cast_dtype)",
    }


def _current_act_per_token() -> tuple:
    from qlora_nb_utils.compile.memory_estimate import _ACT_PER_TOKEN

    return _ACT_PER_TOKEN


def fits(runs: list[dict]) -> dict:
    """Every form fitted to both peaks: ``{"<form>_<allocated|reserved>": fit}``."""
    return {f"{form}_{key.split('_')[1]}": fit(runs, key, form)
            for form in FORMS for key in ("peak_allocated_gib", "peak_reserved_gib")}


# -- the parent --------------------------------------------------------------------------------


def _spawn(args, b, s, target, workdir: Path, env_vars: dict) -> tuple[subprocess.Popen, Path, Path]:
    tag = f"{b}x{s}_{'none' if target is None else target}"
    out, log = workdir / f"{tag}.json", workdir / f"{tag}.log"
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--shape", f"{b}x{s}",
           "--target", "none" if target is None else str(target), "--steps", str(args.steps), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env_vars)
    return proc, out, log


def _print_fits(all_fits: dict) -> None:
    for name, f in all_fits.items():
        nums = {k: round(f[k], 4) for k in FORMS[f["form"]] if k in f}
        if "residuals_gib" not in f:
            print(f"{name}: {f['note']}")
            continue
        picks = ", ".join(f"{x['shape']}@{x['target_gib']}:{x['ckpt_layers']}" for x in f["would_choose_with_covering_overhead"])
        print(f"{name}: {nums} covering overhead {f['overhead_covering']:.3f}; act_per_token {f['act_per_token']}; "
              f"max |residual| {max(map(abs, f['residuals_gib'])):.2f} GiB; picks {picks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write (its log lands beside it)")
    parser.add_argument("--model", default="llama-3.2-1b-shape")
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="BxS:target,target,... (none: no target)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=4, help="processes at once (1: no GPU lock needed)")
    parser.add_argument("--refit", action="store_true", help="recompute the fits of --out's runs (no GPU) and rewrite it")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        b, s = (int(x) for x in args.shape.split("x"))
        child(args.model, b, s, None if args.target == "none" else float(args.target), args.steps, Path(args.out))
        return
    if args.refit:
        results = json.loads(Path(args.out).read_text())
        results["fits"] = fits(results["runs"])
        results.pop("fit_allocated", None), results.pop("fit_reserved", None)
        results["fits_by"] = "python3 lab/gpu/memory/memory_target.py " + shlex.join(sys.argv[1:])
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        _print_fits(results["fits"])
        return

    from qlora_nb_utils import models

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    models.materialize(args.model)  # once, here: children building it side by side would race
    todo = _parse_runs(args.runs)
    workdir = Path(tempfile.mkdtemp(prefix="memory_target_"))
    env_vars = dict(os.environ)
    if args.jobs > 1:
        env_vars["QLORA_NB_GPU_LOCK"] = str(workdir / "gpu.lock")
        env_vars.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // args.jobs)))
    t0 = time.perf_counter()
    running, done = [], []
    while todo or running:
        while todo and len(running) < args.jobs:
            running.append(_spawn(args, *todo.pop(0), workdir, env_vars))
        time.sleep(2)
        for item in [r for r in running if r[0].poll() is not None]:
            running.remove(item)
            done.append(item)
            print(f"[{time.perf_counter() - t0:6.0f} s] {item[1].stem}: exit {item[0].returncode}", flush=True)
    with (out.with_suffix(".log")).open("w") as logs:
        for _, _, log in done:
            logs.write(f"===== {log.stem}\n{log.read_text()}\n")
    runs, failed = [], []
    for proc, res, log in done:
        if proc.returncode == 0 and res.is_file():
            runs.append(json.loads(res.read_text()))
        else:
            failed.append({"run": res.stem, "exit": proc.returncode, "log_tail": log.read_text()[-3000:]})
            print(f"FAILED {res.stem}:\n{log.read_text()[-3000:]}", flush=True)
    runs.sort(key=lambda r: (-r["batch_size"] * r["seq_len"], -(r["target_gib"] or float("inf"))))
    first = runs[0] if runs else {}
    results = {
        "kind": "memory_target",
        "what": "optimize(model, batches=..., max_memory_gib=X) on the 1B shape (NF4, bf16, the main job's loading "
                "and batches): the checkpointed layers it picks, its estimate, and the measured training peaks",
        "device": first.get("device"), "versions": first.get("versions"),
        "command": "python3 lab/gpu/memory/memory_target.py " + shlex.join(sys.argv[1:]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "options": {"model": args.model, "runs": args.runs, "steps": args.steps, "jobs": args.jobs,
                    "gpu_lock": args.jobs > 1, "compile_threads": env_vars.get("TORCHINDUCTOR_COMPILE_THREADS")},
        "wall_s": time.perf_counter() - t0,
        "runs": [{k: v for k, v in r.items() if k not in ("device", "versions")} for r in runs],
        "failed": failed,
        "fits": fits(runs),
    }
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{'shape':>8} {'target':>6} {'ckpt':>5} {'est':>6} {'alloc':>6} {'resv':>6} {'met a/r':>8} {'ms':>7}")
    for r in runs:
        met = "-" if r["target_gib"] is None else "/".join(
            {True: "y", False: "NO", None: "?"}[r[k]] for k in ("met_target_allocated", "met_target_reserved"))
        print(f"{r['batch_size']}x{r['seq_len']:<5} {r['target_gib'] or '-':>6} {r['ckpt_layers']:>2}/{r['n_layers']:<2} "
              f"{r['estimate_gib']:6.2f} {r['peak_allocated_gib'] or 0:6.2f} {r['peak_reserved_gib'] or 0:6.2f} "
              f"{met:>8} {r['median_step_ms']:7.1f}")
    _print_fits(results["fits"])
    print(f"wrote {out} ({len(runs)} runs, {len(failed)} failed)")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
