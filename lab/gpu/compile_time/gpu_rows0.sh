#!/usr/bin/env bash
# Wrote: lab/results/compile_time/cold_start_h200.json (runs ours, ours-rows0 at smollm2-135m; merged from
#   OUT/cold_start_smollm2-135m.json) and lab/results/long_context/context_parallel_small_h200/rows0_cp2.json
# Rerun: OUT=$OUT bash lab/gpu/compile_time/gpu_rows0.sh   (a lent 2-GPU machine, repository root; carry .whl .gpucache)
# Why: at 1,536 rows or fewer a call (bitsandbytes' own CUDA threshold) the NF4 patch leaves a LoRA layer to
# bitsandbytes' own kernels and the update is added after them (the narrow route's rounding), past it the fused
# route runs (wide groups). SmolLM2-135M at 4 x 128 (512 rows) never takes the fused route, and 2-GPU context
# parallel at 2048 tokens (1024 rows a rank) does not while one GPU (2048 rows) does, which alone moves its loss
# after the first update by the narrow route's gap. With the threshold at 0 rows: (1) 2-GPU context parallel at
# the 1B shape, 2048 tokens, 4 steps (against one GPU's losses, call of gpu_cp_grads.sh); (2) SmolLM2-135M's cold
# start, default against ours-rows0, on GPU 0.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
source lab/gpu/gpu_env.sh
models_outside_tree
export TORCHINDUCTOR_COMPILE_THREADS=16
CP_TRY_TIMEOUT=100 cp_try rows0_cp2 2 0,1 --seq-len 2048 --steps 4 --model llama-3.2-1b-shape --cap-gib 22.0 --nf4-min-rows 0
python3 -c "import json; d = json.load(open('$OUT/rows0_cp2.json')); print('rows0_cp2', d.get('losses'))"
CUDA_VISIBLE_DEVICES=0 COMMIT=${COMMIT:-unknown} COLD_START_RUNS=ours:cold,ours-rows0:cold \
  timeout 150 bash lab/gpu/compile_time/gpu_cold_start.sh $OUT smollm2-135m 140 2>&1 | grep "^\[cold_start\]"
rm -f $OUT/*.log
