#!/usr/bin/env bash
# Writes: $OUT/check.json (lab/gpu/long_context/kept_attention_check.py), $OUT/<peer>_<L>.json, $OUT/logs.tgz (their logs), one `lab.long_context try` each (Llama-3.1-8B shape, LoRA r=32, one
#   document, cap 22 GiB as the 24 GB budget, expandable segments), each in its own process.
# Rerun: OUT=$OUT BUDGET=570 bash lab/gpu/long_context/gpu_kept_attention.sh [LENGTHS=... CAP=GiB RUNS='ours unsloth'] (nvidia-h100-x1 or nvidia-h200; carry .whl
#   .gpucache .unsloth; build .unsloth/usite.tar.gz first: lab/gpu/peers/unsloth_bundle.sh).
# The product as it chooses (optimize(max_memory_gib=22): keep_attention="auto" keeps each checkpointed layer's
# attention output for its recompute where it has room, compile.patches.kept_attention), the same with
# keep_attention=False, and Unsloth, at LENGTHS (default 16384 32768), in one call: the tokens/s ratios and
# the two runs' losses (the same rows and seed: equal up to bf16 rounding). Set KEPT=on to ask for it
# (keep_attention=True) in the first run instead.
set -uo pipefail
OUT=${OUT:-$PWD/out/kept_attention}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-570}
LENGTHS=${LENGTHS:-"16384 32768"}
STEPS=${STEPS:-5}  # the first compiles: tokens/s is the median of the other steps
CAP=${CAP:-22}  # GiB, for every run: 22 is the 24 GB budget; Unsloth's own peak compares at equal memory
RUNS=${RUNS:-"ours ours_off unsloth"}
source "$(dirname "$0")/../gpu_env.sh"
models_outside_tree
unsloth_site
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# Unsloth's tries run as lab.long_context's bisect runs them: its site first on the path (its trl shadows
# /tmp/site's) and a checkpoint folder of the model, built once here
UNSLOTH_DIR=$(python3 -c "from lab.peers.common import _model_dir; print(_model_dir('llama-3.1-8b-shape'))" | tail -1)
echo "[kept_attention] model folder for unsloth: $UNSLOTH_DIR ($(( $(date +%s) - T0 )) s elapsed)"
nvidia-smi -L
python3 lab/gpu/long_context/kept_attention_check.py "$OUT/check.json" || echo "[kept_attention] the operator check failed: see $OUT/check.json"
one() {  # one NAME LIMIT PEER SEQ ARGS...
  local name=$1 limit=$2 peer=$3 seq=$4
  shift 4
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 40 ]; then echo "[kept_attention] skip $name: ${limit}s left"; return 1; fi
  echo "[kept_attention] $name: L=$seq limit ${limit}s ($(( $(date +%s) - T0 )) s elapsed)"
  local path=$PYTHONPATH
  if [ "$peer" = unsloth ]; then path=${QLORA_NB_UNSLOTH_SITE:-}:$PYTHONPATH; set -- --model-dir "$UNSLOTH_DIR" "$@"; fi
  PYTHONPATH=$path timeout --signal=TERM --kill-after=10 "$limit" python3 -m lab.long_context try --peer "$peer" --seq-len "$seq" \
    --cap-gib "$CAP" --steps "$STEPS" --alloc-conf expandable_segments:True "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "[kept_attention] $name exit $?"; grep "^\[long_context try\]" "$OUT/$name.log" | tail -1
}
for n in $LENGTHS; do
  for run in $RUNS; do
    case $run in
      ours) one "ours_$n" 150 ours "$n" ${KEPT:+--keep-attention "$KEPT"} ;;
      ours_off) one "ours_off_$n" 150 ours "$n" --keep-attention off ;;
      unsloth) one "unsloth_$n" 150 unsloth "$n" ;;
    esac
  done
done
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log  # the call returns 8 files at most
echo "[kept_attention] finished in $(( $(date +%s) - T0 )) s"
