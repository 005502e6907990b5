"""The records of ``lab/gpu/compile_time/cold_start.py``: its calls' files merged into one, and ours set beside
each peer that ran in the same call.

Why apart: the runner (``cold_start.py``) starts processes on a GPU machine and times them; what is made of
its files afterwards (which runs are set side by side, the ratios the checks read) runs anywhere and is what
the lab's tests read most. ``cold_start.py merge`` and ``cold_start.comparisons`` are these, imported there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _write(path: Path, data: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


#: The peers a comparison sets against ours (each its ratios' key prefix, ``-`` as ``_``).
PEERS = ("unsloth", "hf-eager", "hf-eager-prebuilt")
#: Peers that compile nothing: what a compile cache holds does not change their run, so the one run of
#: a call is set beside ours' cold and warm runs alike (its entry keeps the cache it was recorded under).
HF = NO_COMPILE = ("hf-eager", "hf-eager-prebuilt")  # the HF recipe: batches built in its process, or the parent's


def comparisons(runs: list[dict]) -> list[dict]:
    """Ours against each peer that ran in the same call, at the same shape and cache: the peer's time
    to the first step and to the end of step 60 over ours' (above 1: ours is ahead), one entry per
    call, shape and cache. Only runs of one call are set side by side (one machine, one host's load);
    a run without a time (failed, skipped) gives no ratio. Each entry is named by its shape, cache and
    call, which stay as they are when later calls are merged. A peer that compiles nothing
    (:data:`NO_COMPILE`) is set beside ours' warm runs too: its run does not depend on the caches.
    Where a call ran one library twice at one cache, the entry takes its later run."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in runs:
        if r.get("call_date") and r.get("wall_60_s"):
            for cache in ("cold", "warm") if r["library"] in NO_COMPILE else (r["cache"],):
                groups.setdefault((r["call_date"], Path(str(r["model"])).name, r["batch_size"], r["seq_len"], cache),
                                  {})[r["library"]] = r
    out = []
    for (call, model, batch, seq, cache), libs in groups.items():
        ours = libs.get("ours")
        peers = [lib for lib in PEERS if lib in libs]
        if not ours or not peers:
            continue
        entry = {"case": f"{model} {batch} x {seq} {cache}, call {call}", "call_date": call, "cache": cache,
                 "ours_time_to_first_step_s": ours["time_to_first_step_s"], "ours_wall_60_s": ours["wall_60_s"],
                 "ours_median_step_ms": ours["median_step_ms"]}
        for lib in peers:
            key, peer = lib.replace("-", "_"), libs[lib]
            entry[f"{key}_cache"] = peer["cache"]
            entry[f"{key}_time_to_first_step_s"] = peer["time_to_first_step_s"]
            entry[f"{key}_wall_60_s"] = peer["wall_60_s"]
            entry[f"{key}_time_to_first_step_ratio"] = round(peer["time_to_first_step_s"] / ours["time_to_first_step_s"], 3)
            entry[f"{key}_wall_60_ratio"] = round(peer["wall_60_s"] / ours["wall_60_s"], 3)
        out.append(entry)
    return out


def merge(out_json: str, inputs: list[str], conditions: str | None = None) -> int:
    """One results file of several calls' (one shape each, or files merged before): their runs side by
    side. ``conditions`` says what else the machine ran during the calls of this merge (each of their
    runs and calls carries it): a run beside others is not a quiet one."""
    calls, runs, commands, dates = [], [], [], []
    first = None
    for path in inputs:
        f = json.loads(Path(path).read_text())
        first = first or f
        dates.append(f["date"])
        if "calls" in f:  # merged before: its calls and runs as they are
            calls += f["calls"]
            runs += f["runs"]
            commands += f["command"] if isinstance(f["command"], list) else [f["command"]]
            continue
        extra = {"conditions": conditions} if conditions else {}
        if "bytecode" in f:  # whether the installed modules had their bytecode (imports are seconds without it)
            extra["bytecode"] = f["bytecode"]
        if "primed" in f:  # a priming process ran before the first run (what the machine reads from disk once)
            extra["primed"] = f["primed"]
        calls.append({"shape": f["shape"], "date": f["date"], "skipped": f["skipped"], "wall_s": f.get("wall_s"),
                      "command": f["command"], **extra})
        runs += [{**r, "call_date": f["date"], **extra} for r in f["runs"]]
        commands.append(f["command"])
    merged = {k: first[k] for k in ("what", "device", "versions", "tool", "time_to_first_step_how", "wall_60_how")}
    merged.update(date=max(dates), command=commands, calls=calls, runs=runs, comparisons=comparisons(runs))
    _write(Path(out_json), merged)
    return 0
