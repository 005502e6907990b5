"""Time from launching a training job to its first optimizer step, cold and warm: ours, ours before, HF eager, Unsloth.

Wrote: results/compile_time/cold_start_<gpu>.json (from OUT/cold_start_<shape>.json, one per call;
``merge`` joins them)
Rerun: bash lab/gpu/compile_time/gpu_cold_start.sh OUT SHAPE [BUDGET_S=520]
    (GPU machine, repo root; carry .whl .gpucache .unsloth)

Why: per step the fast path leads, but a user waits for the first step before any of it counts;
a job of a few dozen steps is lost or won in its start. Each run here is one process started the
way a user starts it, timed from its launch (the parent's clock just before the spawn) to the end
of its first optimizer step (the child's clock, ``first_step_end_unix``):

* ``ours``: ``qlora-nb train ... --steps 60`` as it is (``optimize()`` chooses the scope from the
  steps, keeps its compiled artifacts);
* ``ours-before``: the same with the choices of before forced through ``optimize()``'s options
  (``--scope whole --compile-cache off``: the whole model, no artifacts);
* ``hf-eager``: the HF recipe (kbit prep + LoRA, eager), the package's loop, on batches built in its
  process as ours are (nothing cached); the trial ``hf-eager-prebuilt``, and rows with no ``data``, on the parent's;
* ``unsloth``: ``lab.peers.unsloth`` (its own loop) on the parent's batches, padding-free packed.

``cold``: every compile cache empty (a fresh ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``,
the package's artifact folder and token cache removed, Unsloth's compiled-module folder new);
``warm``: a second process on the first one's folders. Each run records the time to its first
step, the median later step, the time to the end of step 60 (``wall_60_s``: to the first step, then
the later steps' times), the peak memory, graph breaks and compilations (ours), and, for ours, where
the start went: imports (process start to the first log line), data, model load, ``optimize()``,
the first step; inside the compile, Dynamo's tracing, AOTAutograd, Inductor, autotuning and CUDA
graph recording (``torch._dynamo.utils.compile_times``, read in the child after the run).

The runs of one call, in this order while the budget lasts (``COLD_START_RUNS=ours:cold,...``
picks others): ours cold, ours warm, unsloth cold, hf-eager cold, ours-before cold, unsloth warm,
ours-before warm. A run that does not fit the time left is listed under ``skipped``. Before them a
priming process (``primed`` in the file; ``COLD_START_PRIME=0`` leaves it out) imports what every
run imports, starts CUDA, a cuBLAS matmul and one small compiled kernel, on compile caches of its own
that are then removed: the first run of a call no longer pays alone what the machine reads from disk
the first time (libraries, the compiler's tools), which the runs after it found in memory. Calls
before it have no ``primed`` entry, and their first run carries that cost.

    python3 lab/gpu/compile_time/cold_start.py run SHAPE OUT_JSON BUDGET_S [--device cpu --model tiny --steps 4]
    python3 lab/gpu/compile_time/cold_start.py merge OUT_JSON IN_JSON... [--conditions TEXT]
    python3 lab/gpu/compile_time/cold_start.py child-ours SIDE_JSON -- QLORA_NB_TRAIN_ARGS...
    python3 lab/gpu/compile_time/cold_start.py child-hf --model M (--batches F | --batch-size B --seq-len S ...)
    python3 lab/gpu/compile_time/cold_start.py child-prime --device cuda
"""

from __future__ import annotations

import sys
import time

_LAUNCHED = time.time()  # a child's own start, before anything heavy is imported

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

from lab.cold_start_records import HF, NO_COMPILE, PEERS, comparisons, merge  # noqa: E402,F401
from lab.trials import LIGHT_ENV, NESTED_ENV, ROWS_ENV, STANCE_ENV, from_environment  # noqa: E402

