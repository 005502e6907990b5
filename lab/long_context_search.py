"""What the long-context driver, its tries and the merge share, with no torch: the cap, the search.

Why apart from :mod:`lab.long_context`: that module measures (a try in this process, the driver
that runs one process per try); :mod:`lab.long_context_merge` combines what the drivers wrote.
Both need the same facts (the peers, the search's resolution, what a cap stands for, how a
record's runs are read and bracketed, the date and command a file is stamped with), so those
live here, below both, and neither imports the other. The search itself is pure: it calls a
try function and is tested with a fake one.
"""

from __future__ import annotations

import datetime as _dt
import os
import shlex
import sys
import time
from typing import Callable

PEERS = ("ours", "unsloth")
#: the resolution of the search, in tokens
STEP = 1024
#: the card each cap stands for: label (GB, as sold) -> cap in GiB (see CAP_NOTE)
CARDS = {24: 22.0, 40: 38.5}
CAP_NOTE = (
    "set_per_process_memory_fraction(cap * 2**30 / total) caps PyTorch's caching allocator only: the CUDA context "
    "(~0.5 GiB), cuBLAS/cuDNN handles and loaded kernel modules live outside it and are not counted. So each cap "
    "is a real card's memory as torch reports it minus ~0.5 GiB: a '24 GB' card is taken as the tightest of the "
    "24 GB class, an L4 or A10G (about 22.5 GiB total, 22.0 GiB usable; an RTX 4090 reports about 24.0 GiB and "
    "has ~1.5 GiB more), cap 22.0 GiB; a '40 GB' card as an A100-40GB (about 39.4 GiB total, ~38.9 usable), cap "
    "38.5 GiB (0.4 GiB kept for what else lives outside the allocator). The card totals are as commonly listed "
    "by nvidia-smi / torch, not measured in this run. The cap binds on reserved memory (an allocation that would "
    "take the reserved pool over it raises out-of-memory), so reserved_gib is the figure compared with the cap."
)


def runs_of(rec: dict) -> list[dict]:
    """A driver record's runs, or a single try's file (``try``: no ``runs``, its own ``seq_len``) as its one run."""
    if "runs" in rec:
        return rec["runs"]
    return [rec] if "seq_len" in rec else []


def stamp() -> dict:
    """Date and command; under lab/gpu/long_context/gpu_long_context.sh the command is the wrapper's (it sets the variable)."""
    cmd = "python -m lab.long_context " + shlex.join(sys.argv[1:])
    wrapper = os.environ.get("QLORA_NB_LONG_CONTEXT_CMD")
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": f"{wrapper} (this step: {cmd})" if wrapper else cmd}


# ---------------------------------------------------------------- the search (pure: tested with a fake try)


