#!/usr/bin/env bash
# Writes: $OUT/runs/<name>/summary.json + log.jsonl (8B phase), $OUT/big_*.json (big phase),
#   $OUT/repro.txt (big phase), $OUT/fsdp_fast_logs.tgz; lab/gpu/fsdp/fsdp_fast_results.py turns them
#   into results/fsdp2_sharded_<gpu>.json.
# Rerun: OUT=$OUT PHASE=8b bash lab/gpu/fsdp/gpu_fsdp_fast.sh, then PHASE=big in a second call
#   (nvidia-h100-x2 or nvidia-h200-x2; carry .whl .gpucache; each phase fits one 600 s call).
# The fast path on every GPU (qlora_nb_utils/distributed/fast.py: optimize()'s recipe, then FSDP2):
#   PHASE=8b: llama-3.1-8b shape built layer by layer on each GPU (random NF4, float32 words), packed
#     rows of 2048, global batch 2 (micro-batch 1 per GPU), STEPS steps; REPEATS pairs, each run alone:
#     fast_2_i (2 GPUs, NF4 + embeddings + LM head sharded; i=1 compares every packed byte after the
#     first all-gather) and fast_1_i (1 GPU, the plain single-GPU fast path: nothing sharded, whole
#     scope, CUDA graphs where optimize() takes them; i=2 permutes the rows of every batch: the bf16 floor).
#   PHASE=big: the Llama-3.1-70B shape, all 80 layers, 2 GPUs, fast path, every layer checkpointed:
#     big_gpu (frozen shards on the GPUs) and big_offload (FSDP2 CPU offload of the shards); then the
#     _foreach_copy_ reproducer of docs/fsdp2.md on one GPU.
# DRY=1: the tiny model on the CPU over gloo, 2 steps (tests/test_fsdp_fast.py runs it).
# VOCAB_HEAD=1: the 2-GPU runs with the LM head split by vocabulary (ops.vocab_parallel).
set -uo pipefail
OUT=${OUT:-$PWD/out/fsdp_fast}
mkdir -p "$OUT/runs"
T0=$(date +%s)
BUDGET=${BUDGET:-560}
REPEATS=${REPEATS:-3}
PHASE=${PHASE:-8b}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
if [ "${DRY:-0}" = 1 ]; then
  PY=${PY:-python3}
  export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  MODEL=tiny; STEPS=2
  DEV=(--device cpu --dtype float32 --backend eager --seq-len 128 --pack --optimize nf4_dequant=true)
  BIG=(--shape llama-tiny --seq-len 32 --steps 2 --device cpu)
  G0=""; G1=""; G01=""
else
  PY=python3
  source "$(dirname "$0")/../gpu_env.sh"
  nvidia-smi -L | tee "$OUT/gpus.txt"
  MODEL=${MODEL:-llama-3.1-8b-shape}; STEPS=${STEPS:-14}
  DEV=(--device cuda --dtype bfloat16 --backend inductor --seq-len 2048 --pack)
  BIG=(--shape llama-3.1-70b --seq-len 2048 --steps "${BIG_STEPS:-4}" --device cuda)
  G0=0; G1=1; G01=0,1
fi
COMMON=(--model "$MODEL" --build layerwise --quant nf4 --nf4 shard --frozen shard --fast-path --lr 2e-4 --seed 0
        --timing-warmup 3 --no-adapter --steps "$STEPS" --global-batch-size 2 --micro-batch-size 1 "${DEV[@]}"
        --one-gpu-scope "${ONE_SCOPE:-regional}")
[ "${DRY:-0}" = 1 ] && COMMON+=(--timing-warmup 0)
# VOCAB_HEAD=1: the 2-GPU runs split the LM head by vocabulary (--vocab-parallel-head: no rank gathers it whole)
VOCAB2=(); [ "${VOCAB_HEAD:-0}" = 1 ] && VOCAB2=(--vocab-parallel-head)

trun() {  # trun NAME LIMIT_S GPUS NPROC MODULE ARGS...: one torchrun, its log in $OUT/runs/NAME.log
  local name=$1 limit=$2 gpus=$3 nproc=$4 module=$5
  shift 5
  if [ "$limit" -lt 40 ]; then echo "[fast] skip $name: ${limit}s left" | tee -a "$OUT/errors.txt"; return 1; fi
  echo "[fast] $name: $nproc process(es), GPUs '${gpus}', limit ${limit}s ($(( $(date +%s) - T0 )) s elapsed)"
  CUDA_VISIBLE_DEVICES=$gpus timeout --signal=TERM --kill-after=20 "$limit" \
    $PY -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m "$module" "$@" > "$OUT/runs/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && { echo "[fast] $name FAILED (exit $rc)" | tee -a "$OUT/errors.txt"; tail -25 "$OUT/runs/$name.log" | tee -a "$OUT/errors.txt"; }
  grep -h "^\[fsdp_train\]\|^\[big_model\]" "$OUT/runs/$name.log" | tail -2
  return $rc
}
[ "${DRY:-0}" = 1 ] || unset CUDA_VISIBLE_DEVICES
FT=qlora_nb_utils.distributed.fsdp_train

if [ "$PHASE" = 8b ] || [ "$PHASE" = all ]; then
  for i in $(seq 1 "$REPEATS"); do  # each run alone on the machine
    extra2=(); [ "$i" = 1 ] && extra2=(--check-bytes)
    extra1=(); [ "$i" = 2 ] && extra1=(--permute-rows 1)
    cap=$(( $(left) - ${BIG_RESERVE:-0} )); [ $cap -gt 170 ] && cap=170
    trun "fast_2_$i" "$cap" "$G01" 2 $FT "${COMMON[@]}" "${extra2[@]}" "${VOCAB2[@]}" --out "$OUT/runs/fast_2_$i"
    cap=$(( $(left) - ${BIG_RESERVE:-0} )); [ $cap -gt 170 ] && cap=170
    trun "fast_1_$i" "$cap" "$G0" 1 $FT "${COMMON[@]}" "${extra1[@]}" --out "$OUT/runs/fast_1_$i"
  done
fi
if [ "$PHASE" = big ] || [ "$PHASE" = all ]; then
  trun big_offload "$(( $(left) - ${GPU_RESERVE:-0} ))" "$G01" 2 qlora_nb_utils.distributed.big_model "${BIG[@]}" --fast-path --cpu-offload --out "$OUT/big_offload.json"
  trun big_gpu "$(( $(left) - 30 ))" "$G01" 2 qlora_nb_utils.distributed.big_model "${BIG[@]}" --fast-path --out "$OUT/big_gpu.json"
  if [ "${DRY:-0}" != 1 ]; then
    timeout 25 $PY lab/gpu/fsdp/fsdp_foreach_repro.py > "$OUT/repro.txt" 2>&1; cat "$OUT/repro.txt"
  fi
fi
tar czf "$OUT/fsdp_fast_logs.tgz" -C "$OUT" runs 2>/dev/null
echo "[fast] finished in $(( $(date +%s) - T0 )) s"
