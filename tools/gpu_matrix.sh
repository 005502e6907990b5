#!/usr/bin/env bash
# The compile matrix on the lent GPU machine (see tools/gpu_bench.sh for the carried files).
# Usage (on that machine, from the repository root): bash tools/gpu_matrix.sh OUT_JSON BUDGET_S [configs]
set -euo pipefail
out=${1:?usage: tools/gpu_matrix.sh OUT_JSON BUDGET_S [configs]}
budget=${2:?time budget in seconds}
configs=${3:-qlora,lora,base}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export QLORA_NB_CACHE=$PWD/.gpucache/qlora_nb HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L
python3 - "$out" "$budget" "$configs" <<'PY'
import sys, warnings
warnings.filterwarnings("ignore")
from qlora_nb_utils import matrix
out, budget, configs = sys.argv[1], float(sys.argv[2]), sys.argv[3].split(",")
res = matrix.run_matrix("llama-3.2-1b-shape", configs=configs, steps=30, batch_size=4, max_len=256,
                        warmup=5, out=out, time_budget_s=budget,
                        command=f"bash tools/gpu_matrix.sh {out} {sys.argv[2]} {sys.argv[3]}")
print(matrix.summary_frame(res).to_string())
PY
