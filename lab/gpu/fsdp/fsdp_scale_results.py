"""lab/results/fsdp/fsdp2_scaling_<gpu>.json from what lab/gpu/fsdp/gpu_fsdp_scale.sh wrote: nothing typed in.

Use: python lab/gpu/fsdp/fsdp_scale_results.py RUNS_DIR SHARDED_JSON DEST_JSON [COMMAND]
     python lab/gpu/fsdp/fsdp_scale_results.py --vocab-only VHEAD_LOGS_TGZ DEST_JSON [COMMAND]
RUNS_DIR holds mb<R>_logs.tgz (one call of gpu_fsdp_scale.sh each, R rows per GPU), nccl.json and
topo.txt, and vhead_logs.tgz where a call ran with VOCAB_HEAD=1 (the 2-GPU arm with the LM head split
by vocabulary, plus one plain 2-GPU run in the same call): its table goes under ``vocab_parallel_head``
of both files. SHARDED_JSON is fsdp2_sharded_<gpu>.json: its 1-row pairs join the table, and its
headline scaling, throughput, parity and memory fields are set from the largest per-GPU batch
measured (the 1-row fields kept under ``at_1_row``).
"""
import datetime as dt
import json
import re
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_fast_results import pair_fields, read_runs  # noqa: E402

HEADLINE = ("scaling", "scaling_runs", "scaling_spread", "scaling_definition", "tokens_per_s_per_gpu",
            "tokens_per_s_runs", "per_gpu_ratio", "max_abs_loss_diff", "mean_abs_loss_diff", "floor_max",
            "floor_mean", "within_floor", "steps_over_floor", "peak_mem_gib_per_gpu", "peak_saving_gib",
            "memory_target_met")


def profile_totals(path: Path) -> dict | None:
    """Self CPU and device time totals (ms) of one rank's profile tables, and the collectives' device time."""
    if not path.is_file():
        return None
    text = path.read_text()
    cpu = re.findall(r"Self CPU time total: ([\d.]+)(ms|s)", text)
    dev = re.findall(r"Self CUDA time total: ([\d.]+)(ms|s)", text)
    ms = lambda v, u: float(v) * (1000 if u == "s" else 1)  # noqa: E731
    coll = {}
    for line in text.split("# by CPU time")[0].splitlines():
        cols = re.split(r"\s{2,}", line.strip())
        if cols[0] in ("nccl:_all_gather_base", "nccl:_reduce_scatter_base", "nccl:all_reduce") and len(cols) > 6:
            value = re.fullmatch(r"([\d.]+)(ms|us|s)", cols[6])  # the Self CUDA column
            if value:
                coll[cols[0]] = float(value.group(1)) * {"s": 1000, "ms": 1, "us": 1e-3}[value.group(2)]
    return {"self_cpu_ms": ms(*cpu[0]) if cpu else None, "self_device_ms": ms(*dev[0]) if dev else None,
            "collectives_device_ms": coll}


def read_profiles(runs_dir: Path, runs: dict) -> dict:
    """prof_1 / prof_2 totals per rank under RUNS_DIR/runs, with the rows per GPU they ran at (from
    ``runs``, :func:`read_runs` of the same folder)."""
    profiles = {}
    for name in ("prof_1", "prof_2"):
        rows = ((runs.get(name) or {}).get("options") or {}).get("micro_batch_size")
        for rank in (0, 1):
            got = profile_totals(runs_dir / "runs" / name / f"profile_rank{rank}.txt")
            if got:
                profiles[f"{name}_rank{rank}"] = {**got, "steps": 2, "rows_per_gpu": rows,
                                                  "micro_batches": 4 if name == "prof_1" else 2}
    return profiles


def vocab_head_table(tgz: Path) -> dict:
    """The VOCAB_HEAD=1 call's pairs (the 2-GPU arm with the LM head split by vocabulary), its plain 2-GPU run
    and, where the call profiled, the profiled pair's totals."""
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(tgz) as tar:
            tar.extractall(tmp, filter="data")
        runs = read_runs(Path(tmp))
        profiles = read_profiles(Path(tmp), runs)
    rows = runs["scale_2_1"]["options"]["micro_batch_size"]
    plain = runs.get("plain_2_1")
    return pair_fields(runs, "scale", rows) | {
        "profiles": profiles or None,
        "source": f"{tgz.parent.name}/{tgz.name}",
        "vocab_parallel_head": [runs[f"scale_2_{i}"].get("vocab_parallel_head") for i in (1, 2, 3)
                                if f"scale_2_{i}" in runs],
        "plain_same_call": None if not plain else {
            "peak_mem_gib_per_gpu": plain["peak_mem_gib_per_gpu"], "tokens_per_s": plain["tokens_per_s"],
            "median_step_ms": plain["median_step_ms"],
            "scaling": plain["tokens_per_s"] / runs["scale_1_1"]["tokens_per_s"] if "scale_1_1" in runs else None},
        "median_step_ms": {n: r["median_step_ms"] for n, r in runs.items()},
        "graph_breaks": {n: r["graph_breaks"].get("total") for n, r in runs.items()},
        "compilations": {n: r["compile"]["compilations"] for n, r in runs.items()},
        "run_commands": {n: r.get("command") for n, r in runs.items()},
        "device": runs["scale_2_1"].get("device"), "versions": runs["scale_2_1"].get("versions"),
        "date": runs["scale_2_1"].get("date"),
    }