#: The shapes, one per call: (model, batch size, sequence length, packing); SmolLM2 at the CLI's defaults.
SHAPES = {
    "smollm2-135m": {"model": "smollm2-135m", "batch_size": 4, "seq_len": 128, "packing": "auto"},
    "llama-3.2-1b-shape": {"model": "llama-3.2-1b-shape", "batch_size": 8, "seq_len": 1024, "packing": "on"},
    "llama-3.1-8b-shape": {"model": "llama-3.1-8b-shape", "batch_size": 4, "seq_len": 2048, "packing": "on"},
}
#: (library, cache) in the order a call runs them.
ORDER = [("ours", "cold"), ("ours", "warm"), ("unsloth", "cold"), ("hf-eager", "cold"), ("ours-before", "cold"),
         ("unsloth", "warm"), ("ours-before", "warm")]
#: What ours-before forces through optimize()'s options: the whole model, no artifacts.
BEFORE = ["--scope", "whole", "--compile-cache", "off"]
#: Our runs, by library name: the options each adds to ``qlora-nb train``'s. Trials, run only when
#: COLD_START_RUNS names them: ``ours-cudagraphs`` (regional with CUDA graphs); ``ours-cpp-wrapper``
#: (Inductor's C++ wrapper launches the kernels: the host's share of a small model's step);
#: ``ours-nested`` (the whole model, the decoder layer a ``nested_compile_region``: traced once inside
#: the whole graph?); ``ours-rebatched`` (ours' caches, the batch cache emptied: a warm start as before
#: ``data.batch_cache``, for a same-call A/B); ``ours-eager`` (Dynamo's eager backend: the layer traced,
#: nothing compiled by Inductor); ``ours-stance-eager`` (``optimize()``'s plan as chosen, every compiled
#: function run as plain code under torch's ``force_eager`` stance: no Dynamo either); ``ours-rows0`` (the NF4
#: route past 0 rows on CUDA, not bitsandbytes' own threshold: every LoRA layer over NF4 fused at any batch);
#: ``ours-one-config`` (Inductor's kernels each compiled in one configuration, none benchmarked on the first
#: step: pointwise kernels not autotuned, reductions filtered to one config as its deterministic mode does);
#: ``ours-eager-loss`` (the chunked loss's math run as plain code, not compiled on its own);
#: ``ours-light`` (both); ``ours-combo`` (Inductor's combo kernels: independent small kernels launched as
#: one, the host's share of a small model's step); ``ours-autotune`` (``--autotune on``: each kernel's
#: candidate configurations benchmarked on the first step, the product's default before ``optimize()``
#: chose one configuration); ``ours-no-patterns`` (Inductor's pattern matcher off: its patterns' lazy build
#: on a cold compile); ``ours-early-pool`` (Inductor's compile workers started before data and model load);
#: ``ours-no-step-graph`` (``--step-graph off``: every step launched from the host, as before the loop
#: captured the step where it can).
OURS = {"ours": [], "ours-before": BEFORE, "ours-cudagraphs": ["--mode", "reduce-overhead"], "ours-cpp-wrapper": [],
        "ours-nested": ["--scope", "whole"], "ours-rebatched": [], "ours-eager": ["--backend", "eager"],
        "ours-stance-eager": [], "ours-rows0": [], "ours-one-config": [], "ours-eager-loss": [], "ours-light": [],
        "ours-combo": [], "ours-autotune": ["--autotune", "on"], "ours-no-patterns": [], "ours-early-pool": [],
        "ours-no-step-graph": ["--step-graph", "off"]}
#: Trials that run on another library's compile caches (its warm runs are warm for them too).
CACHES_OF = {"ours-rebatched": "ours"}
#: Trials whose start finds no batches kept (the batch cache emptied just before; the token cache kept).
REBATCHED = ("ours-rebatched",)
#: The environment a trial of ours adds (recorded in its row as ``env``).
OURS_ENV = {"ours-cpp-wrapper": {"TORCHINDUCTOR_CPP_WRAPPER": "1"}, "ours-nested": {NESTED_ENV: "1"},
            "ours-stance-eager": {STANCE_ENV: "force_eager"}, "ours-rows0": {ROWS_ENV: "0"},
            "ours-one-config": {LIGHT_ENV: "one-config"}, "ours-eager-loss": {LIGHT_ENV: "eager-loss"},
            "ours-light": {LIGHT_ENV: "one-config,eager-loss"}, "ours-combo": {LIGHT_ENV: "combo-kernels"},
            "ours-no-patterns": {LIGHT_ENV: "no-patterns"}, "ours-early-pool": {LIGHT_ENV: "early-pool"}}
