"""Run the peers: one in this process (:func:`run_peer`), or each in a fresh process (:func:`run_peers`).

Why it exists: :func:`run_peer` runs one peer in this process (the notebooks use it on a CPU);
:func:`run_peers` runs each in a fresh subprocess (one process per library: Unsloth and torchao
patch things, and each peer's peak memory must be its own), with the batches written once to a
``.pt`` file that every process reads, a time limit per peer, and the results file rewritten
after every peer so that a timeout loses only the peer that ran out. A peer that fails is a
run with an ``error`` string, never a missing row (the run dict is described in
:mod:`lab.peers.results`). ``python -m lab.peers --spec
SPEC.json --out RUN.json`` (:func:`_child_main`) is the child that :func:`run_peers` starts for
every peer but Unsloth, whose child is :mod:`lab.peers.unsloth`.
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

import torch

from lab.peers.common import _model_dir
from lab.peers.hf import _peer_hf
from lab.peers.ours import _peer_ours
from lab.peers.process import _run_spec_in_child, _write_json
from lab.peers.registry import OURS_VARIANTS, _variant_options, peer_names
from lab.peers.results import _one_line, error_run, pick_ours
from lab.peers.torchao import _peer_torchao
from lab.peers.trl import _peer_trl
from lab.peers.unsloth_launcher import _peer_unsloth
from qlora_nb_utils import env, models
from qlora_nb_utils.env import resolve_device_dtype as _resolve_device_dtype

__all__ = ["run_peer", "run_peers", "job_start", "job_peak_tflops"]


def job_start(out: str | Path, work_dir: str | Path | None, device: Any, dtype: Any, steps: int,
              warmup: int) -> tuple[Path, Path, torch.device, torch.dtype]:
    """What a peer job does first: check the warm-up, make the results and work folders, resolve device and dtype.

    Returns:
        ``(out, work, device, dtype)``; ``work`` is ``work_dir`` or ``<out's folder>/<out's stem>_work``.

    Raises:
        ValueError: ``warmup`` not in ``[0, steps)``.
    """
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup ({warmup}) must be >= 0 and smaller than steps ({steps})")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else out.parent / f"{out.stem}_work"
    work.mkdir(parents=True, exist_ok=True)
    dev, dt = _resolve_device_dtype(device, dtype)
    return out, work, dev, dt


def job_peak_tflops(device: torch.device, dtype: torch.dtype, peak_tflops: float | None) -> float:
    """``peak_tflops``, or this device's matmul rate measured now (MFU's denominator), its scratch freed."""
    if peak_tflops is not None:
        return peak_tflops
    from qlora_nb_utils.bench.flops import measure_matmul_tflops

    peak = measure_matmul_tflops(device, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peak


def run_peer(name: str, batches: list, *, model: str = "tiny", steps: int | None = None, warmup: int = 3,
             lr: float = 2e-4, seed: int = 0, lora_r: int = 16, lora_alpha: float = 32, device: Any = "auto",
             dtype: Any = "auto", grad_ckpt: bool = False, peak_tflops: float | None = None,
             variants: dict[str, dict] | None = None, progress: bool = False,
             extra: dict | None = None) -> dict[str, Any]:
    """Train one peer for ``steps`` steps on ``batches`` in this process and return its run dict.

    A failure inside the peer becomes a run with ``error`` (the exception's type and message),
    so a comparison always has one row per peer.

    Args:
        name: a peer of :data:`PEERS` or ``ours-<variant>``.
        batches: the micro-batches (dicts of CPU int64 tensors), cycled if fewer than ``steps``.
        model: a named model or a local checkpoint folder.
        steps: optimizer steps (default: ``len(batches)``).
        warmup: steps left out of the medians.
        lr: AdamW learning rate (constant).
        seed: seeds LoRA initialisation and training.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        device: ``auto``, ``cpu``, ``cuda``...
        dtype: ``auto`` (bf16 on SM80+, fp32 on a CPU) or a dtype name.
        grad_ckpt: gradient checkpointing for every peer (off: what the issue's targets use).
        peak_tflops: the device's measured matmul rate, for MFU (None: no MFU).
        variants: extra ``ours`` variants (name -> options).
        progress: progress bars.
        extra: more of the run's context for the peer (the packing benchmark's epoch check:
            ``epoch_batches``, ``parity_steps``; see :mod:`lab.peers.packed`).

    Returns:
        The run dict (see the module docstring).

    Raises:
        ValueError: unknown peer, bad options, ``warmup >= steps``.
    """
    peer_names([name], variants)
    steps = len(batches) if steps is None else steps
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup ({warmup}) must be >= 0 and smaller than steps ({steps})")
    opts = _variant_options(name, variants) if name.startswith("ours") and name != "ours-default-compile" else None
    b, s = (int(x) for x in batches[0]["input_ids"].shape)
    dev, dt = _resolve_device_dtype(device, dtype)
    ctx = {"name": name, "model": model, "steps": steps, "warmup": warmup, "lr": lr, "seed": seed,
           "lora_r": lora_r, "lora_alpha": lora_alpha, "device": str(dev), "dtype": str(dt).replace("torch.", ""),
           "grad_ckpt": grad_ckpt,
           "batch_size": b, "seq_len": s, "peak_tflops": peak_tflops, "progress": progress, **(extra or {})}
    ctx["flops_per_step"] = _flops_per_step(model, b, s, lora_r)
    torch.manual_seed(seed)
    try:
        if name in ("unsloth", "unsloth-packed"):
            return _peer_unsloth(ctx, batches)
        if name in ("hf-eager", "ours-default-compile", "hf-eager-packed"):
            return _peer_hf(ctx, batches, compiled=name == "ours-default-compile")
        if name in ("trl-sft-compile", "trl-sft-optimize", "trl-sft-packed"):
            return _peer_trl(ctx, batches)
        if name == "torchao-nf4":
            return _peer_torchao(ctx, batches)
        return _peer_ours(ctx, batches, *opts)
    except Exception as exc:  # the comparison records it; the traceback goes to the log
        traceback.print_exc()
        return error_run(name, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                         batch_size=b, seq_len=s)
    finally:
        import gc

        torch.compiler.reset()
        gc.collect()  # the peer's model goes now, not at some later collection: peaks stay per peer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _flops_per_step(model: str, batch_size: int, seq_len: int, lora_r: int) -> int | None:
    from transformers import AutoConfig

    from qlora_nb_utils.bench.flops import train_step_flops

    try:
        config = AutoConfig.from_pretrained(_model_dir(model))
    except (ValueError, OSError):
        return None
    return train_step_flops(config, batch_size, seq_len, lora_r=lora_r).total


def run_peers(model_name: str, peers: Sequence[str], batch_size: int, seq_len: int, steps: int, warmup: int,
              out: str | Path, *, lr: float = 2e-4, seed: int = 0, lora_r: int = 16, lora_alpha: float = 32,
              device: Any = "auto", dtype: Any = "auto", grad_ckpt: bool = False,
              variants: dict[str, dict] | None = None, timeout_s: float | dict[str, float] = 600,
              budget_s: float | None = None, data: str | None = None, peak_tflops: float | None = None,
              work_dir: str | Path | None = None, command: str | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run each peer in a fresh process on the same batches; append the runs to ``out``.

    ``out`` is rewritten after every peer (a timeout or a crash loses only that peer). An
    existing ``out`` with the same model keeps its runs, so two shapes can share one file.

    Args:
        model_name: a named model (built into the cache first) or a local checkpoint folder.
        peers: names from :data:`PEERS` or ``ours-<variant>`` (a list or a comma-separated string).
        batch_size: rows per batch.
        seq_len: fixed padded length.
        steps: optimizer steps per peer.
        warmup: steps left out of the medians.
        out: the results JSON.
        lr: AdamW learning rate.
        seed: data order, LoRA initialisation, training.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        device: run device (``auto``: CUDA when there).
        dtype: ``auto`` or a dtype name.
        grad_ckpt: gradient checkpointing for every peer.
        variants: extra ``ours`` variants (name -> options).
        timeout_s: seconds per peer (a number, or peer name -> seconds with ``"default"``).
        budget_s: seconds for this whole call; a peer that would start with less than 30 s
            left is recorded as skipped.
        data: a JSONL data file (default: the shipped KJV set).
        peak_tflops: the device's matmul rate; measured here when None.
        work_dir: where the batches file and per-peer logs go (default: next to ``out``).
        command: the command line to record.
        log: progress messages.

    Returns:
        The results dict as written.

    Raises:
        ValueError: unknown peers or bad options (before anything runs).
    """
    from transformers import AutoConfig

    from qlora_nb_utils.bench import main_job as bench
    from qlora_nb_utils.bench.flops import train_step_flops

    peers = peer_names(peers, variants)
    for p in peers:
        if p.startswith("ours") and p != "ours-default-compile":
            _variant_options(p, variants)
    t_start = time.monotonic()
    out, work, dev, dt = job_start(out, work_dir, device, dtype, steps, warmup)
    model_dir = _model_dir(model_name)
    tok = models.load_tokenizer(model_name)
    batches, pad = bench.make_bench_batches(tok, batch_size=batch_size, seq_len=seq_len, steps=steps,
                                            padding="fixed", data=data, seed=seed)
    batches_path = work / f"batches_{batch_size}x{seq_len}.pt"
    torch.save(batches, batches_path)
    peak_tflops = job_peak_tflops(dev, dt, peak_tflops)
    flops = train_step_flops(AutoConfig.from_pretrained(model_dir), batch_size, seq_len, lora_r=lora_r)
    results = json.loads(out.read_text()) if out.is_file() else {}
    if results.get("model") not in (None, model_name):
        raise ValueError(f"{out} holds runs of {results['model']!r}, not {model_name!r}: use another file")
    results.update({
        "device": env.device_info(dev), "versions": env.versions(),
        "command": command or (shlex.join(sys.argv) if sys.argv and sys.argv[0] else "run_peers()"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "model": model_name,
        "dtype": str(dt).replace("torch.", ""), "peak_tflops": peak_tflops,
        "peak_tflops_how": f"median of 3 rounds of n x n matmuls in {str(dt).replace('torch.', '')} "
                           "(qlora_nb_utils.bench.flops.measure_matmul_tflops)",
        "options": {"lr": lr, "seed": seed, "lora_r": lora_r, "lora_alpha": lora_alpha, "grad_ckpt": grad_ckpt,
                    "padding": "fixed", "variants": {**OURS_VARIANTS, **(variants or {})}},
    })
    # a file may gather several invocations (shapes, peers a budget left out): keep each one
    results.setdefault("calls", []).append({k: results[k] for k in ("command", "date")} | {
        "device": results["device"].get("name"), "shape": f"{batch_size}x{seq_len}", "peers": list(peers)})
    results.setdefault("shapes", {})[f"{batch_size}x{seq_len}"] = {
        "flops_per_step": flops.to_dict(), "padding": pad, "steps": steps, "warmup": warmup}
    runs = [r for r in results.get("runs", []) if (r["batch_size"], r["seq_len"]) != (batch_size, seq_len)
            or r["name"] not in peers]
    results["runs"] = runs
    ctx = {"model": model_name, "steps": steps, "warmup": warmup, "lr": lr, "seed": seed, "lora_r": lora_r,
           "lora_alpha": lora_alpha, "device": str(dev), "dtype": str(dt).replace("torch.", ""),
           "grad_ckpt": grad_ckpt, "peak_tflops": peak_tflops, "variants": variants or {},
           "batch_size": batch_size, "seq_len": seq_len, "flops_per_step": flops.total}
    shape = {"batch_size": batch_size, "seq_len": seq_len}
    for peer in peers:
        limit = timeout_s.get(peer, timeout_s.get("default", 600)) if isinstance(timeout_s, dict) else timeout_s
        if budget_s is not None:
            left = budget_s - (time.monotonic() - t_start)
            if left < 30:
                runs.append(error_run(peer, f"skipped: {left:.0f} s of the {budget_s:.0f} s budget left", **shape))
                _write_json(out, results)
                continue
            limit = min(limit, left)
        log(f"==> {peer} at {batch_size} x {seq_len} (limit {limit:.0f} s)")
        t0 = time.monotonic()
        run = _run_peer_process(peer, ctx, batches, batches_path, limit, work)
        run["wall_s"] = time.monotonic() - t0
        run["invocation_date"] = results["date"]  # which of results["calls"] this row comes from
        runs.append(run)
        log(f"    {peer}: " + _one_line(run))
        pick_ours(runs)
        _write_json(out, results)
    return results


def _run_peer_process(peer: str, ctx: dict, batches: list, batches_path: Path, limit: float, work: Path) -> dict:
    shape = {"batch_size": ctx["batch_size"], "seq_len": ctx["seq_len"]}
    if peer in ("unsloth", "unsloth-packed"):
        return _peer_unsloth({**ctx, "name": peer}, batches, str(batches_path), limit)
    return _run_spec_in_child(lambda spec, out: ["lab.peers", "--spec", str(spec), "--out", str(out)],
                              {**ctx, "name": peer, "batches": str(batches_path)},
                              tag=f"{peer}_{ctx['batch_size']}x{ctx['seq_len']}", env_peer=peer, work=work,
                              limit=limit, name=peer, shape=shape)


def _child_main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.peers --spec SPEC.json --out RUN.json``: one peer, one process."""
    parser = argparse.ArgumentParser(description=_child_main.__doc__)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    batches = torch.load(spec["batches"])
    run = run_peer(spec["name"], batches, model=spec["model"], steps=spec["steps"], warmup=spec["warmup"],
                   lr=spec["lr"], seed=spec["seed"], lora_r=spec["lora_r"], lora_alpha=spec["lora_alpha"],
                   device=spec["device"], dtype=spec["dtype"], grad_ckpt=spec["grad_ckpt"],
                   peak_tflops=spec["peak_tflops"], variants=spec.get("variants") or None,
                   extra=spec.get("extra"))
    _write_json(Path(args.out), run)
    return 0
