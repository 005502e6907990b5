#!/usr/bin/env bash
# Run tools/fsdp_diag.py on 1 and 2 GPUs (8B shape), then, when the 2-GPU forward matches the
# 1-GPU one (all-gather bit-exact, per-row losses within 1e-3), tools/gpu_fsdp.sh again.
#     OUT=/some/dir bash tools/gpu_fsdp_diag.sh
set -euo pipefail
OUT=${OUT:-$PWD/out/fsdp2_diag}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export QLORA_NB_CACHE=$PWD/.gpucache/qlora_nb HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
MODEL=${MODEL:-llama-3.1-8b-shape}
timeout 240 python3 -c "from qlora_nb_utils import models; print(models.materialize('$MODEL'))" 2>&1 | tail -1
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  tools/fsdp_diag.py "$MODEL" "$OUT/diag_1.json" > "$OUT/diag_1.log" 2>&1 || tail -20 "$OUT/diag_1.log"
CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
  tools/fsdp_diag.py "$MODEL" "$OUT/diag_2.json" > "$OUT/diag_2.log" 2>&1 || tail -20 "$OUT/diag_2.log"
grep '^{' "$OUT/diag_1.log" "$OUT/diag_2.log" || true
rm -f "$OUT"/diag_*.log  # at most 8 files come back
if python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
one = json.load(open(f"{out}/diag_1.json"))[0]
two = json.load(open(f"{out}/diag_2.json"))
ok = all(r["integrity"]["bad_words"] == 0 and r["integrity"]["missing_quant_state"] == 0 for r in two)
for r in two:
    for row, v in r["fsdp_eager"].items():
        d = abs(v - one["fsdp_eager"][row])
        print(f"rank {r['rank']} row {row}: 2-GPU eager {v:.6f} vs 1-GPU {one['fsdp_eager'][row]:.6f} (diff {d:.2e})")
        ok = ok and d < 1e-3
sys.exit(0 if ok else 1)
EOF
then
  echo "[diag] 2-GPU forward matches: rerunning tools/gpu_fsdp.sh"
  OUT=$OUT bash tools/gpu_fsdp.sh
  tar -czf "$OUT/runs.tgz" -C "$OUT" --exclude='*.pt' --exclude='ckpt' --exclude='adapter' runs
  rm -rf "$OUT/runs"
else
  echo "[diag] 2-GPU forward DIFFERS from 1-GPU: not rerunning"
fi
