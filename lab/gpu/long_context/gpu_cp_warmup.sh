#!/usr/bin/env bash
# Wrote: lab/results/long_context/context_parallel_small_h200/warmup_*.json (OUT/*.json each try's record)
# Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_cp_warmup.sh   (a lent 2-GPU machine, repository root; carry .whl .gpucache)
# Why: at the 1B shape (one row of 2048 tokens) 2-GPU context parallel's loss leaves one GPU's at AdamW's first
# step (gpu_cp_grads.sh: the ring's gradients a few per cent from one GPU's, signs of small ones turned). With a
# linear warm-up of the learning rate (WARMUP steps) the first steps are small: does the gap then stay at the floor?
# 2 GPUs, one GPU, and one GPU again (the floor pair), 16 steps each.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
source lab/gpu/gpu_env.sh
models_outside_tree
export TORCHINDUCTOR_COMPILE_THREADS=16
WARMUP=${WARMUP:-8}
common=(--seq-len 2048 --steps 16 --model llama-3.2-1b-shape --cap-gib 22.0 --warmup "$WARMUP")
cp_try warmup_cp2 2 0,1 "${common[@]}"
cp_try warmup_one 1 0 "${common[@]}" & p=$!
cp_try warmup_one_again 1 1 "${common[@]}"
wait $p
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = {n: json.load(open(f"{out}/warmup_{n}.json"))["losses"] for n in ("cp2", "one", "one_again")}
apart = lambda a, b: max(abs(x - y) for x, y in zip(runs[a], runs[b]))
print(f"warm-up: max |cp2 - one| {apart('cp2', 'one'):.2e}, floor |one_again - one| {apart('one_again', 'one'):.2e}")
print("step diffs cp2-one:", [f"{abs(x - y):.1e}" for x, y in zip(runs["cp2"], runs["one"])])
PY
rm -f $OUT/*.log
