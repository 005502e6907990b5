#!/usr/bin/env bash
# Writes: $OUT/runs/<name>/summary.json + log.jsonl + $OUT/runs/<name>.log + <name>.status, $OUT/pipeline_<gpu>.json
#   (lab/gpu/fsdp/pipeline_results.py; copy it to lab/results/fsdp/), $OUT/pipeline_logs.tgz, $OUT/errors.txt
# Rerun: OUT=$OUT KEEP=lab/results/fsdp/pipeline_h200.json bash lab/gpu/fsdp/gpu_pipeline.sh (nvidia-h200-x2;
#   carry .whl .gpucache). First call: 1f1b, gpipe, one GPU, floor and FSDP2 ran; zbv and the 70B shape failed.
# The pipeline layout (qlora_nb_utils/distributed/pipeline.py) against one GPU and FSDP2, in one call, in this order:
#   big_70b first (it needs the most time): the Llama-3.1-70B shape, all 80 layers, 2 GPUs, every weight on its
#     GPU, each process capped at CAP GiB, every layer checkpointed with its input offloaded to host memory,
#     1f1b, the loss in 256-row pieces, the allocator's expandable segments (the cap counts reserved memory, and
#     the first call died of a 2 MiB block with 1.8 GiB reserved but cut up); an out-of-memory first try is
#     tried again at BIG_SEQ_RETRY (1024) when time allows (its first log kept as big_70b_try1.log);
#   pp_zbv (the 8B shape on 2 GPUs, ScheduleZBVZeroBubble); one_1 (1 GPU, every layer one stage) beside
#   floor_1 (the same, rows of every batch permuted: the floor) on the other GPU; pp_1f1b, pp_gpipe; fsdp_2
#   (FSDP2 fast path, NF4 sharded, the same global batch, 4 rows per GPU and micro-batch). The 8B runs: global
#   batch GB rows of SEQ, micro-batches of 1 row.
# BUDGET (s, default 540) bounds the whole; a run that no longer fits is skipped (its .status says so).
# ONLY="big_70b pp_zbv" runs those alone; KEEP=<earlier results file> merges in the runs this call did not
# finish, each with its own date and command (pipeline_results.py --keep). PHASE=8b or big: one half.
# BIG_EXTRA: launcher options appended to the 70B run's (e.g. "--profile 1 --global-batch-size 16");
# BIG_ALLOC_CONF: its PYTORCH_CUDA_ALLOC_CONF (default expandable_segments:True).
# DRY=1: the tiny shape with 4 layers on the CPU over gloo, 2 steps, zbv with aot_eager (about 3 minutes
# on 2 idle cores).
set -uo pipefail
OUT=${OUT:-$PWD/out/pipeline}
mkdir -p "$OUT/runs"
T0=$(date +%s)
BUDGET=${BUDGET:-540}
PHASE=${PHASE:-all}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
if [ "${DRY:-0}" = 1 ]; then
  PY=${PY:-python3}
  export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  MODEL=tiny; STEPS=2; SEQ=64; GB=4; CAP=22
  SHAPE=(--model tiny --build layerwise --layers 4); BIG=(--model tiny --build layerwise --layers 4)
  DEV=(--device cpu --dtype float32 --backend eager --timing-warmup 0)
  FSDP=(--model tiny --device cpu --dtype float32 --backend eager --timing-warmup 0); FSDP_SEQ=128
  ZB=(--backend aot_eager)  # eager frees an autograd Function's saved values at the first backward
  BIG_OPT=(--optimize grad_ckpt=true --optimize ce_chunks=8 --optimize ce_min_rows=16)
  BIG_SEQ=${BIG_SEQ:-64}; BIG_SEQ_RETRY=${BIG_SEQ_RETRY:-64}; BIG_SPLIT=${BIG_SPLIT:-2,2}
  G0=""; G1=""; G01=""
