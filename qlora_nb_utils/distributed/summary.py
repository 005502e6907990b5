"""What a run measures and reports: peak memory over ranks, graph breaks, ``summary.json``.

Why this module exists: a run is judged by its summary, and the summary's fields are what
:func:`qlora_nb_utils.distributed.runs.compare_runs` and the FSDP2 results files read, so they
are written in one place. Rank 0 appends one JSON line per step to ``OUT/log.jsonl`` (step,
loss, step_ms, tokens, peak_mem_gib: the maximum over ranks) and writes ``OUT/summary.json``
with world size, tokens/s (the median of the per-step rates after ``--timing-warmup`` steps, so
that one late recompilation does not set the throughput), peak memory per GPU, graph breaks,
compilations, the sharding, versions, device, command and date.
"""

from __future__ import annotations

import datetime as _dt
import shlex
import sys

import torch

__all__: list[str] = []


def _max_over_ranks(value: float, device: torch.device) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _graph_break_total() -> tuple[int, list[str]]:
    try:
        from torch._dynamo.utils import counters

        breaks = counters["graph_break"]
        return int(sum(breaks.values())), [str(r).splitlines()[0] for r in breaks]
    except Exception:  # private counters moved: report unknown
        return -1, []


def _summary(args, info, records, sharded, storage, dtype, start_step, breaks_before,
             peak) -> dict:
    from .. import env
    from .fsdp import sharding_report

    breaks_after, reasons = _graph_break_total()
    timed = [r for r in records if r["step"] >= start_step + args.timing_warmup and r.get("run_start") == start_step]
    med = lambda xs: float(sorted(xs)[len(xs) // 2]) if xs else None  # noqa: E731
    step_ms = med([r["step_ms"] for r in timed])
    # Medians of per-step rates, not total tokens / total time: one late recompilation (a step
    # many times the others' length) must not set the throughput.
    rate = med([r["tokens"] / (r["step_ms"] / 1e3) for r in timed if r["step_ms"] > 0])
    rate_padded = med([r["tokens_padded"] / (r["step_ms"] / 1e3) for r in timed if r["step_ms"] > 0])
    report = sharding_report(sharded.model)
    kinds: dict[str, dict[str, int]] = {}
    for row in report:
        key = "+".join(row["placements"]) or "not sharded"
        kinds.setdefault(row["kind"], {}).setdefault(key, 0)
        kinds[row["kind"]][key] += 1
    compile_stats = sharded.compile_stats()
    return {
        "world_size": info.world_size,
        "backend": info.backend,
        "model": args.model,
        "options": {k: v for k, v in vars(args).items()},
        "dtype": str(dtype).replace("torch.", ""),
        "quant_storage": str(storage).replace("torch.", ""),
        "nf4": sharded.nf4,
        "steps": len(records),
        "resumed_from": start_step or None,
        "losses": [r["loss"] for r in records],
        "tokens_per_s": rate,
        "tokens_per_s_padded": rate_padded,
        "step_ms": [r["step_ms"] for r in records],
        "median_step_ms": step_ms,
        "timed_steps": len(timed),
        "first_step_s": next((r["step_ms"] / 1e3 for r in records if r["step"] == start_step), None),
        "peak_mem_gib_per_gpu": peak,
        "graph_breaks": {
            "total": breaks_after - breaks_before if breaks_after >= 0 else None,
            "reasons": reasons,
            "compiled_layers": len(sharded.layers) if args.compile else 0,
            "fullgraph": bool(args.compile and args.fullgraph),
            "fsdp_boundary": 0 if args.compile else None,
            "fsdp_boundary_note": ("FSDP2's pre/post-forward hooks are torch._dynamo.disable'd and run "
                                   "eagerly around each compiled layer's forward frame: no break "
                                   "is taken there"),
        },
        "compile": compile_stats,
        "sharding": kinds,
        "device": env.device_info(info.device),
        "versions": env.versions(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, "-m", "qlora_nb_utils.distributed.fsdp_train", *sys.argv[1:]]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }
