"""Matmul kernel time per operand shape: which GEMM of a step is the slow one.

Why it exists: the kernel groups of :mod:`lab.profile` say that our base matmuls
at 8B, 8 x 1024 take 10.8 ms a step more than Unsloth's (``lab/results/step/profile_8b_h200_gaps.json``),
but not which of them: a decoder layer has seven projections of four shapes (q and o, k and v
with grouped-query attention's narrow outputs, gate and up, down), each a forward product and
one or two in the backward, and cuBLAS picks a kernel per shape and epilogue. :func:`by_shape`
splits a group's time by the launching op's operand shapes and phase, the same way for every
library, so two profiles can be compared GEMM by GEMM.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

__all__ = ["by_shape"]


def by_shape(records: Sequence[dict[str, Any]], classify: Callable[[dict[str, Any]], str], group: str = "base_matmul",
             *, steps: int = 1, top: int = 16) -> list[dict[str, Any]]:
    """The ``top`` (shapes, phase) pairs of ``group`` by kernel time per step.

    Args:
        records: :func:`lab.profile.kernel_records` of a profile.
        classify: a record's group (what :func:`~lab.profile.group_kernels` uses).
        group: the group to split.
        steps: profiled steps the records cover (times are per step).
        top: how many rows to return, most time first.

    Returns:
        Rows ``{"shapes": "8192x4096 4096x1024", "phase", "ms", "calls", "kernels"}`` (``kernels``:
        the kernel names seen for it, most time first, at most three); shapes ``"?"`` where the
        launching op's shapes are not known.
    """
    steps = max(int(steps), 1)
    agg: dict[tuple[str, str], dict] = defaultdict(lambda: {"us": 0.0, "calls": 0, "names": defaultdict(float)})
    for r in records:
        if classify(r) != group:
            continue
        shapes = " ".join("x".join(str(d) for d in s) for s in (r.get("shapes") or []) if s) or "?"
        a = agg[(shapes, r.get("phase", "unknown"))]
        a["us"] += r["us"]
        a["calls"] += 1
        a["names"][r["name"]] += r["us"]
    rows = [{"shapes": shapes, "phase": phase, "ms": round(a["us"] / steps / 1e3, 3), "calls": a["calls"] // steps,
             "kernels": [n[:100] for n, _ in sorted(a["names"].items(), key=lambda kv: -kv[1])[:3]]}
            for (shapes, phase), a in agg.items()]
    return sorted(rows, key=lambda row: -row["ms"])[:top]