else
  PY=python3
  source "$(dirname "$0")/../gpu_env.sh"
  nvidia-smi -L | tee "$OUT/gpus.txt"
  MODEL=${MODEL:-llama-3.1-8b-shape}; STEPS=${STEPS:-8}; SEQ=${SEQ:-2048}; GB=${GB:-8}; CAP=${CAP:-22}
  SHAPE=(--model "$MODEL" --build layerwise)
  BIG=(--model llama-3.1-70b --build layerwise)
  DEV=(--device cuda --dtype bfloat16 --backend inductor --timing-warmup 3)
  FSDP=(--model "$MODEL" --build layerwise --device cuda --dtype bfloat16 --backend inductor --timing-warmup 3); FSDP_SEQ=$SEQ
  ZB=()
  read -r -a BIG_OPT <<< "${BIG_OPT:---optimize grad_ckpt=true --optimize offload=true --optimize ce_chunks=8 --optimize ce_min_rows=256}"
  BIG_SEQ=${BIG_SEQ:-2048}; BIG_SEQ_RETRY=${BIG_SEQ_RETRY:-1024}; BIG_SPLIT=${BIG_SPLIT:-40,40}
  G0=${G0:-0}; G1=${G1:-1}; G01=$G0,$G1  # G0/G1: which two GPUs (another job may hold the others)
fi
PP=(--pack --global-batch-size "$GB" --micro-batch-size 1 --lr 2e-4 --seed 0 --no-adapter "${DEV[@]}")
RUNS="$OUT/runs"
ONLY=${ONLY:-}

failure() {  # failure LOG: its first traceback (60 lines, caret lines dropped) and its last 20 lines, each cut at 300
  # characters: small enough to come back when the logs' tarball does not
  local lines; lines=$(grep -v -E '^(\[rank[0-9]+\]: *)?[ ~^]*$' "$1")
  echo "--- first traceback"; grep -m1 -A60 'Traceback' <<< "$lines" | head -61 | cut -c1-300
  echo "--- last lines"; tail -20 <<< "$lines" | cut -c1-300
}
trun() {  # trun NAME LIMIT_S GPUS NPROC ARGS...: one torchrun of the launcher, its log in $RUNS/NAME.log, exit in NAME.status
  local name=$1 limit=$2 gpus=$3 nproc=$4
  shift 4
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then echo "[pipeline] $name: not in ONLY"; return 1; fi
  if [ "$limit" -lt 40 ]; then
    echo "skipped: ${limit}s left" > "$RUNS/$name.status"
    echo "[pipeline] skip $name: ${limit}s left" | tee -a "$OUT/errors.txt"; return 1
  fi
  echo "[pipeline] $name: $nproc process(es), GPUs '${gpus}', limit ${limit}s ($(( $(date +%s) - T0 )) s elapsed)"
  CUDA_VISIBLE_DEVICES=$gpus timeout --signal=TERM --kill-after=20 "$limit" \
    $PY -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m qlora_nb_utils.distributed.launch "$@" \
    > "$RUNS/$name.log" 2>&1
  local rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "exit $rc: stopped at the ${limit}s limit" > "$RUNS/$name.status"
  else echo "exit $rc" > "$RUNS/$name.status"; fi
  [ $rc -ne 0 ] && { echo "[pipeline] $name FAILED (exit $rc)" | tee -a "$OUT/errors.txt"; failure "$RUNS/$name.log" >> "$OUT/errors.txt"; }
  grep -h "^\[pipeline\]\|^\[fsdp_train\]" "$RUNS/$name.log" | tail -1
  return $rc
}
cap() { local l; l=$(left); [ "$l" -gt "$1" ] && echo "$1" || echo "$l"; }
read -r -a BIG_EXTRA <<< "${BIG_EXTRA:-}"  # more launcher options for the 70B run, last (e.g. --profile 1)
big() {  # big SEQ LIMIT: the 70B shape, every weight on its GPU, under the cap
  PYTORCH_CUDA_ALLOC_CONF=${BIG_ALLOC_CONF:-expandable_segments:True} trun big_70b "$2" "$G01" 2 --layout pipeline "${BIG[@]}" \
    --seq-len "$1" "${PP[@]}" "${BIG_OPT[@]}" --schedule 1f1b --layers-per-stage "$BIG_SPLIT" \
    --steps "${BIG_STEPS:-4}" --timing-warmup 1 --max-mem-gib "$CAP" "${BIG_EXTRA[@]}" --out "$RUNS/big_70b"
}

