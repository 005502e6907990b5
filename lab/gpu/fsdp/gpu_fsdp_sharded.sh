#!/usr/bin/env bash
# Writes: $OUT/fsdp2_sharded_<gpu>.json (copy to results/), $OUT/nf4_probe.json, $OUT/big_model.json, $OUT/fsdp_sharded_logs.tgz
# Rerun: OUT=$OUT bash lab/gpu/fsdp/gpu_fsdp_sharded.sh (nvidia-h200-x2; carry .whl .gpucache)
#   (on the lent GPU machine, from the repository root). Not yet run on a GPU.
# Issue 21 in one 2-GPU call: NF4 weights sharded over NCCL with the float32-word plan of
# qlora_nb_utils/distributed/packed_words.py, at the llama-3.1-8b shape (seq 2048, packed, bf16 compute):
#   0. nf4_probe on 2 GPUs: does CUDA's same-dtype _foreach_copy_ rewrite bf16 NaN words to 7fff
#      (hypothesis: 253 of the 65,536 patterns), and does fully_shard do it (bf16 words) or not (fp32)?
#   1. parity_1 (1 GPU, global batch 2 = 1 x 2 accumulation) beside floor_1 (the same, rows permuted:
#      the bf16 floor of training/parity.py) on the other GPU; then parity_2 (2 GPUs, global batch 2,
#      --check-bytes: every packed byte compared after the first all-gather)
#   2. REPEATS (3) x [scaling_1 (1 GPU, batch 1), scaling_2 (2 GPUs, batch 1 per GPU)], each alone
#   3. big_model: the Llama-3.1-70B shape, BIG_LAYERS (20) layers, sharded on 2 GPUs, grad ckpt
# BUDGET (s, default 560) bounds the whole; a step that no longer fits is skipped and listed in missing_runs.
# PHASE=big runs only step 3 and merges into results/fsdp2_sharded_<gpu>.json when that file exists
# (a second call when the first ran out of time). DRY=1: the tiny model on the CPU over gloo, 2 steps
# (the CI dry run of everything but the GPU: tests/test_fsdp_sharded_script.py).
set -uo pipefail
OUT=${OUT:-$PWD/out/fsdp_sharded}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-560}
REPEATS=${REPEATS:-3}
PHASE=${PHASE:-all}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
if [ "${DRY:-0}" = 1 ]; then
  PY=${PY:-python3}
  export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  MODEL=tiny; STEPS=2; SCALE_STEPS=2; DEV=(--device cpu --dtype float32 --backend eager)
  BIG=(--shape llama-tiny --layers 2 --seq-len 32 --steps 2 --device cpu); GPUS0=""; GPUS1=""; GPUS01=""
else
  PY=python3
  source "$(dirname "$0")/../gpu_env.sh"
  nvidia-smi -L | tee "$OUT/gpus.txt"
  MODEL=${MODEL:-llama-3.1-8b-shape}; STEPS=${STEPS:-20}; SCALE_STEPS=${SCALE_STEPS:-12}
  DEV=(--device cuda --dtype bfloat16 --backend inductor --no-fullgraph --seq-len 2048 --pack)
  BIG=(--shape llama-3.1-70b --layers "${BIG_LAYERS:-20}" --seq-len 2048 --steps 5 --device cuda)
  GPUS0=0; GPUS1=1; GPUS01=0,1
fi
COMMON=(--model "$MODEL" --quant nf4 --nf4 shard --lr 2e-4 --seed 0 --timing-warmup 3 --no-adapter "${DEV[@]}")
[ "${DRY:-0}" = 1 ] && COMMON+=(--seq-len 128 --timing-warmup 0)
RUNS="$OUT/runs"; mkdir -p "$RUNS"

trun() {  # trun NAME LIMIT_S GPUS NPROC MODULE ARGS...: one torchrun, its log in $RUNS/NAME.log
  local name=$1 limit=$2 gpus=$3 nproc=$4 module=$5
  shift 5
  if [ "$limit" -lt 30 ]; then echo "[sharded] skip $name: ${limit}s left" | tee -a "$OUT/errors.txt"; return 1; fi
  echo "[sharded] $name: $nproc process(es), GPUs '${gpus}', limit ${limit}s ($(( $(date +%s) - T0 )) s elapsed)"
  CUDA_VISIBLE_DEVICES=$gpus timeout --signal=TERM --kill-after=20 "$limit" \
    $PY -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m "$module" "$@" > "$RUNS/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && { echo "[sharded] $name FAILED (exit $rc)" | tee -a "$OUT/errors.txt"; tail -15 "$RUNS/$name.log" >> "$OUT/errors.txt"; }
  return $rc
}
[ "${DRY:-0}" = 1 ] || unset CUDA_VISIBLE_DEVICES
FT=qlora_nb_utils.distributed.fsdp_train

