#!/usr/bin/env bash
# Wrote: results/packing_<gpu>.json's loss_checks (the longer loss check) and doc_attention (flex, varlen, ...)
# Use (on the lent GPU machine, repository root; carry .whl .gpucache):
#   bash lab/gpu/packing/gpu_packing_checks.sh OUT_DIR LIMIT_S CHECK [CHECK ...]
#   CHECK: loss:MODEL:DATA:ROWS:STEPS:FLOOR_RUNS      (lab.peers.packed_checks loss)
#          kernel:KERNEL:MODEL:DATA:ROWS:STEPS[:SCOPE] (... kernel; warm-up 3, 4 loss-check steps, 2 permuted runs;
#                                                      SCOPE whole (default) or regional, as at 8B)
# e.g. bash lab/gpu/packing/gpu_packing_checks.sh $OUT 450 loss:llama-3.1-8b-shape:kjv:4:8:3 kernel:flex_attention:llama-3.2-1b-shape:kjv:8:10
# Each check is a process of its own under `timeout` (what is left of LIMIT_S); a check with less
# than 60 s left is skipped. An existing OUT_DIR/packing_<gpu>.json is added to, else the
# carried results/packing_<gpu>.json is copied first, so these keys land beside the benchmark's runs.
# Models are built in /tmp/qlora_nb_cache (the tokenizer copied from .gpucache), as gpu_packing.sh does.
set -euo pipefail
out=${1:?usage: lab/gpu/packing/gpu_packing_checks.sh OUT_DIR LIMIT_S CHECK [CHECK ...]}
limit=${2:?LIMIT_S}; shift 2
t_start=$(date +%s)
export QLORA_NB_CALL="${QLORA_NB_CALL:-$(hostname)-$t_start}"  # every row of this call carries it (same_call)
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
mkdir -p /tmp/qlora_nb_cache && cp -rn .gpucache/qlora_nb/. /tmp/qlora_nb_cache/
export QLORA_NB_CACHE=/tmp/qlora_nb_cache
gpu=$(python3 -c "import torch; n=torch.cuda.get_device_name(); print(next((t.lower() for t in ('H100','H200','A100','L4','T4') if t in n), 'gpu'))")
file="$out/packing_${gpu}.json"
if [ ! -f "$file" ] && [ -f "results/packing_${gpu}.json" ]; then cp "results/packing_${gpu}.json" "$file"; fi
python3 - <<'PY'
import inspect, torch
try:
    from torch.nn.attention.varlen import varlen_attn
    print("torch", torch.__version__, "varlen_attn", inspect.signature(varlen_attn))
except ImportError as exc:
    print("torch", torch.__version__, "no varlen_attn:", exc)
PY
for check in "$@"; do
  IFS=: read -r what a b c d e f <<< "$check"
  left=$(( limit - ($(date +%s) - t_start) - 5 ))
  if [ "$left" -lt 60 ]; then echo "skipped $check: $left s left"; continue; fi
  if [ "$what" = loss ]; then model=$a; else model=$b; fi
  t_build=$(date +%s); python3 -c "from qlora_nb_utils import models; models.materialize('$model')"
  echo "materialize $model: $(( $(date +%s) - t_build )) s"
  left=$(( limit - ($(date +%s) - t_start) - 5 ))
  echo "==> $check ($left s left)"
  t_check=$(date +%s)
  if [ "$what" = loss ]; then
    timeout "$left" python3 -m lab.peers.packed_checks loss --model "$a" --data "$b" --rows "$c" \
      --steps "$d" --floor-runs "$e" --out "$file" --command "bash lab/gpu/packing/gpu_packing_checks.sh OUT $limit $check" \
      2>&1 | grep -v -i "warning\|Loading weights" || echo "$check: exit ${PIPESTATUS[0]}"
  else
    timeout "$left" python3 -m lab.peers.packed_checks kernel --kernel "$a" --model "$b" --data "$c" \
      --rows "$d" --steps "$e" --warmup 3 --parity-steps 4 --floor-runs 2 --scope "${f:-whole}" --out "$file" \
      --command "bash lab/gpu/packing/gpu_packing_checks.sh OUT $limit $check" \
      2>&1 | grep -v -i "warning\|Loading weights" || echo "$check: exit ${PIPESTATUS[0]}"
  fi
  echo "$check: $(( $(date +%s) - t_check )) s"
done
ls -la "$out"
