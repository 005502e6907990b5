#!/usr/bin/env bash
# Wrote: lab/results/fsdp/fsdp2_h200.json, lab/results/fsdp/fsdp2_h200_trainer_hf.json (and an executed notebook 07 over its runs, in $OUT only: the
#   committed notebooks show their Colab rehearsal, lab/gpu/notebooks/gpu_colab_rehearsal.sh)
# Rerun: TORCHINDUCTOR_DETERMINISTIC=1 OUT=$OUT TOTAL=575 FSDP_BUDGET=360 SEQUENTIAL=1 FROZEN=replicate EXTRA_FROZEN=shard bash lab/gpu/fsdp/gpu_fsdp_all.sh (nvidia-h200-x2; carry .nbwhl too)
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache)
# Everything issue 5 needs from one 2-GPU call (nvidia-h200-x2, carry .whl .gpucache .nbwhl):
#   1. lab/gpu/fsdp/gpu_fsdp.sh (1 vs 2 GPUs, llama-3.1-8b-shape, seq 2048) with FROZEN (default replicate)
#   2. notebook 07 (gpu profile) executed on the same machine, reading step 1's run folders
#      (QLORA_NB_FSDP_RUNS) so that its tables are those runs', outputs kept
#   3. the HF Trainer route (--trainer hf, accelerate FSDP2) on 2 GPUs, llama-3.2-1b-shape, with
#      uint8 quant storage (accelerate replicates uint8 Params4bit), regional compile
# Usage: OUT=/dir bash lab/gpu/fsdp/gpu_fsdp_all.sh   (about 9 minutes; each step has a time limit)
# Sends back at most 8 files: the results JSON and plot, the executed notebook, and one tarball
# of the logs and summaries (adapters and probe tensors left out).
set -uo pipefail
FINAL=${OUT:?set OUT}
WORK=$PWD/out/fsdp_all
rm -rf "$WORK"; mkdir -p "$WORK"
T0=$(date +%s)
left() { echo $(( ${TOTAL:-580} - ($(date +%s) - T0) )); }

echo "[fsdp_all] 1. gpu_fsdp.sh FROZEN=${FROZEN:=replicate} SEQUENTIAL=${SEQUENTIAL:=0}"
OUT=$WORK FROZEN=$FROZEN SEQUENTIAL=$SEQUENTIAL BUDGET=${FSDP_BUDGET:-330} bash lab/gpu/fsdp/gpu_fsdp.sh 2>&1 | tee "$WORK/gpu_fsdp.log" | grep "gpu_fsdp\]\|  "

if [ -n "${EXTRA_FROZEN:-}" ] && [ "$(left)" -gt 200 ]; then
  # the other --frozen mode on 2 GPUs, same session: its step time against parity_2's
  echo "[fsdp_all] 1b. parity_2 with --frozen $EXTRA_FROZEN ($(left) s left)"
  source lab/gpu/gpu_env.sh
  timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m qlora_nb_utils.distributed.fsdp_train \
    --model llama-3.1-8b-shape --quant nf4 --nf4 auto --frozen "$EXTRA_FROZEN" --seq-len 2048 --pack \
    --dtype bfloat16 --device cuda --compile --backend inductor --no-fullgraph --lr 2e-4 --seed 0 \
    --timing-warmup 3 --steps 30 --global-batch-size 2 --micro-batch-size 1 --no-adapter \
    --out "$WORK/runs_extra/parity_2_frozen_$EXTRA_FROZEN" > "$WORK/parity_2_frozen_$EXTRA_FROZEN.log" 2>&1
  echo "[fsdp_all] exit $?"; grep "fsdp_train\]" "$WORK/parity_2_frozen_$EXTRA_FROZEN.log" | tail -2
fi

echo "[fsdp_all] 2. notebook 07 ($(left) s left)"
if [ "$(left)" -gt 150 ]; then
  QLORA_NB_FSDP_RUNS=$WORK/runs QLORA_NB_CELL_TIMEOUT=200 timeout $(( $(left) - 100 )) \
    bash lab/gpu/notebooks/gpu_notebooks.sh notebooks/07_fsdp2_qlora.ipynb > "$WORK/notebook07.log" 2>&1
  echo "[fsdp_all] notebook exit $? ($(left) s left)"; tail -5 "$WORK/notebook07.log"
  cp notebooks/07_fsdp2_qlora.ipynb "$FINAL/07_fsdp2_qlora.h200x2.ipynb"
fi

echo "[fsdp_all] 3. HF Trainer on 2 GPUs ($(left) s left)"
if [ "${TRAINER:-1}" = 1 ] && [ "$(left)" -gt 70 ]; then
  source lab/gpu/gpu_env.sh
  timeout $(( $(left) - 15 )) python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m qlora_nb_utils.distributed.fsdp_train --trainer hf --model llama-3.2-1b-shape --quant nf4 --quant-storage uint8 \
    --seq-len 512 --dtype bfloat16 --device cuda --compile --backend inductor --no-fullgraph \
    --global-batch-size 4 --micro-batch-size 1 --steps 10 --lr 2e-4 --seed 0 \
    --out "$WORK/trainer_hf_2" > "$WORK/trainer_hf_2.log" 2>&1
  echo "[fsdp_all] trainer exit $?"; grep "fsdp_train\]" "$WORK/trainer_hf_2.log" | tail -3; tail -3 "$WORK/trainer_hf_2.log"
fi

cp "$WORK"/fsdp2_*.json "$WORK"/fsdp2_*.png "$FINAL/" 2>/dev/null
tar czf "$FINAL/fsdp_all_logs.tgz" -C "$WORK" --exclude='adapter' --exclude='probe.pt' --exclude='trainer' --exclude='*.safetensors' --exclude='ckpt*' .
ls -la "$FINAL"
echo "[fsdp_all] finished in $(( $(date +%s) - T0 )) s"
