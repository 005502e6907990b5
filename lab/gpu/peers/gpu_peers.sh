#!/usr/bin/env bash
# Wrote: lab/results/peers/peers_h200.json, lab/results/peers/peers_h200_search.json, results/peers_h200_*.png
# Rerun: FRESH=0 bash lab/gpu/peers/gpu_peers.sh OUT 185 4x512 ours-default-compile 20 (Unsloth: carry .unsloth too)
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache)
# The peer comparison on the lent GPU machine: one process per library, same checkpoint, same
# batches, same seed (lab.peers.run_peers), into $OUT_DIR/peers_<gpu>.json, then the
# report (table on stdout, PNGs next to the JSON).
#
# Carried (see lab/gpu/bench/gpu_bench.sh): .whl (bitsandbytes, datasets, peft, trl, ...; torchao in
# .whl/torchao/, installed into its own site so only the torchao peer imports it), .gpucache
# (the SmolLM2 tokenizer). Unsloth: set QLORA_NB_UNSLOTH_SITE to its site folder, else that
# peer is an error run saying why.
#
# Usage (on that machine, from the repository root):
#   bash lab/gpu/peers/gpu_peers.sh OUT_DIR [BUDGET_S=500] [SHAPE=4x512] [PEERS=...] [STEPS=20]
# An existing results/peers_<gpu>.json (carried with the tree) is copied to OUT_DIR first, so a
# second call (another shape, the peers a budget left out) appends to the same file; FRESH=1
# starts a new file instead (every row of it then comes from this session's calls).
set -euo pipefail
out=${1:?usage: lab/gpu/peers/gpu_peers.sh OUT_DIR [BUDGET_S] [SHAPE] [PEERS] [STEPS]}
budget=${2:-500}
shape=${3:-4x512}
peers=${4:-hf-eager,ours-chunked,unsloth,ours-ckpt,ours-budget,ours-default-compile,torchao-nf4,trl-sft-compile}
steps=${5:-20}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
if compgen -G ".whl/torchao/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-torchao .whl/torchao/*.whl
  export QLORA_NB_TORCHAO_SITE=/tmp/site-torchao
fi
nvidia-smi -L
gpu=$(python3 -c "import torch; n=torch.cuda.get_device_name(); print(next((t.lower() for t in ('H100','H200','A100','L4','T4') if t in n), 'gpu'))")
file="$out/peers_${gpu}.json"
if [ "${FRESH:-0}" != 1 ] && [ ! -f "$file" ] && [ -f "results/peers_${gpu}.json" ]; then cp "results/peers_${gpu}.json" "$file"; fi
export QLORA_NB_PEERS_CMD="FRESH=${FRESH:-0} bash lab/gpu/peers/gpu_peers.sh $*"
python3 - "$file" "$budget" "$shape" "$peers" "$steps" <<'PY'
import os, sys, time, warnings
warnings.filterwarnings("ignore")
from qlora_nb_utils import models
from lab import peers
path, budget, shape, names, steps = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
b, s = (int(x) for x in shape.split("x"))
t0 = time.monotonic()
models.materialize("llama-3.2-1b-shape")  # built once, random weights drawn on the GPU
left = budget - (time.monotonic() - t0)
# whole-model compile of this shape: ~60-85 s on an H100; a peer gets at most 170 s (eager 90 s)
limits = {"default": 170, "hf-eager": 90, "unsloth": 200}
peers.run_peers("llama-3.2-1b-shape", names, b, s, steps=steps, warmup=5, out=path, timeout_s=limits,
                budget_s=left, command=os.environ["QLORA_NB_PEERS_CMD"])
PY
python3 -m qlora_nb_utils.cli report "$file"
