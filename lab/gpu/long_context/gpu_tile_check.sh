#!/usr/bin/env bash
# Wrote: lab/results/long_context/tile_check_<gpu>/ (one record per setting, each in a fresh process beside its own
#   reference: $OUT/<n>.json and .log)
# Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_tile_check.sh   (one GPU; carry .whl .gpucache)
# lab/tile_check.py says why. env: SETTINGS (';'-separated names, or "all"), PAR (1: processes at a time on each
# GPU; the processes take the machine's GPUs in turn), R16 (1: also r=16, 'whole').
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
source "$(dirname "$0")/../gpu_env.sh"
models_outside_tree
mkdir -p "$OUT"
SETTINGS=${SETTINGS:-whole;whole, not offloaded;whole, not checkpointed}
[ "$SETTINGS" = all ] && SETTINGS=$(python3 -m lab.tile_check --list --out /dev/null)
IFS=';' read -r -a settings <<< "$SETTINGS"
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$GPUS" -ge 1 ] || GPUS=1
PAR=$(( ${PAR:-1} * GPUS ))  # processes at a time: the reference's eager attention at 4,096 positions holds ~45 GiB
python3 -c "from lab.long_context import make_row" || exit 1
i=0; pids=()
for s in "${settings[@]}"; do
  CUDA_VISIBLE_DEVICES=$(( i % GPUS )) timeout 240 python3 -m lab.tile_check ${STORAGE:+--storage "$STORAGE"} ${NO_REF:+--no-reference} --only "$s" --out "$OUT/$i.json" > "$OUT/$i.log" 2>&1 &
  pids+=($!); i=$((i + 1))
  if [ ${#pids[@]} -ge "$PAR" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done
[ "${R16:-0}" = 1 ] && timeout 120 python3 -m lab.tile_check --lora-r 16 --only whole --out "$OUT/r16.json" > "$OUT/r16.log" 2>&1
grep -h "^\[tile_check\]" "$OUT"/*.log | cut -c1-700
grep -h "Error" "$OUT"/*.log | sort | uniq -c | head
