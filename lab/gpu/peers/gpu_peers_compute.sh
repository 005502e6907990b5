#!/usr/bin/env bash
# Writes: $OUT_DIR/peers_compute_<gpu>.json (committed as results/peers_compute_<gpu>.json), its
#   _tradeoff.png (the offload files of results/ on it too), peers_compute_log.txt, children_logs.tar.gz
# Rerun (lab/results/compute/peers_compute_h100.json came from these two calls, 573 s and 440 s on an H100):
#   COMMIT=<sha> bash lab/gpu/peers/gpu_peers_compute.sh "$OUT" 550 8b-8x1024,8b-8x1024-ckpt,8b-2x1024 12 4
#   COMMIT=<sha> bash lab/gpu/peers/gpu_peers_compute.sh "$OUT" 520 1b-4x512,1b-16x1024 20 5
#   (on the lent GPU machine, repository root; carry .whl .gpucache .unsloth)
# Issue 20: ours (optimize(), the product path) against Unsloth at its compute-bound shapes,
# checkpointing off and on, one process per run, the same batches
# (lab.peers.compute says which scope and checkpointing each run uses and why).
# An existing results/peers_compute_<gpu>.json (carried with the tree) is copied to OUT_DIR first,
# so a second call (the settings a budget left out) fills the same file; FRESH=1 starts anew.
# Settings a budget leaves out are rows with error "skipped: ..." until a later call runs them.
#
# VARIANTS="ours-no-recompute={\"recompute\":false} ..." adds those ours runs at every setting
#   (space-separated NAME=JSON, JSON without spaces: the same-call A/B of an optimize() option).
# Usage: bash lab/gpu/peers/gpu_peers_compute.sh OUT_DIR [BUDGET_S=560] [SETTINGS=all] [STEPS=12] [WARMUP=4]
set -uo pipefail
out=${1:?usage: lab/gpu/peers/gpu_peers_compute.sh OUT_DIR [BUDGET_S] [SETTINGS] [STEPS] [WARMUP]}
budget=${2:-560}
settings=${3:-8b-8x1024,8b-8x1024-ckpt,8b-2x1024,1b-4x512,1b-16x1024}
steps=${4:-12}
warmup=${5:-4}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
unsloth_site
nvidia-smi -L
gpu=$(python3 -c "import torch; n=torch.cuda.get_device_name(); print(next((t.lower() for t in ('H100','H200','A100','L4','T4') if t in n), 'gpu'))")
file="$out/peers_compute_${gpu}.json"
if [ "${FRESH:-0}" != 1 ] && [ -f "results/peers_compute_${gpu}.json" ]; then cp "results/peers_compute_${gpu}.json" "$file"; fi
extra=()
for v in ${VARIANTS:-}; do extra+=(--variant "$v"); done
cmd="FRESH=${FRESH:-0} VARIANTS='${VARIANTS:-}' bash lab/gpu/peers/gpu_peers_compute.sh \$OUT $budget $settings $steps $warmup (code: ${COMMIT:-unknown commit} + working tree)"
python3 -m lab.peers.compute run --out "$file" --settings "$settings" --steps "$steps" \
  --warmup "$warmup" --budget-s "$budget" --timeout-s 240 --work-dir /tmp/peers_compute_work --command "$cmd" "${extra[@]}" \
  2>&1 | tee "$out/peers_compute_log.txt"
abs=$(realpath "$out")
(cd /tmp/peers_compute_work && tar -czf "$abs/children_logs.tar.gz" log_*.txt 2>/dev/null) || true
python3 -m qlora_nb_utils.cli report "$file" results/offload_"${gpu}"*.json 2>&1 | tee -a "$out/peers_compute_log.txt"
