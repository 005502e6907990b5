#!/usr/bin/env bash
# Writes: $OUT/big_offload.json (when it finished), $OUT/launch_logs.tgz (runs/: each run's command,
#   log, summary.json, log.jsonl, sharding.json; runs/ itself is removed), $OUT/errors.txt (failures), $OUT/gpus.txt.
# Use (one call on nvidia-h200-x2 or nvidia-h100-x2, carry .whl .gpucache, about 6 minutes):
#   OUT=$OUT bash lab/gpu/fsdp/gpu_fsdp_launch.sh
# Each step has its own time limit, so one failure leaves the others their time:
#   1. big_offload: the Llama-3.1-70B shape, all 80 layers, 2 GPUs, fast path, FSDP2 CPU offload of
#      the frozen shards, BIG_STEPS steps (qlora_nb_utils.distributed.big_model --cpu-offload).
#   2. launch_torchrun: `torchrun --standalone --nproc-per-node 2 -m ...fsdp_train` on a small model.
#   3. launch_accelerate: the same arguments through
#      `accelerate launch --config_file configs/accelerate_fsdp2.yaml -m ...fsdp_train`.
#   4. launch_trainer_hf: the HF Trainer route (`fsdp_train --trainer hf`, accelerate's FSDP2) with NF4
#      sharded as float32 words and every packed byte compared after accelerate's all-gather.
#   5. adapter_one_gpu: step 2's adapter loaded on one GPU (lab/gpu/fsdp/adapter_one_gpu.py), its eval loss.
# SKIP_BIG=1 / SKIP_ACCEL=1 leave step 1 / step 3 out (their results are kept in the results file).
# DRY=1: the tiny model and llama-tiny on the CPU over gloo (accelerate launched with --cpu off:
#   its config file starts 2 processes there too).
set -uo pipefail
OUT=${OUT:-$PWD/out/fsdp_launch}
mkdir -p "$OUT/runs"
T0=$(date +%s)
if [ "${DRY:-0}" = 1 ]; then
  PY=${PY:-python3}
  export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  BIG=(--shape llama-tiny --seq-len 32 --steps 2 --device cpu)
  SMALL=(--model tiny --device cpu --dtype float32 --backend eager --seq-len 128 --steps 2 --timing-warmup 0)
  LIM_BIG=${LIM_BIG:-120}; LIM_LAUNCH=${LIM_LAUNCH:-120}
else
  PY=python3
  source "$(dirname "$0")/../gpu_env.sh"
  nvidia-smi -L | tee "$OUT/gpus.txt"
  BIG=(--shape llama-3.1-70b --seq-len 2048 --steps "${BIG_STEPS:-3}" --device cuda)
  SMALL=(--model "${SMALL_MODEL:-llama-3.2-1b-shape-4l}" --build layerwise --device cuda --dtype bfloat16
         --seq-len 512 --steps "${SMALL_STEPS:-6}" --timing-warmup 2)
  LIM_BIG=${LIM_BIG:-210}; LIM_LAUNCH=${LIM_LAUNCH:-100}
fi
SMALL+=(--pack --nf4 shard --frozen shard --fast-path --check-bytes --eval --global-batch-size 4
        --micro-batch-size 1 --lr 2e-4 --seed 0)

step() {  # step NAME LIMIT_S CMD...: its log in $OUT/runs/NAME.log, a failure in $OUT/errors.txt
  local name=$1 limit=$2
  shift 2
  echo "[launch] $name: limit ${limit}s ($(( $(date +%s) - T0 )) s elapsed): $*" | tee "$OUT/runs/$name.cmd"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" > "$OUT/runs/$name.log" 2>&1
  local rc=$?
  echo "[launch] $name exit $rc ($(( $(date +%s) - T0 )) s elapsed)"
  if [ $rc -ne 0 ]; then
    { echo "[launch] $name FAILED (exit $rc)"; tail -30 "$OUT/runs/$name.log"; } | tee -a "$OUT/errors.txt"
  fi
  grep -h "^\[fsdp_train\]\|^\[big_model\]" "$OUT/runs/$name.log" | tail -2
  return 0
}

[ "${SKIP_BIG:-0}" = 1 ] || step big_offload "$LIM_BIG" $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
  -m qlora_nb_utils.distributed.big_model "${BIG[@]}" --fast-path --cpu-offload --out "$OUT/big_offload.json"
cp "$OUT/big_offload.json" "$OUT/runs/" 2>/dev/null
step launch_torchrun "$LIM_LAUNCH" $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
  -m qlora_nb_utils.distributed.fsdp_train "${SMALL[@]}" --out "$OUT/runs/launch_torchrun"
[ "${SKIP_ACCEL:-0}" = 1 ] || step launch_accelerate "$LIM_LAUNCH" $PY -m accelerate.commands.launch --config_file configs/accelerate_fsdp2.yaml \
  --num_processes 2 -m qlora_nb_utils.distributed.fsdp_train "${SMALL[@]}" --out "$OUT/runs/launch_accelerate"
TRAINER=()  # the same arguments but --fast-path and --eval: the Trainer compiles each layer itself (its callback)
for a in "${SMALL[@]}"; do case $a in --fast-path|--eval) ;; *) TRAINER+=("$a") ;; esac; done
step launch_trainer_hf "$LIM_LAUNCH" $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
  -m qlora_nb_utils.distributed.fsdp_train "${TRAINER[@]}" --trainer hf --out "$OUT/runs/launch_trainer_hf"
if [ "${DRY:-0}" != 1 ]; then
  first_gpu=${CUDA_VISIBLE_DEVICES:-0}
  step adapter_one_gpu "$LIM_LAUNCH" env CUDA_VISIBLE_DEVICES="${first_gpu%%,*}" $PY lab/gpu/fsdp/adapter_one_gpu.py \
    "$OUT/runs/launch_torchrun" --out "$OUT/runs/adapter_one_gpu.json"
fi
rm -rf "$OUT"/runs/launch_*/adapter "$OUT"/runs/launch_*/ckpt "$OUT"/runs/launch_*/trainer
tar czf "$OUT/launch_logs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"  # few files come back from a call
echo "[launch] finished in $(( $(date +%s) - T0 )) s"
