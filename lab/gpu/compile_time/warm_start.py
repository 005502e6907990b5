"""Issue 20's warm start: where a new process's time to its first step goes, with
``optimize(warm_cache=...)`` on and off, each start in its own process.

Wrote: results/warm_start_<gpu>.json (from OUT/warm_start.json)
Rerun: bash lab/gpu/compile_time/gpu_warm_start.sh OUT [BUDGET_S=420]  (GPU machine, repo root; carry .whl .gpucache)

Why: a warm start (a second process, the Inductor cache on disk from the first) took 31.6 s to
its first step at 8B in ``lab/results/compute/compute_extras_h100.json``, against a 20 s target, and its
counters said AOTAutograd's cache was bypassed: every graph of the recipe holds an autograd
Function, which that cache refuses unless torch's setting says otherwise (``warm_cache``, on
by default now). Each start is :func:`qlora_nb_utils.bench.compile_time.measure`, which splits
the time into spawn, imports (torch, transformers, peft, bitsandbytes, the package), model load
(``from_pretrained`` with NF4 quantization, LoRA, batches), ``optimize()`` and the first step,
and records the cache counters.

Per shape, in this order, all in one Inductor cache folder:

* ``cold``: an empty cache, ``warm_cache`` on (``"auto"``);
* ``warm``: the same again (AOTAutograd cache hits expected);
* ``warm_off``: ``warm_cache=False`` (the behaviour before: Inductor's graph cache hits, the
  AOTAutograd cache bypassed);
* ``warm_again``: ``warm_cache`` on once more, a repeat to set the difference against;
* ``warm_nf4`` and ``warm_nf4_again``: warm starts that load a pre-quantized NF4 checkpoint
  (:func:`qlora_nb_utils.models.save_nf4`, written once after the cold start, in a process of
  its own, its time ``nf4_save_s``) instead of quantizing the bf16 one while loading: about 5.6
  instead of 16 GB read at 8B, and no quantization. Their losses must equal the bf16 loads'
  (the same bits, ``tests/test_models.py``): ``nf4_losses_equal``.

* ``warm_nf4_retokenized`` and ``warm_nf4_cached_tokens`` (and ``_again``): the same-call A/B of
  :mod:`qlora_nb_utils.data.token_cache`: the first deletes the token and batch caches before its start, so
  the data is rendered and tokenized again (and kept), the second reads it back.
  ``load_parts_s`` splits every start's load into the model and the batches.

``WARM_START_RUNS=cold,warm,...`` keeps only those runs (in this order).

The shapes: Llama-3.1-8B, 2 x 1024, regional scope (the compute_extras warm start's), then, if the
budget leaves room, Llama-3.2-1B, 4 x 512, whole scope (CUDA graphs; its cold compile was
119-125 s in ``lab/results/compute/peers_compute_h100.json``). A model is built into the cache before its
first start (its build is not timed as a start).

    python3 lab/gpu/compile_time/warm_start.py OUT_JSON BUDGET_S   (WARM_START_MODELS=m1,m2: only those shapes)
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

SHAPES = [
    {"model": "llama-3.1-8b-shape", "scope": "regional", "batch_size": 2, "seq_len": 1024, "steps": 6},
    {"model": "llama-3.2-1b-shape", "scope": "whole", "batch_size": 4, "seq_len": 512, "steps": 8},
]
#: (run, optimize's warm_cache) in the order they run; the ``_nf4`` ones load the pre-quantized checkpoint.
RUNS = [("cold", "auto"), ("warm", "auto"), ("warm_off", False), ("warm_nf4", "auto"), ("warm_again", "auto"),
        ("warm_nf4_again", "auto"), ("warm_nf4_retokenized", "auto"), ("warm_nf4_cached_tokens", "auto"),
        ("warm_nf4_retokenized_again", "auto"), ("warm_nf4_cached_tokens_again", "auto")]
#: Both warm runs of one kind, for the best time to the first step.
KINDS = {"bf16 checkpoint, quantized while loading": ("warm", "warm_again"),
         "pre-quantized NF4 checkpoint": ("warm_nf4", "warm_nf4_again", "warm_nf4_cached_tokens",
                                          "warm_nf4_cached_tokens_again"),
         "pre-quantized NF4 checkpoint, data tokenized again": ("warm_nf4_retokenized", "warm_nf4_retokenized_again")}
#: Seconds a start needs left in the budget (a cold one, a warm one), by model.
NEEDS = {"llama-3.1-8b-shape": (90, 60), "llama-3.2-1b-shape": (200, 90)}
TARGET_S = 20.0


def write(path: Path, data: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def summarize(runs: dict) -> dict:
    """The warm start with the setting against without it, and the target."""
    def get(name, key):
        r = runs.get(name) or {}
        return r.get(key)

    out = {}
    for key in ("compile_s", "first_step_s", "time_to_first_step_s", "import_s", "load_s", "dynamo_compile_s"):
        out[key] = {name: get(name, key) for name in runs}
    on = [v for v in (get("warm", "compile_s"), get("warm_again", "compile_s")) if v is not None]
    off = get("warm_off", "compile_s")
    if on and off is not None:
        out["warm_compile_s_on_median"] = statistics.median(on)
        out["warm_compile_s_off"] = off
        out["warm_compile_saved_s"] = off - statistics.median(on)
    by_kind = {}
    for kind, names in KINDS.items():
        timed = [(get(n, "time_to_first_step_s"), n) for n in names if get(n, "time_to_first_step_s")]
        if not timed:
            continue
        best, name = min(timed)
        r = runs[name]
        by_kind[kind] = {"runs": [n for _, n in timed], "time_to_first_step_s_best": best,
                         "under_target": best < TARGET_S, "load_s": [get(n, "load_s") for _, n in timed],
                         "breakdown_s_of_best": {"spawn": r.get("spawn_to_main_s"), "imports": r.get("import_s"),
                                                 "load": r.get("load_s"), "optimize": r.get("optimize_s"),
                                                 "first_step": r.get("first_step_s")}}
    if by_kind:
        out["warm_by_checkpoint"] = by_kind
        best_kind = min(by_kind, key=lambda k: by_kind[k]["time_to_first_step_s_best"])
        out["warm_time_to_first_step_s_best"] = by_kind[best_kind]["time_to_first_step_s_best"]
        out["warm_time_to_first_step_best_with"] = best_kind
        out["warm_time_to_first_step_under_target"] = by_kind[best_kind]["under_target"]
        out["warm_breakdown_s"] = by_kind[best_kind]["breakdown_s_of_best"]
    losses = {n: get(n, "losses") for n in runs if n != "cold" and n != "warm_off" and get(n, "losses")}
    batches = {n: (get(n, "load_parts_s") or {}).get("batches_s") for n in runs}
    if any(v is not None for v in batches.values()):
        out["batches_s"] = batches
    if len(losses) > 1:  # every warm start trains the same batches from the same start
        out["warm_losses_equal"] = len({tuple(v) for v in losses.values()}) == 1
    if any(n.startswith("warm_nf4") for n in losses) and any(not n.startswith("warm_nf4") for n in losses):
        out["nf4_losses_equal"] = len({tuple(v) for v in losses.values()}) == 1
    out["aot_autograd_counters"] = {name: (r or {}).get("cache_counters", {}).get("aot_autograd")
                                    for name, r in runs.items()}
    return out


def save_nf4(name: str, folder: Path, entry: dict) -> float:
    """Write ``name``'s pre-quantized NF4 checkpoint in a process of its own; its wall seconds."""
    t = time.monotonic()
    code = f"from qlora_nb_utils import models; models.save_nf4({name!r}, {str(folder)!r}, overwrite=True)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        entry["nf4_error"] = (proc.stdout + proc.stderr)[-2000:]
        print(f"[warm_start] save_nf4 failed: {entry['nf4_error'][-500:]}", flush=True)
    else:
        entry["nf4_bytes"] = sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".safetensors")
        print(f"[warm_start] save_nf4 {name}: {entry['nf4_bytes'] / 2**30:.2f} GiB in {time.monotonic() - t:.1f} s",
              flush=True)
    return round(time.monotonic() - t, 1)


