#!/usr/bin/env bash
# Writes: $OUT/<peer>_<cap>_<L>.json (one `lab.long_context try` each), $OUT/logs.tgz (their logs),
#   $OUT/edge_tries_log.txt. Merge them: python -m lab.long_context merge $OUT/*_*_*.json <the merged file> ...
# Rerun: OUT=$OUT DEADLINE_S=540 TRIES_0='unsloth:22:60416 unsloth:38.5:125952' TRIES_1='unsloth:38.5:123904 unsloth:38.5:124928'
#   bash lab/gpu/long_context/gpu_edge_tries.sh  (one TRIES_<gpu> list per GPU of the kind: nvidia-h200-x2 for two; carry .whl
#   .gpucache .unsloth; build .unsloth/usite.tar.gz first: lab/gpu/peers/unsloth_bundle.sh)
# Where an earlier bisection left a peer's edge near a known length, the few tries that settle it, side by
# side on the GPUs of one call, instead of a new bisection (whose probes alone take a call at 40 GB).
# Each GPU runs its list in order (PEER:CAP_GIB:LENGTH, Llama-3.1-8B shape, LoRA r=32, one document,
# 2 steps, expandable segments, each in its own process), skipping the rest of its tries at a cap once
# one at that cap ran out of memory (a longer one would too).
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
DEADLINE_S=${DEADLINE_S:-540}
MODEL=${MODEL:-llama-3.1-8b-shape}
source "$(dirname "$0")/../gpu_env.sh"
long_context_call edge_tries_log.txt
nvidia-smi -L
CMD="OUT=\$OUT DEADLINE_S=$DEADLINE_S$(for v in ${!TRIES_*}; do printf " %s='%s'" "$v" "${!v}"; done) bash lab/gpu/long_context/gpu_edge_tries.sh"
export QLORA_NB_LONG_CONTEXT_CMD="$CMD"
UNSLOTH_DIR=""
all_tries=$(for v in $(compgen -v TRIES_); do echo "${!v}"; done)
if [[ "$all_tries" == *unsloth* ]]; then
  UNSLOTH_DIR=$(python3 -c "from lab.peers.common import _model_dir; print(_model_dir('$MODEL'))" | tail -1)
  echo "[edge_tries] Unsloth's checkpoint folder $UNSLOTH_DIR ready at $(elapsed) s"
fi

gpu_list() {  # GPU "PEER:CAP:L ...": the tries one after another on that GPU
  local gpu=$1 failed=" "
  for item in $2; do
    IFS=: read -r peer cap seq <<< "$item"
    local name="${peer}_${cap}_${seq}" extra=() path=$PYTHONPATH
    if [[ "$failed" == *" $cap "* ]]; then echo "[edge_tries] GPU $gpu: skip $name (a shorter try at cap $cap failed)"; continue; fi
    local limit=$(( $(left) - 10 ))
    if [ "$limit" -lt 60 ]; then echo "[edge_tries] GPU $gpu: skip $name (${limit} s left)"; continue; fi
    if [ "$peer" = unsloth ]; then path=${QLORA_NB_UNSLOTH_SITE:-}:$PYTHONPATH; extra=(--model-dir "$UNSLOTH_DIR"); fi
    echo "[edge_tries] GPU $gpu: $name, limit $limit s ($(elapsed) s elapsed)"
    CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$path timeout --signal=TERM --kill-after=10 "$limit" python3 -m lab.long_context try \
      --peer "$peer" --seq-len "$seq" --cap-gib "$cap" --model "$MODEL" --steps 2 --alloc-conf expandable_segments:True \
      "${extra[@]}" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    grep "^\[long_context try\]" "$OUT/$name.log" | tail -1 | sed "s/^/[edge_tries] GPU $gpu: /"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); sys.exit(0 if r.get('ok') else 1)" "$OUT/$name.json" 2>/dev/null \
      || failed+="$cap "
  done
}

pids=()
for v in $(compgen -v TRIES_ | sort); do
  gpu_list "${v#TRIES_}" "${!v}" &
  pids+=($!)
done
wait "${pids[@]}"
(cd "$OUT" && tar -czf logs.tgz *.log && rm -f *.log)  # a call returns 8 files at most
echo "[edge_tries] done at $(elapsed) s"
