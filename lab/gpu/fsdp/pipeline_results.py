"""The pipeline results file from one ``lab/gpu/fsdp/gpu_pipeline.sh`` call.

    python lab/gpu/fsdp/pipeline_results.py RUNS OUT --cap 22 --command "..."

Reads each run's ``summary.json`` under RUNS and writes ``OUT/pipeline_<gpu>.json``: ``world_size``,
``runs`` (per schedule: ``schedule``, ``model``, ``tokens_per_s``, ``peak_mem_gib_per_gpu``,
``graph_breaks``, ``max_abs_loss_diff`` against the one-GPU run on the same batches, ``floor_max``:
the one-GPU run against itself with the rows of every batch permuted), ``one_gpu``,
``fsdp_tokens_per_s`` (FSDP2 at the same global batch), ``big_model`` (the 70B shape: ``layers_run``,
``cpu_offload`` false: no weight leaves its GPU, ``peak_mem_gib_per_gpu``, ``tokens_per_s``,
``cap_gib``), ``missing_runs``, ``device``, ``versions``, ``date``, ``command``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
from pathlib import Path

SCHEDULE_RUNS = {"gpipe": "pp_gpipe", "1f1b": "pp_1f1b", "zbv": "pp_zbv"}


def _summary(runs: Path, name: str) -> dict | None:
    path = runs / name / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _diff(a: list[float], b: list[float]) -> float | None:
    pairs = list(zip(a, b))
    return max(abs(x - y) for x, y in pairs) if pairs else None


def _slug(device: dict | None) -> str:
    name = (device or {}).get("name") or "cpu"
    return re.sub(r"[^a-z0-9]+", "", name.lower().replace("nvidia", "")) or "gpu"


def build_record(runs: Path, cap: float, command: str) -> dict:
    one, floor = _summary(runs, "one_1"), _summary(runs, "floor_1")
    floor_max = _diff(one["losses"], floor["losses"]) if one and floor else None
    missing = [n for n in ("one_1", "floor_1", *SCHEDULE_RUNS.values(), "fsdp_2", "big_70b") if _summary(runs, n) is None]
    rows = []
    for schedule, name in SCHEDULE_RUNS.items():
        s = _summary(runs, name)
        if s is None:
            continue
        diff = _diff(one["losses"], s["losses"]) if one else None
        rows.append({"schedule": schedule, "model": s["model"], "world_size": s["world_size"],
                     "micro_batches": s["micro_batches"], "seq_len": s["options"]["seq_len"],
                     "global_batch_size": s["options"]["global_batch_size"],
                     "tokens_per_s": s["tokens_per_s"], "tokens_per_s_padded": s["tokens_per_s_padded"],
                     "median_step_ms": s["median_step_ms"], "first_step_s": s["first_step_s"],
                     "peak_mem_gib_per_gpu": s["peak_mem_gib_per_gpu"], "graph_breaks": s["graph_breaks"]["total"],
                     "compile": s["compile"], "max_abs_loss_diff": diff, "floor_max": floor_max,
                     "within_floor": diff is not None and floor_max is not None and diff <= floor_max,
                     "vs_one_gpu": (s["tokens_per_s"] / one["tokens_per_s"]) if one and one["tokens_per_s"] else None,
                     "stages": s["stages"], "losses": s["losses"], "command": s["command"]})
    fsdp = _summary(runs, "fsdp_2")
    big = _summary(runs, "big_70b")
    big_rec = None
    if big is not None:
        big_rec = {"model": big["model"], "layers_run": sum(len(x) for r in big["stages"].values() for x in r["layers"]),
                   "cpu_offload": False, "weights_on_gpu": True,
                   "activation_offload": any("offload" in o for o in big["options"].get("optimize", [])),
                   "cap_gib": cap, "schedule": big["schedule"], "seq_len": big["options"]["seq_len"],
                   "global_batch_size": big["options"]["global_batch_size"], "micro_batches": big["micro_batches"],
                   "peak_mem_gib_per_gpu": big["peak_mem_gib_per_gpu"],
                   "build_peak_mem_gib_per_gpu": big["build_peak_mem_gib_per_gpu"],
                   "tokens_per_s": big["tokens_per_s"], "median_step_ms": big["median_step_ms"],
                   "graph_breaks": big["graph_breaks"]["total"], "build_s": big["build_s"],
                   "losses_note": "random weights: the loss is not meaningful", "command": big["command"]}
    ref = next((s for s in (one, *(_summary(runs, n) for n in SCHEDULE_RUNS.values()), fsdp, big) if s), None) or {}
    return {
        "world_size": 2,
        "runs": rows,
        "one_gpu": None if one is None else {"tokens_per_s": one["tokens_per_s"],
                                             "peak_mem_gib_per_gpu": one["peak_mem_gib_per_gpu"],
                                             "graph_breaks": one["graph_breaks"]["total"], "losses": one["losses"]},
        "floor_max": floor_max,
        "fsdp_tokens_per_s": fsdp["tokens_per_s"] if fsdp else None,
        "fsdp_peak_mem_gib_per_gpu": fsdp["peak_mem_gib_per_gpu"] if fsdp else None,
        "fsdp_max_abs_loss_diff": _diff(one["losses"], fsdp["losses"]) if one and fsdp else None,
        "big_model": big_rec,
        "missing_runs": missing,
        "device": ref.get("device"),
        "versions": ref.get("versions"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "command": command,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("runs", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--cap", type=float, required=True)
    p.add_argument("--command", required=True)
    a = p.parse_args(argv)
    rec = build_record(a.runs, a.cap, a.command)
    path = a.out / f"pipeline_{_slug(rec['device'])}.json"
    path.write_text(json.dumps(rec, indent=2, default=str) + "\n")
    print(f"[pipeline] wrote {path}")
    for r in rec["runs"]:
        print(f"  {r['schedule']}: {r['tokens_per_s']} tokens/s, {r['peak_mem_gib_per_gpu']} GiB, "
              f"breaks {r['graph_breaks']}, diff {r['max_abs_loss_diff']} (floor {r['floor_max']})")
    print(f"  fsdp: {rec['fsdp_tokens_per_s']} tokens/s; big_model: {rec['big_model'] and {k: rec['big_model'][k] for k in ('layers_run', 'peak_mem_gib_per_gpu', 'tokens_per_s')}}")
    print(f"  missing_runs: {rec['missing_runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
