"""Where a rank's step went: a ``torch.profiler`` window over a run's steps, written per rank.

Why this module exists: a parallel run can be slow in ways a step time does not show: a rank's GPU
waits on its host, on another rank's collective, or on its own allocator releasing its cache. Both
loops (``fsdp_train`` and ``pipeline_train``) open the same window for ``--profile N`` and write the
same files, so that one rank's time is read the same way in every layout: the ops by device and by
host time, and the wall time per step beside the device time its kernels took.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["start_profiler", "write_profile"]


def start_profiler(info):
    """A torch.profiler over CPU (and CUDA) activity, entered now; :func:`write_profile` ends it."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    prof = profile(activities=acts)
    prof.__enter__()
    prof.qlora_t0 = time.perf_counter()
    return prof


def write_profile(prof, out: Path, info, steps: int = 1) -> dict:
    """End ``prof`` and write where this rank's time went: two tables (the ops by device time, by CPU
    time; collectives show as ``nccl:*``) in ``OUT/profile_rank<R>.txt``, and in
    ``OUT/profile_rank<R>.json`` the wall time per step beside the device time its kernels took
    (their sum over streams; a device time well under the wall means the GPU waited, on the host
    or on another rank) and the ops that took the most device time. Returns the JSON record."""
    wall = time.perf_counter() - getattr(prof, "qlora_t0", time.perf_counter())
    prof.__exit__(None, None, None)
    table = prof.key_averages()
    text = []
    if info.device.type == "cuda":
        text += ["# by device time", table.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)]
    text += ["# by CPU time", table.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_rank{info.rank}.txt").write_text("\n".join(text) + "\n")
    from torch.autograd import DeviceType

    # the device's own events (kernels, copies): an op's row would count its kernels a second time
    ops = sorted(((e.key, e.self_device_time_total / 1e6, e.count) for e in table
                  if getattr(e, "device_type", None) == DeviceType.CUDA), key=lambda x: -x[1])
    steps = max(1, steps)
    record = {"rank": info.rank, "steps": steps, "wall_s_per_step": wall / steps,
              "device_s_per_step": sum(s for _, s, _ in ops) / steps,
              "top_device_ops": [{"op": k[:120], "s_per_step": s / steps, "calls_per_step": n / steps}
                                 for k, s, n in ops[:25]]}
    (out / f"profile_rank{info.rank}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record
