#!/usr/bin/env bash
# Writes: OUT/cold_start_<shape>.json (-> results/compile_time/cold_start_<gpu>.json: python3
#   lab/gpu/compile_time/cold_start.py merge lab/results/compile_time/cold_start_<gpu>.json OUT*/cold_start_*.json),
#   OUT/cold_start_<shape>_log.txt
# Rerun: bash lab/gpu/compile_time/gpu_cold_start.sh OUT SHAPE [BUDGET_S=520]
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache .unsloth; one call per shape:
#   smollm2-135m, llama-3.2-1b-shape, llama-3.1-8b-shape)
# Time from launching `qlora-nb train ... --steps 60` to the end of its first step, cold and warm, for ours,
# ours with the choices of before forced (--scope whole --compile-cache off), HF eager and Unsloth, each in a
# process of its own; lab/gpu/compile_time/cold_start.py says how (COLD_START_RUNS=lib:cache,...: only those).
# On a CPU (the dry run): DEVICE=cpu MODEL=tiny STEPS=4 bash lab/gpu/compile_time/gpu_cold_start.sh OUT smollm2-135m 300
set -uo pipefail
out=${1:?usage: lab/gpu/compile_time/gpu_cold_start.sh OUT_DIR SHAPE [BUDGET_S]}
shape=${2:?usage: lab/gpu/compile_time/gpu_cold_start.sh OUT_DIR SHAPE [BUDGET_S]}
budget=${3:-520}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L 2>/dev/null || echo "no nvidia-smi: ${DEVICE:-cuda} run"
models_outside_tree
unsloth_site
export QLORA_NB_COLD_CMD="COMMIT=${COMMIT:-unknown} COLD_START_RUNS=${COLD_START_RUNS:-} bash lab/gpu/compile_time/gpu_cold_start.sh \$OUT $shape $budget (code: ${COMMIT:-unknown commit} + working tree)"
extra=()
[ -n "${MODEL:-}" ] && extra+=(--model "$MODEL")
[ -n "${STEPS:-}" ] && extra+=(--steps "$STEPS")
python3 lab/gpu/compile_time/cold_start.py run "$shape" "$out/cold_start_$shape.json" "$budget" \
  --device "${DEVICE:-cuda}" "${extra[@]}" 2>&1 | tee "$out/cold_start_${shape}_log.txt"
