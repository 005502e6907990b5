#!/usr/bin/env bash
# Wrote: results/bench_packing_<gpu>_{flex,sdpa}.json (+ *_loss_curves.png)
# Rerun: bash lab/gpu/packing/gpu_packing_bench.sh OUT [LIMIT=400] [SHAPE=8x1024]
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache)
# `qlora-nb bench --packing` on the 1B shape, once per per-document attention kernel (flex
# attention's BlockMask, then SDPA's dense mask): hf-eager on the packed batches, the fast path on
# the same examples padded, and the fast path packed, with parity against the packed recipe
# uncompiled and its two-order floor. Each run has a hard time limit; what finished is kept.
set -uo pipefail
out=${1:?usage: lab/gpu/packing/gpu_packing_bench.sh OUT [LIMIT] [SHAPE]}
limit=${2:-400}
shape=${3:-8x1024}
b=${shape%x*}; s=${shape#*x}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L
gpu=$(python3 -c "import torch; n=torch.cuda.get_device_name(); print(next((t.lower() for t in ('H100','H200','A100','L4','T4') if t in n), 'gpu'))")
python3 -c "import torch; from qlora_nb_utils.ops.doc_attention import varlen_available; print('torch', torch.__version__, 'varlen_attn:', varlen_available())"
for kernel in flex_attention sdpa; do
  tag=${kernel%_attention}
  timeout "${RUN_LIMIT_S:-280}" python3 -m qlora_nb_utils.cli bench --packing --doc-attention "$kernel" \
    --model llama-3.2-1b-shape --batch-size "$b" --seq-len "$s" --steps 60 --warmup 3 --limit "$limit" \
    --out "$out/$tag" --no-progress > "$out/bench_packing_${gpu}_${tag}.log" 2>&1
  echo "$kernel: exit $?"; tail -n 30 "$out/bench_packing_${gpu}_${tag}.log"
  if [ -f "$out/$tag/results.json" ]; then
    cp "$out/$tag/results.json" "$out/bench_packing_${gpu}_${tag}.json"
    cp "$out/$tag/loss_curves.png" "$out/bench_packing_${gpu}_${tag}_loss_curves.png" 2>/dev/null || true
    rm -rf "${out:?}/$tag"
  fi
done
