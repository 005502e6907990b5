"""Where the device waits inside a profiled training step, and why it matters.

A step's time is its kernels' time only when the device never waits for the host. When it does
(a sync in mid-step, launch overhead between small graphs), the profiler's kernel table cannot
show it: the step is longer than its kernels. :func:`idle_gaps` measures the difference inside
each step's window (the :data:`STEP_RANGE` range that
:func:`lab.profile.profile_training` puts around each step) and lists the longest
gaps with the kernels either side, which says where in the step the host held the device up.
On an H200 at 8B, 8 x 1024 it showed 0.46 ms idle in a 403 ms step for ours
(``lab/results/step/profile_8b_h200_gaps.json``): the rest of the gap to Unsloth is kernel time.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

__all__ = ["STEP_RANGE", "idle_gaps", "kernels_and_windows", "op_chain", "short_name"]

#: The profiler range put around each step (its call and the closing sync).
STEP_RANGE = "qlora_nb_step"


def short_name(name: str, limit: int = 140) -> str:
    """``name`` cut to ``limit`` characters (kernel names run to hundreds)."""
    return name if len(name) <= limit else name[: limit - 3] + "..."


def op_chain(event: Any) -> list[str]:
    """The names of a profiler event and its CPU parents, innermost first."""
    out = []
    while event is not None:
        out.append(event.name)
        event = event.cpu_parent
    return out


def idle_gaps(kernels: Sequence[tuple[float, float, str, str]], windows: Sequence[tuple[float, float]], *,
              top: int = 12, min_us: float = 20.0) -> dict[str, Any]:
    """Where the device waits inside each step: the time of a step's window no kernel covers.

    Args:
        kernels: ``(start_us, end_us, kernel name, launching op)`` of every device kernel.
        windows: ``(start_us, end_us)`` of each step (:data:`STEP_RANGE`), on the same clock.
        top: how many of the longest gaps to list.
        min_us: gaps shorter than this are counted (``idle_ms``) but not listed or counted as gaps.

    Returns:
        Per step (averaged over the windows): ``window_ms``, ``busy_ms`` (kernels' union: overlap
        counted once), ``idle_ms``, ``lead_ms`` (step start to its first kernel), ``tail_ms`` (last
        kernel to the step's end), ``gaps`` (count of gaps of at least ``min_us``), and ``top``: the
        longest gaps of all steps with the kernels either side and the op that launched the next one.
    """
    steps = max(len(windows), 1)
    total = busy = lead = tail = 0.0
    n_gaps, listed = 0, []
    ordered = sorted(kernels)
    for ws, we in windows:
        inside = [k for k in ordered if k[0] >= ws and k[0] < we]
        total += we - ws
        if not inside:
            lead += we - ws
            continue
        merged: list[list] = []
        for start, end, name, op in inside:
            end = min(end, we)
            if merged and start <= merged[-1][1]:
                if end > merged[-1][1]:
                    merged[-1][1], merged[-1][3] = end, name
                continue
            merged.append([start, end, name, name, op])  # start, end, first name, last name, first op
        busy += sum(e - s for s, e, *_ in merged)
        lead += merged[0][0] - ws
        tail += max(we - merged[-1][1], 0.0)
        for prev, nxt in zip(merged, merged[1:]):
            gap = nxt[0] - prev[1]
            if gap >= min_us:
                n_gaps += 1
                listed.append({"us": round(gap, 1), "after": short_name(prev[3], 80), "before": short_name(nxt[2], 80),
                               "launched_by": short_name(nxt[4], 80)})
    ms = lambda us: round(us / steps / 1e3, 3)  # noqa: E731
    listed.sort(key=lambda g: -g["us"])
    return {"steps": len(windows), "window_ms": ms(total), "busy_ms": ms(busy), "idle_ms": ms(total - busy),
            "lead_ms": ms(lead), "tail_ms": ms(tail), "gaps": n_gaps // steps, "min_gap_us": min_us,
            "top": listed[:top]}


def kernels_and_windows(events: Iterable[Any]) -> tuple[list[tuple[float, float, str, str]], list[tuple[float, float]]]:
    """The device kernels (with the CPU op that launched each) and the :data:`STEP_RANGE` windows of a profile."""
    events = list(events)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    by_id = {e.id: e for e in cpu if not e.is_async}
    windows = [(e.time_range.start, e.time_range.end) for e in cpu if e.name == STEP_RANGE]
    kernels = []
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            op = by_id.get(getattr(e, "linked_correlation_id", 0))
            chain = op_chain(op) if op is not None else []
            launched = next((c for c in chain if not c.startswith(("cuda", "cu"))), chain[0] if chain else "")
            kernels.append((e.time_range.start, e.time_range.end, e.name, launched))
    return kernels, sorted(windows)
