#!/usr/bin/env bash
# Wrote: lab/results/matrix/compile_matrix_h200.json (parts merged with python -m qlora_nb_utils.bench.matrix --merge)
# Rerun: EAGER_NUMERICS=1 BASE_FP32_MASTER=1 bash lab/gpu/matrix/gpu_matrix.sh OUT/quick.json 385 qlora,lora,base quick; the same with OUT/dyn.json 455 ... dynamic; base cells: BASE_LR=2e-5 ... OUT/base.json 480 base all
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache)
# The compile matrix on the lent GPU machine (see lab/gpu/bench/gpu_bench.sh for the carried files).
# Usage (on that machine, from the repository root):
#   bash lab/gpu/matrix/gpu_matrix.sh OUT_JSON BUDGET_S [configs] [group]
# group "quick": fixed lengths (whole, regional) and variable lengths (regional);
# group "dynamic": variable lengths, whole model (a dynamic graph of the whole model: the
# slowest compile); group "variable": variable lengths, whole then regional; group "all": all. Parts of two calls merge with
# `python -m qlora_nb_utils.bench.matrix --merge PART.json ... --out ALL.json`.
# EAGER_NUMERICS=1 compiles with inductor's emulate_precision_casts (--eager-numerics: bf16
# rounded after every op, as eager does); parts with and without it do not merge.
# BASE_FP32_MASTER=1 trains the full fine-tune ("base") with fp32 master weights under bf16
# autocast (--base-fp32-master); likewise, parts with and without it do not merge.
# BASE_LR=2e-5 trains the base cells at that learning rate (--base-lr; LoRA/QLoRA keep 2e-4).
#
# One process per (config, checkpointing): six processes compile at once on the host's cores
# (two threads each). Their training steps never overlap on the GPU: each step holds an
# exclusive file lock, let go while torch compiles (qlora_nb_utils/training/gpulock.py). Each process
# stops at BUDGET_S (cells it finished are kept); the parts are then merged into OUT_JSON.
set -euo pipefail
out=${1:?usage: lab/gpu/matrix/gpu_matrix.sh OUT_JSON BUDGET_S [configs]}
budget=${2:?time budget in seconds}
configs=${3:-qlora,lora,base}
group=${4:-all}
case $group in quick|dynamic|variable|all) ;; *) echo "group must be quick, dynamic, variable or all, not $group" >&2; exit 2;; esac
model=${QLORA_NB_MATRIX_MODEL:-llama-3.2-1b-shape}
case ${EAGER_NUMERICS:-0} in
  1) numerics=--eager-numerics; numerics_env="EAGER_NUMERICS=1 " ;;
  0|"") numerics=; numerics_env= ;;
  *) echo "EAGER_NUMERICS must be 0 or 1, not $EAGER_NUMERICS" >&2; exit 2;;
esac
case ${BASE_FP32_MASTER:-0} in
  1) numerics="$numerics --base-fp32-master"; numerics_env="${numerics_env}BASE_FP32_MASTER=1 " ;;
  0|"") ;;
  *) echo "BASE_FP32_MASTER must be 0 or 1, not $BASE_FP32_MASTER" >&2; exit 2;;
esac
if [ -n "${BASE_LR:-}" ]; then
  python3 -c "import sys; v = float(sys.argv[1]); assert v > 0" "$BASE_LR" 2>/dev/null \
    || { echo "BASE_LR must be a positive number, not $BASE_LR" >&2; exit 2; }
  numerics="$numerics --base-lr $BASE_LR"; numerics_env="${numerics_env}BASE_LR=$BASE_LR "
fi
source "$(dirname "$0")/../gpu_env.sh"
export QLORA_NB_GPU_LOCK=/tmp/qlora_nb_gpu.lock TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
nvidia-smi -L
cmd="${numerics_env}bash lab/gpu/matrix/gpu_matrix.sh $out $budget $configs $group"
# Build each model once before the parts start, so that the parts do not all build it.
python3 -c "from qlora_nb_utils import models; models.materialize('$model')"
parts=$(dirname "$out")/matrix_parts
mkdir -p "$parts"
(while sleep 30; do echo "== $(date +%T) $(uptime | sed 's/.*load/load/')"; free -g | sed -n 2p; ls "$parts"; done) > "$(dirname "$out")/matrix_monitor.txt" 2>&1 &
monitor=$!
deadline=$(( $(date +%s) + budget ))
part() {  # part TAG LENGTHS SCOPES: runs until the common deadline at most
  local rem=$(( deadline - $(date +%s) ))
  [ "$rem" -gt 10 ] || return 0
  timeout --kill-after=10 "$rem" python3 -W ignore -m qlora_nb_utils.bench.matrix --model "$model" --configs "$c" \
    --grad-ckpt "$ck" --lengths "$2" --scopes "$3" --steps 30 --batch-size 4 --max-len 256 \
    --warmup 5 $numerics --command "$cmd" --out "$parts/$c-$ck-$1.json" >> "$parts/$c-$ck.log" 2>&1
}
for c in ${configs//,/ }; do
  for ck in off on; do
    case $group in
      quick) (part fixed fixed regional,whole; part varregional variable regional) & ;;
      dynamic) part varwhole variable whole & ;;
      variable) (part varwhole variable whole; part varregional variable regional) & ;;
      all) (part fixed fixed regional,whole; part varregional variable regional; part varwhole variable whole) & ;;
    esac
  done
done
wait $(jobs -p | grep -v "^$monitor$") 2>/dev/null || true
kill $monitor 2>/dev/null || true
ls "$parts"/*.json >/dev/null 2>&1 || { echo "no part finished a cell"; tail -n 20 "$parts"/*.log; exit 1; }
python3 -m qlora_nb_utils.bench.matrix --merge "$parts"/*.json --command "$cmd" --out "$out"
for f in "$parts"/*.log; do echo "== $f"; grep -E "Error|error|Traceback" "$f" | tail -n 5 || true; done