def main(runs_dir: str, sharded_json: str, dest: str, command: str = "") -> None:
    runs_dir = Path(runs_dir)
    sharded = json.loads(Path(sharded_json).read_text())
    table = {"1": {k: sharded.get(k) for k in HEADLINE} | {"source": Path(sharded_json).name}}
    if "at_1_row" in sharded:
        table["1"] = {**sharded["at_1_row"], "source": Path(sharded_json).name}
    device = versions = None
    profiles = {}
    run_commands = {}
    vocab_head = None
    if (runs_dir / "vhead_logs.tgz").is_file():
        vocab_head = vocab_head_table(runs_dir / "vhead_logs.tgz")
    for tgz in sorted(runs_dir.glob("mb*_logs.tgz")):
        rows = int(tgz.name[2:].split("_")[0])
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(tgz) as tar:
                tar.extractall(tmp, filter="data")
            runs = read_runs(Path(tmp))
            table[str(rows)] = {**pair_fields(runs, "scale", rows), "source": f"{runs_dir.name}/{tgz.name}"}
            ref = runs.get("scale_2_1") or {}
            device, versions = ref.get("device", device), ref.get("versions", versions)
            run_commands[str(rows)] = {n: r.get("command") for n, r in runs.items()}
            profiles.update(read_profiles(Path(tmp), runs))
    best = max(table, key=int)
    rec = {
        "model": sharded.get("model"), "seq_len": sharded.get("seq_len"), "world_size": 2,
        "by_rows_per_gpu": table,
        "headline_rows_per_gpu": int(best),
        "nccl": json.loads((runs_dir / "nccl.json").read_text()) if (runs_dir / "nccl.json").is_file() else None,
        "topology": (runs_dir / "topo.txt").read_text().split("\n\n")[0] if (runs_dir / "topo.txt").is_file() else None,
        "profiles": profiles,
        "vocab_parallel_head": vocab_head,
        "device": device, "versions": versions, "run_commands": run_commands,
        "command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(),
    }
    Path(dest).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    if "at_1_row" not in sharded:
        sharded["at_1_row"] = {k: sharded.get(k) for k in HEADLINE}
    # the headline is the configuration that meets the memory target at the headline rows: the split head
    # where its call measured there and met it (FSDP2's sharded head alone does not), else the plain pairs
    split = (vocab_head is not None and vocab_head.get("rows_per_gpu") == int(best)
             and vocab_head.get("memory_target_met"))
    sharded.update({k: (vocab_head if split else table[best])[k] for k in HEADLINE})
    sharded["scaling_rows_per_gpu"] = int(best)
    sharded["scaling_configuration"] = ("the LM head split by vocabulary (--vocab-parallel-head)" if split
                                        else "the LM head sharded by FSDP2")
    if vocab_head:
        sharded["vocab_parallel_head"] = vocab_head
    sharded["scaling_source"] = (f"{Path(dest).name} (vocab_parallel_head, {best} rows per GPU; the plain pairs: "
                                 f"by_rows_per_gpu.{best}; the 1-row pairs: at_1_row)" if split else
                                 f"{Path(dest).name} (by_rows_per_gpu.{best}; the 1-row pairs: at_1_row)")
    Path(sharded_json).write_text(json.dumps(sharded, indent=1, default=str) + "\n")
    for rows, row in sorted(table.items(), key=lambda kv: int(kv[0])):
        print(rows, {k: row.get(k) for k in ("scaling", "scaling_runs", "per_gpu_ratio", "peak_mem_gib_per_gpu",
                                              "peak_saving_gib", "max_abs_loss_diff", "floor_max", "within_floor")})


def vocab_only(tgz: str, dest: str, command: str = "") -> None:
    """A VOCAB_HEAD=1 call on its own (a card with no other scaling record): its table as ``dest``."""
    rec = vocab_head_table(Path(tgz)) | {"command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat()}
    Path(dest).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    print({k: rec.get(k) for k in ("scaling", "scaling_runs", "peak_mem_gib_per_gpu", "peak_saving_gib",
                                    "memory_target_met", "within_floor", "plain_same_call")})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--vocab-only"]:
        vocab_only(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
