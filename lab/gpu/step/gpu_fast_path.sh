#!/usr/bin/env bash
# Wrote: results/fast_path_<gpu>.json (+ fast_path_<gpu>_<b>x<s>.png), results/odd_lengths_<gpu>.json
# Rerun: bash lab/gpu/step/gpu_fast_path.sh OUT 4x512 [30]   then   bash lab/gpu/step/gpu_fast_path.sh OUT 16x1024 [20]
#        bash lab/gpu/step/gpu_fast_path.sh OUT odd
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache), then on this machine
#   python3 lab/gpu/step/fast_path_results.py --gpu h100 OUT_OF_EACH_CALL...
# The README main job on a GPU (issue 18): `qlora-nb bench` on the 1B shape, HF eager against plain
# torch.compile and optimize()'s fast path, with the eager-vs-eager floor; or the odd-lengths check:
# `qlora-nb diagnose --strict` over lengths that are not multiples of 8, QLoRA + checkpointing,
# through optimize().
set -euo pipefail
out=${1:?usage: lab/gpu/step/gpu_fast_path.sh OUT_DIR 4x512|16x1024|odd [steps]}
what=${2:?shape BxS or odd}
steps=${3:-30}
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L
mkdir -p "$out"
if [ "$what" = odd ]; then
  lens=97,131,173,211,257,299,331,379,421,467,480
  python3 -m qlora_nb_utils.cli diagnose --model llama-3.2-1b-shape-4l --grad-ckpt --batch-size 2 \
    --seq-lens "$lens" --strict --json "$out/odd_lengths.json"
  exit 0
fi
b=${what%x*}
s=${what#*x}
python3 -m qlora_nb_utils.cli bench --model llama-3.2-1b-shape --batch-size "$b" --seq-len "$s" --steps "$steps" \
  --warmup 5 --out "$out/bench_${what}" --no-progress
