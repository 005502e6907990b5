#!/usr/bin/env bash
# Wrote: lab/results/bench/bench_h100.json (+ bench_h100_loss_curves.png)
# Rerun: bash lab/gpu/bench/gpu_bench.sh OUT --model llama-3.2-1b-shape --batch-size 4 --seq-len 512 --steps 30 --warmup 5
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache)
# The GPU run of the main job, as sent to the lent GPU machine (see README "Results on a GPU").
# That machine has torch, transformers and accelerate but no bitsandbytes/datasets and no
# network: the wheels travel in .whl/ (made by the gpu-wheels tool) and the SmolLM2 tokenizer
# in .gpucache/ (copied from ~/.cache/qlora_nb/_tokenizer-smollm2 after one CPU run).
# Usage (on that machine, from the repository root): bash lab/gpu/bench/gpu_bench.sh OUT_DIR [bench args...]
set -euo pipefail
out=${1:?usage: lab/gpu/bench/gpu_bench.sh OUT_DIR [qlora-nb bench args...]}
shift
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L
python3 -m qlora_nb_utils.cli bench --out "$out" --no-progress "$@"
