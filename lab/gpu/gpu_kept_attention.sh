#!/usr/bin/env bash
# Writes: $OUT/<peer>_<L>.json + .log, one `lab.long_context try` each (Llama-3.1-8B shape, LoRA r=32, one
#   document, cap 22 GiB as the 24 GB budget, expandable segments), each in its own process.
# Rerun: OUT=$OUT BUDGET=570 bash lab/gpu/gpu_kept_attention.sh (nvidia-h100-x1 or nvidia-h200; carry .whl
#   .gpucache .unsloth; build .unsloth/usite.tar.gz first: lab/gpu/unsloth_bundle.sh).
# The attention output kept for the recompute (optimize(keep_attention=True), compile.patches.kept_attention)
# against the same product without it and against Unsloth, at LENGTHS (default 16384 32768), in one call:
# the tokens/s ratios and the two runs' losses (the same rows and seed: equal up to bf16 rounding).
set -uo pipefail
OUT=${OUT:-$PWD/out/kept_attention}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-570}
LENGTHS=${LENGTHS:-"16384 32768"}
source "$(dirname "$0")/gpu_env.sh"
models_outside_tree
unsloth_site
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi -L
one() {  # one NAME LIMIT PEER SEQ ARGS...
  local name=$1 limit=$2 peer=$3 seq=$4
  shift 4
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 40 ]; then echo "[kept_attention] skip $name: ${limit}s left"; return 1; fi
  echo "[kept_attention] $name: L=$seq limit ${limit}s ($(( $(date +%s) - T0 )) s elapsed)"
  timeout --signal=TERM --kill-after=10 "$limit" python3 -m lab.long_context try --peer "$peer" --seq-len "$seq" \
    --cap-gib 22 --alloc-conf expandable_segments:True "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "[kept_attention] $name exit $?"; grep "^\[long_context try\]" "$OUT/$name.log" | tail -1
}
for n in $LENGTHS; do
  one "ours_$n" 150 ours "$n"
  one "ours_kept_$n" 150 ours "$n" --keep-attention
  one "unsloth_$n" 150 unsloth "$n"
done
echo "[kept_attention] finished in $(( $(date +%s) - T0 )) s"
