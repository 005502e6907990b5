#!/usr/bin/env bash
# Wrote: lab/results/long_context/context_parallel_small_h200/kernel_*.json (OUT/*.json each try's record)
# Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_cp_floor_kernels.sh   (a lent 2-GPU machine, repository root; carry .whl .gpucache)
# Why: at the 1B shape (one row of 2048 tokens, 16 steps) the floor pairs of the context-parallel check are bit for
# bit the same forward (the one-GPU fast path takes the same flash kernel as the one-GPU context code): they differ
# only in the backward's nondeterminism. 2-GPU context parallel changes the forward's arithmetic (the ring's blocks,
# GEMMs of half the rows). Two one-GPU runs that change the forward's arithmetic too, not what it computes: the fast
# path with cuDNN's attention kernel (GPU 0), and the same code with the LoRA layers' narrow route (GPU 1): how far
# do they move the loss from the one-GPU run's?
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
source lab/gpu/gpu_env.sh
models_outside_tree
export TORCHINDUCTOR_COMPILE_THREADS=16
common=(--seq-len 2048 --steps 16 --model llama-3.2-1b-shape --cap-gib 22.0)
cp_try kernel_plain_cudnn 1 0 "${common[@]}" --plain --sdpa-kernel cudnn & p=$!
cp_try kernel_one_narrow 1 1 "${common[@]}" --optimize lora_addmm=narrow
wait $p
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for n in ("kernel_plain_cudnn", "kernel_one_narrow"):
    d = json.load(open(f"{out}/{n}.json"))
    print(n, d.get("choices", {}).get("sdpa_kernel"), d.get("choices", {}).get("lora_wide"), [round(x, 5) for x in d.get("losses", [])])
PY
rm -f $OUT/*.log
