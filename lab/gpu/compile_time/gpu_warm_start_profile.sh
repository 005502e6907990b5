#!/usr/bin/env bash
# Writes: OUT/warm_start_profile.json (-> results/warm_start_profile_<gpu>.json), OUT/warm_start_profile_log.txt
# Rerun: bash lab/gpu/compile_time/gpu_warm_start_profile.sh OUT
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache; about 3 minutes on an H100)
# Issue 20's warm start: one warm 8B start from a pre-quantized NF4 checkpoint under cProfile, after a
# cold one filled the Inductor cache; lab/gpu/compile_time/warm_start_profile.py says how.
set -uo pipefail
out=${1:?usage: lab/gpu/compile_time/gpu_warm_start_profile.sh OUT_DIR}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L
models_outside_tree
export QLORA_NB_PROFILE_CMD="COMMIT=${COMMIT:-unknown} bash lab/gpu/compile_time/gpu_warm_start_profile.sh \$OUT (code: ${COMMIT:-unknown commit} + working tree)"
python3 lab/gpu/compile_time/warm_start_profile.py "$out" 2>&1 | tee "$out/warm_start_profile_log.txt"
