#!/usr/bin/env bash
# Wrote: lab/results/long_context/train_cli_65536_h200.json (+ train_cli_65536_h200_log.txt, loss_curve_65536.png)
# Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_train_long.sh   (one GPU, from the repository root; carry .whl .gpucache)
# `qlora-nb train` as a user with a 24 GB card runs it on long documents: the shipped data packed into rows of
# SEQ_LEN (65536) tokens, llama-3.1-8b-shape, --max-memory-gib 24. The process is capped to CAP_GIB (22.0, what
# an L4 / A10G leaves PyTorch: lab.long_context.CAP_NOTE) before the CLI starts, so a peak over the card fails
# here as it would there; the allocator setting is the one `train --max-memory-gib` picks by itself
# (expandable segments), set in the environment because the cap starts CUDA first.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
SEQ_LEN=${SEQ_LEN:-65536}; CAP_GIB=${CAP_GIB:-22.0}; STEPS=${STEPS:-3}
source "$(dirname "$0")/../gpu_env.sh"
models_outside_tree
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
args=(train --model llama-3.1-8b-shape --max-memory-gib 24 --seq-len "$SEQ_LEN" --packing on --batch-size 1
      --steps "$STEPS" --eval-every 0 --save-every 0 --eval-size 2 --out /tmp/train_long --overwrite --no-progress)
start=$(date +%s)
python3 - "$CAP_GIB" "${args[@]}" > "$OUT/train_log.txt" 2>&1 <<'PY'
import sys, torch
cap = float(sys.argv[1])
torch.cuda.set_per_process_memory_fraction(cap * 2**30 / torch.cuda.get_device_properties(0).total_memory, 0)
from qlora_nb_utils.cli import main
code = main(sys.argv[2:])
print(f"[train_long] exit {code}; peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
      f"reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB under a {cap} GiB cap")
sys.exit(code)
PY
rc=$?
echo "[train_long] rc $rc after $(( $(date +%s) - start )) s" >> "$OUT/train_log.txt"
cp /tmp/train_long/metrics.json "$OUT/metrics.json" 2>/dev/null; cp /tmp/train_long/loss_curve.png "$OUT/" 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader >> "$OUT/train_log.txt"
tail -25 "$OUT/train_log.txt"
