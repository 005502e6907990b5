"""results/fsdp2_sharded_<gpu>.json from what lab/gpu/fsdp/gpu_fsdp_fast.sh wrote: nothing typed in.

Use: python lab/gpu/fsdp/fsdp_fast_results.py OUT_DIR RESULTS_JSON [COMMAND]
OUT_DIR holds runs/ (unpacked from fsdp_fast_logs.tgz), big_gpu.json / big_offload.json when
those runs finished, repro.txt and errors.txt. A run that did not finish leaves its fields None
and is named in ``missing_runs``.
"""
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

from qlora_nb_utils.training.parity import judge


def load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def frozen_gib(sharding: list) -> dict:
    """The frozen weights' GiB by kind (NF4 words, other) from a run's sharding.json."""
    size = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}
    frozen = {}
    for row in sharding:
        if not row["requires_grad"]:
            n = 1
            for d in row["global_shape"]:
                n *= d
            frozen[row["kind"]] = frozen.get(row["kind"], 0) + n * size[row["dtype"]] / 2**30
    return {"by_kind": frozen, "total": sum(frozen.values()), "half": sum(frozen.values()) / 2}


def pair_fields(runs: dict, prefix: str, rows: int) -> dict:
    """Scaling, loss parity and memory of the pairs PREFIX_1_i (1 GPU) / PREFIX_2_i (2 GPUs), i = 1..3;
    PREFIX_1_2 permutes the rows of every batch (the bf16 floor)."""
    pairs = [(runs.get(f"{prefix}_1_{i}"), runs.get(f"{prefix}_2_{i}")) for i in (1, 2, 3)]
    pairs = [(a, b) for a, b in pairs if a and b]
    ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in pairs]
    one = [a["tokens_per_s"] for a, _ in pairs]
    two = [b["tokens_per_s"] for _, b in pairs]
    p1, fl, p2 = runs.get(f"{prefix}_1_1"), runs.get(f"{prefix}_1_2"), runs.get(f"{prefix}_2_1")
    verdict = judge(p1["losses"], fl["losses"], p2["losses"]) if p1 and fl and p2 else {}
    peak1 = statistics.median(a["peak_mem_gib_per_gpu"] for a, _ in pairs) if pairs else None
    peak2 = statistics.median(b["peak_mem_gib_per_gpu"] for _, b in pairs) if pairs else None
    # the frozen bytes of the whole model: the 1-GPU run's rows (a vocabulary-split head lists only its rows)
    frozen = frozen_gib((p1 or {}).get("sharding_rows") or (p2 or {}).get("sharding_rows") or [])
    return {
        "scaling": statistics.median(ratios) if ratios else None,
        "scaling_runs": ratios,
        "scaling_spread": (max(ratios) - min(ratios)) if ratios else None,
        "scaling_definition": f"2-GPU tokens/s over 1-GPU tokens/s at global batch {2 * rows} x 2048 ({rows} "
                              "row(s) per GPU and micro-batch; the 1-GPU run accumulates 2 micro-batches), each "
                              "run alone on the machine",
        "rows_per_gpu": rows,
        "tokens_per_s_per_gpu": {"1": statistics.median(one) if one else None,
                                 "2": statistics.median(two) / 2 if two else None},
        "tokens_per_s_runs": {"1": one, "2": two},
        "per_gpu_ratio": (statistics.median(two) / 2 / statistics.median(one)) if one and two else None,
        "max_abs_loss_diff": verdict.get("max_abs_loss_diff"),
        "mean_abs_loss_diff": verdict.get("mean_abs_loss_diff"),
        "floor_max": verdict.get("floor_max_abs_loss_diff"),
        "floor_mean": verdict.get("floor_mean_abs_loss_diff"),
        "within_floor": verdict.get("within_floor"), "steps_over_floor": verdict.get("steps_over_floor"),
        "peak_mem_gib_per_gpu": {"1": peak1, "2": peak2},
        "peak_saving_gib": (peak1 - peak2) if peak1 is not None and peak2 is not None else None,
        "frozen_weight_gib": frozen if frozen["total"] else None,
        "memory_target_met": ((peak1 - peak2) >= frozen["half"]
                              if peak1 is not None and peak2 is not None and frozen["total"] else None),
    }


def read_runs(out: Path) -> dict:
    """Every finished run's summary.json under OUT/runs, with its sharding.json as ``sharding_rows``."""
    runs = {}
    for p in sorted((out / "runs").iterdir()):
        summary = load(p / "summary.json") if p.is_dir() else None
        if summary:
            summary["sharding_rows"] = load(p / "sharding.json") or []
            runs[p.name] = summary
    return runs


