#!/usr/bin/env bash
# Wrote: results/packing_<gpu>.json (issue 19's packing benchmark; 1B call, then the 8B subset into the same file)
# Use (on the lent GPU machine, repository root; carry .whl .gpucache .unsloth):
#   bash scripts/gpu/gpu_packing.sh OUT_DIR [BUDGET_S=470] [MODEL=llama-3.2-1b-shape] [RUNS=all] [DATA=kjv,long-tail]
#                                   [SEQ_LEN=1024] [ROWS=8] [STEPS=10]
#   env EPOCH_DATA=long-tail: ours-packed's epoch check on those data sets only; DATA_OUTER=1: every
#   run on the first data set before any on the next (a budget cut then loses the last data set).
# The packing benchmark (qlora_nb_utils.bench.peers.packed): the same examples packed and padded,
# one process per run (ours-packed, ours-padded, unsloth-packed, hf-eager-packed, trl-sft-packed,
# hf-eager, unsloth), real tokens/s counted one way for all, into OUT_DIR/packing_<gpu>.json,
# rewritten after every run. ours-packed also counts the compilations over every packed batch of
# one epoch and judges its loss against the same recipe uncompiled (bf16 floor).
# An existing results/packing_<gpu>.json (carried with the tree) or OUT_DIR one is kept, so the
# 8B call appends to the 1B rows.
# Why 1024 x 8 at 1B: 8,192 slots per step, HF eager's padded step fits an 80 GB card with room
# (it peaked at 20 GiB on 2 x 2048), a packed row holds ~6 shipped examples (median 169 tokens) and
# ~2-3 long-tail ones (mean 429), and a step is long enough (>= 100 ms) for the medians to be
# stable over 10 steps. 8B: ROWS=4 (half the tokens per step: Unsloth and ours run without
# gradient checkpointing there unless optimize() picks it).
set -euo pipefail
out=${1:?usage: scripts/gpu/gpu_packing.sh OUT_DIR [BUDGET_S] [MODEL] [RUNS] [DATA] [SEQ_LEN] [ROWS] [STEPS]}
budget=${2:-470}; model=${3:-llama-3.2-1b-shape}; runs=${4:-all}; data=${5:-kjv,long-tail}
seq=${6:-1024}; rows=${7:-8}; steps=${8:-10}
t_start=$(date +%s)
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
if [ -f .unsloth/usite.tar.gz ]; then
  mkdir -p /tmp/usite && tar -xzf .unsloth/usite.tar.gz -C /tmp/usite
  export QLORA_NB_UNSLOTH_SITE=/tmp/usite
fi
nvidia-smi -L
gpu=$(python3 -c "import torch; n=torch.cuda.get_device_name(); print(next((t.lower() for t in ('H100','H200','A100','L4','T4') if t in n), 'gpu'))")
file="$out/packing_${gpu}.json"
if [ ! -f "$file" ] && [ -f "results/packing_${gpu}.json" ]; then cp "results/packing_${gpu}.json" "$file"; fi
python3 -c "from qlora_nb_utils import models; models.materialize('$model')"
[ "$runs" = all ] && runs=ours-packed,ours-padded,unsloth-packed,hf-eager-packed,trl-sft-packed,hf-eager,unsloth
left=$(( budget - ($(date +%s) - t_start) ))
extra=()
[ -n "${EPOCH_DATA:-}" ] && extra+=(--epoch-data "$EPOCH_DATA")
[ "${DATA_OUTER:-0}" = 1 ] && extra+=(--data-outer)
python3 -m qlora_nb_utils.bench.peers.packed "${extra[@]}" --command "EPOCH_DATA=${EPOCH_DATA:-} DATA_OUTER=${DATA_OUTER:-0} bash scripts/gpu/gpu_packing.sh $*" --model "$model" --data "$data" --runs "$runs" --seq-len "$seq" \
  --rows "$rows" --steps "$steps" --warmup 3 --parity-steps 4 --long-tail-examples 600 --budget-s "$left" \
  --timeouts '{"default": 120, "ours-lowmem-packed": 300, "ours-packed": 170, "ours-padded": 150, "unsloth-packed": 120, "unsloth": 110, "hf-eager": 70, "hf-eager-packed": 70, "trl-sft-packed": 90}' \
  --out "$file" 2>&1 | grep -v -i "warning\|Loading weights" || true
ls -la "$out"
