"""Merge what lab/gpu/fsdp/gpu_fsdp_launch.sh wrote into results/fsdp2_sharded_<gpu>.json: nothing typed in.

Use: python lab/gpu/fsdp/fsdp_launch_results.py OUT_DIR RESULTS_JSON CALL_NAME COMMAND [WHAT]
OUT_DIR holds big_offload.json (when the 70B offload run finished), runs/ (unpacked from
launch_logs.tgz), errors.txt when a step failed, gpus.txt. Fills ``big_model_offload`` from the
measured record only, adds ``launch`` (the torchrun and accelerate runs, the HF Trainer route as
``trainer_hf``), ``adapter_one_gpu`` (the torchrun run's adapter on one GPU) and ``calls[CALL_NAME]``.
"""
import json
import sys
from pathlib import Path

#: the per-GPU peak of the configuration that Answer.AI and PEFT describe as fitting 2 x 24 GB cards
OFFLOAD_TARGET_GIB = 20.0
KEEP = ("layers_run", "layers_total", "extrapolated", "peak_mem_gib_per_gpu", "tokens_per_s", "cpu_offload",
        "cpu_ram_gib", "cpu_ram_note", "machine_used_gib", "build_peak_mem_gib_per_gpu", "build_s", "median_step_s",
        "first_step_s", "step_s", "steps", "seq_len", "batch_per_gpu", "world_size", "fast_path", "graph_breaks",
        "compile_stats", "optimize_choices", "quant_storage", "nf4", "grad_ckpt", "command", "date", "device",
        "versions")
LAUNCH_KEEP = ("world_size", "backend", "model", "nf4", "quant_storage", "frozen", "mp_param_dtype", "steps",
               "losses", "eval_loss", "tokens_per_s", "median_step_ms", "first_step_s", "peak_mem_gib_per_gpu",
               "command", "date")

TRAINER_KEEP = ("world_size", "trainer", "model", "distributed_type", "fsdp_wrapped", "nf4", "quant_storage", "losses",
                "train_runtime_s", "bytes_check", "device", "versions", "date")


def load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def main(out: str, dest: str, call: str, command: str,
         what: str = "70B offload run and the torchrun / accelerate launches") -> None:
    out, dest = Path(out), Path(dest)
    rec = json.loads(dest.read_text())
    big = load(out / "big_offload.json") or load(out / "runs" / "big_offload.json")
    errors = (out / "errors.txt").read_text()[-3000:] if (out / "errors.txt").is_file() else None
    if big is not None:
        rec["big_model_offload"] = {"measured": True, "call": call, **{k: big.get(k) for k in KEEP},
                                    "peak_target_gib": OFFLOAD_TARGET_GIB,
                                    "peak_target_met": big["peak_mem_gib_per_gpu"] <= OFFLOAD_TARGET_GIB,
                                    "build_peak_target_met": big["build_peak_mem_gib_per_gpu"] <= OFFLOAD_TARGET_GIB,
                                    "peak_note": "peak_mem_gib_per_gpu is the training peak (reset after sharding); "
                                                 "build_peak_mem_gib_per_gpu is the peak while the model is built, "
                                                 "when every GPU holds all NF4 weights before fully_shard moves its "
                                                 "shards to the CPU"}
        rec["missing_runs"] = [r for r in rec.get("missing_runs", []) if r != "big_offload"]
    launch = {k: v for k, v in (rec.get("launch") or {}).items() if k not in ("same_losses", "same_eval_loss")}
    for name, launcher in (("launch_torchrun", "torchrun"), ("launch_accelerate", "accelerate launch")):
        summ = load(out / "runs" / name / "summary.json")
        cmd = (out / "runs" / f"{name}.cmd").read_text().strip() if (out / "runs" / f"{name}.cmd").is_file() else None
        if summ is None and cmd is None:
            continue  # the step was left out of this call (SKIP_*): an earlier call's record stays
        if summ is None:
            launch[launcher] = {"ran": False, "call": call, "launch_command": cmd}
            continue
        launch[launcher] = {"ran": True, "call": call, "launch_command": cmd, **{k: summ.get(k) for k in LAUNCH_KEEP},
                            "graph_breaks": summ["graph_breaks"]["total"],
                            "bytes_equal_after_allgather": (summ.get("bytes_check") or {}).get("equal"),
                            "bytes_check": summ.get("bytes_check")}
    runs = [launch[k] for k in ("torchrun", "accelerate launch") if launch.get(k, {}).get("ran")]
    if len(runs) == 2:
        if runs[0].get("call") == runs[1].get("call"):  # the two launchers compared within one call only
            launch["same_losses"] = runs[0]["losses"] == runs[1]["losses"]
            launch["same_eval_loss"] = runs[0]["eval_loss"] == runs[1]["eval_loss"]
    trainer = load(out / "runs" / "launch_trainer_hf" / "summary.json")
    if trainer is not None or (out / "runs" / "launch_trainer_hf.cmd").is_file():
        cmd = (out / "runs" / "launch_trainer_hf.cmd").read_text().strip()
        launch["trainer_hf"] = {"ran": trainer is not None, "call": call, "launch_command": cmd, **{
            k: (trainer or {}).get(k) for k in TRAINER_KEEP}}
        if trainer is not None:
            launch["trainer_hf"]["bytes_equal_after_allgather"] = (trainer.get("bytes_check") or {}).get("equal")
    adapter = load(out / "runs" / "adapter_one_gpu.json")
    if adapter is not None:
        rec["adapter_one_gpu"] = {"call": call, **adapter}
    launch["call"] = call
    rec["launch"] = launch
    ref = big or next((load(out / "runs" / n / "summary.json") for n in ("launch_torchrun", "launch_accelerate")
                       if load(out / "runs" / n / "summary.json")), {}) or {}
    gpus = (out / "gpus.txt").read_text().strip() if (out / "gpus.txt").is_file() else None
    rec.setdefault("calls", {})[call] = {"what": what,
                                        "command": command, "gpus": gpus, "device": ref.get("device"),
                                        "versions": ref.get("versions"), "date": ref.get("date"), "errors": errors}
    dest.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    off = rec["big_model_offload"]
    print({k: off.get(k) for k in ("measured", "layers_run", "peak_mem_gib_per_gpu", "build_peak_mem_gib_per_gpu",
                                   "tokens_per_s", "cpu_ram_gib", "peak_target_met")})
    print({k: (v if not isinstance(v, dict) else {x: v.get(x) for x in ("ran", "tokens_per_s", "eval_loss")})
           for k, v in launch.items()})


if __name__ == "__main__":
    main(*sys.argv[1:])
