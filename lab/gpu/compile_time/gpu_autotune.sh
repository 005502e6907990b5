#!/usr/bin/env bash
# Writes: OUT/cold_start_<shape>.json for smollm2-135m, llama-3.2-1b-shape and llama-3.1-8b-shape (-> merged into
#   lab/results/compile_time/cold_start_h200.json: python3 lab/gpu/compile_time/cold_start.py merge ...)
# Rerun: OUT=$OUT bash lab/gpu/compile_time/gpu_autotune.sh   (the lent GPU machine, repository root; carry .whl .gpucache)
# Why: optimize() now compiles each Inductor kernel in one configuration and benchmarks none on the first step
# unless autotune is asked. Against the default before (ours-autotune: --autotune on) at each shape of the
# cold-start table, cold, each run in its own process: the time to the first step, and the steady step and peak,
# which may not get worse (at most 5% slower, 5% more memory); HF eager beside them at SmolLM2-135M.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
run() {  # shape budget runs
  CUDA_VISIBLE_DEVICES=0 COMMIT=${COMMIT:-unknown} COLD_START_RUNS=$3 \
    timeout $(( $2 + 20 )) bash lab/gpu/compile_time/gpu_cold_start.sh $OUT $1 $2 2>&1 | grep "^\[cold_start\]"
}
run smollm2-135m 200 ours-autotune:cold,ours:cold,hf-eager:cold
run llama-3.2-1b-shape 250 ours-autotune:cold,ours:cold
run llama-3.1-8b-shape 390 ours:cold,ours-autotune:cold
rm -f $OUT/*.log