if [ "$PHASE" = all ]; then
  [ "${DRY:-0}" = 1 ] || timeout 240 $PY -c "from qlora_nb_utils import models; print(models.materialize('$MODEL'))" 2>&1 | tail -1
  trun nf4_probe 90 "$GPUS01" 2 qlora_nb_utils.distributed.nf4_probe --out "$OUT/nf4_probe.json"
  grep "nf4_probe\]" "$RUNS/nf4_probe.log" | tail -1
  LIM=$(( $(left) / 4 )); [ $LIM -gt 150 ] && LIM=150
  trun parity_1 "$LIM" "$GPUS0" 1 $FT "${COMMON[@]}" --steps "$STEPS" --global-batch-size 2 --micro-batch-size 1 --out "$RUNS/parity_1" &
  P1=$!
  trun floor_1 "$LIM" "$GPUS1" 1 $FT "${COMMON[@]}" --steps "$STEPS" --global-batch-size 2 --micro-batch-size 1 --permute-rows 1 --out "$RUNS/floor_1" &
  P2=$!
  wait $P1; wait $P2
  trun parity_2 "$(( $(left) > 150 ? 150 : $(left) ))" "$GPUS01" 2 $FT "${COMMON[@]}" --steps "$STEPS" --global-batch-size 2 --micro-batch-size 1 --check-bytes --out "$RUNS/parity_2"
  for i in $(seq 1 "$REPEATS"); do  # each run alone on the machine
    trun "scaling_1_$i" "$(( $(left) - ${BIG_RESERVE:-150} ))" "$GPUS0" 1 $FT "${COMMON[@]}" --steps "$SCALE_STEPS" --global-batch-size 1 --out "$RUNS/scaling_1_$i"
    trun "scaling_2_$i" "$(( $(left) - ${BIG_RESERVE:-150} ))" "$GPUS01" 2 $FT "${COMMON[@]}" --steps "$SCALE_STEPS" --global-batch-size 2 --out "$RUNS/scaling_2_$i"
  done
fi
if [ "$PHASE" = all ] || [ "$PHASE" = big ]; then
  trun big_model "$(( $(left) - 20 ))" "$GPUS01" 2 qlora_nb_utils.distributed.big_model "${BIG[@]}" --out "$OUT/big_model.json"
  grep "big_model\]" "$RUNS/big_model.log" | tail -1
fi

$PY - "$RUNS" "$OUT" "$PHASE" "OUT=\$OUT PHASE=$PHASE BUDGET=$BUDGET REPEATS=$REPEATS DRY=${DRY:-0} bash $0" <<'PYEOF'
import json, re, sys
from pathlib import Path
import torch
from lab.report.fsdp import sharded_record

runs, out, phase, command = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
slug = re.sub(r"[^a-z0-9]+", "", name.lower().replace("nvidia", "")) or "gpu"
previous = Path("results") / f"fsdp2_sharded_{slug}.json"
if phase == "big" and previous.is_file():
    rec = json.loads(previous.read_text())
    big = out / "big_model.json"
    rec["big_model"] = json.loads(big.read_text()) if big.is_file() else rec.get("big_model")
    rec.setdefault("later_commands", []).append(command)
else:
    rec = sharded_record(runs, out / "nf4_probe.json", out / "big_model.json", command)
rec["device_name"] = name
path = out / f"fsdp2_sharded_{slug}.json"
path.write_text(json.dumps(rec, indent=2, default=str) + "\n")
print(f"[sharded] wrote {path}")
for key in ("nf4", "world_size", "scaling", "scaling_runs", "max_abs_loss_diff", "floor_max", "within_floor",
            "peak_mem_gib_per_gpu", "bytes_equal_after_allgather", "missing_runs"):
    print(f"  {key}: {rec.get(key)}")
if rec.get("big_model"):
    print("  big_model:", {k: rec["big_model"].get(k) for k in ("layers_run", "peak_mem_gib_per_gpu", "tokens_per_s", "extrapolated")})
PYEOF
tar czf "$OUT/fsdp_sharded_logs.tgz" -C "$OUT" --exclude='*.safetensors' --exclude='ckpt*' --exclude='adapter' runs 2>/dev/null
echo "[sharded] finished in $(( $(date +%s) - T0 )) s"
