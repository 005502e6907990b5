#!/usr/bin/env bash
# The GPU run of the main job, as sent to the lent GPU machine (see README "Results on a GPU").
# That machine has torch, transformers and accelerate but no bitsandbytes/datasets and no
# network: the wheels travel in .whl/ (made by the gpu-wheels tool) and the SmolLM2 tokenizer
# in .gpucache/ (copied from ~/.cache/qlora_nb/_tokenizer-smollm2 after one CPU run).
# Usage (on that machine, from the repository root): bash tools/gpu_bench.sh OUT_DIR [bench args...]
set -euo pipefail
out=${1:?usage: tools/gpu_bench.sh OUT_DIR [qlora-nb bench args...]}
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export QLORA_NB_CACHE=$PWD/.gpucache/qlora_nb HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg
nvidia-smi -L
python3 -m qlora_nb_utils.cli bench --out "$out" --no-progress "$@"
