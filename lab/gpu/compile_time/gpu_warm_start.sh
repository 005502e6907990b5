#!/usr/bin/env bash
# Writes: OUT/warm_start.json (-> results/warm_start_<gpu>.json), OUT/warm_start_log.txt
# Rerun: bash lab/gpu/compile_time/gpu_warm_start.sh OUT [BUDGET_S=420]
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache)
# Issue 20's warm start: a cold start, then warm starts with optimize(warm_cache=...) on and off,
# each in its own process over one Inductor cache folder, and warm starts from a pre-quantized NF4
# checkpoint, at 8B (2 x 1024, regional) and, if the budget leaves room, 1B (4 x 512, whole scope);
# lab/gpu/compile_time/warm_start.py says how (WARM_START_MODELS, WARM_START_RUNS: only those).
set -uo pipefail
out=${1:?usage: lab/gpu/compile_time/gpu_warm_start.sh OUT_DIR [BUDGET_S]}
budget=${2:-420}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L
models_outside_tree
export QLORA_NB_WARM_CMD="COMMIT=${COMMIT:-unknown} WARM_START_MODELS=${WARM_START_MODELS:-} WARM_START_RUNS=${WARM_START_RUNS:-} bash lab/gpu/compile_time/gpu_warm_start.sh \$OUT $budget (code: ${COMMIT:-unknown commit} + working tree)"
python3 lab/gpu/compile_time/warm_start.py "$out/warm_start.json" "$budget" 2>&1 | tee "$out/warm_start_log.txt"