def main(out: str, dest: str, command: str = "") -> None:
    out = Path(out)
    runs = read_runs(out)
    pairs = [(runs.get(f"fast_1_{i}"), runs.get(f"fast_2_{i}")) for i in (1, 2, 3)]
    pairs = [(a, b) for a, b in pairs if a and b]
    p1, p2 = runs.get("fast_1_1"), runs.get("fast_2_1")
    fields = pair_fields(runs, "fast", 1)
    ranks = [r for _, b in pairs for r in b["fast_path"]["ranks"]]
    fused = all(int(r["choices"].get("nf4_lora_linear", 0) or 0) > 0 for r in ranks)
    big, big_off = load(out / "big_gpu.json"), load(out / "big_offload.json")

    def big_fields(rec, offload):
        if rec is None:
            return {"measured": False, "layers_run": None, "extrapolated": None, "peak_mem_gib_per_gpu": None,
                    "tokens_per_s": None, "cpu_offload": offload, "cpu_ram_gib": None}
        keep = ("layers_run", "layers_total", "extrapolated", "peak_mem_gib_per_gpu", "tokens_per_s", "cpu_offload",
                "cpu_ram_gib", "machine_used_gib", "build_peak_mem_gib_per_gpu", "build_s", "median_step_s",
                "step_s", "seq_len", "batch_per_gpu", "world_size", "fast_path", "graph_breaks", "compile_stats",
                "optimize_choices", "quant_storage", "nf4", "grad_ckpt", "command", "date", "device", "versions")
        return {"measured": True, **{k: rec.get(k) for k in keep}}

    ref = p2 or (pairs[0][1] if pairs else {})
    rec = {
        "nf4": p2["nf4"] if p2 else None,
        "world_size": 2,
        "fast_path": bool(ranks) and all(r["ran"] and r["sharded"] for r in ranks) and fused,
        "fast_path_note": "optimize()'s recipe ran on every rank of every 2-GPU run (choices gathered from each "
                          "rank: fused NF4 LoRA linears, groups, labelled-rows chunked loss, elementwise "
                          "recompute, autocast); regional scope, no CUDA graphs (distributed/fast.py says why)",
        "fast_path_choices_rank0": (p2 or {}).get("fast_path", {}).get("choices"),
        "one_gpu_baseline": (p1 or {}).get("fast_path", {}).get("choices", {}).get("scope"),
        **{k: v for k, v in fields.items() if k != "rows_per_gpu"},
        "bytes_equal_after_allgather": (p2 or {}).get("bytes_check", {}).get("equal"),
        "bytes_check": (p2 or {}).get("bytes_check"),
        "graph_breaks": {n: r["graph_breaks"]["total"] for n, r in runs.items()},
        "compilations": {n: (r.get("compile") or {}).get("compilations") for n, r in runs.items()},
        "losses": {n: r["losses"] for n, r in runs.items()},
        "median_step_ms": {n: r["median_step_ms"] for n, r in runs.items()},
        "big_model": big_fields(big, False),
        "big_model_offload": big_fields(big_off, True),
        "foreach_copy_repro": (out / "repro.txt").read_text() if (out / "repro.txt").is_file() else None,
        "errors": (out / "errors.txt").read_text()[-3000:] if (out / "errors.txt").is_file() else None,
        "missing_runs": sorted({f"fast_{w}_{i}" for w in (1, 2) for i in (1, 2, 3)} - set(runs))
        + ([] if big else ["big_gpu"]) + ([] if big_off else ["big_offload"]),
        "model": ref.get("model"), "seq_len": (ref.get("options") or {}).get("seq_len"),
        "device": ref.get("device"), "versions": ref.get("versions"),
        "run_commands": {n: r.get("command") for n, r in runs.items()},
        "command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(),
        "runs_date": ref.get("date"),
    }
    Path(dest).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    for key in ("nf4", "fast_path", "scaling", "scaling_runs", "tokens_per_s_per_gpu", "per_gpu_ratio",
                "max_abs_loss_diff", "floor_max", "within_floor", "peak_mem_gib_per_gpu", "frozen_weight_gib",
                "bytes_equal_after_allgather", "missing_runs"):
        print(f"{key}: {rec[key]}")


if __name__ == "__main__":
    main(*sys.argv[1:])
