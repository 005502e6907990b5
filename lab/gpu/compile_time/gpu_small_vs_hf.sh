#!/usr/bin/env bash
# Writes: OUT/cold_start_smollm2-135m.json (-> merged into lab/results/compile_time/cold_start_h200.json: python3
#   lab/gpu/compile_time/cold_start.py merge ...), OUT/cold_start_smollm2-135m_log.txt
# Rerun: OUT=$OUT bash lab/gpu/compile_time/gpu_small_vs_hf.sh   (the lent GPU machine, repository root; carry .whl .gpucache)
# Why: at SmolLM2-135M (4 x 128) a 60-step job of ours is within a few seconds of HF eager's, either side by
# call, and the first process of a call used to pay alone what the machine reads from disk once. Here the
# call is primed first (cold_start.py's priming process), and ours and HF eager alternate, twice each, so
# that each has a neighbour of the other in the same conditions; ours-combo (Inductor's combo kernels:
# fewer launches for a host-bound step) runs between them.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
CUDA_VISIBLE_DEVICES=0 COMMIT=${COMMIT:-unknown} \
  COLD_START_RUNS=${COLD_START_RUNS:-hf-eager:cold,ours:cold,ours-combo:cold,hf-eager:cold,ours:cold} \
  timeout ${SMALL_TIMEOUT:-560} bash lab/gpu/compile_time/gpu_cold_start.sh $OUT smollm2-135m ${SMALL_BUDGET:-330} 2>&1 \
  | grep "^\[cold_start\]"
rm -f $OUT/*.log
