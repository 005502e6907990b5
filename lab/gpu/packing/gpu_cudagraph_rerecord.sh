#!/usr/bin/env bash
# Writes: $OUT_DIR/cudagraph_rerecord.json (committed as results/cudagraph_rerecord_<gpu>.json), arm_*.json, arm_*.log
# Rerun: bash lab/gpu/packing/gpu_cudagraph_rerecord.sh "$OUT" [VARIANTS=held,held_no_rows,no_target] [LIMIT_S=420]
#   (on the lent GPU machine, repository root; carry .whl .gpucache)
# Issue 19: why optimize(max_memory_gib=9.61) in whole scope (CUDA graphs) on the 1B shape and the
# long-tail draw peaked at 13.0 GiB: CUDA graphs counted per step, one arm per optimize() choice
# (lab/gpu/packing/cudagraph_rerecord.py), the arms at the same time on the one GPU.
set -uo pipefail
out=${1:?usage: lab/gpu/packing/gpu_cudagraph_rerecord.sh OUT_DIR [VARIANTS] [LIMIT_S]}
variants=${2:-held,held_no_rows,no_target}
limit=${3:-420}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
mkdir -p /tmp/qlora_nb_cache && cp -rn .gpucache/qlora_nb/. /tmp/qlora_nb_cache/
export QLORA_NB_CACHE=/tmp/qlora_nb_cache
nvidia-smi -L
python3 -c "from qlora_nb_utils import models; models.materialize('llama-3.2-1b-shape')"
export QLORA_NB_CALL="bash lab/gpu/packing/gpu_cudagraph_rerecord.sh \$OUT $variants $limit"
CUDAGRAPH_LOGS=${CUDAGRAPH_LOGS:-0} python3 lab/gpu/packing/cudagraph_rerecord.py driver "$out" --variants "$variants" --limit-s "$limit" 2>&1 | tail -120
