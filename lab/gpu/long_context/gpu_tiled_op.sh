#!/usr/bin/env bash
# Writes: $OUT/<name>.json + <name>.log, one `lab.long_context try` each (ours, Llama-3.1-8B shape,
#   LoRA r=32, one document, cap 22 GiB as the 24 GB budget, expandable segments).
# Rerun: OUT=$OUT BUDGET=570 bash lab/gpu/long_context/gpu_tiled_op.sh (nvidia-h100-x1 or nvidia-h200; carry .whl .gpucache).
# The MLP tiled as one opaque operator (compile.patches.tiled_mlp): its step time at 32,768 tokens beside
# the untiled step of the same call, then its peak at 95,232 with the memory account (where the
# checkpointed pieces peaked at 19.83 GiB), then LENGTHS (longer tries) while the budget lasts
# (FIRST=0: the longer tries only); ACCOUNT_LENGTHS: tries with the memory account.
set -uo pipefail
OUT=${OUT:-$PWD/out/tiled_op}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-570}
LENGTHS=${LENGTHS-"110592"}  # set but empty: none
source "$(dirname "$0")/../gpu_env.sh"
models_outside_tree
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi -L
one() {  # one NAME LIMIT SEQ ARGS...
  local name=$1 limit=$2 seq=$3
  shift 3
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 40 ]; then echo "[tiled_op] skip $name: ${limit}s left"; return 1; fi
  echo "[tiled_op] $name: L=$seq limit ${limit}s ($(( $(date +%s) - T0 )) s elapsed)"
  timeout --signal=TERM --kill-after=10 "$limit" python3 -m lab.long_context try --peer ours --seq-len "$seq" \
    --cap-gib 22 --alloc-conf expandable_segments:True "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "[tiled_op] $name exit $?"; grep "^\[long_context try\]" "$OUT/$name.log" | tail -1
}
if [ "${FIRST:-1}" = 1 ]; then
  one untiled_32k 120 32768
  one tiled_32k 120 32768 --tile-mlp 4096
  one account_95k 200 95232 --account
fi
for n in $LENGTHS; do one "edge_$n" 300 "$n"; done
for n in ${ACCOUNT_LENGTHS:-}; do one "account_$n" 380 "$n" --account; done
echo "[tiled_op] finished in $(( $(date +%s) - T0 )) s"
