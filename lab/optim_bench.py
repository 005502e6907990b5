"""The optimizer step, eager against compiled: compilations, loss, and time of the step alone.

Why it exists: issue 3 asks for the optimizer step compiled too, and counted.
:class:`~qlora_nb_utils.compile.CompiledOptimizer` does the compiling, and the CPU tests
show that it matches AdamW and does not recompile when the LR schedule changes. Neither
says what it buys on a GPU. This module trains one (Q)LoRA model, compiled once, with each
of three AdamW steps. Every run starts from the same adapter, uses the same batches, and
keeps the same compiled forward:

* ``foreach``: ``torch.optim.AdamW`` as it comes (the multi-tensor kernels, eager).
* ``fused``: ``AdamW(fused=True)``, one CUDA kernel per step (``foreach`` on a CPU, where
  torch has no fused AdamW for every dtype).
* ``compiled``: :func:`~qlora_nb_utils.compile.compiled_optimizer`, the step through Inductor.

For each it records the compilations of the optimizer step over the run (the LR warm-up
changes the rate at every step), the loss curve against ``foreach``, and the whole training
step. It also times ``opt.step()`` alone: the same gradients are stepped ``repeats`` times
with CUDA events, after a warm-up, and the median is kept. The training step is mostly
forward and backward, so the optimizer's share shows only in the isolated timing.

Usage: ``python -m lab.optim_bench --model llama-3.2-1b-shape --out optim.json``
(defaults: the tiny model on the CPU, so it runs anywhere).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from qlora_nb_utils import env, models
from qlora_nb_utils.bench.matrix import _batches
from qlora_nb_utils.compile import compiled_optimizer, prepare_for_compile
from qlora_nb_utils.env import resolve_device_dtype
from qlora_nb_utils.training.device import sync
from qlora_nb_utils.training.loop import TrainConfig, load_trainable_state, summarize, train, trainable_state

__all__ = ["OPTIMIZERS", "compare_optimizers", "time_optimizer_step", "main"]

OPTIMIZERS = ("foreach", "fused", "compiled")


def _make_optimizer(kind: str, params: list[torch.nn.Parameter], lr: float, weight_decay: float, device: torch.device,
                    backend: str = "inductor"):
    if kind == "foreach":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
    if kind == "fused":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=device.type == "cuda",
                                 foreach=None if device.type == "cuda" else True)
    if kind == "compiled":
        # AdamW's own defaults (a tensor lr with an explicit foreach=True needs capturable=True)
        return compiled_optimizer(params, backend=backend, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {kind!r}; valid: {list(OPTIMIZERS)}")


def time_optimizer_step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], *, repeats: int = 50,
                        warmup: int = 5) -> dict[str, float]:
    """Median and spread of ``opt.step()`` alone, in ms, on gradients that stay fixed.

    The parameters move (it is a real step), so callers restore them afterwards. CUDA events
    time a GPU step; ``perf_counter`` a CPU one.

    Raises:
        ValueError: when a parameter has no gradient, or ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if any(p.grad is None for p in params):
        raise ValueError("every parameter needs a gradient before timing the step")
    device = params[0].device
    for _ in range(warmup):
        opt.step()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "repeats": repeats}


