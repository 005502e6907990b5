#!/usr/bin/env bash
# Wrote: lab/results/long_context/tile_steps_<gpu>/ (one record per variant: $OUT/<name>.json; logs in /tmp/ts)
# Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_tile_steps.sh   (one or two GPUs, two variants at a time, one per
#   GPU; carry .whl .gpucache)
# lab/tile_steps.py says why. env: VARIANTS (';'-separated NAME=optimize options, ','-separated; default: the
# plain runs and each LoRA route switched off; an item --flag=value passes a lab.tile_steps flag), SEQ (16384), TILE (2048), MODEL (llama-3.2-1b-shape)
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
source "$(dirname "$0")/../gpu_env.sh"
models_outside_tree
mkdir -p "$OUT" /tmp/ts
IFS=';' read -r -a variants <<< "${VARIANTS:-plain=;unfused=lora_addmm=unfused;narrow=lora_addmm=narrow;no_nf4_patch=nf4_dequant=false}"
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$GPUS" -ge 1 ] || GPUS=1
i=0; pids=()
for v in "${variants[@]}"; do
  name=${v%%=*}; opts=${v#*=}; extra=()
  IFS=',' read -r -a kv <<< "$opts"
  for o in "${kv[@]}"; do  # --flag=value passes a lab.tile_steps flag, KEY=VALUE an optimize() option
    case "$o" in --*) extra+=("${o%%=*}" "${o#*=}") ;; ?*) extra+=(--optimize "$o") ;; esac
  done
  CUDA_VISIBLE_DEVICES=$(( i % GPUS )) timeout 300 python3 -m lab.tile_steps --model "${MODEL:-llama-3.2-1b-shape}" \
    --seq-len "${SEQ:-16384}" --tile "${TILE:-2048}" "${extra[@]}" --out "$OUT/$name.json" > "/tmp/ts/$name.log" 2>&1 &
  pids+=($!); i=$((i + 1))
  if [ ${#pids[@]} -ge "$GPUS" ]; then for p in "${pids[@]}"; do wait "$p"; done; pids=(); fi
done
for p in "${pids[@]}"; do wait "$p"; done
for f in /tmp/ts/*.log; do echo "== $f"; grep -h "^\[tile_steps\]\|Error" "$f" | cut -c1-400; done
