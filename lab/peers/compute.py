"""Ours against Unsloth where the GPU is busy: issue 20's shapes, ``results/peers_compute_<gpu>.json``.

Why it exists: our lead over Unsloth was measured where the step is launch-bound (small
batches, where CUDA graphs remove the overhead). Issue 20 asks the same question at the shapes
where the GPU is busy (1B at 16 x 1024, 8B at 2 and 8 x 1024) and with checkpointing, and names
one file for the answer. This job writes it: each run is one library at one shape with
checkpointing on or off, in a process of its own, on the same batches:

* ``unsloth``: :mod:`lab.peers.unsloth`, started by
  :func:`~lab.peers.unsloth_launcher._peer_unsloth` as in ``run_peers``;
  checkpointing is its own (``use_gradient_checkpointing="unsloth"``: every layer, the saved
  layer inputs offloaded to CPU memory) where the setting has it on, off elsewhere (as
  ``run_peers`` runs it).
* ``ours``: the public :func:`qlora_nb_utils.optimize` (the product path, no benchmark-only
  recipe), with checkpointing matching Unsloth's: off, or every layer (``grad_ckpt=True``).
  The scope is per model (:data:`SCOPES`): ``whole`` at 1B, where CUDA graphs carry the
  launch-bound step; ``regional`` at 8B, where one layer's graph compiles in ~15 s instead of
  the whole graph's 150-200 s (both measured on an H100, ``lab/results/memory/offload_h100.json`` and
  issue 20) and the step is compute-bound, so the call fits a GPU lease. ``scope`` is recorded.
* variants (``--variant NAME='{"recompute": false}'``, repeatable): ``ours`` with more
  optimize() keyword arguments, e.g. ``ours-no-recompute`` (the partitioner's default of saving
  what the backward's matmuls read) for the same-call A/B of ``optimize(recompute=...)``.
* ``ours-held``: at a checkpointing-on setting, ``optimize(max_memory_gib=<Unsloth's peak in
  the same call>)``: optimize() picks checkpointing and offload by itself to meet it.

``vs_unsloth`` pairs each ours run with Unsloth's at the same setting: Unsloth's step time over
ours (``speedup``), our peak over Unsloth's (``mem_ratio``), and whether issue 20's target
(at least 1.1x at no more memory) is met. Each run also carries ``mfu``
(:mod:`qlora_nb_utils.bench.flops`, one FLOP count per shape for both libraries) and
``compile_s`` (first step minus the median step; Unsloth's first step compiles its own
kernels). The results file is rewritten after every run, so a timeout loses only that run; a
run that fails is a row with ``error``.

    python -m lab.peers.compute run --out lab/results/compute/peers_compute_h100.json \
        [--settings 8b-8x1024,8b-8x1024-ckpt] [--budget-s 540]   (lab/gpu/peers/gpu_peers_compute.sh)
    python -m lab.peers.compute child SPEC.json RUN.json   (one ours run)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["SETTINGS", "SCOPES", "TARGET_SPEEDUP", "compare", "run_compute", "run_ours"]

#: Issue 20's table: name -> model, batch, length, checkpointing (both libraries), the held row.
SETTINGS: dict[str, dict[str, Any]] = {
    "1b-4x512": {"model": "llama-3.2-1b-shape", "batch_size": 4, "seq_len": 512, "grad_ckpt": False},
    "1b-16x1024": {"model": "llama-3.2-1b-shape", "batch_size": 16, "seq_len": 1024, "grad_ckpt": False},
    "8b-2x1024": {"model": "llama-3.1-8b-shape", "batch_size": 2, "seq_len": 1024, "grad_ckpt": False},
    "8b-8x1024": {"model": "llama-3.1-8b-shape", "batch_size": 8, "seq_len": 1024, "grad_ckpt": False},
    "8b-8x1024-ckpt": {"model": "llama-3.1-8b-shape", "batch_size": 8, "seq_len": 1024, "grad_ckpt": True,
                       "held": True},
}
#: optimize()'s scope per model (the module docstring says why); others: "whole".
SCOPES = {"llama-3.2-1b-shape": "whole", "llama-3.1-8b-shape": "regional"}
#: Issue 20's target: at least this speed-up over Unsloth, at no more than its peak memory.
TARGET_SPEEDUP = 1.1


def _setting(spec: str | dict, name: str | None = None) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        if spec not in SETTINGS:
            raise ValueError(f"unknown setting {spec!r}; valid: {list(SETTINGS)}")
        return spec, dict(SETTINGS[spec])
    missing = {"model", "batch_size", "seq_len", "grad_ckpt"} - set(spec)
    if missing:
        raise ValueError(f"a setting needs model, batch_size, seq_len, grad_ckpt; {spec} lacks {sorted(missing)}")
    return name or spec.get("name") or "{model}-{batch_size}x{seq_len}{ck}".format(
        ck="-ckpt" if spec["grad_ckpt"] else "", **spec), dict(spec)


def _ok(run: dict | None) -> bool:
    return bool(run) and "error" not in run and bool(run.get("median_step_ms")) and bool(run.get("peak_mem_gib"))


def compare(runs: Sequence[dict], target: float = TARGET_SPEEDUP) -> list[dict[str, Any]]:
    """Each ours run against Unsloth's at the same setting.

    Args:
        runs: run dicts with ``setting`` and ``library``.
        target: the speed-up to reach at no more than Unsloth's peak memory.

    Returns:
        One dict per ours run whose setting has an Unsloth run: the names, shape, ``speedup``
        (Unsloth's median step over ours), ``mem_ratio`` (our peak over Unsloth's),
        ``target_met``; with ``error`` (and None for the ratios) when either run failed.
    """
    out = []
    for ours in (r for r in runs if r.get("library") == "ours"):
        uns = next((r for r in runs if r.get("library") == "unsloth" and r.get("setting") == ours.get("setting")),
                   None)
        if uns is None:
            continue
        row = {"setting": ours["setting"], "ours": ours["name"], "unsloth": uns["name"],
               **{k: ours.get(k) for k in ("model", "batch_size", "seq_len", "grad_ckpt")},
               "target_speedup": target, "speedup": None, "mem_ratio": None, "target_met": False}
        if not (_ok(ours) and _ok(uns)):
            row["error"] = "; ".join(f"{r['name']}: {r.get('error', 'no step time or peak')}"
                                     for r in (ours, uns) if not _ok(r))
        else:
            row["speedup"] = uns["median_step_ms"] / ours["median_step_ms"]
            row["mem_ratio"] = ours["peak_mem_gib"] / uns["peak_mem_gib"]
            row["faster"] = row["speedup"] >= target
            row["within_memory"] = row["mem_ratio"] <= 1.0
            row["target_met"] = row["faster"] and row["within_memory"]
        out.append(row)
    return out


# ---------------------------------------------------------------- ours: one run, in this process


def run_ours(spec: dict[str, Any], batches: list) -> dict[str, Any]:
    """Load the model the HF way, ``optimize(model, batches=..., **spec["optimize"])``, train, record.

    Args:
        spec: ``name``, ``model``, ``steps``, ``warmup``, ``lr``, ``seed``, ``lora_r``,
            ``lora_alpha``, ``device``, ``dtype``, ``optimize`` (optimize()'s keyword arguments),
            and for MFU ``flops_per_step`` and ``peak_tflops``.
        batches: the micro-batches.

    Returns:
        The run dict (:mod:`~lab.peers.results`) with ``optimize`` (its choices),
        ``description``, ``compilations``; or an error run.
    """
    from lab.peers.common import _train_cfg
    from lab.peers.results import _from_history, error_run
    from qlora_nb_utils import models
    from qlora_nb_utils.compile.fast_path import optimize
    from qlora_nb_utils.training.loop import train

    b, s = (int(x) for x in batches[0]["input_ids"].shape)
    kwargs = dict(spec.get("optimize") or {})
    try:
        model, _ = models.load_model(
            spec["model"], quant="nf4", lora=True, lora_r=spec["lora_r"], lora_alpha=spec["lora_alpha"],
            dtype=spec["dtype"], device=spec["device"], prepare_kbit=True,
            gradient_checkpointing=kwargs.get("grad_ckpt") is True, seed=spec["seed"])
        opt = optimize(model, batches=batches, **kwargs)
        try:
            hist = train(model, batches, _train_cfg(spec), forward=opt.forward, label=spec["name"])
        finally:
            opt.undo()
    except Exception as exc:  # recorded: the table keeps one row per run
        traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return error_run(spec["name"], f"{type(exc).__name__}: {first}", batch_size=b, seq_len=s)
    stats = opt.counter.to_dict()
    run = _from_history(spec["name"], hist, spec, f"{opt.description}; {stats.get('compilations')} compilation(s)",
                        kwargs)
    run["optimize"] = {k: str(v) for k, v in opt.choices.items()}
    run["description"] = opt.description
    run["compilations"] = stats.get("compilations")
    run["dynamo_compile_s"] = stats.get("compile_s")
    return run


def _child(spec_path: str, out_path: str) -> int:
    import torch

    from lab.peers.process import _write_json

    spec = json.loads(Path(spec_path).read_text())
    run = run_ours(spec, torch.load(spec["batches"]))
    _write_json(Path(out_path), run)
    return 0


# ---------------------------------------------------------------- the job


def _unsloth_run(ctx: dict, batches_path: Path, limit: float) -> dict[str, Any]:
    from lab.peers.unsloth_launcher import _peer_unsloth

    run = _peer_unsloth({**ctx, "name": "unsloth"}, None, str(batches_path), limit)
    if "error" not in run and run.get("compile_s") is None and run.get("step_ms"):
        run["compile_s"] = max(0.0, (run["step_ms"][0] - run["median_step_ms"]) / 1e3)
        run["compile_s_how"] = "first step minus the median step (Unsloth compiles some of its kernels there)"
    return run


def _ours_run(ctx: dict, kwargs: dict, batches_path: Path, limit: float, work: Path) -> dict[str, Any]:
    from lab.peers.process import _run_spec_in_child

    return _run_spec_in_child(lambda spec, out: ["lab.peers.compute", "child", str(spec), str(out)],
                              {**ctx, "batches": str(batches_path), "optimize": kwargs},
                              tag=f"{ctx['setting']}_{ctx['name']}", env_peer="ours", work=work, limit=limit,
                              name=ctx["name"], shape={"batch_size": ctx["batch_size"], "seq_len": ctx["seq_len"]})


def _plan(key: str, st: dict, scope: str, ours_options: dict,
          variants: dict[str, dict] | None = None) -> list[tuple[str, str, dict | None]]:
    """(name, library, optimize kwargs) of a setting's runs, in order: Unsloth first (the held row needs its peak)."""
    ours = {"grad_ckpt": bool(st["grad_ckpt"]), "scope": scope, **ours_options}
    plan: list[tuple[str, str, dict | None]] = [("unsloth", "unsloth", None), ("ours", "ours", ours)]
    for name, extra in (variants or {}).items():
        plan.append((name, "ours", {**ours, **extra}))
    if st.get("held"):
        plan.append(("ours-held", "ours", {"max_memory_gib": None, "scope": scope, **ours_options}))
    return plan


def run_compute(out: str | Path, settings: Sequence[str | dict] = tuple(SETTINGS), *, steps: int = 12,
                warmup: int = 4, lr: float = 2e-4, seed: int = 0, lora_r: int = 16, lora_alpha: float = 32,
                device: Any = "auto", dtype: Any = "auto", scopes: dict[str, str] | None = None,
                ours_options: dict | None = None, variants: dict[str, dict] | None = None, timeout_s: float = 300, budget_s: float | None = None,
                peak_tflops: float | None = None, work_dir: str | Path | None = None, command: str | None = None,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run Unsloth and ours (and ours held to Unsloth's peak) at each setting; write ``out``.

    An existing ``out`` keeps the runs of the settings not run now (two GPU calls fill one file).

    Args:
        out: the results JSON (``results/peers_compute_<gpu>.json``).
        settings: names of :data:`SETTINGS` or dicts (``model``, ``batch_size``, ``seq_len``,
            ``grad_ckpt``, optional ``held`` and ``name``).
        steps: optimizer steps per run (the batches are this many distinct ones).
        warmup: steps left out of the medians.
        lr: AdamW learning rate.
        seed: data order, LoRA initialisation, training.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        device: ``auto`` (CUDA when there) or a device.
        dtype: ``auto`` or a dtype name.
        scopes: optimize()'s scope per model (default :data:`SCOPES`, else ``whole``).
        ours_options: more optimize() keyword arguments for every ours run.
        variants: more ours runs at every setting, by name: their optimize() keyword arguments
            on top of ``ours``'s.
        timeout_s: seconds per run's process.
        budget_s: seconds for the whole call; a run that would start with less than 30 s left
            is recorded as skipped.
        peak_tflops: the matmul rate for MFU (None: measured here).
        work_dir: batches, specs and logs (default: ``<out stem>_work`` beside ``out``).
        command: the command line to record.
        log: progress messages.

    Returns:
        The results dict as written.

    Raises:
        ValueError: an unknown setting, or ``warmup >= steps``.
    """
    import torch
    from transformers import AutoConfig

    from lab.peers.common import _model_dir
    from lab.peers.process import _write_json
    from lab.peers.results import _one_line, error_run
    from lab.peers.runner import job_peak_tflops, job_start
    from qlora_nb_utils import env, models
    from qlora_nb_utils.bench.flops import train_step_flops
    from qlora_nb_utils.bench.main_job import make_bench_batches

    chosen = [_setting(s) for s in settings]
    t_start = time.monotonic()
    out, work, dev, dt = job_start(out, work_dir, device, dtype, steps, warmup)
    dt_name = str(dt).replace("torch.", "")
    scopes = {**SCOPES, **(scopes or {})}
    peak_tflops = job_peak_tflops(dev, dt, peak_tflops)
    res = json.loads(out.read_text()) if out.is_file() else {}
    res.update({
        "kind": "peers_compute", "what": "issue 20: ours (optimize()) against Unsloth at compute-bound shapes, "
        "checkpointing off and on, one process per run, the same batches (lab.peers.compute)",
        "device": env.device_info(dev), "versions": env.versions(),
        "command": command or (shlex.join(sys.argv) if sys.argv and sys.argv[0] else "run_compute()"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "dtype": dt_name,
        "peak_tflops": peak_tflops, "peak_tflops_how": f"median of 3 rounds of n x n matmuls in {dt_name} "
        "(qlora_nb_utils.bench.flops.measure_matmul_tflops)", "target_speedup": TARGET_SPEEDUP,
    })
    res.setdefault("calls", []).append({k: res[k] for k in ("command", "date")} | {
        "device": res["device"].get("name"), "settings": [k for k, _ in chosen], "peak_tflops": peak_tflops})
    res.setdefault("settings", {})
    runs = [r for r in res.get("runs", []) if r.get("setting") not in {k for k, _ in chosen}]
    res["runs"] = runs

    def save() -> None:
        res["vs_unsloth"] = compare(runs)
        _write_json(out, res)

    for key, st in chosen:
        model, b, s = st["model"], int(st["batch_size"]), int(st["seq_len"])
        model_dir = _model_dir(model)  # a named model is built into the cache on first use (on the GPU)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # what building it left cached here is not the children's
        batches, pad = make_bench_batches(models.load_tokenizer(model), batch_size=b, seq_len=s, steps=steps,
                                          padding="fixed", seed=seed)
        batches_path = work / f"batches_{key}.pt"
        torch.save(batches, batches_path)
        flops = train_step_flops(AutoConfig.from_pretrained(model_dir), b, s, lora_r=lora_r)
        scope = scopes.get(model, "whole")
        res["settings"][key] = {**st, "scope": scope, "steps": steps, "warmup": warmup, "padding": pad,
                                "flops_per_step": flops.total, "invocation_date": res["date"]}
        ctx = {"setting": key, "model": model, "batch_size": b, "seq_len": s, "grad_ckpt": bool(st["grad_ckpt"]),
               "steps": steps, "warmup": warmup, "lr": lr, "seed": seed, "lora_r": lora_r, "lora_alpha": lora_alpha,
               "device": str(dev), "dtype": dt_name, "peak_tflops": peak_tflops, "flops_per_step": flops.total}
        for name, library, kwargs in _plan(key, st, scope, dict(ours_options or {}), variants):
            left = None if budget_s is None else budget_s - (time.monotonic() - t_start)
            uns = next((r for r in runs if r.get("setting") == key and r.get("library") == "unsloth"), None)
            if left is not None and left < 30:
                run = error_run(name, f"skipped: {left:.0f} s of the {budget_s:.0f} s budget left", batch_size=b,
                                seq_len=s)
            elif kwargs is not None and "max_memory_gib" in kwargs and not _ok(uns):
                run = error_run(name, "no Unsloth peak to hold to: its run failed", batch_size=b, seq_len=s)
            else:
                limit = timeout_s if left is None else min(timeout_s, left)
                log(f"==> {key}: {name} (limit {limit:.0f} s)")
                t0 = time.monotonic()
                if library == "unsloth":
                    run = _unsloth_run({**ctx, "name": name}, batches_path, limit)
                else:
                    if "max_memory_gib" in kwargs:
                        kwargs = {**kwargs, "max_memory_gib": float(uns["peak_mem_gib"])}
                    run = _ours_run({**ctx, "name": name}, kwargs, batches_path, limit, work)
                run["wall_s"] = time.monotonic() - t0
            run.update({"name": name, "library": library, "setting": key, "model": model, "batch_size": b,
                        "seq_len": s, "grad_ckpt": bool(st["grad_ckpt"]), "invocation_date": res["date"]})
            if library == "ours":
                run["scope"] = (run.get("optimize") or {}).get("scope", (kwargs or {}).get("scope"))
                if kwargs and kwargs.get("max_memory_gib"):
                    run["max_memory_gib"] = kwargs["max_memory_gib"]
            for field in ("median_step_ms", "peak_mem_gib", "mfu", "compile_s"):
                run.setdefault(field, None)
            runs.append(run)
            log(f"    {key} {name}: " + _one_line(run))
            save()
    save()
    return res


def _variants(specs: Sequence[str]) -> dict[str, dict]:
    """``NAME=JSON`` strings as {name: optimize() kwargs}; a clear error for a malformed one."""
    out = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        try:
            kwargs = json.loads(text) if sep else None
        except json.JSONDecodeError:
            kwargs = None
        if not name.startswith("ours-") or not isinstance(kwargs, dict):
            raise ValueError(f"--variant must be ours-NAME='{{json object}}', got {spec!r}")
        out[name] = kwargs
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``run`` (the job) or ``child`` (one ours run); see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m lab.peers.compute", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--warmup", type=int, default=4)
    r.add_argument("--timeout-s", type=float, default=300)
    r.add_argument("--budget-s", type=float, default=None)
    r.add_argument("--command", default=None, help="the command line to record")
    r.add_argument("--work-dir", default=None, help="batches, specs, child logs (default: beside --out)")
    r.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="also an ours run with these optimize() arguments, e.g. ours-no-recompute='{\"recompute\": false}'")
    c = sub.add_parser("child")
    c.add_argument("spec")
    c.add_argument("out")
    args = p.parse_args(argv)
    if args.cmd == "child":
        return _child(args.spec, args.out)
    run_compute(args.out, [s for s in args.settings.split(",") if s], steps=args.steps, warmup=args.warmup,
                timeout_s=args.timeout_s, budget_s=args.budget_s, command=args.command, work_dir=args.work_dir,
                variants=_variants(args.variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
