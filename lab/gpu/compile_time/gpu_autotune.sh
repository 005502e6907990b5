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
run() {  # shape budget runs (none: the shape is left out)
  [ -n "${3:-}" ] || return 0
  CUDA_VISIBLE_DEVICES=0 COMMIT=${COMMIT:-unknown} COLD_START_RUNS=$3 \
    timeout $(( $2 + 20 )) bash lab/gpu/compile_time/gpu_cold_start.sh $OUT $1 $2 2>&1 | grep "^\[cold_start\]"
}
# each shape's runs can be given (RUNS_135M, RUNS_1B, RUNS_8B; empty: that shape left out), with its budget
run smollm2-135m ${BUDGET_135M:-200} "${RUNS_135M-ours-autotune:cold,ours:cold,hf-eager:cold}"
run llama-3.2-1b-shape ${BUDGET_1B:-250} "${RUNS_1B-ours-autotune:cold,ours:cold}"
run llama-3.1-8b-shape ${BUDGET_8B:-390} "${RUNS_8B-ours:cold,ours-autotune:cold}"
rm -f $OUT/*.log
