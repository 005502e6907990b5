#!/usr/bin/env bash
# Wrote: lab/results/fsdp/fsdp2_h200.json, lab/results/fsdp/fsdp2_h200_runs/, lab/results/fsdp/fsdp2_h200_loss.png (through gpu_fsdp_all.sh)
# Rerun: OUT=$OUT bash lab/gpu/fsdp/gpu_fsdp.sh (2 GPUs: nvidia-h200-x2)
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache)
# QLoRA + FSDP2 + per-layer torch.compile on 1 and 2 GPUs: the runs behind results/fsdp2_<device>.json.
# For a machine with 2 GPUs (2x H200), torch/transformers/peft/accelerate installed, no network:
# bitsandbytes/datasets/trl come from the carried .whl/ folder, the SmolLM2 tokenizer from
# .gpucache/ (see lab/gpu/bench/gpu_bench.sh). Usage, from the repository root:
#     OUT=/some/dir bash lab/gpu/fsdp/gpu_fsdp.sh          (OUT defaults to ./out/fsdp2)
# Budget: ~9 minutes wall time. Three runs of llama-3.1-8b-shape NF4 QLoRA at seq 2048:
#   parity_1  1 GPU,  global batch 2 (micro-batch 1 x 2 accumulation), 30 steps  } concurrently,
#   scaling_1 1 GPU,  global batch 1 (per-GPU batch 1), 12 steps                } one per GPU
#   parity_2  2 GPUs, global batch 2 (per-GPU batch 1), 30 steps: parity with parity_1 and
#             tokens/s against scaling_1 at the same per-GPU batch.
# Each run has a timeout; whatever finished is kept, and the JSON says what is missing.
# BUDGET (seconds, default 530) bounds the whole script; the 1-GPU pair gets at most 270 of it.
set -euo pipefail
OUT=${OUT:-$PWD/out/fsdp2}
mkdir -p "$OUT"
T0=$(date +%s)
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
MODEL=${MODEL:-llama-3.1-8b-shape}
NF4=${NF4:-auto}  # auto = replicate on NCCL: sharded NF4 bytes did not survive NCCL (lab/results/fsdp/fsdp2_h200_diag.json)
FROZEN=${FROZEN:-shard}  # replicate: embeddings/LM head/norms whole on every GPU (no all-gather)
COMMON=(--model "$MODEL" --quant nf4 --nf4 "$NF4" --frozen "$FROZEN" --seq-len 2048 --pack --dtype bfloat16 --device cuda
        --compile --backend inductor --no-fullgraph --lr 2e-4 --seed 0 --timing-warmup 3)
RUNS="$OUT/runs"
mkdir -p "$RUNS"

# 1. Build the random 8B-shape checkpoint once (bf16 safetensors in the cache; ranks only read it).
echo "[gpu_fsdp] building/locating $MODEL ($(($(date +%s) - T0)) s)"
timeout 240 python3 -c "from qlora_nb_utils import models; print(models.materialize('$MODEL'))" \
  2>&1 | tail -3 || echo "[gpu_fsdp] build failed or timed out" | tee -a "$OUT/errors.txt"

run() {  # run NAME TIMEOUT_S GPUS NPROC ARGS...
  local name=$1 limit=$2 gpus=$3 nproc=$4
  shift 4
  echo "[gpu_fsdp] $name on GPU(s) $gpus, $nproc process(es), limit ${limit}s ($(($(date +%s) - T0)) s elapsed)"
  if CUDA_VISIBLE_DEVICES=$gpus timeout --signal=TERM --kill-after=20 "$limit" \
      python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
      -m qlora_nb_utils.distributed.fsdp_train "${COMMON[@]}" "$@" --out "$RUNS/$name" > "$RUNS/$name.log" 2>&1; then
    echo "[gpu_fsdp] $name done ($(($(date +%s) - T0)) s elapsed)"
  else
    echo "[gpu_fsdp] $name FAILED or timed out (exit $?); tail of its log:" | tee -a "$OUT/errors.txt"
    tail -25 "$RUNS/$name.log" | tee -a "$OUT/errors.txt"
  fi
}

