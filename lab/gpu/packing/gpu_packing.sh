#!/usr/bin/env bash
# Wrote: results/packing_<gpu>.json (issue 19's packing benchmark; 1B call, then the 8B subset into the same file)
# Use (on the lent GPU machine, repository root; carry .whl .gpucache .unsloth):
#   bash lab/gpu/packing/gpu_packing.sh OUT_DIR [BUDGET_S=470] [MODEL=llama-3.2-1b-shape] [RUNS=all] [DATA=kjv,long-tail]
#                                   [SEQ_LEN=1024] [ROWS=8] [STEPS=10]
#   env EPOCH_DATA=long-tail: ours-packed's epoch check on those data sets only; DATA_OUTER=1: every
#   run on the first data set before any on the next (a budget cut then loses the last data set);
#   LOWMEM_GIB=N|unsloth (default unsloth): ours-lowmem-packed's max_memory_gib, a number or the
#   lowest Unsloth peak already measured on the same model and data (run an Unsloth run first).
#   LOWMEM_SCOPE=whole|regional (default whole): ours-lowmem-packed's optimize() scope (regional at 8B:
#   one layer's compile, ~15 s, where the whole graph's took ~210 s and outran the run's limit)
# Time limits and the seconds a run needs to start are per model (the 8B shape's whole-graph cold
# compile is 176-220 s, lab/results/step/profile_8b_h100.json); a run that no longer fits is skipped, the next
# one tried (1B ours-lowmem-packed needs ~160 s: its whole-graph cold compile with checkpointing took 119 s on
# kjv, and on long-tail a 137 s limit ran out). Built models are kept in /tmp/qlora_nb_cache (the tokenizer copied from .gpucache), so
# a second call on a still-warm machine does not build the 16 GB 8B checkpoint again.
# The packing benchmark (lab.peers.packed): the same examples packed and padded,
# one process per run (ours-packed, ours-padded, unsloth-packed, hf-eager-packed, trl-sft-packed,
# hf-eager, unsloth), real tokens/s counted one way for all, into OUT_DIR/packing_<gpu>.json,
# rewritten after every run. ours-packed also counts the compilations over every packed batch of
# one epoch and judges its loss against the same recipe uncompiled (bf16 floor).
# An existing results/packing_<gpu>.json (carried with the tree) or OUT_DIR one is kept, so the
# 8B call appends to the 1B rows.
# Why 1024 x 8 at 1B: 8,192 slots per step, HF eager's padded step fits an 80 GB card with room
# (it peaked at 20 GiB on 2 x 2048), a packed row holds ~6 shipped examples (median 169 tokens) and
# ~2-3 long-tail ones (mean 429), and a step is long enough (>= 100 ms) for the medians to be
# stable over 10 steps. 8B: ROWS=4, the most that HF eager's padded-recipe step can hold on an 80 GB
# card without checkpointing (no peer checkpoints here): its 1B step at 8 x 1024 peaked at 38 GiB, of
# which ~26 GiB grow with depth x width (8B: 32 layers of 4096 vs 16 of 2048, ~4x), so 8 x 1024 at
# 8B would need ~110 GiB and 4 x 1024 ~60 GiB (an estimate, not a measurement).
set -euo pipefail
out=${1:?usage: lab/gpu/packing/gpu_packing.sh OUT_DIR [BUDGET_S] [MODEL] [RUNS] [DATA] [SEQ_LEN] [ROWS] [STEPS]}
budget=${2:-470}; model=${3:-llama-3.2-1b-shape}; runs=${4:-all}; data=${5:-kjv,long-tail}
seq=${6:-1024}; rows=${7:-8}; steps=${8:-10}
t_start=$(date +%s)
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
mkdir -p /tmp/qlora_nb_cache && cp -rn .gpucache/qlora_nb/. /tmp/qlora_nb_cache/
export QLORA_NB_CACHE=/tmp/qlora_nb_cache
unsloth_site
nvidia-smi -L
gpu=$(python3 -c "import torch; n=torch.cuda.get_device_name(); print(next((t.lower() for t in ('H100','H200','A100','L4','T4') if t in n), 'gpu'))")
file="$out/packing_${gpu}.json"
if [ ! -f "$file" ] && [ -f "results/packing_${gpu}.json" ]; then cp "results/packing_${gpu}.json" "$file"; fi
t_build=$(date +%s); python3 -c "from qlora_nb_utils import models; models.materialize('$model')"
echo "materialize $model: $(( $(date +%s) - t_build )) s"
[ "$runs" = all ] && runs=ours-packed,ours-padded,unsloth-packed,hf-eager-packed,trl-sft-packed,hf-eager,unsloth
if [ "$model" = llama-3.1-8b-shape ]; then
  timeouts='{"default": 180, "ours-packed": 330, "ours-padded": 300, "ours-lowmem-packed": 330, "unsloth-packed": 180, "unsloth": 180, "hf-eager": 150, "hf-eager-packed": 150, "trl-sft-packed": 150}'
  needs='{"ours-packed": 230, "ours-padded": 210, "ours-lowmem-packed": 230, "unsloth-packed": 80, "unsloth": 80, "hf-eager": 50, "hf-eager-packed": 50, "trl-sft-packed": 60}'
else
  timeouts='{"default": 120, "ours-lowmem-packed": 300, "ours-packed": 170, "ours-padded": 150, "unsloth-packed": 120, "unsloth": 110, "hf-eager": 70, "hf-eager-packed": 70, "trl-sft-packed": 90}'
  needs='{"ours-packed": 100, "ours-padded": 100, "ours-lowmem-packed": 160, "unsloth-packed": 60, "unsloth": 60, "hf-eager": 30, "hf-eager-packed": 30, "trl-sft-packed": 35}'
fi
left=$(( budget - ($(date +%s) - t_start) ))
extra=()
[ -n "${EPOCH_DATA:-}" ] && extra+=(--epoch-data "$EPOCH_DATA")
[ "${DATA_OUTER:-0}" = 1 ] && extra+=(--data-outer)
python3 -m lab.peers.packed "${extra[@]}" --command "EPOCH_DATA=${EPOCH_DATA:-} DATA_OUTER=${DATA_OUTER:-0} LOWMEM_GIB=${LOWMEM_GIB:-unsloth} LOWMEM_SCOPE=${LOWMEM_SCOPE:-whole} bash lab/gpu/packing/gpu_packing.sh $*" --model "$model" --data "$data" --runs "$runs" --seq-len "$seq" \
  --rows "$rows" --steps "$steps" --warmup 3 --parity-steps 4 --long-tail-examples 600 --budget-s "$left" \
  --timeouts "$timeouts" --needs "$needs" --lowmem-gib "${LOWMEM_GIB:-unsloth}" --lowmem-scope "${LOWMEM_SCOPE:-whole}" \
  --out "$file" 2>&1 | grep -v -i "warning\|Loading weights" || true
ls -la "$out"
