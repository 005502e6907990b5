#!/usr/bin/env bash
# Wrote: lab/results/long_context/context_parallel_h200.json (from $OUT/context_parallel_<gpu>.json; also $OUT/*.json
#   (each try's record), $OUT/*.log, $OUT/context_parallel_log.txt)
# Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_context_parallel.sh   (a lent 2-GPU machine, from the repository root;
#   carry .whl .gpucache); DRY=1 OUT=/tmp/cp bash lab/gpu/long_context/gpu_context_parallel.sh runs it on the CPU
#   (gloo, the tiny model, short rows).
# Context parallelism on 2 GPUs each capped at a 24 GB card's memory (lab/context_parallel.py says how), in order of
# what matters, each step only when the call's time still holds it:
#   1. the ring alone against SDPA over the whole row (ours and torch's public context_parallel), 2 GPUs;
#   2. 2 GPUs at SHORT (65,536) tokens; then, at once, the same code on GPU 0 alone at SHORT (tokens/s, losses) and
#      the one-GPU fast path as a user gets it at SHORT on GPU 1 (the loss floor: labels, cuDNN's kernel);
#   3. 2 GPUs at each of LONG (the target 278,528 = 2 x the one-GPU edge first, then the fallbacks below it if it
#      fails; then ABOVE if the call still has time);
#   then merge.
# env: OUT (required), DEADLINE_S (540), CAP (22.0 GiB), SHORT (65536), ABOVE (286720),
#   LONG ("278528 262144 229376 196608": the first that trains is the edge found),
#   STEPS_SHORT (3), STEPS_LONG (2; fewer make the long tries probes of memory, which count only when they fail:
#   STEPS_NEEDED, 2, is what a long row must train), MODEL (llama-3.1-8b-shape), DRY (1: CPU, tiny, gloo), D0/D1 (the two GPUs: 0, 1),
#   CP_OPT (optimize() options for the three SHORT tries: one plan on 1 and 2 GPUs; LONG="" ABOVE="": no long tries),
#   SHORT_RUNS (0: no SHORT tries this call), REPEAT_ONE (1: the one-GPU SHORT try run twice, a second floor pair), KEEP (an earlier results file whose runs this call did not make are merged in).
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
DEADLINE_S=${DEADLINE_S:-540}
CAP=${CAP:-22.0}; SHORT=${SHORT:-65536}; LONG=${LONG-278528 262144 229376 196608}; ABOVE=${ABOVE-286720}
read -r -a CP_OPT <<< "${CP_OPT:-}"  # optimize() options for the SHORT tries, e.g. "--optimize tile_mlp=4096 --optimize ce_chunks=64" (every layer is checkpointed on 2 GPUs)
D0=${D0:-0}; D1=${D1:-1}; STEPS_SHORT=${STEPS_SHORT:-3}; STEPS_LONG=${STEPS_LONG:-2}; MODEL=${MODEL:-llama-3.1-8b-shape}
if [ "${DRY:-0}" = 1 ]; then  # the same steps on the CPU: tiny model, short rows, no cap
  CAP=""; SHORT=${DRY_SHORT:-256}; LONG=${DRY_LONG:-1024}; ABOVE=""; MODEL=tiny; STEPS_SHORT=2; STEPS_LONG=2
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES=""
fi
source "$(dirname "$0")/../gpu_env.sh"
long_context_call context_parallel_log.txt
export QLORA_NB_CP_CMD="OUT=\$OUT DEADLINE_S=$DEADLINE_S SHORT_RUNS=${SHORT_RUNS:-1} REPEAT_ONE=${REPEAT_ONE:-0} LONG='$LONG' STEPS_LONG=$STEPS_LONG ABOVE='$ABOVE' KEEP=${KEEP:-} bash lab/gpu/long_context/gpu_context_parallel.sh"
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$(( $(nproc) / 2 ))}
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
cap_args=(); [ -n "$CAP" ] && cap_args=(--cap-gib "$CAP")
run() {  # NAME NPROC DEVICES NEED_S ARGS...: one torchrun job if NEED_S seconds are left; its record is $OUT/NAME.json
  local name=$1 n=$2 devices=$3 need=$4; shift 4
  local budget=$(( $(left) - 15 ))
  if [ "$budget" -lt "$need" ]; then echo "[gpu_context_parallel] skip $name: ${budget} s left, needs ~${need} s"; return 2; fi
  echo "[gpu_context_parallel] $name on ${n} process(es), devices '${devices}', up to ${budget} s (at $(elapsed) s)"
  local vis=(); [ "${DRY:-0}" = 1 ] || vis=(env CUDA_VISIBLE_DEVICES="$devices")
  "${vis[@]}" timeout -k 10 "$budget" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
    -m lab.context_parallel "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -h "^\[context_parallel\]" "$OUT/$name.log"; echo "[gpu_context_parallel] $name: exit $rc at $(elapsed) s"
  return $rc
}
run attention 2 $D0,$D1 30 attention --seq-len "$([ "${DRY:-0}" = 1 ] && echo 64 || echo 32768)" \
  $([ "${DRY:-0}" = 1 ] && echo "--heads 4 --kv-heads 2 --head-dim 16")
if [ "${SHORT_RUNS:-1}" = 1 ]; then
run "cp2_$SHORT" 2 $D0,$D1 90 try --seq-len "$SHORT" --steps "$STEPS_SHORT" --model "$MODEL" "${cap_args[@]}" "${CP_OPT[@]}"
# the floor run on GPU 1 beside the one-GPU baseline on GPU 0: each alone on its GPU, sharing only the host
run "plain_$SHORT" 1 $D1 80 try --seq-len "$SHORT" --steps "$STEPS_SHORT" --model "$MODEL" --plain "${cap_args[@]}" "${CP_OPT[@]}" &
floor_pid=$!
run "one_$SHORT" 1 $D0 80 try --seq-len "$SHORT" --steps "$STEPS_SHORT" --model "$MODEL" "${cap_args[@]}" "${CP_OPT[@]}"
wait "$floor_pid"
# the same one-GPU code once more (REPEAT_ONE=1): a second floor pair that differs only in nondeterminism
[ "${REPEAT_ONE:-0}" = 1 ] && run "one_${SHORT}_again" 1 $D0 80 try --seq-len "$SHORT" --steps "$STEPS_SHORT" \
  --model "$MODEL" "${cap_args[@]}" "${CP_OPT[@]}"
fi
trained=""
for L in $LONG; do
  if run "cp2_$L" 2 $D0,$D1 150 try --seq-len "$L" --steps "$STEPS_LONG" --model "$MODEL" "${cap_args[@]}"; then trained=$L; break; fi
done
if [ -n "$ABOVE" ] && [ "$trained" = "${LONG%% *}" ]; then
  run "cp2_$ABOVE" 2 $D0,$D1 300 try --seq-len "$ABOVE" --steps "$STEPS_LONG" --model "$MODEL" "${cap_args[@]}"
fi
gpu=$([ "${DRY:-0}" = 1 ] && echo cpu || python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower())")
python3 -m lab.context_parallel merge "$OUT" --short "$SHORT" --model "$MODEL" ${CAP:+--cap-gib "$CAP"} \
  --steps-long "${STEPS_NEEDED:-2}" \
  ${KEEP:+--keep "$KEEP"} --out "$OUT/context_parallel_${gpu}.json"
echo "[gpu_context_parallel] done at $(elapsed) s"