#: Seconds a run needs left to be started, by model (a cold whole-model 8B start took minutes).
NEEDS = {"tiny": 20, "smollm2-135m": 60, "llama-3.2-1b-shape": 120, "llama-3.1-8b-shape": 180}
STEPS = 60
LR, SEED, LORA_R, LORA_ALPHA = 2e-4, 0, 16, 32


def _write(path: Path, data: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _median_after_first(step_ms: list[float]) -> float | None:
    return statistics.median(step_ms[1:]) if len(step_ms) > 1 else None


# ----------------------------------------------------------------------------- children
#: What each frame Dynamo compiled keeps of its compilation metrics.
FRAME_FIELDS = ("compile_id", "co_name", "co_filename", "co_firstlineno", "is_forward", "restart_reasons",
                "dynamo_time_before_restart_s", "entire_frame_compile_time_s", "backend_compile_time_s",
                "inductor_compile_time_s", "graph_op_count", "fail_type", "fail_reason", "num_graph_breaks",
                "recompile_reason")


def _compile_breakdown() -> dict:
    """Dynamo's timers since the process started, summed, and what they add up to by phase."""
    try:
        from torch._dynamo.utils import compile_times, counters

        names, values = compile_times(repr="csv", aggregate=True)
        raw = {n: float(v) for n, v in zip(names, values) if str(v).replace(".", "", 1).isdigit()}
        cache = {g: {k: int(v) for k, v in counters[g].items() if "cache" in k} for g in ("aot_autograd", "inductor")}
    except Exception as exc:  # a private helper moved: the rest of the record still stands
        return {"error": f"{type(exc).__name__}: {exc}"}

    frames = []
    try:  # each frame Dynamo compiled: what it was, whether its analysis restarted and why, what it cost
        from torch._dynamo.utils import get_compilation_metrics

        for m in get_compilation_metrics():
            frame = {k: getattr(m, k, None) for k in FRAME_FIELDS}
            frame["co_filename"] = Path(str(frame["co_filename"])).name
            if isinstance(frame["restart_reasons"], set):  # JSON has no sets
                frame["restart_reasons"] = sorted(frame["restart_reasons"])
            frames.append(frame)
    except Exception as exc:  # a private helper moved
        frames.append({"error": f"{type(exc).__name__}: {exc}"})

    def total(*parts: str, exclude: tuple = ()) -> float:
        return round(sum(v for k, v in raw.items() if any(p.lower() in k.lower() for p in parts)
                         and not any(e.lower() in k.lower() for e in exclude)), 3)

    whole = total("_compile.compile_inner")
    backend = total("OutputGraph.call_user_compiler")
    aot = total("create_aot_dispatcher_function")
    forward = total("fw_compiler_base")  # inside AOTAutograd's; the backward compiles lazily, outside it
    inductor = total("fw_compiler_base", "bw_compiler")
    return {"raw_s": raw, "cache_counters": cache, "frames": frames, "phases_s": {
        "tracing_dynamo": round(max(whole - backend, 0.0), 3),
        "aot_autograd": round(max(aot - forward, 0.0), 3),
        "inductor": inductor,
        "autotuning": total("benchmark_all_configs", "select_algorithm", "autotune"),
        "cuda_graph_recording": total("cudagraph", exclude=("cudagraphify_impl",)),
        "backward_lazy": total("bw_compiler")}}


#: What ``qlora-nb train`` imports before its first line, in its order: timed one by one in the child.
IMPORTS = ("torch", "transformers", "peft", "qlora_nb_utils.training.finetuning", "qlora_nb_utils.compile.fast_path",
           "qlora_nb_utils.models.load")
#: Timed first: what the command line does before a command that loads models imports anything
#: (``qlora_nb_utils.cli.prepare_command``: transformers' assisted-generation module without scikit-learn).
DEFER = "qlora_nb_utils.startup.defer_sklearn"


def child_ours(side: str, argv: list[str]) -> int:
    """``qlora-nb train ARGV`` in this process (its imports first, each timed, after what the command line
    does before them), then Dynamo's timers into ``side``."""
    import importlib

    imports = {}
    t0 = time.perf_counter()
    from qlora_nb_utils.cli import prepare_command

    deferred = prepare_command("train")
    imports[DEFER] = round(time.perf_counter() - t0, 3)
    for name in IMPORTS:
        t0 = time.perf_counter()
        importlib.import_module(name)
        imports[name] = round(time.perf_counter() - t0, 3)
    imported_unix = time.time()
    trial = from_environment(os.environ)  # the trial's process-wide settings, before the product runs
    from qlora_nb_utils import cli

    code = cli.main(["train", *argv])
    _write(Path(side), {"exit": code, "launched_unix": _LAUNCHED, "imported_unix": imported_unix,
                        "imports_s": imports, "sklearn_deferred": deferred is not None,
                        "sklearn_imported": "sklearn" in sys.modules, "compile": _compile_breakdown(), **({"trial": trial} if trial else {})})
    return code


def shape_batches(model: str, batch_size: int, seq_len: int, packing: str, cache: bool = True) -> list:
    """The training batches ``qlora-nb train`` builds for these options (``packing``: a shape's "auto"/"on")."""
    from qlora_nb_utils import models
    from qlora_nb_utils.training.finetune_batches import build_finetune_batches

    return build_finetune_batches(models.load_tokenizer(model), data=None, batch_size=batch_size, seq_len=seq_len,
                                  seed=SEED, eval_size=8, log=lambda _: None, cache=cache,
                                  packing={"auto": "auto", "on": True}[packing])[0]


def child_hf(args: argparse.Namespace) -> int:
    """The HF recipe, eager, the package's loop, on batches built here (nothing cached) or read from ``--batches``."""
    record: dict = {"launched_unix": _LAUNCHED}
    try:
        import torch

        from lab.peers.packed_batches import for_transformers
        from qlora_nb_utils import env, models
        from qlora_nb_utils.training.loop import TrainConfig, train

        t0 = time.perf_counter()
        if args.batches:
            batches = torch.load(args.batches)
            record["data"] = "read from the parent's file"
        else:
            batches = shape_batches(args.model, args.batch_size, args.seq_len, args.packing, cache=False)[:args.steps]
            record["data"] = "built in the process (build_finetune_batches, cache=False)"
        record["data_s"] = round(time.perf_counter() - t0, 3)
        device, dtype = env.resolve_device_dtype(args.device, "auto")
        model, _ = models.load_model(args.model, quant="nf4", lora=True, lora_r=LORA_R, lora_alpha=LORA_ALPHA,
                                     dtype=dtype, device=device, prepare_kbit=True, seed=SEED)
        record["load_s"] = round(time.perf_counter() - t0, 3)
        packed = "document_ids" in batches[0]

        def forward(**batch):
            return model(**(for_transformers(batch) if packed else batch))

        def on_step(step: int, row: dict) -> None:
            if step == 0:
                record["first_step_end_unix"] = time.time()

        hist = train(model, batches, TrainConfig(steps=args.steps, lr=LR, seed=SEED, progress=False),
                     forward=forward, label="hf-eager", on_step=on_step)
        record.update(step_ms=[float(x) for x in hist["step_ms"]], losses=[float(x) for x in hist["loss"]],
                      peak_mem_gib=float(hist["peak_mem_gib"].max()), packed=packed)
    except Exception as exc:
        import traceback

        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()[-3000:]
    _write(Path(args.out), record)
    return 0


# ----------------------------------------------------------------------------- the parent
def _spawn(cmd: list[str], env: dict, log: Path, timeout_s: float) -> tuple[float, float, int | None]:
    """Start ``cmd``; (its launch time, its wall seconds, exit code or None on timeout)."""
    import signal

    with open(log, "w") as fh:
        launched = time.time()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group this call started
            proc.wait()
            code = None
    return launched, time.time() - launched, code


def _env(dirs: Path, extra_site: str = "") -> dict:
    from qlora_nb_utils._paths import pythonpath_with_package

    env = dict(os.environ)
    env.update(TORCHINDUCTOR_CACHE_DIR=str(dirs / "inductor"), TRITON_CACHE_DIR=str(dirs / "triton"),
               UNSLOTH_COMPILE_LOCATION=str(dirs / "unsloth_compiled"), HF_DATASETS_CACHE=str(dirs / "datasets"),
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = pythonpath_with_package(env.get("PYTHONPATH"), extra_site, str(Path(__file__).resolve().parents[3]))
    return env


def _clear_cold(dirs: Path) -> None:
    """Every compile cache a run reads, empty: its folders, the package's artifacts, token and batch caches."""
    from qlora_nb_utils.data import batch_cache, token_cache
    from qlora_nb_utils.models.registry import default_cache_dir

    shutil.rmtree(dirs, ignore_errors=True)
    dirs.mkdir(parents=True)
    shutil.rmtree(default_cache_dir() / "compile", ignore_errors=True)
    shutil.rmtree(token_cache.default_dir(), ignore_errors=True)
    shutil.rmtree(batch_cache.default_dir(), ignore_errors=True)


def _caches_for(lib: str, cache: str, work: Path) -> Path:
    """A run's compile-cache folders (those of the library a trial shares them with), emptied with
    every other cache for a cold run; for a rebatched trial, the batch cache emptied."""
    from qlora_nb_utils.data import batch_cache

    dirs = work / f"{CACHES_OF.get(lib, lib)}-cache"
    if cache == "cold":
        _clear_cold(dirs)
    if lib in REBATCHED:
        shutil.rmtree(batch_cache.default_dir(), ignore_errors=True)
    return dirs


#: What the priming process imports: every library a run of ours or HF eager imports before its model.
PRIME_IMPORTS = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "qlora_nb_utils.cli")


def child_prime(device: str) -> int:
    """Import what the runs import, start ``device``, run a matmul and compile one small function: what the
    first process on a machine reads from disk, read before the measured runs (its caches are thrown away)."""
    import importlib

    for name in PRIME_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import torch

    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    (x @ x).float().sum().item()
    torch.compile(lambda t: torch.relu(t * 2).sum(dim=-1), fullgraph=True)(x).float().sum().item()
    return 0


def prime(work: Path, device: str, timeout_s: float = 120.0) -> dict:
    """Run :func:`child_prime` in a process of its own, on compile caches of its own, then remove them."""
    dirs = work / "prime-cache"
    shutil.rmtree(dirs, ignore_errors=True)
    dirs.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "child-prime", "--device", device]
    _, wall, code = _spawn(cmd, _env(dirs), work / "prime.log", timeout_s)
    shutil.rmtree(dirs, ignore_errors=True)
    return {"process_s": round(wall, 2), "exit": code, "imports": list(PRIME_IMPORTS),
            "what": "imports, the device started, a matmul and one small compiled kernel, on caches then removed"}


