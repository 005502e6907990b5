#!/usr/bin/env bash
# Run tools/fsdp_diag.py on 2 GPUs (8B shape) with the 4-bit weights sharded and replicated; when
# replicated matches the unsharded model (per-row losses within 1e-3), run tools/gpu_fsdp.sh
# again with NF4=replicate.      OUT=/some/dir bash tools/gpu_fsdp_diag.sh
set -euo pipefail
OUT=${OUT:-$PWD/out/fsdp2_diag}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
MODEL=${MODEL:-llama-3.1-8b-shape}
timeout 240 python3 -c "from qlora_nb_utils import models; print(models.materialize('$MODEL'))" 2>&1 | tail -1
for mode in shard replicate; do
  DIAG_NF4=$mode CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m torch.distributed.run --standalone \
    --nproc-per-node 2 tools/fsdp_diag.py "$MODEL" "$OUT/diag_2_$mode.json" > "$OUT/diag_$mode.log" 2>&1 \
    || tail -20 "$OUT/diag_$mode.log"
  grep '^{' "$OUT/diag_$mode.log" || true
done
rm -f "$OUT"/diag_*.log  # at most 8 files come back
# each rank's "plain" losses (both rows, no FSDP) are the rank-independent reference
if python3 tools/fsdp_diag.py --check "$OUT"; then
  echo "[diag] replicate matches: rerunning tools/gpu_fsdp.sh with NF4=replicate"
  NF4=replicate OUT=$OUT bash tools/gpu_fsdp.sh
  tar -czf "$OUT/runs.tgz" -C "$OUT" --exclude='*.pt' --exclude='ckpt' --exclude='adapter' runs
  rm -rf "$OUT/runs"
else
  echo "[diag] replicate does not match the unsharded model: not rerunning"
fi