def main(out_path: str, budget_s: float) -> int:
    import torch

    from qlora_nb_utils import env
    from qlora_nb_utils.bench import compile_time
    from qlora_nb_utils.data import batch_cache, token_cache
    from qlora_nb_utils.models.build import materialize

    t0 = time.monotonic()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(os.environ.get("WARM_START_WORK", "/tmp/warm_start_work"))
    work.mkdir(parents=True, exist_ok=True)
    res = {"what": __doc__.split("\n\n")[0], "device": env.device_info(dev), "versions": env.versions(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": os.environ.get("QLORA_NB_WARM_CMD", " ".join(sys.argv)), "tool": "lab/gpu/compile_time/warm_start.py",
           "target_s": TARGET_S, "budget_s": budget_s,
           "time_to_first_step_how": "from the parent starting the process to the end of the first optimizer step "
                                     "(bench.compile_time.measure: spawn, imports, load, optimize(), first step)",
           "compile_s_how": "first step minus the median later step", "shapes": []}
    write(Path(out_path), res)
    only = [m for m in os.environ.get("WARM_START_MODELS", "").split(",") if m]
    runs_kept = [r for r in os.environ.get("WARM_START_RUNS", "").split(",") if r]
    res["runs_kept"] = runs_kept or [r for r, _ in RUNS]
    for shape in SHAPES:
        name = shape["model"]
        if only and name not in only:
            continue
        entry = {**shape, "runs": {}, "skipped": []}
        res["shapes"].append(entry)
        cold_need, warm_need = NEEDS[name]
        if budget_s - (time.monotonic() - t0) < cold_need + 2 * warm_need:
            entry["skipped"] = [r for r, _ in RUNS]
            entry["error"] = "skipped: the budget leaves too little for a cold and two warm starts"
            write(Path(out_path), res)
            continue
        t_build = time.monotonic()
        try:
            materialize(name)
        except Exception as exc:  # a failed build ends this shape, not the call
            entry["error"] = f"build: {type(exc).__name__}: {exc}"
            write(Path(out_path), res)
            continue
        entry["build_s"] = round(time.monotonic() - t_build, 1)
        cache = work / name.replace(".", "_")
        nf4_dir = work / f"{name}-nf4"
        for run, warm_cache in [r for r in RUNS if not runs_kept or r[0] in runs_kept]:
            left = budget_s - (time.monotonic() - t0)
            if left < (cold_need if run == "cold" else warm_need):
                entry["skipped"].append(run)
                continue
            if run.startswith("warm_nf4") and "nf4_save_s" not in entry:
                entry["nf4_save_s"] = save_nf4(name, nf4_dir, entry)
            if run.startswith("warm_nf4") and "nf4_error" in entry:
                entry["skipped"].append(run)
                continue
            if "retokenized" in run:  # the A/B's other arm: the data tokenized and batched again, as before the data caches
                shutil.rmtree(token_cache.default_dir(), ignore_errors=True)
                shutil.rmtree(batch_cache.default_dir(), ignore_errors=True)
            print(f"[warm_start] {name} {run} (warm_cache={warm_cache}), {left:.0f} s left", flush=True)
            try:
                r = compile_time.measure(model=str(nf4_dir) if run.startswith("warm_nf4") else name,
                                         scope=shape["scope"], cache_dir=cache, device=dev.type,
                                         dtype="bfloat16", batch_size=shape["batch_size"], seq_len=shape["seq_len"],
                                         steps=shape["steps"], warm_cache=warm_cache, timeout_s=max(left - 5, 30))
                if run != "cold":  # one description per shape is enough
                    r.pop("optimize", None)
                entry["runs"][run] = {"warm_cache": warm_cache, **r}
                print(f"[warm_start]   first step {r['first_step_s']:.1f} s, compile {r['compile_s']:.1f} s, "
                      f"to first step {r.get('time_to_first_step_s')} s, imports {r['import_s']:.1f} s, "
                      f"load {r['load_s']:.1f} s, aot {r['cache_counters']['aot_autograd']}", flush=True)
            except Exception as exc:
                entry["runs"][run] = {"warm_cache": warm_cache, "error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()[-2000:]}
                print(f"[warm_start]   failed: {exc}", flush=True)
            entry["summary"] = summarize({k: v for k, v in entry["runs"].items() if "error" not in v})
            write(Path(out_path), res)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    write(Path(out_path), res)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