def _run_ours(lib: str, shape: dict, work: Path, dirs: Path, device: str, steps: int, timeout_s: float) -> dict:
    out = work / f"{lib}-{dirs.name}-{int(time.time())}"
    side = out.with_suffix(".side.json")
    argv = ["--model", shape["model"], "--steps", str(steps), "--batch-size", str(shape["batch_size"]),
            "--seq-len", str(shape["seq_len"]), "--packing", shape["packing"], "--device", device,
            "--eval-every", "0", "--save-every", "0", "--eval-size", "8", "--no-progress", "--out", str(out),
            # the peers' loops hold the learning rate from the first step: the same schedule, comparable losses
            "--warmup-steps", "0", "--overwrite", *OURS[lib]]
    cmd = [sys.executable, str(Path(__file__).resolve()), "child-ours", str(side), "--", *argv]
    extra = OURS_ENV.get(lib, {})
    launched, wall, code = _spawn(cmd, {**_env(dirs), **extra}, out.with_suffix(".log"), timeout_s)
    rec = {"command": "qlora-nb train " + " ".join(argv), "exit": code, "process_s": round(wall, 2),
           **({"env": extra} if extra else {})}
    metrics_file = out / "metrics.json"
    if not metrics_file.is_file():
        rec["error"] = f"no metrics.json (exit {code}): " + _tail(out.with_suffix(".log"))
        failed = out / "qlora-nb-train-error.txt"  # where qlora-nb train writes the traceback of a failed run
        if failed.is_file():  # kept in the record: the run's folder stays on the GPU machine
            rec["traceback"] = failed.read_text(errors="replace")[-4000:]
        return rec
    m = json.loads(metrics_file.read_text())
    step_ms = [r["step_ms"] for r in m["history"]]
    rec.update(step_ms=step_ms, first_step_end_unix=m.get("first_step_end_unix"), launched_unix=launched,
               peak_mem_gib=m.get("peak_mem_gib"), graph_breaks=m["graph_breaks"],
               compilations=m["compilations"]["compilations"], compile_s=m["compile_s"],
               first_step_s=m.get("first_step_s"), losses=m["losses"], tokens_per_s=m["tokens_per_s"],
               optimize={"description": m["optimize"]["description"], "scope": m["optimize"]["choices"]["scope"],
                         "mode": m["optimize"]["choices"].get("mode"),
                         "compile_cache": m["optimize"]["choices"].get("compile_cache")},
               start_phases_s=m.get("start_phases_s"), start_overlap_s=m.get("start_overlap_s"))
    if side.is_file():
        s = json.loads(side.read_text())
        rec["interpreter_s"] = round(s["launched_unix"] - launched, 3)  # the interpreter's own start
        rec["imports_s"] = round(s["imported_unix"] - launched, 3)  # to the end of the imports, the start included
        rec["imports_by_module_s"] = s["imports_s"]
        rec["compile_breakdown"] = s["compile"]
        for key in ("sklearn_deferred", "sklearn_imported"):  # the command line's deferral, and what came of it
            if key in s:
                rec[key] = s[key]
        if "trial" in s:
            rec["trial"] = s["trial"]
        if rec.get("first_step_end_unix"):  # the rest of the start: the "before" sample, the step-0 held-out loss
            phases = rec.get("start_phases_s") or {}
            rec["start_other_s"] = round(rec["first_step_end_unix"] - s["imported_unix"] - sum(phases.values())
                                         - (rec.get("first_step_s") or 0), 3)
    return rec