def fit_line(points: list[tuple[int, float]]) -> dict | None:
    """Least squares ``peak = a + b * L`` over ``(L, peak)``; None with fewer than two lengths."""
    if len({L for L, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(L for L, _ in points) / n, sum(p for _, p in points) / n
    b = sum((L - mx) * (p - my) for L, p in points) / sum((L - mx) ** 2 for L, _ in points)
    a = my - b * mx
    return {"a_gib": a, "b_gib_per_token": b, "points": sorted(points),
            "residuals_gib": [p - (a + b * L) for L, p in sorted(points)]}


def _regime(run: dict) -> tuple:
    c = run.get("choices") or {}
    return tuple(str(c.get(k)) for k in ("ckpt_layers", "offload", "scope"))


def predict(runs: list[dict], cap_gib: float, step: int = STEP) -> dict | None:
    """The longest length whose fitted peak stays under ``cap_gib``, floored to ``step``.

    The fit uses the figure the cap binds on (``reserved_gib``; ``peak_mem_gib`` where a run has
    none) of the ok runs in the same regime (:func:`_regime`) as the longest ok run, or of every
    ok run when that regime has fewer than two lengths.
    """
    ok = [r for r in runs if r.get("ok")]
    if not ok:
        return None
    key = "reserved_gib" if all(r.get("reserved_gib") is not None for r in ok) else "peak_mem_gib"
    if any(r.get(key) is None for r in ok):
        return None
    top = max(ok, key=lambda r: r["seq_len"])
    same = [r for r in ok if _regime(r) == _regime(top)]
    used = same if len({r["seq_len"] for r in same}) >= 2 else ok
    fit = fit_line([(r["seq_len"], r[key]) for r in used])
    if fit is None or fit["b_gib_per_token"] <= 0:
        return None
    edge = (cap_gib - fit["a_gib"]) / fit["b_gib_per_token"]
    return {**fit, "of": key, "regime": "same" if used is same else "all ok runs", "cap_gib": cap_gib,
            "edge_tokens": edge, "max_seq_len": max(0, int(edge // step) * step)}


def bracket(runs: list[dict]) -> tuple[int, int | None]:
    """(longest ok length or 0, shortest failed length above it or None); timeouts bound nothing."""
    lo = max((r["seq_len"] for r in runs if r.get("ok")), default=0)
    fails = [r["seq_len"] for r in runs if not r.get("ok") and not r.get("timeout") and r["seq_len"] > lo]
    return lo, min(fails, default=None)


def next_length(runs: list[dict], cap_gib: float, step: int = STEP, edge_tries: int = 0) -> int | None:
    """The next length to try after the probes, or None when the edge is known to ``step``.

    The predicted edge first, then its neighbour on the side the first's result points to
    (``edge_tries``: the tries made after the probes), then plain bisection of the bracket; with
    no failure yet, the prediction but at least 25% more than the longest ok length (twice it
    without a prediction).
    """
    lo, hi = bracket(runs)
    tried = {r["seq_len"] for r in runs if not r.get("timeout")}
    if hi is not None and hi - lo <= step:
        return None
    pred = predict(runs, cap_gib, step)
    p = pred["max_seq_len"] if pred else None
    if lo == 0:  # nothing trained: halve below the shortest failure
        cand = (hi // 2) // step * step if hi else None
        return cand if cand and cand >= step and cand not in tried else None
    if edge_tries < 2 and p is not None:
        if edge_tries == 0:
            cand = p if p > lo else lo + step
        else:  # the neighbour of the predicted edge, on the side its result points to
            cand = runs[-1]["seq_len"] + (step if runs[-1].get("ok") else -step)
        if cand not in tried and cand > lo and (hi is None or cand < hi):
            return cand
    if hi is None:
        return max(p or 0, lo + step, (lo * 5 // 4) // step * step if p else 2 * lo)
    return max(lo + step, ((lo + hi) // 2) // step * step)


def search(try_fn: Callable[[int, float], dict], *, cap_gib: float, probes: list[int], deadline_s: float,
           step: int = STEP, clock: Callable[[], float] = time.monotonic, margin_s: float = 5.0,
           on_run: Callable[[list[dict], dict | None], None] | None = None) -> dict:
    """Probe, predict, bisect; ``try_fn(seq_len, timeout_s)`` returns a try's record.

    A try starts only when the time left is at least ``margin_s`` plus the longest wall time of
    any earlier try at a length not above it (a longer row never trains faster); its timeout is
    the time left less ``margin_s``.

    Returns:
        ``{"max_seq_len", "edge_found", "stopped", "runs", "prediction"}``.
    """
    t0 = clock()
    runs: list[dict] = []
    stopped = "edge found"

    def attempt(L: int) -> bool:
        left = deadline_s - (clock() - t0)
        need = max((r.get("wall_s", 0.0) for r in runs if r["seq_len"] <= L), default=0.0)
        if left - margin_s < max(need, 1.0):
            return False
        run = dict(try_fn(L, left - margin_s))
        run.setdefault("seq_len", L)
        runs.append(run)
        if on_run is not None:
            on_run(runs, predict(runs, cap_gib, step))
        return True

    for L in sorted(set(probes)):
        if not attempt(L):
            stopped = "deadline"
            break
        if not runs[-1].get("ok") and not runs[-1].get("timeout"):
            break  # longer probes would fail too
    if runs and not any(r.get("ok") for r in runs) and not any(r.get("oom") or r.get("timeout") for r in runs):
        stopped = "setup error (no try trained, and none ran out of memory)"
    edge_tries = 0
    while stopped == "edge found":
        L = next_length(runs, cap_gib, step, edge_tries)
        if L is None:
            break
        if not attempt(L):
            stopped = "deadline"
            break
        if runs[-1].get("timeout"):
            stopped = "a try timed out"
            break
        edge_tries += 1
    lo, hi = bracket(runs)
    if not runs:
        stopped = "deadline" if probes else "nothing to try (no probe)"
    return {"max_seq_len": lo or None, "edge_found": hi is not None and hi - lo <= step and lo > 0,
            "bracket": [lo, hi], "stopped": stopped if not (hi is not None and hi - lo <= step) else "edge found",
            "runs": runs, "prediction": predict(runs, cap_gib, step)}
