"""Which allocations make a CUDA memory peak: the live set at the peak of a recorded window.

Why: "compiled peaks above eager" is a total; the fix needs the *allocations* behind it.
PyTorch's allocator can record every allocation and free with its Python stack
(``torch.cuda.memory._record_memory_history``); :func:`live_at_peak` replays such a recording,
finds the moment the allocated bytes were highest, and lists what was alive then, largest
first and summed by the line that allocated it. Two recordings of the same step (eager and
compiled, say) then differ by named lines instead of by a total.

Only allocations made *during* the recording are attributed: what was alive before it started
(weights, optimizer state) is the same on both sides of such a comparison and shows as the
difference between ``peak_gib`` (the allocator's own figure) and the recorded live bytes.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from typing import Any, Iterator

import torch

__all__ = ["recording", "live_at_peak", "site_of"]

#: Inductor's generated modules, in whatever cache folder (``$TORCHINDUCTOR_CACHE_DIR``): ``<2 chars>/c<hash>.py``
_INDUCTOR_MODULE = re.compile(r"/[a-z0-9]{2}/c[a-z0-9]{40,}\.py$")
_INTERNAL = ("/torch/", "/contextlib.py", "/functools.py", "<frozen", "/threading.py")


def site_of(frames: list[dict[str, Any]]) -> str:
    """``file:line:function`` of the innermost frame outside torch's own modules.

    Inductor's generated code (``/tmp/torchinductor_*/...``) is named as such: in a compiled
    step the kernel buffers are allocated there, and the file tells forward from backward graphs.
    """
    for f in frames:
        name = f.get("filename", "")
        if "torchinductor" in name or _INDUCTOR_MODULE.search(name):
            return f"inductor:{name.rsplit('/', 1)[-1]}:{f.get('line')}:{f.get('name')}"
        if not any(part in name for part in _INTERNAL):
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{f.get('line')}:{f.get('name')}"
    return "torch-internal" if frames else "no-stack"


def _short_stack(frames: list[dict[str, Any]], depth: int) -> list[str]:
    return [f"{'/'.join(f.get('filename', '').split('/')[-2:])}:{f.get('line')}:{f.get('name')}" for f in frames[:depth]]


def live_at_peak(snapshot: dict[str, Any], device: int = 0, top: int = 15, depth: int = 8,
                 at: str = "peak", free_on: str = "free_completed") -> dict[str, Any]:
    """The allocations alive at the highest point of a recorded window (or at its end).

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` taken while recording (or a dict with the
            same ``device_traces`` layout: events with ``action``, ``addr``, ``size``, ``frames``).
        device: which device's trace to read.
        top: how many of the largest live allocations and sites to return.
        depth: stack frames kept per listed allocation.
        at: ``"peak"``, or ``"end"``: what the window left allocated (a leak shows there).
        free_on: the event that ends an allocation: ``"free_completed"`` (the block is back in the
            pool: what reserved memory can reuse) or ``"free_requested"`` (the tensor died: what the
            allocator's ``allocated`` figures count). They differ by frees that wait for another
            stream (a side-stream copy still reading the block).

    Returns:
        ``peak_delta_gib`` (allocated bytes at the peak minus at the start of the recording; frees
        of older allocations count), ``end_delta_gib`` (the same at the end), ``live_gib`` (bytes
        allocated during the recording and alive at the peak, or at the end), ``events``, ``largest`` (size, site, stack) and ``by_site`` (site -> GiB, count).

    Raises:
        ValueError: the snapshot has no trace for ``device`` (recording was not on), or ``at``
            is neither ``"peak"`` nor ``"end"``.
    """
    if at not in ("peak", "end"):
        raise ValueError(f"at must be 'peak' or 'end', got {at!r}")
    if free_on not in ("free_completed", "free_requested"):
        raise ValueError(f"free_on must be 'free_completed' or 'free_requested', got {free_on!r}")
    traces = snapshot.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        raise ValueError(f"no allocation trace for device {device}: record with "
                         "torch.cuda.memory._record_memory_history() (qlora_nb_utils.diagnostics.memprof.recording) first")
    events = traces[device]
    level, best, best_at = 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            level += e["size"]
        elif e["action"] == free_on:
            level -= e["size"]
        if level > best:
            best, best_at = level, i
    end_level = level
    if at == "end":
        best_at = len(events) - 1
    live: dict[int, dict] = {}
    for e in events[: best_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == free_on:
            live.pop(e["addr"], None)
    blocks = sorted(live.values(), key=lambda e: -e["size"])
    sites: dict[str, list] = defaultdict(lambda: [0, 0])
    for e in blocks:
        s = sites[site_of(e.get("frames") or [])]
        s[0] += e["size"]
        s[1] += 1
    by_site = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "peak_delta_gib": best / 2**30,
        "end_delta_gib": end_level / 2**30,
        "live_gib": sum(e["size"] for e in blocks) / 2**30,
        "events": len(events),
        "largest": [{"mib": e["size"] / 2**20, "site": site_of(e.get("frames") or []),
                     "stack": _short_stack(e.get("frames") or [], depth)} for e in blocks[:top]],
        "by_site": [{"site": k, "gib": v[0] / 2**30, "count": v[1]} for k, v in by_site],
    }


@contextlib.contextmanager
def recording(max_entries: int = 1_000_000) -> Iterator[dict[str, Any]]:
    """Record CUDA allocations with Python stacks; the yielded dict gets ``"snapshot"`` on exit.

    Raises:
        RuntimeError: CUDA is not available (the allocator being recorded is CUDA's).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("memprof.recording records the CUDA caching allocator; no CUDA device here")
    out: dict[str, Any] = {}
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=max_entries)
    try:
        yield out
        torch.cuda.synchronize()
        out["snapshot"] = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
