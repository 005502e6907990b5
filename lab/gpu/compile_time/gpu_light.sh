#!/usr/bin/env bash
# Writes: OUT/cold_start_smollm2-135m.json (-> lab/results/compile_time/cold_start_h200.json: python3
#   lab/gpu/compile_time/cold_start.py merge ...), OUT/cold_start_smollm2-135m_log.txt
# Rerun: OUT=$OUT bash lab/gpu/compile_time/gpu_light.sh   (the lent GPU machine, repository root; carry .whl .gpucache)
# Why: SmolLM2-135M's cold first step is mostly compile (one decoder layer's forward and backward, and the
# chunked loss's math on its own), and a 60-step job does not repay it against HF eager. Two ways to compile
# less, each a trial of cold_start.py, in one call beside the default and HF eager: ours-one-config (every
# Inductor kernel in one configuration, none benchmarked on the first step), ours-eager-loss (the loss's math
# as plain code) and ours-light (both).
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
COMMIT=${COMMIT:-unknown} COLD_START_RUNS=${COLD_START_RUNS:-ours:cold,ours-light:cold,hf-eager:cold,ours-one-config:cold,ours-eager-loss:cold} \
  timeout ${LIGHT_TIMEOUT:-560} bash lab/gpu/compile_time/gpu_cold_start.sh $OUT smollm2-135m ${LIGHT_BUDGET:-540} 2>&1 | grep "^\[cold_start\]"
