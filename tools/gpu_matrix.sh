#!/usr/bin/env bash
# The compile matrix on the lent GPU machine (see tools/gpu_bench.sh for the carried files).
# Usage (on that machine, from the repository root): bash tools/gpu_matrix.sh OUT_JSON BUDGET_S [configs]
#
# One process per (config, checkpointing, lengths): 12 processes compile at once on the host's
# cores. Their training steps never overlap on the GPU: each step holds an exclusive file lock,
# let go while torch compiles (qlora_nb_utils/gpulock.py). Each process stops at BUDGET_S
# (cells it finished are kept); the parts are then merged into OUT_JSON.
set -euo pipefail
out=${1:?usage: tools/gpu_matrix.sh OUT_JSON BUDGET_S [configs]}
budget=${2:?time budget in seconds}
configs=${3:-qlora,lora,base}
model=${QLORA_NB_MATRIX_MODEL:-llama-3.2-1b-shape}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export QLORA_NB_CACHE=$PWD/.gpucache/qlora_nb HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export QLORA_NB_GPU_LOCK=/tmp/qlora_nb_gpu.lock TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}
nvidia-smi -L
cmd="bash tools/gpu_matrix.sh $out $budget $configs"
# Build each model once before the parts start, so that 12 processes do not all build it.
python3 -c "from qlora_nb_utils import models; models.materialize('$model')"
parts=$(dirname "$out")/matrix_parts
mkdir -p "$parts"
for c in ${configs//,/ }; do
  for ck in off on; do
    for len in variable fixed; do
      # the slow cell (whole model, variable lengths: a dynamic graph) last, so a budget cut loses only it
      tag=$c-$ck-$len
      timeout --kill-after=10 "$budget" python3 -W ignore -m qlora_nb_utils.matrix --model "$model" --configs "$c" \
        --grad-ckpt "$ck" --lengths "$len" --scopes regional,whole --steps 30 --batch-size 4 --max-len 256 \
        --warmup 5 --command "$cmd" --out "$parts/$tag.json" > "$parts/$tag.log" 2>&1 &
    done
  done
done
wait || true
ls "$parts"/*.json >/dev/null 2>&1 || { echo "no part finished a cell"; tail -n 20 "$parts"/*.log; exit 1; }
python3 -m qlora_nb_utils.matrix --merge "$parts"/*.json --command "$cmd" --out "$out"
for f in "$parts"/*.log; do echo "== $f"; grep -E "Error|error|Traceback" "$f" | tail -n 5 || true; done