def compare_optimizers(
    model_name: str = "tiny",
    *,
    quant: str = "nf4",
    optimizers: tuple[str, ...] = OPTIMIZERS,
    steps: int = 30,
    batch_size: int = 4,
    max_len: int = 256,
    lengths: str = "fixed",
    scope: str = "regional",
    dtype: str = "auto",
    device: str = "auto",
    backend: str = "inductor",
    lr: float = 2e-4,
    warmup: int = 5,
    repeats: int = 50,
    seed: int = 0,
    command: str | None = None,
    log: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Train once per optimizer on one compiled model; return the results dict (see the module doc).

    Raises:
        ValueError: for an unknown optimizer name, or none given.
    """
    if not optimizers:
        raise ValueError("give at least one optimizer")
    bad = [o for o in optimizers if o not in OPTIMIZERS]
    if bad:
        raise ValueError(f"unknown optimizers {bad}; valid: {list(OPTIMIZERS)}")
    dev, torch_dtype = resolve_device_dtype(device, dtype)
    model, tok = models.load_model(model_name, quant=quant, lora=True, dtype=torch_dtype, device=dev, seed=seed)
    model.train()
    start = trainable_state(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = _batches(tok, lengths, batch_size, max_len, steps, seed)
    cfg = TrainConfig(steps=steps, lr=lr, seed=seed, progress=False)
    result: dict[str, Any] = {
        "device": env.device_info(dev), "versions": env.versions(), "command": command or shlex.join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "options": {"model": model_name, "quant": quant, "steps": steps, "batch_size": batch_size, "max_len": max_len,
                    "lengths": lengths, "scope": scope, "dtype": str(torch_dtype).replace("torch.", ""),
                    "backend": backend, "lr": lr, "warmup": warmup, "repeats": repeats, "seed": seed,
                    "trainable_params": sum(p.numel() for p in params), "trainable_tensors": len(params)},
        "runs": [],
    }
    prepared = prepare_for_compile(model, scope=scope, backend=backend, fullgraph=True)
    curves: dict[str, list[float]] = {}
    try:
        for kind in optimizers:
            log(f"==> optimizer {kind}")
            load_trainable_state(model, start)
            opt = _make_optimizer(kind, params, lr, cfg.weight_decay, dev, backend)
            hist = train(model, batches, cfg, forward=prepared.forward, label=kind, optimizer=opt)
            curves[kind] = [float(x) for x in hist["loss"]]
            s = summarize(hist, warmup)
            counted = opt.counter.to_dict() if hasattr(opt, "counter") else None
            # the step alone, on the gradients of one more backward
            load_trainable_state(model, start)
            batch = {k: v.to(dev) for k, v in batches[0].items()}
            prepared.forward(**batch).loss.backward()
            timing = time_optimizer_step(opt, params, repeats=repeats)
            opt.zero_grad(set_to_none=True)
            result["runs"].append({
                "optimizer": kind, "median_step_ms": s["median_step_ms"], "peak_mem_gib": s["peak_mem_gib"],
                "optimizer_step": timing,
                "optimizer_compilations": counted["compilations"] if counted else None,
                "optimizer_recompile_reasons": counted["recompile_reasons"] if counted else None,
                "losses": curves[kind],
                "max_abs_loss_diff_vs_first": (max(abs(a - b) for a, b in zip(curves[kind], curves[optimizers[0]]))),
            })
            del opt
    finally:
        result["model_compile"] = prepared.counter.to_dict()
        prepared.undo()
        load_trainable_state(model, start)
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m lab.optim_bench``: :func:`compare_optimizers` into a JSON file."""
    p = argparse.ArgumentParser(prog="python -m lab.optim_bench", description=main.__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--quant", default="nf4", choices=models.QUANT_CHOICES)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, from {list(OPTIMIZERS)}")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--lengths", default="fixed", choices=("fixed", "variable"))
    p.add_argument("--scope", default="regional", choices=("whole", "regional"))
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--command", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        res = compare_optimizers(a.model, quant=a.quant, optimizers=tuple(x for x in a.optimizers.split(",") if x),
                                 steps=a.steps, batch_size=a.batch_size, max_len=a.max_len, lengths=a.lengths,
                                 scope=a.scope, device=a.device, backend=a.backend, repeats=a.repeats,
                                 command=a.command)
    except ValueError as err:
        p.error(str(err))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    for r in res["runs"]:
        print(f"{r['optimizer']:>9}: step {r['median_step_ms']:.1f} ms, optimizer.step {r['optimizer_step']['median_ms']:.3f} ms, "
              f"compilations {r['optimizer_compilations']}, max loss diff vs {res['runs'][0]['optimizer']} "
              f"{r['max_abs_loss_diff_vs_first']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
