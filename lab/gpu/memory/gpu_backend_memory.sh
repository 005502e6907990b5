#!/usr/bin/env bash
# Writes: $OUT/backend_memory.json (committed as lab/results/memory/backend_memory_<gpu>.json), arm_*.json, backend_memory_log.txt
# Rerun: OUT=dir [ARMS=inductor,inductor-whole] bash lab/gpu/memory/gpu_backend_memory.sh [BUDGET_S=520] [MODEL=llama-3.2-1b-shape] [BATCH=8] [SEQ=1024] [STEPS=40]
#   (on the lent GPU machine, repository root; carry .whl .gpucache). On a CPU, a dry run (no wheels installed):
#   PYTHONPATH=$PWD .venv/bin/python lab/gpu/memory/backend_memory.py driver /tmp/bm --model tiny --batch-size 2 \
#       --seq-len 256 --steps 31 --budget-s 1400 --arms eager-unfixed,eager,aot_eager
# Memory after every step of a packed fine-tune through optimize() on each backend qlora-nb train
# accepts, and on the eager backend with the saved-values rewrite turned off (the leak it fixes):
# lab/gpu/memory/backend_memory.py.
set -uo pipefail
: "${OUT:?set OUT}"
mkdir -p "$OUT"
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L 2>/dev/null || true
python3 lab/gpu/memory/backend_memory.py driver "$OUT" --budget-s "${1:-520}" --model "${2:-llama-3.2-1b-shape}" \
    --batch-size "${3:-8}" --seq-len "${4:-1024}" --steps "${5:-40}" ${ARMS:+--arms "$ARMS"} 2>&1 | grep -v -i "warning" | tee "$OUT/backend_memory_log.txt"
