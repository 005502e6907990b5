"""The pipeline results file from one ``lab/gpu/fsdp/gpu_pipeline.sh`` call.

    python lab/gpu/fsdp/pipeline_results.py RUNS OUT --cap 22 --command "..."

Reads each run's ``summary.json`` under RUNS and writes ``OUT/pipeline_<gpu>.json``: ``world_size``,
``runs`` (per schedule: ``schedule``, ``model``, ``tokens_per_s``, ``peak_mem_gib_per_gpu``,
``graph_breaks``, ``max_abs_loss_diff`` against the one-GPU run on the same batches, ``floor_max``:
the one-GPU run against itself with the rows of every batch permuted), ``one_gpu``,
``fsdp_tokens_per_s`` (FSDP2 at the same global batch), ``big_model`` (the 70B shape: ``layers_run``,
``cpu_offload`` false: no weight leaves its GPU, ``peak_mem_gib_per_gpu``, ``tokens_per_s``,
``cap_gib``), ``missing_runs``, ``device``, ``versions``, ``date``, ``command``.

A run that failed or did not run is listed in ``failed_runs`` with its status (``RUNS/<name>.status``,
written by the script: the exit code, or why it was skipped) and its root-cause line (the first
``...Error:`` line of ``RUNS/<name>.log``), so a partial call explains itself. ``--keep PREVIOUS.json``
merges in the runs of an earlier results file that this call did not run (each keeps its own
``date`` and ``command``, under ``carried_from``).

What the loss comparisons mean (``floor_note``, ``fsdp_loss_note`` in the file): the one-GPU run is
the same pipeline code on one process, micro-batches of one row like the 2-GPU runs, so every row
goes through the same kernels and a pipeline schedule can equal it bit for bit; the floor run
changes only the order in which the micro-batches' losses and LoRA gradients are summed (a few
fp32 units in the last place). FSDP2's run is a throughput and memory comparison at the same
global batch size and length, not a loss check: another model (its random weights drawn in one
sequence, the pipeline's per layer; PEFT's own LoRA initialisation) on other rows (``--pack``
concatenates examples and attends across them, the pipeline packs whole examples and attends per
document).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
from pathlib import Path

SCHEDULE_RUNS = {"gpipe": "pp_gpipe", "1f1b": "pp_1f1b", "zbv": "pp_zbv"}
ALL_RUNS = ("big_70b", "one_1", "floor_1", *SCHEDULE_RUNS.values(), "fsdp_2")
#: the first line of a log that names an exception: ``[rank1]: torch.OutOfMemoryError: CUDA out of ...``
ERROR_LINE = re.compile(r"(?:^|[\s:\]])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)): ?(.*)$")
FLOOR_NOTE = ("one_gpu is the same pipeline code on one process with micro-batches of one row, as every 2-GPU "
              "schedule runs them: each row goes through the same kernels, so a schedule can equal it bit for bit "
              "(max_abs_loss_diff 0). The floor run permutes the rows of every batch, which here changes only the "
              "order in which the micro-batches' losses and LoRA gradients are summed: a few fp32 units in the last "
              "place of the loss, the floor of this configuration (summation order alone), smaller than a floor "
              "with several rows per micro-batch, where kernels see other row mixes.")
FSDP_LOSS_NOTE = ("not a loss check: FSDP2's run is a throughput and memory comparison at the same global batch "
                  "size and length. Its losses are another model on other rows: its random weights are drawn in "
                  "one sequence (the pipeline seeds each layer by its index), its LoRA A from PEFT's own "
                  "initialisation, and its --pack concatenates examples and attends across them where the "
                  "pipeline packs whole examples best-fit and attends per document.")


def _summary(runs: Path, name: str) -> dict | None:
    path = runs / name / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _diff(a: list[float], b: list[float]) -> float | None:
    pairs = list(zip(a, b))
    return max(abs(x - y) for x, y in pairs) if pairs else None


def _slug(device: dict | None) -> str:
    name = (device or {}).get("name") or "cpu"
    return re.sub(r"[^a-z0-9]+", "", name.lower().replace("nvidia", "")) or "gpu"


def root_cause(log: Path) -> str | None:
    """The first line of ``log`` that names an exception (``[rankN]:`` prefix dropped), with the next
    non-empty line when the exception's own message is empty; None without such a line."""
    if not log.is_file():
        return None
    lines = log.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        m = ERROR_LINE.search(line)
        if m is None or "Traceback" in line:
            continue
        text = f"{m.group(1)}: {m.group(2).strip()}".strip()
        if not m.group(2).strip():
            nxt = next((re.sub(r"^\[rank\d+\]:\s*", "", x).strip() for x in lines[i + 1:i + 4]
                        if re.sub(r"^\[rank\d+\]:\s*", "", x).strip()), "")
            text = f"{text} {nxt}".strip()
        return text[:1500]
    return None


def _status(runs: Path, name: str) -> str:
    path = runs / f"{name}.status"
    if path.is_file():
        return path.read_text().strip() or "unknown"
    return "not run" if not (runs / f"{name}.log").is_file() else "no summary"