if [ "$PHASE" = all ] || [ "$PHASE" = big ]; then
  big "$BIG_SEQ" "$(cap 220)"
  if [ $? -ne 0 ] && grep -q "OutOfMemoryError" "$RUNS/big_70b.log" 2>/dev/null && [ "$(left)" -gt "${BIG_RETRY_MIN_S:-330}" ]; then
    mv "$RUNS/big_70b.log" "$RUNS/big_70b_try1.log"; mv "$RUNS/big_70b.status" "$RUNS/big_70b_try1.status"
    echo "[pipeline] big_70b ran out of memory at --seq-len $BIG_SEQ; again at $BIG_SEQ_RETRY"
    big "$BIG_SEQ_RETRY" "$(cap 180)"
  fi
fi
if [ "$PHASE" = all ] || [ "$PHASE" = 8b ]; then
  trun pp_zbv "$(cap 120)" "$G01" 2 --layout pipeline "${SHAPE[@]}" --seq-len "$SEQ" "${PP[@]}" --schedule zbv "${ZB[@]}" \
    --steps "$STEPS" --out "$RUNS/pp_zbv"
  LIM=$(cap 150)
  trun one_1 "$LIM" "$G0" 1 --layout pipeline "${SHAPE[@]}" --seq-len "$SEQ" "${PP[@]}" --schedule gpipe --steps "$STEPS" \
    --out "$RUNS/one_1" &
  P1=$!
  trun floor_1 "$LIM" "$G1" 1 --layout pipeline "${SHAPE[@]}" --seq-len "$SEQ" "${PP[@]}" --schedule gpipe --steps "$STEPS" \
    --permute-rows 1 --out "$RUNS/floor_1" &
  P2=$!
  wait $P1; wait $P2
  trun pp_1f1b "$(cap 110)" "$G01" 2 --layout pipeline "${SHAPE[@]}" --seq-len "$SEQ" "${PP[@]}" --schedule 1f1b \
    --steps "$STEPS" --out "$RUNS/pp_1f1b"
  trun pp_gpipe "$(cap 100)" "$G01" 2 --layout pipeline "${SHAPE[@]}" --seq-len "$SEQ" "${PP[@]}" --schedule gpipe \
    --steps "$STEPS" --out "$RUNS/pp_gpipe"
  trun fsdp_2 "$(( $(left) - 10 ))" "$G01" 2 --layout fsdp "${FSDP[@]}" --quant nf4 --nf4 shard --frozen shard --fast-path \
    --seq-len "$FSDP_SEQ" --pack --global-batch-size "$GB" --micro-batch-size "$(( GB / 2 > 4 ? 4 : GB / 2 ))" \
    --lr 2e-4 --seed 0 --no-adapter --steps "$STEPS" --out "$RUNS/fsdp_2"
fi

KEEP_ARGS=()
[ -n "${KEEP:-}" ] && KEEP_ARGS=(--keep "$KEEP")
$PY lab/gpu/fsdp/pipeline_results.py "$RUNS" "$OUT" --cap "$CAP" "${KEEP_ARGS[@]}" \
  --command "OUT=\$OUT PHASE=$PHASE BUDGET=$BUDGET ONLY='$ONLY' KEEP=${KEEP:-} DRY=${DRY:-0} bash lab/gpu/fsdp/gpu_pipeline.sh"
# each log's last 3000 lines only (a whole log of compile warnings made the tarball too big to come back)
mkdir -p "$OUT/logs_tail"
for f in "$RUNS"/*.log; do [ -f "$f" ] && tail -3000 "$f" | cut -c1-2000 > "$OUT/logs_tail/$(basename "$f")"; done
tar czf "$OUT/pipeline_logs.tgz" -C "$OUT" logs_tail 2>/dev/null && rm -rf "$OUT/logs_tail"
echo "[pipeline] finished in $(( $(date +%s) - T0 )) s"
