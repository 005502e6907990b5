#!/usr/bin/env bash
# Writes: OUT/nf4_dequant_step.json (-> results/nf4_dequant_step_<gpu>.json), OUT/compute_extras.json
#   (-> results/compute_extras_<gpu>.json), OUT/compute_extras_log.txt, OUT/children_logs.tar.gz
# Rerun: bash lab/gpu/step/gpu_compute_extras.sh OUT [BUDGET_S=540] [PARTS=8b,1b] (8b8: the A/B at 8 x 1024)
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache; about 450-540 s on an H100)
# The committed results came from one call: COMMIT=dbc98a5 bash lab/gpu/step/gpu_compute_extras.sh $OUT 530
#   (parts 8b,1b; 375 s; its 1B arms failed on a bug fixed since). The parts fasteager,8b8,1b ran in a second
#   call (2026-11-24, `... $OUT <left> fasteager,8b8,1b`, ~430 s with a packing run before it) into
#   lab/results/compute/compute_extras_h100_call2.json and results/nf4_dequant_step_h100_call2.json.
# Issue 20's three small measurements in one call (lab/gpu/step/compute_extras.py says how): the NF4
# dequantize patch A/B in a real step at 8B (2 x 1024, regional) and 1B (4 x 512, whole), the warm
# start of the 8B regional compile from a shared Inductor cache, and the 8B loss against HF eager's
# bf16 floor. Phases a budget leaves out are recorded as skipped.
set -uo pipefail
out=${1:?usage: lab/gpu/step/gpu_compute_extras.sh OUT_DIR [BUDGET_S]}
budget=${2:-540}
parts=${3:-8b,1b}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L
models_outside_tree
echo "TORCHINDUCTOR_CACHE_DIR from gpu_env.sh: ${TORCHINDUCTOR_CACHE_DIR:-unset} (each child gets its own; see compute_extras.py)"
export QLORA_NB_EXTRAS_CMD="COMMIT=${COMMIT:-unknown} bash lab/gpu/step/gpu_compute_extras.sh \$OUT $budget $parts (code: ${COMMIT:-unknown commit} + working tree)"
python3 lab/gpu/step/compute_extras.py main "$out" "$budget" --parts "$parts" --work /tmp/compute_extras_work 2>&1 \
  | tee "$out/compute_extras_log.txt"
abs=$(realpath "$out")
(cd /tmp/compute_extras_work && tar -czf "$abs/children_logs.tar.gz" log_*.txt run_*.json 2>/dev/null) || true
