#!/usr/bin/env bash
# Wrote: lab/results/long_context/plan_knobs_<gpu>/ (each try's record $OUT/<name>.json and log)
# Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_plan_knobs.sh   (a lent 2-GPU machine, from the repository root;
#   carry .whl .gpucache); DRY=1 OUT=/tmp/knobs bash lab/gpu/long_context/gpu_plan_knobs.sh runs it on the CPU.
# Why: at 65,536 tokens on the 8B shape, the 2-GPU context-parallel run whose plan split the MLP into no pieces
# and the loss into 32 chunks took a loss after its first step 0.063 from the one-GPU runs (MLP in pieces of
# 4,096, loss in 64 chunks), twice, while the one-GPU runs stayed within 2.5e-4 of each other. These tries run
# the one-GPU code with each knob set one way and the other, every other choice held (every layer checkpointed
# and offloaded), two at a time (one per GPU, no cap): which knob moves the trajectory, and whether the
# one-GPU code with the 2-GPU plan lands where the 2-GPU run did.
# env: OUT (required), SEQ (65536), STEPS (3), MODEL (llama-3.1-8b-shape), TILE (4096), DEADLINE_S (540), DRY (1: CPU, tiny),
#   PAIRS (2; 1: the first pair only, the MLP whole and in pieces)
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
DEADLINE_S=${DEADLINE_S:-540}; SEQ=${SEQ:-65536}; STEPS=${STEPS:-3}; MODEL=${MODEL:-llama-3.1-8b-shape}
TILE=${TILE:-4096}; CHUNKS_A=32; CHUNKS_B=64
if [ "${DRY:-0}" = 1 ]; then
  SEQ=256; MODEL=tiny; STEPS=2; TILE=64; CHUNKS_A=2; CHUNKS_B=4
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES=""
fi
source "$(dirname "$0")/../gpu_env.sh"
long_context_call plan_knobs_log.txt
base=(--optimize grad_ckpt=true --optimize offload=true)
try() {  # NAME DEVICE ARGS...
  local name=$1 dev=$2; shift 2
  local vis=(); [ "${DRY:-0}" = 1 ] || vis=(env CUDA_VISIBLE_DEVICES="$dev")
  "${vis[@]}" timeout -k 10 $(( $(left) - 10 )) python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m lab.context_parallel try --seq-len "$SEQ" --steps "$STEPS" --model "$MODEL" "${base[@]}" "$@" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "[plan_knobs] $name: exit $? at $(elapsed) s"
}
try "plain_tile0_ce$CHUNKS_A" 0 --plain --optimize tile_mlp=false --optimize ce_chunks=$CHUNKS_A &
pid=$!
try "plain_tile${TILE}_ce$CHUNKS_A" 1 --plain --optimize tile_mlp=$TILE --optimize ce_chunks=$CHUNKS_A
wait "$pid"  # not a bare wait: it would wait for the log's tee too
if [ "${PAIRS:-2}" -ge 2 ]; then
try "plain_tile0_ce$CHUNKS_B" 0 --plain --optimize tile_mlp=false --optimize ce_chunks=$CHUNKS_B &
pid=$!
try "one_tile0_ce$CHUNKS_A" 1 --optimize tile_mlp=false --optimize ce_chunks=$CHUNKS_A
wait "$pid"
fi
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    print(f"[plan_knobs] {f.stem}: losses {r.get('losses')} grad norms {r.get('grad_norms')} "
          f"tile {r.get('choices', {}).get('tile_mlp')} loss {r.get('choices', {}).get('loss')} ok {r.get('ok')}")
PY