def _run_row(schedule: str, s: dict) -> dict:
    return {"schedule": schedule, "model": s["model"], "world_size": s["world_size"],
            "micro_batches": s["micro_batches"], "seq_len": s["options"]["seq_len"],
            "global_batch_size": s["options"]["global_batch_size"],
            "tokens_per_s": s["tokens_per_s"], "tokens_per_s_padded": s["tokens_per_s_padded"],
            "median_step_ms": s["median_step_ms"], "first_step_s": s["first_step_s"],
            "peak_mem_gib_per_gpu": s["peak_mem_gib_per_gpu"], "graph_breaks": s["graph_breaks"]["total"],
            "compile": s["compile"], "stages": s["stages"], "losses": s["losses"], "date": s.get("date"),
            "command": s["command"]}


def _big_row(big: dict, cap: float) -> dict:
    return {"model": big["model"], "layers_run": sum(len(x) for r in big["stages"].values() for x in r["layers"]),
            "cpu_offload": False, "weights_on_gpu": True,
            "activation_offload": any("offload" in o for o in big["options"].get("optimize", [])),
            "optimize": big["options"].get("optimize", []), "layers_per_stage": big["options"].get("layers_per_stage"),
            "cap_gib": cap, "schedule": big["schedule"], "seq_len": big["options"]["seq_len"],
            "global_batch_size": big["options"]["global_batch_size"], "micro_batches": big["micro_batches"],
            "peak_mem_gib_per_gpu": big["peak_mem_gib_per_gpu"],
            "build_peak_mem_gib_per_gpu": big["build_peak_mem_gib_per_gpu"],
            "tokens_per_s": big["tokens_per_s"], "median_step_ms": big["median_step_ms"],
            "optimizer": big.get("optimizer"), "graph_breaks": big["graph_breaks"]["total"], "build_s": big["build_s"],
            "losses_note": "random weights: the loss is not meaningful", "date": big.get("date"),
            "command": big["command"]}


def build_record(runs: Path, cap: float, command: str) -> dict:
    """This call's record (runs it did not finish: ``failed_runs``; merge earlier ones with :func:`merge`)."""
    one, floor = _summary(runs, "one_1"), _summary(runs, "floor_1")
    rows = [_run_row(schedule, s) for schedule, name in SCHEDULE_RUNS.items() if (s := _summary(runs, name))]
    fsdp, big = _summary(runs, "fsdp_2"), _summary(runs, "big_70b")
    failed = [{"run": n, "status": _status(runs, n), "root_cause": root_cause(runs / f"{n}.log")}
              for n in ALL_RUNS if _summary(runs, n) is None]
    ref = next((s for s in (one, *(_summary(runs, n) for n in SCHEDULE_RUNS.values()), fsdp, big) if s), None) or {}
    date = _dt.datetime.now(_dt.timezone.utc).isoformat()
    rec = {
        "world_size": 2,
        "runs": rows,
        "one_gpu": None if one is None else {"tokens_per_s": one["tokens_per_s"],
                                             "peak_mem_gib_per_gpu": one["peak_mem_gib_per_gpu"],
                                             "graph_breaks": one["graph_breaks"]["total"], "losses": one["losses"],
                                             "date": one.get("date"), "command": one["command"]},
        "floor": None if floor is None else {"losses": floor["losses"], "date": floor.get("date"),
                                             "command": floor["command"]},
        "fsdp": None if fsdp is None else {"tokens_per_s": fsdp["tokens_per_s"],
                                           "peak_mem_gib_per_gpu": fsdp["peak_mem_gib_per_gpu"],
                                           "graph_breaks": fsdp["graph_breaks"]["total"], "losses": fsdp["losses"],
                                           "loss_comparable": False, "date": fsdp.get("date"),
                                           "command": fsdp["command"]},
        "big_model": None if big is None else _big_row(big, cap),
        "big_model_first_try": None if not (runs / "big_70b_try1.log").is_file() else {
            "status": _status(runs, "big_70b_try1"), "root_cause": root_cause(runs / "big_70b_try1.log"),
            "note": "the first try of the 70B shape; big_model is the second, at the shorter length it names"},
        "failed_runs": failed,
        "device": ref.get("device"),
        "versions": ref.get("versions"),
        "date": date,
        "command": command,
    }
    return finish(rec)


def _carry(entry: dict, prev: dict) -> dict:
    """An entry of an earlier results file, with where it came from (its own date and command)."""
    out = dict(entry)
    out.setdefault("carried_from", {"date": entry.get("date") or prev.get("date"),
                                    "command": entry.get("command") or prev.get("command"),
                                    "results_command": prev.get("command")})
    return out


