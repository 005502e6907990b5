"""``python lab/gpu/fsdp/big_cap_results.py RUNS OUT``: the 70B-shape pipeline runs under different memory caps,
one row each, from the files the calls brought back.

Why: the 70B shape on two GPUs keeps every weight on its GPU at a 21.41 GiB peak, close under a 22 GiB cap
(a 24 GB card). Its step is much slower under that cap than under a looser one with the same plan and the same
peak, and that difference is the allocator's, not the kernels': under the cap it finds no room for a block,
releases its cache and tries again, waiting for the GPU each time. This table sets the runs side by side:
the cap, the plan (``--optimize``), tokens/s, each step's time, the allocator's retries where the run logged
them, and the device and kernel time per step where the run was profiled.

RUNS holds one folder per run (``call<N>_<v>/``: ``pipeline_h200.json`` from ``gpu_pipeline.sh``, and
``summary.json``, ``profile_rank<R>.json``, ``log.jsonl`` where they came back, ``commit.txt``: the commit of the
call's snapshot) and ``call<N>_stdout.txt``, each step's
``<v> <step> <step_ms> <alloc_retries so far> <peak GiB>`` as the call printed them from the run's log. A run's own
``log.jsonl``, where there is one, is read first: its steps carry every rank's retries and peak.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

RUN_DIR = re.compile(r"^call(\d+)_([a-z])$")


def _steps_printed(runs: Path) -> dict[tuple[str, str], list[dict]]:
    """``(call, variant) -> [{step, step_ms, alloc_retries, peak_mem_gib}]`` from the calls' printed lines."""
    found: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(runs.glob("call*_stdout.txt")):
        call = path.name.split("_")[0].removeprefix("call")
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5 and len(parts[0]) == 1 and parts[1].isdigit():
                found.setdefault((call, parts[0]), []).append(
                    {"step": int(parts[1]), "step_ms": float(parts[2]), "alloc_retries": int(parts[3]),
                     "peak_mem_gib": float(parts[4])})
    return found


def _retries(steps: list[dict]) -> dict:
    """The allocator's retries in each step after the first, from the running counts the steps logged
    (one count, rank 0's, or one per rank), and each rank's peak where the steps logged it."""
    if "alloc_retries" not in steps[0]:
        return {}
    counts = [s["alloc_retries"] if isinstance(s["alloc_retries"], list) else [s["alloc_retries"]] for s in steps]
    per_rank = [[b[r] - a[r] for a, b in zip(counts, counts[1:])] for r in range(len(counts[0]))]
    out = {"alloc_retries_per_step": per_rank[0]} if len(per_rank) == 1 else {"alloc_retries_per_step_rank": per_rank}
    if "peak_mem_gib_per_rank" in steps[-1]:
        out["peak_mem_gib_per_rank"] = steps[-1]["peak_mem_gib_per_rank"]
    return out


def merge(runs: Path) -> dict:
    """The rows of every run folder under ``runs`` (module docstring)."""
    printed = _steps_printed(runs)
    rows, device, versions = [], None, None
    for folder in sorted(p for p in runs.iterdir() if p.is_dir() and RUN_DIR.match(p.name)):
        call, variant = RUN_DIR.match(folder.name).groups()
        record = json.loads((folder / "pipeline_h200.json").read_text())
        big = record["big_model"]
        device, versions = device or record.get("device"), versions or record.get("versions")
        summary_path = folder / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        row = {"run": folder.name, "cap_gib": big["cap_gib"], "optimize": big["optimize"],
               "tokens_per_s": big["tokens_per_s"], "median_step_ms": big["median_step_ms"],
               "peak_mem_gib_per_gpu": big["peak_mem_gib_per_gpu"], "graph_breaks": big["graph_breaks"],
               "step_ms_each": summary.get("step_ms"), "date": big["date"], "command": big["command"]}
        if summary:  # the split and each rank's optimizer, where the run's summary came back
            row["layers_per_stage"] = summary.get("options", {}).get("layers_per_stage")
            row["optimizer"] = summary.get("optimizer")
        if (folder / "commit.txt").is_file():  # the commit the call's snapshot was made from
            row["commit"] = (folder / "commit.txt").read_text().strip()
        logged = folder / "log.jsonl"
        steps = ([json.loads(line) for line in logged.read_text().splitlines() if line.strip()]
                 if logged.is_file() else printed.get((call, variant)))
        if steps:
            row["step_ms_each"] = [s["step_ms"] for s in steps]
            row.update(_retries(steps))
        profiled = sorted(folder.glob("profile_rank*.json"))
        if profiled:
            row["profile"] = [{k: p[k] for k in ("rank", "wall_s_per_step", "device_s_per_step")}
                              for p in (json.loads(f.read_text()) for f in profiled)]
            row["profile_note"] = ("a profiled step is slower than the others; device_s_per_step is the sum of "
                                   "its kernels' time over streams, collectives' waits included")
        rows.append(row)
    if not rows:
        raise SystemExit(f"no run folder (call<N>_<v>/) under {runs}")
    return {"model": "llama-3.1-70b", "layers_run": 80, "world_size": 2, "schedule": "1f1b", "seq_len": 2048,
            "global_batch_size": 8, "micro_batch_size": 1, "runs": rows, "device": device, "versions": versions,
            "date": max(r["date"] for r in rows),
            "command": "python lab/gpu/fsdp/big_cap_results.py lab/results/fsdp/pipeline_70b_cap_h200_runs "
                       "lab/results/fsdp/pipeline_70b_cap_h200.json (each run's own command in its row)"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    record = merge(args.runs)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for r in record["runs"]:
        print(f"{r['run']}: cap {r['cap_gib']:g} GiB, {r['tokens_per_s']:.0f} tokens/s, "
              f"retries {r.get('alloc_retries_per_step', r.get('alloc_retries_per_step_rank'))}, "
              f"peaks {r.get('peak_mem_gib_per_rank')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