def _run_peer(lib: str, shape: dict, work: Path, dirs: Path, batches: Path, device: str, steps: int,
              timeout_s: float) -> dict:
    out = work / f"{lib}-{dirs.name}-{int(time.time())}.json"
    model_dir = shape["model_dir"]
    if lib in HF:
        data = (["--batches", str(batches)] if lib == "hf-eager-prebuilt" else
                ["--batch-size", str(shape["batch_size"]), "--seq-len", str(shape["seq_len"]), "--packing", shape["packing"]])
        cmd = [sys.executable, str(Path(__file__).resolve()), "child-hf", "--model", shape["model"], *data,
               "--steps", str(steps), "--device", device, "--out", str(out)]
        env = _env(dirs)
    else:
        cmd = [sys.executable, "-m", "lab.peers.unsloth", "--model-dir", model_dir, "--batches", str(batches),
               "--steps", str(steps), "--warmup", "1", "--lr", str(LR), "--seed", str(SEED), "--lora-r", str(LORA_R),
               "--lora-alpha", str(LORA_ALPHA), "--out", str(out)] + (["--packed"] if shape["packed"] else [])
        env = _env(dirs, os.environ.get("QLORA_NB_UNSLOTH_SITE", ""))
    launched, wall, code = _spawn(cmd, env, out.with_suffix(".log"), timeout_s)
    rec = {"command": " ".join(cmd[1:]), "exit": code, "process_s": round(wall, 2), "launched_unix": launched}
    if not out.is_file():
        return {**rec, "error": f"no record (exit {code}): " + _tail(out.with_suffix(".log"))}
    r = json.loads(out.read_text())
    if r.get("error"):
        return {**rec, "error": r["error"]}
    rec.update(step_ms=r["step_ms"], first_step_end_unix=r.get("first_step_end_unix"), peak_mem_gib=r["peak_mem_gib"],
               losses=r.get("losses"), load_s=r.get("load_s"), graph_breaks=None, compilations=None,
               data=r.get("data", "read from the parent's file"), **({"data_s": r["data_s"]} if "data_s" in r else {}))
    return rec