def merge(rec: dict, prev: dict) -> dict:
    """``rec`` with the runs of ``prev`` (an earlier results file) that ``rec``'s call did not finish.

    Older files (before ``one_gpu``/``floor``/``fsdp`` carried their own date) give the file's date."""
    have = {r["schedule"] for r in rec["runs"]}
    carried = []
    for r in prev.get("runs") or []:
        if r["schedule"] not in have:
            rec["runs"].append(_carry(r, prev))
            carried.append(SCHEDULE_RUNS.get(r["schedule"], r["schedule"]))
    if rec.get("one_gpu") is None and prev.get("one_gpu"):
        rec["one_gpu"] = _carry(prev["one_gpu"], prev)
        carried.append("one_1")
    if rec.get("floor") is None:
        if prev.get("floor"):
            rec["floor"] = _carry(prev["floor"], prev)
            carried.append("floor_1")
        elif prev.get("floor_max") is not None:  # an older file kept only the floor's largest difference
            rec["floor"] = _carry({"floor_max": prev["floor_max"]}, prev)
            carried.append("floor_1")
    if rec.get("fsdp") is None and (prev.get("fsdp") or prev.get("fsdp_tokens_per_s") is not None):
        old = prev.get("fsdp") or {"tokens_per_s": prev["fsdp_tokens_per_s"],
                                   "peak_mem_gib_per_gpu": prev.get("fsdp_peak_mem_gib_per_gpu"),
                                   "loss_comparable": False}
        rec["fsdp"] = _carry(old, prev)
        carried.append("fsdp_2")
    if rec.get("big_model") is None and prev.get("big_model"):
        rec["big_model"] = _carry(prev["big_model"], prev)
        rec["big_model_first_try"] = prev.get("big_model_first_try")
        carried.append("big_70b")
    rec["failed_runs"] = [f for f in rec["failed_runs"] if f["run"] not in carried]
    rec["carried_runs"] = carried
    for key in ("device", "versions"):
        rec[key] = rec.get(key) or prev.get(key)
    return finish(rec)


def finish(rec: dict) -> dict:
    """The fields computed from the entries: the floor, each schedule's difference from one GPU, the
    FSDP2 figures under the names the checks read, ``missing_runs``."""
    one, floor = rec.get("one_gpu"), rec.get("floor")
    floor_max = None
    if floor is not None:
        floor_max = floor.get("floor_max")
        if floor.get("losses") is not None and one is not None:
            floor_max = _diff(one["losses"], floor["losses"])
            floor["floor_max"] = floor_max
    rec["floor_max"] = floor_max
    rec["floor_note"] = FLOOR_NOTE
    for r in rec["runs"]:
        diff = _diff(one["losses"], r["losses"]) if one and r.get("losses") else None
        r["max_abs_loss_diff"] = diff
        r["floor_max"] = floor_max
        r["within_floor"] = diff is not None and floor_max is not None and diff <= floor_max
        r["bitwise_equal_to_one_gpu"] = diff == 0.0
        r["vs_one_gpu"] = (r["tokens_per_s"] / one["tokens_per_s"]) if one and one.get("tokens_per_s") else None
    order = {name: i for i, name in enumerate(SCHEDULE_RUNS)}
    rec["runs"].sort(key=lambda r: order.get(r["schedule"], len(order)))
    fsdp = rec.get("fsdp")
    rec["fsdp_tokens_per_s"] = fsdp["tokens_per_s"] if fsdp else None
    rec["fsdp_peak_mem_gib_per_gpu"] = fsdp.get("peak_mem_gib_per_gpu") if fsdp else None
    rec["fsdp_loss_note"] = FSDP_LOSS_NOTE
    rec.pop("fsdp_max_abs_loss_diff", None)  # never a parity figure (fsdp_loss_note)
    rec["missing_runs"] = [f["run"] for f in rec["failed_runs"]]
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("runs", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--cap", type=float, required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--keep", type=Path, default=None,
                   help="an earlier results file: its runs that this call did not finish are merged in")
    a = p.parse_args(argv)
    rec = build_record(a.runs, a.cap, a.command)
    if a.keep is not None:
        if a.keep.is_file():
            rec = merge(rec, json.loads(a.keep.read_text()))
        else:
            print(f"[pipeline] --keep {a.keep}: no such file; nothing merged")
    path = a.out / f"pipeline_{_slug(rec['device'])}.json"
    path.write_text(json.dumps(rec, indent=2, default=str) + "\n")
    print(f"[pipeline] wrote {path}")
    for r in rec["runs"]:
        print(f"  {r['schedule']}: {r['tokens_per_s']} tokens/s, {r['peak_mem_gib_per_gpu']} GiB, "
              f"breaks {r['graph_breaks']}, diff {r['max_abs_loss_diff']} (floor {r['floor_max']})"
              + (" [carried]" if "carried_from" in r else ""))
    big = rec["big_model"]
    print(f"  fsdp: {rec['fsdp_tokens_per_s']} tokens/s; big_model: "
          f"{big and {k: big.get(k) for k in ('layers_run', 'peak_mem_gib_per_gpu', 'tokens_per_s')}}")
    for f in rec["failed_runs"]:
        print(f"  failed: {f['run']} ({f['status']}): {f['root_cause']}")
    print(f"  missing_runs: {rec['missing_runs']}; carried: {rec.get('carried_runs', [])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
