#!/usr/bin/env bash
# Wrote: lab/results/packing/packing_h100.json (8B ours-lowmem-packed row) and lab/results/compute/peers_compute_h100_membudget.json
# (issue 20: is optimize(max_memory_gib=Unsloth peak, memory_budget=0.5) under 8.1 GiB at 8B 8x1024?).
# Use (GPU machine, repo root; carry .whl .gpucache .unsloth): OUT=dir bash lab/gpu/memory/gpu_held_membudget.sh
set -u
t0=$(date +%s)
export LOWMEM_GIB=unsloth EPOCH_DATA=long-tail
bash lab/gpu/packing/gpu_packing.sh $OUT 330 llama-3.1-8b-shape ours-lowmem-packed kjv 1024 4 10 2>&1 | tail -12
echo "packing done after $(( $(date +%s) - t0 )) s"
source lab/gpu/gpu_env.sh
unsloth_site
left=$(( 560 - ($(date +%s) - t0) ))
python3 - "$left" <<'PY' 2>&1 | grep -v -i "warning" | tail -15
import sys
from lab.peers.compute import run_compute
left = float(sys.argv[1])
st = {"name": "8b-8x1024-ckpt-membudget0.5", "model": "llama-3.1-8b-shape", "batch_size": 8, "seq_len": 1024,
      "grad_ckpt": True, "held": True}
import os
run_compute(os.environ["OUT"] + "/peers_compute_h100_membudget.json", [st], ours_options={"memory_budget": 0.5},
            budget_s=left, timeout_s=200, work_dir="/tmp/pcw",
            command="OUT=$OUT bash lab/gpu/memory/gpu_held_membudget.sh (inline: run_compute(setting 8b-8x1024-ckpt with held, "
                    "ours_options={'memory_budget': 0.5}); lead's session 13)")
PY
ls -la $OUT
