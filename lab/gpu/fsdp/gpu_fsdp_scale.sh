#!/usr/bin/env bash
# Writes: $OUT/topo.txt, $OUT/nccl.json + nccl_debug.txt (all-gather bandwidth and NCCL's transport),
#   $OUT/runs/<name>/summary.json + log.jsonl (+ profile_rank<R>.txt), $OUT/fsdp_scale_logs.tgz;
#   lab/gpu/fsdp/fsdp_scale_results.py turns them into lab/results/fsdp/fsdp2_scaling_<gpu>.json.
# Rerun: OUT=$OUT bash lab/gpu/fsdp/gpu_fsdp_scale.sh (nvidia-h100-x2 or nvidia-h200-x2; carry .whl .gpucache).
# Scaling of the fast path under FSDP2 at a per-GPU batch that gives each GPU work to hide its
# all-gathers behind: llama-3.1-8b shape built layer by layer (random NF4, float32 words), packed rows of
# 2048, MB rows per GPU and micro-batch (default 4), global batch 2 x MB; REPEATS pairs, each run alone:
# scale_2_i (2 GPUs, NF4 + embeddings + LM head sharded) and scale_1_i (1 GPU, nothing sharded, the
# same regional fast path, accumulating 2 micro-batches; i=2 permutes the rows: the bf16 floor).
# Then (PROFILE=1, the default), time allowing, one profiled pair at PROFILE_ROWS rows per GPU (default 1; where the
# step time goes on each rank; with VOCAB_HEAD=1 the 2-GPU one splits the head too).
# VOCAB_HEAD=1: the 2-GPU runs split the LM head by vocabulary (--vocab-parallel-head), and after the first
# pair one plain 2-GPU run (plain_2_1, the head sharded by FSDP2 as before) gives the same call's comparison.
set -uo pipefail
OUT=${OUT:-$PWD/out/fsdp_scale}
mkdir -p "$OUT/runs"
T0=$(date +%s)
BUDGET=${BUDGET:-560}
REPEATS=${REPEATS:-3}
MB=${MB:-4}
STEPS=${STEPS:-12}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
{ nvidia-smi topo -m; echo; nvidia-smi nvlink -s 2>&1 | head -40; echo; env | grep -i "^NCCL" ; } > "$OUT/topo.txt" 2>&1
cat "$OUT/topo.txt" | head -20
[ "${NCCL_TEST:-1}" = 1 ] && NCCL_DEBUG=INFO timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
  lab/gpu/fsdp/nccl_bandwidth.py "$OUT/nccl.json" > "$OUT/nccl_debug.txt" 2>&1
grep "^\[nccl\]" "$OUT/nccl_debug.txt"; grep -i "via \|NVLS\|P2P\|SHM" "$OUT/nccl_debug.txt" | head -8

FT=qlora_nb_utils.distributed.fsdp_train
COMMON=(--model llama-3.1-8b-shape --build layerwise --quant nf4 --nf4 shard --frozen shard --fast-path --lr 2e-4
        --seed 0 --timing-warmup 3 --no-adapter --device cuda --dtype bfloat16 --backend inductor --seq-len 2048 --pack
        --one-gpu-scope regional)
trun() {  # trun NAME LIMIT_S GPUS NPROC ARGS...: one torchrun, its log in $OUT/runs/NAME.log
  local name=$1 limit=$2 gpus=$3 nproc=$4
  shift 4
  if [ "$limit" -lt 45 ]; then echo "[scale] skip $name: ${limit}s left" | tee -a "$OUT/errors.txt"; return 1; fi
  echo "[scale] $name: $nproc process(es), GPUs '${gpus}', limit ${limit}s ($(( $(date +%s) - T0 )) s elapsed)"
  CUDA_VISIBLE_DEVICES=$gpus timeout --signal=TERM --kill-after=15 "$limit" \
    python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m $FT "$@" > "$OUT/runs/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && { echo "[scale] $name FAILED (exit $rc)" | tee -a "$OUT/errors.txt"; tail -25 "$OUT/runs/$name.log" | tee -a "$OUT/errors.txt"; }
  grep -h "^\[fsdp_train\]" "$OUT/runs/$name.log" | tail -1
  return $rc
}
VOCAB2=(); [ "${VOCAB_HEAD:-0}" = 1 ] && VOCAB2=(--vocab-parallel-head)
for i in $(seq 1 "$REPEATS"); do
  cap=$(left); [ $cap -gt 150 ] && cap=150
  trun "scale_2_$i" "$cap" 0,1 2 "${COMMON[@]}" --steps "$STEPS" --global-batch-size $((2 * MB)) --micro-batch-size "$MB" "${VOCAB2[@]}" --out "$OUT/runs/scale_2_$i"
  extra=(); [ "$i" = 2 ] && extra=(--permute-rows 1)
  cap=$(left); [ $cap -gt 150 ] && cap=150
  trun "scale_1_$i" "$cap" 0 1 "${COMMON[@]}" --steps "$STEPS" --global-batch-size $((2 * MB)) --micro-batch-size "$MB" "${extra[@]}" --out "$OUT/runs/scale_1_$i"
  if [ "$i" = 1 ] && [ "${VOCAB_HEAD:-0}" = 1 ]; then
    cap=$(left); [ $cap -gt 150 ] && cap=150
    trun plain_2_1 "$cap" 0,1 2 "${COMMON[@]}" --steps "$STEPS" --global-batch-size $((2 * MB)) --micro-batch-size "$MB" --out "$OUT/runs/plain_2_1"
  fi
done
if [ "${PROFILE:-1}" = 1 ]; then
  cap=$(( $(left) / 2 ))
  PR=${PROFILE_ROWS:-1}  # rows per GPU and micro-batch of the profiled pair (MB: where the scaling is measured)
  trun prof_2 "$cap" 0,1 2 "${COMMON[@]}" --steps 6 --global-batch-size $((2 * PR)) --micro-batch-size "$PR" \
    "${VOCAB2[@]}" --profile 2 --out "$OUT/runs/prof_2"
  trun prof_1 "$(( $(left) - 5 ))" 0 1 "${COMMON[@]}" --steps 6 --global-batch-size $((2 * PR)) --micro-batch-size "$PR" \
    --profile 2 --out "$OUT/runs/prof_1"
fi
tar czf "$OUT/fsdp_scale_logs.tgz" -C "$OUT" runs 2>/dev/null
echo "[scale] finished in $(( $(date +%s) - T0 )) s"
