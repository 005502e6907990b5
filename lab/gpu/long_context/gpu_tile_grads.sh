#!/usr/bin/env bash
# Wrote: lab/results/long_context/tile_grads_<gpu>.json (from $OUT/tile_grads_<gpu>.json; also $OUT/*.log)
# Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_tile_grads.sh   (a lent GPU machine, 2 GPUs run two at a time;
#   carry .whl .gpucache); DRY=1 OUT=/tmp/tg bash lab/gpu/long_context/gpu_tile_grads.sh runs it on the CPU (tiny).
# lab/tile_grads.py says why: the step-0 gradients with the MLP whole (two attention kernels: the floor) and in pieces.
# env: OUT (required), SEQ (65536), TILE (4096), MODEL (llama-3.1-8b-shape), DRY (1: CPU, tiny)
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
SEQ=${SEQ:-65536}; TILE=${TILE:-4096}; MODEL=${MODEL:-llama-3.1-8b-shape}; D1=1
if [ "${DRY:-0}" = 1 ]; then SEQ=256; TILE=64; MODEL=tiny; D1=""; export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""; fi
source "$(dirname "$0")/../gpu_env.sh"
mkdir -p "$OUT" /tmp/tg
one() {  # NAME DEVICE ARGS...
  local name=$1 dev=$2; shift 2
  env ${dev:+CUDA_VISIBLE_DEVICES=$dev} python3 -m lab.tile_grads run --seq-len "$SEQ" --model "$MODEL" "$@" \
    --out "/tmp/tg/$name.pt" > "$OUT/$name.log" 2>&1
  echo "[gpu_tile_grads] $name: exit $?"; grep -h "^\[tile_grads\]" "$OUT/$name.log"
}
if [ "${DRY:-0}" = 1 ]; then
  one base "" --sdpa-kernel default; one tiled "" --tile "$TILE" --sdpa-kernel default; one floor "" --sdpa-kernel default --ce-chunks 16  # no cuDNN on a CPU: the loss in other chunks
else
  one base 0 --sdpa-kernel default & pid=$!; one tiled "$D1" --tile "$TILE" --sdpa-kernel default; wait "$pid"
  one floor 0 --sdpa-kernel cudnn
fi
gpu=$([ "${DRY:-0}" = 1 ] && echo cpu || python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower())")
python3 -m lab.tile_grads compare /tmp/tg/base.pt /tmp/tg/floor.pt /tmp/tg/tiled.pt \
  --command "OUT=\$OUT SEQ=$SEQ TILE=$TILE bash lab/gpu/long_context/gpu_tile_grads.sh" --out "$OUT/tile_grads_$gpu.json"