def _tail(log: Path) -> str:
    try:
        return " | ".join([ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-4:])[-800:]
    except OSError:
        return ""


def _finish(rec: dict, lib: str, cache: str, shape: dict, steps: int) -> dict:
    """The fields the checks read, from a run's raw record."""
    row = {"library": lib, "model": shape["model"], "batch_size": shape["batch_size"], "seq_len": shape["seq_len"],
           "packed": shape["packed"], "cache": cache, "steps": steps}
    if "error" in rec:
        return {**row, **rec, "time_to_first_step_s": None}
    ms = rec["step_ms"]
    ttfs = rec["first_step_end_unix"] - rec["launched_unix"] if rec.get("first_step_end_unix") else None
    row.update(time_to_first_step_s=None if ttfs is None else round(ttfs, 2),
               median_step_ms=_median_after_first(ms),
               wall_60_s=None if ttfs is None else round(ttfs + sum(ms[1:60]) / 1e3, 2),
               peak_mem_gib=rec.get("peak_mem_gib"), graph_breaks=rec.get("graph_breaks"),
               compilations=rec.get("compilations"), first_step_s=round(ms[0] / 1e3, 3))
    return {**row, **{k: v for k, v in rec.items() if k not in row}}


#: SmolLM2-135M-Instruct's config (a Llama: 30 layers of 576, 9 query and 3 key/value heads, a tied head).
SMOLLM2_CONFIG = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                  "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
                  "eos_token_id": 2, "pad_token_id": 2}