# 2. The two 1-GPU runs side by side, one per GPU; then the 2-GPU run.
BUDGET=${BUDGET:-530}
PAIR=$(( BUDGET / 2 < 270 ? BUDGET / 2 : 270 ))
if [ "${SEQUENTIAL:-0}" = 1 ]; then
  # Alone on the machine: run side by side, the 1-GPU baseline shared the host with the other
  # run's compilation and measured 349 ms/step where it ran 263 ms alone (2026-11-22 vs -21).
  run scaling_1 "$PAIR" 0 1 --steps 30 --global-batch-size 1 --no-adapter
  run parity_1 "$PAIR" 0 1 --steps 30 --global-batch-size 2 --micro-batch-size 1 --no-adapter
else
  run parity_1 "$PAIR" 0 1 --steps 30 --global-batch-size 2 --micro-batch-size 1 --no-adapter &
  P1=$!
  run scaling_1 "$PAIR" 1 1 --steps 12 --global-batch-size 1 --no-adapter &
  P2=$!
  wait $P1 || true
  wait $P2 || true
fi
LEFT=$((BUDGET - ($(date +%s) - T0)))
if [ "$LEFT" -gt 60 ]; then
  run parity_2 "$LEFT" 0,1 2 --steps 30 --global-batch-size 2 --micro-batch-size 1 --probe
else
  echo "[gpu_fsdp] no time left for parity_2 ($LEFT s)" | tee -a "$OUT/errors.txt"
fi

# 3. The results file (partial when a run is missing), and the loss plot.
FROZEN=$FROZEN NF4=$NF4 python3 - "$RUNS" "$OUT" "$0 $*" <<'EOF' || echo "[gpu_fsdp] writing the results failed" | tee -a "$OUT/errors.txt"
import json, os, re, sys, datetime
from pathlib import Path
import torch
from qlora_nb_utils.distributed.runs import compare_runs

runs, out, command = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
done = {p.name for p in runs.iterdir() if (p / "summary.json").is_file()}
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
slug = re.sub(r"[^a-z0-9]+", "", name.lower().replace("nvidia", "")) or "gpu"
if {"parity_1", "parity_2"} <= done:
    res = compare_runs(runs / "parity_1", runs / "parity_2",
                       runs / "scaling_1" if "scaling_1" in done else None)
    res["scaling_baseline"] = (("scaling_1: 1 GPU, global batch 1, 30 steps, alone on the machine" if os.environ.get("SEQUENTIAL") == "1" else
                                "scaling_1: 1 GPU, global batch 1, run concurrently with parity_1 on the other GPU")
                               if "scaling_1" in done else
                               "parity_1 (1 GPU, micro-batch 1 x 2 accumulation): scaling_1 did not finish")
else:
    res = {"partial": True, "finished_runs": sorted(done),
           "summaries": {n: json.loads((runs / n / "summary.json").read_text()) for n in sorted(done)}}
res["command"] = command
res["env"] = {k: os.environ.get(k) for k in ("FROZEN", "NF4", "SEQUENTIAL", "TORCHINDUCTOR_DETERMINISTIC")}
res["device_name"] = name
res["missing_runs"] = sorted({"parity_1", "parity_2", "scaling_1"} - done)
res["written"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
path = out / f"fsdp2_{slug}.json"
path.write_text(json.dumps(res, indent=2, default=str) + "\n")
print(f"[gpu_fsdp] wrote {path}")
for key in ("world_size", "tokens_per_s", "scaling", "peak_mem_gib_per_gpu", "max_abs_loss_diff"):
    if key in res:
        print(f"  {key}: {res[key]}")
if "graph_breaks" in res:
    print("  graph_breaks:", {k: v.get("total") for k, v in res["graph_breaks"].items()})
try:
    import pandas as pd
    from qlora_nb_utils import plots
    rows = [{"run": f"{k} GPU", "step": i, "loss": v} for k, ls in res["losses"].items() for i, v in enumerate(ls)]
    plots.plot_loss_curves(pd.DataFrame(rows), title=f"{res['model']}: 1 vs {res['world_size']} GPUs (FSDP2)",
                           path=out / f"fsdp2_{slug}_loss.png")
except Exception as exc:  # plotting is a convenience; the JSON is the result
    print(f"[gpu_fsdp] no plot: {exc!r}")
EOF
echo "[gpu_fsdp] finished in $(($(date +%s) - T0)) s"
