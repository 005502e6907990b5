"""Cold-start cost of compiled QLoRA training, and the ways to cut it, each in a fresh process.

Why it exists: the first compiled step pays for tracing, AOTAutograd and Inductor's codegen
(and its autotuning, where asked: ``optimize(autotune=True)``); a Colab user pays it again after
every reconnect. Three levers, measured here:

* **Regional compilation**: compile one decoder layer's code (``scope="regional"`` in
  :func:`qlora_nb_utils.optimize`); the layers share it, so the cost is about one layer's
  instead of the whole stack's.
* **Inductor's on-disk caches** (``TORCHINDUCTOR_CACHE_DIR``: FX graph cache, AOTAutograd
  cache, compiled kernels): a second process on the same machine reuses them.
* **Cache artifacts** (``torch.compiler.save_cache_artifacts()`` ->
  ``load_cache_artifacts(bytes)``): the same caches as one portable blob, so a new machine (a
  reconnected Colab runtime, with an empty cache directory) starts warm. The package's own
  artifact folder (``optimize(compile_cache=...)``) is off in a measured process: it is shared
  between processes, so a "cold" case would load what the case before it saved.
* **AOTAutograd's cache for the recipe's graphs** (``optimize(warm_cache=...)``): without it the
  AOTAutograd cache refuses every graph holding an autograd Function, and a warm process traces
  and partitions again. ``cache_counters`` (AOTAutograd's and Inductor's hit, miss and bypass
  counts after the run) shows which caches a process used.

An honest cold start needs a new process (Dynamo and Inductor keep in-memory caches), so
:func:`measure` runs ``python -m qlora_nb_utils.bench.compile_time`` with its own cache folder and
reads back the JSON it writes. The process trains through :func:`qlora_nb_utils.optimize`, the
one fast path (its description and choices are in the result), so what is timed is what a user
gets. What is timed: ``first_step_s`` (the first training step,
compile included), the steady ``median_step_ms``, ``compile_s`` (first step minus the steady
step), and where the rest of a start goes: ``import_s`` (torch, transformers, peft,
bitsandbytes and the package, each in ``imports``), ``load_s`` (``from_pretrained`` with NF4
quantization, LoRA, the batches; ``load_parts_s`` splits it), ``optimize_s`` and ``time_to_first_step_s`` (from the parent
starting the process to the end of the first step), and the process's whole wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .._paths import pythonpath_with_package

__all__ = ["measure", "load_case", "child_main", "WARM_CACHE", "IMPORTS"]

#: What ``measure(warm_cache=...)`` passes on to ``optimize()``.
WARM_CACHE = ("auto", True, False)
#: The libraries a measured process imports first, each timed (``imports`` in its result).
IMPORTS = ("torch", "transformers", "peft", "bitsandbytes")


def measure(*, model: str = "tiny", scope: str = "whole", cache_dir: str | Path, device: str = "cpu",
            dtype: str = "float32", batch_size: int = 2, seq_len: int = 128, steps: int = 3,
            save_artifacts: str | Path | None = None, load_artifacts: str | Path | None = None,
            warm_cache: bool | str = "auto", timeout_s: float = 900,
            profile_to: str | Path | None = None) -> dict[str, Any]:
    """Train ``steps`` compiled QLoRA steps in a new process and report the compile cost.

    Args:
        model: a named model or checkpoint folder.
        scope: ``"whole"`` or ``"regional"``, passed to :func:`qlora_nb_utils.optimize`.
        cache_dir: the process's ``TORCHINDUCTOR_CACHE_DIR`` (a fresh folder = a cold cache).
        device: device of the run.
        dtype: compute dtype.
        batch_size: rows per batch.
        seq_len: fixed padded length.
        steps: steps to train (>= 2: one compiling, the rest steady).
        save_artifacts: write ``torch.compiler.save_cache_artifacts()`` here after the run.
        load_artifacts: ``torch.compiler.load_cache_artifacts`` this file before compiling.
        warm_cache: :func:`qlora_nb_utils.optimize`'s ``warm_cache`` (``"auto"``, True or False).
        timeout_s: limit for the process.
        profile_to: run the process under ``cProfile``, its stats written here (Python-heavy
            parts run slower then: read its times as shares).

    Returns:
        The child's JSON plus ``process_s`` (the whole process, imports included). The child's
        JSON has the timings, ``compilations`` and ``recompile_reasons``, the ``losses``, and
        ``optimize``: ``{"description": ..., "choices": {name: str(value)}}`` of the run.

    Raises:
        ValueError: a bad ``scope``, ``warm_cache`` or ``steps`` < 2.
        RuntimeError: the process failed (its output's tail is in the message).
    """
    from ..compile.options import OptimizeOptions

    OptimizeOptions(scope=scope, warm_cache=warm_cache)  # optimize()'s own checks, before a process starts
    if scope == "auto":
        raise ValueError("scope must be 'whole' or 'regional' here: a measurement names what it compiles")
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (one compiling step, then steady ones), got {steps}")
    out = Path(cache_dir) / "result.json"
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    profiler = ["-m", "cProfile", "-o", str(profile_to)] if profile_to else []
    cmd = [sys.executable, *profiler, "-m", "qlora_nb_utils.bench.compile_time", "--model", model, "--scope", scope,
           "--device", device, "--dtype", dtype, "--batch-size", str(batch_size), "--seq-len", str(seq_len),
           "--steps", str(steps), "--out", str(out), "--warm-cache", str(warm_cache)]
    if save_artifacts:
        cmd += ["--save-artifacts", str(save_artifacts)]
    if load_artifacts:
        cmd += ["--load-artifacts", str(load_artifacts)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(cache_dir) / "inductor"),
           "TRITON_CACHE_DIR": str(Path(cache_dir) / "triton")}
    env["PYTHONPATH"] = pythonpath_with_package(env.get("PYTHONPATH"))
    cmd += ["--spawned-at", repr(time.time())]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"compile-time process failed (exit {proc.returncode}): {' | '.join(tail)}")
    return {**json.loads(out.read_text()), "process_s": wall}


def load_case(*, model: str = "tiny", device: str = "cpu", dtype: str = "float32", batch_size: int = 2,
              seq_len: int = 128, steps: int = 3, timings: dict | None = None) -> tuple[Any, list[dict]]:
    """The model and batches every measured process trains: the notebook's in-process look uses it too.

    Args:
        model: a named model or checkpoint folder (NF4 base, LoRA, no kbit preparation).
        device: device of the run.
        dtype: compute dtype.
        batch_size: rows per batch.
        seq_len: fixed padded length.
        steps: how many batches.
        timings: filled with ``model_s`` (tokenizer, ``from_pretrained``, LoRA) and ``batches_s``.

    Returns:
        ``(model, batches)``.
    """
    from .. import models
    from . import main_job as bench

    t0 = time.perf_counter()
    loaded, tok = models.load_model(model, quant="nf4", dtype=dtype, device=device)
    t1 = time.perf_counter()
    batches, _ = bench.make_bench_batches(tok, batch_size=batch_size, seq_len=seq_len, steps=steps)
    if timings is not None:
        timings.update(model_s=round(t1 - t0, 3), batches_s=round(time.perf_counter() - t1, 3))
    return loaded, batches


def _import_timed() -> dict[str, float]:
    """Import :data:`IMPORTS`, then the package's training path: seconds each, in that order."""
    import importlib

    took = {}
    for name in (*IMPORTS, "qlora_nb_utils"):
        t0 = time.perf_counter()
        if name == "qlora_nb_utils":  # what the run below uses: the fast path, the loop, the models
            from ..compile import fast_path  # noqa: F401
            from ..models import load  # noqa: F401
            from ..training import loop  # noqa: F401
        else:
            importlib.import_module(name)
        took[name] = round(time.perf_counter() - t0, 3)
    return took


def _cache_counters() -> dict[str, dict[str, int]]:
    """AOTAutograd's and Inductor's cache counters so far (hits, misses, bypasses, saves)."""
    from torch._dynamo.utils import counters

    return {group: {k: int(v) for k, v in counters[group].items() if "cache" in k}
            for group in ("aot_autograd", "inductor")}


def _warm_cache_arg(text: str) -> bool | str:
    """``--warm-cache auto|True|False`` back to what ``optimize(warm_cache=...)`` takes."""
    try:
        return {"auto": "auto", "True": True, "False": False}[text]
    except KeyError:
        raise argparse.ArgumentTypeError(f"--warm-cache must be auto, True or False, got {text!r}") from None


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import statistics

    t_main, t_main_perf = time.time(), time.perf_counter()
    imports = _import_timed()
    import torch

    from ..compile.fast_path import optimize
    from ..training.loop import TrainConfig, train

    loaded = 0
    if args.load_artifacts:
        t0 = time.perf_counter()
        info = torch.compiler.load_cache_artifacts(Path(args.load_artifacts).read_bytes())
        loaded = time.perf_counter() - t0
    t_load = time.perf_counter()
    load_parts: dict = {}
    model, batches = load_case(model=args.model, device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                               seq_len=args.seq_len, steps=args.steps, timings=load_parts)
    t_opt = time.perf_counter()
    # compile_cache=False: the package's own artifact folder is shared by every process, so a case
    # would start warm from another's artifacts; each case's caches are the ones measure() gives it
    opt = optimize(model, batches=batches, scope=args.scope, warm_cache=args.warm_cache, compile_cache=False)
    t_train = time.perf_counter()
    try:
        hist = train(model, batches, TrainConfig(steps=args.steps, progress=False), forward=opt.forward)
    finally:
        opt.undo()
    ms = list(hist["step_ms"])
    steady = statistics.median(ms[1:])
    result = {"scope": args.scope, "model": args.model, "device": args.device, "dtype": args.dtype,
              "first_step_s": ms[0] / 1e3, "median_step_ms": steady, "compile_s": (ms[0] - steady) / 1e3,
              "compilations": opt.counter.compilations, "recompile_reasons": opt.counter.recompile_reasons,
              "dynamo_compile_s": opt.counter.compile_s, "losses": [float(x) for x in hist["loss"]],
              "load_artifacts_s": loaded, "loaded_artifacts": bool(args.load_artifacts),
              "imports": imports, "import_s": round(sum(imports.values()), 3),
              "load_s": round(t_opt - t_load, 3), "load_parts_s": load_parts, "optimize_s": round(t_train - t_opt, 3),
              "cache_counters": _cache_counters(),
              "optimize": {"description": opt.description, "choices": {k: str(v) for k, v in opt.choices.items()}}}
    if args.spawned_at is not None:  # the parent's clock: Python's own start counts too
        result["spawn_to_main_s"] = round(t_main - args.spawned_at, 3)
        result["time_to_first_step_s"] = round(t_main - args.spawned_at + t_train - t_main_perf + ms[0] / 1e3, 3)
    if args.load_artifacts:
        result["artifacts_loaded"] = info is not None
    if args.save_artifacts:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise RuntimeError("torch.compiler.save_cache_artifacts() returned nothing to save")
        blob, _info = saved
        Path(args.save_artifacts).write_bytes(blob)
        result["artifacts_bytes"] = len(blob)
    return result


def child_main(argv: Sequence[str] | None = None) -> int:
    """``python -m qlora_nb_utils.bench.compile_time ...``: one measured cold (or warm) start."""
    p = argparse.ArgumentParser(description=child_main.__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--scope", choices=("whole", "regional"), default="whole")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-artifacts", default=None)
    p.add_argument("--load-artifacts", default=None)
    p.add_argument("--warm-cache", type=_warm_cache_arg, default="auto")
    p.add_argument("--spawned-at", type=float, default=None, help="the parent's time.time() at the spawn")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = _run(args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