def smollm2_shape(folder: Path) -> Path:
    """A checkpoint of SmolLM2-135M's shape with seeded random weights and its tokenizer (from the cache)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from qlora_nb_utils.models.registry import default_cache_dir

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_CONFIG)).to(torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_cache_dir() / "_tokenizer-smollm2").save_pretrained(folder)
    return folder


def run(shape_name: str, out_json: str, budget_s: float, device: str, model: str | None, steps: int) -> int:
    import torch

    from qlora_nb_utils import env, models
    from qlora_nb_utils.data import packing as qpacking

    t0 = time.monotonic()
    shape = dict(SHAPES[shape_name])
    if model:
        shape["model"] = model
    work = Path(os.environ.get("COLD_START_WORK", "/tmp/cold_start_work")) / shape_name
    work.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device)
    res = {"what": __doc__.split("\n\n")[0], "shape": shape_name, "device": env.device_info(dev),
           "versions": env.versions(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": os.environ.get("QLORA_NB_COLD_CMD", " ".join(sys.argv)), "tool": "lab/gpu/compile_time/cold_start.py",
           "budget_s": budget_s, "steps": steps,
           "bytecode": os.environ.get("QLORA_NB_BYTECODE", "not recorded (the image as it is)"),
           "time_to_first_step_how": "the parent's time.time() just before the spawn to the child's time.time() at the "
                                     "end of its first optimizer step (after the device sync)",
           "wall_60_how": "time to the first step plus the times of steps 2..60 (evaluation and checkpoints are "
                          "not in it: ours runs with --eval-every 0 --save-every 0)",
           "runs": [], "skipped": []}
    _write(Path(out_json), res)
    t_build = time.monotonic()
    try:
        shape["model_dir"] = str(models.materialize(shape["model"]))
    except FileNotFoundError as exc:  # SmolLM2's real weights come from a package the GPU machine lacks
        if shape["model"] != "smollm2-135m":
            raise
        shape["model_dir"] = shape["model"] = str(smollm2_shape(work / "smollm2-135m-shape"))
        res["model_note"] = (f"SmolLM2-135M's shape with random weights ({exc}); compile and step times depend on "
                             "the shape, the losses do not mean anything")
    res["build_s"] = round(time.monotonic() - t_build, 1)
    # the batches the peers train: what qlora-nb train builds from the same options
    train_batches = shape_batches(shape["model"], shape["batch_size"], shape["seq_len"], shape["packing"])
    shape["packed"] = "document_ids" in train_batches[0]
    batches_file = work / "batches.pt"
    torch.save(train_batches[:steps], batches_file)
    res["real_tokens_per_step"] = statistics.median(qpacking.real_tokens(b) for b in train_batches[:steps])
    wanted = [tuple(r.split(":")) for r in os.environ.get("COLD_START_RUNS", "").split(",") if r] or ORDER
    if os.environ.get("COLD_START_PRIME", "1") != "0":
        res["primed"] = prime(work, device)
        _write(Path(out_json), res)
    need = NEEDS.get(shape["model"], NEEDS.get(shape_name, 120))
    for lib, cache in wanted:
        left = budget_s - (time.monotonic() - t0)
        if left < need * (1.5 if cache == "cold" else 1.0):
            res["skipped"].append(f"{lib}:{cache} ({left:.0f} s left)")
            _write(Path(out_json), res)
            continue
        if lib == "unsloth" and device != "cuda":
            res["skipped"].append(f"{lib}:{cache} (Unsloth runs on CUDA only)")
            continue
        dirs = _caches_for(lib, cache, work)
        print(f"[cold_start] {shape_name} {lib} {cache}: {left:.0f} s left", flush=True)
        try:
            if lib in OURS:
                rec = _run_ours(lib, shape, work, dirs, device, steps, left - 5)
            else:
                rec = _run_peer(lib, shape, work, dirs, batches_file, device, steps, left - 5)
        except Exception as exc:  # one failed run does not end the call
            rec = {"error": f"{type(exc).__name__}: {exc}"}
        row = _finish(rec, lib, cache, shape, steps)
        res["runs"].append(row)
        print(f"[cold_start]   to first step {row.get('time_to_first_step_s')} s, median step "
              f"{row.get('median_step_ms')} ms, wall_60 {row.get('wall_60_s')} s, peak {row.get('peak_mem_gib')} GiB, "
              f"compilations {row.get('compilations')}, breaks {row.get('graph_breaks')}"
              + (f", ERROR {row['error'][:300]}" if "error" in row else ""), flush=True)
        _write(Path(out_json), res)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    _write(Path(out_json), res)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child-ours"]:
        side, rest = argv[1], argv[2:]
        return child_ours(side, rest[1:] if rest[:1] == ["--"] else rest)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("shape", choices=sorted(SHAPES))
    r.add_argument("out_json")
    r.add_argument("budget_s", type=float)
    r.add_argument("--device", default="cuda")
    r.add_argument("--model", default=None, help="another model at the shape's batch (the CPU dry run: tiny)")
    r.add_argument("--steps", type=int, default=STEPS)
    m = sub.add_parser("merge")
    m.add_argument("out_json")
    m.add_argument("inputs", nargs="+")
    m.add_argument("--conditions", default=None, help="what else the machine ran during these calls")
    h = sub.add_parser("child-hf")
    h.add_argument("--model", required=True)
    h.add_argument("--batches", default=None, help="the parent's batches file (else built here)")
    for name, kind, default in (("--batch-size", int, 4), ("--seq-len", int, 128), ("--packing", str, "auto")):
        h.add_argument(name, type=kind, default=default)
    h.add_argument("--steps", type=int, required=True)
    h.add_argument("--device", default="cuda")
    h.add_argument("--out", required=True)
    pr = sub.add_parser("child-prime")
    pr.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run(args.shape, args.out_json, args.budget_s, args.device, args.model, args.steps)
    if args.cmd == "merge":
        return merge(args.out_json, args.inputs, args.conditions)
    if args.cmd == "child-prime":
        return child_prime(args.device)
    return child_hf(args)


if __name__ == "__main__":
    sys.exit(main())
