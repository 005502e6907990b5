#!/usr/bin/env bash
# Wrote: lab/results/long_context/long_context_h200.json (from $OUT/<peer>_<card>.json, one per driver; also
#   $OUT/long_context_<gpu>.json, $OUT/tries.tgz (each try's record and log), $OUT/long_context_log.txt)
# Rerun: OUT=$OUT DEADLINE_S=520 bash lab/gpu/long_context/gpu_long_context.sh   (on a lent 4-GPU machine, from the
#   repository root; carry .whl .gpucache .unsloth; build .unsloth/usite.tar.gz first: lab/gpu/peers/unsloth_bundle.sh)
# The longest sequence that trains llama-3.1-8b-shape QLoRA under a smaller card's memory, ours and
# Unsloth (lab/long_context.py says how): one `python -m lab.long_context bisect` driver per
# (peer, card) pair, each on a GPU of its own, all at once; then `merge`.
#
# env: OUT (required), DEADLINE_S (520: the whole call, merge included), PAIRS (the pairs in GPU order,
#   "ours:24 ours:40 unsloth:24 unsloth:40"; a name with -xs runs that peer with
#   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, ours with -tile runs each MLP in pieces of TILE_ROWS
#   (4096) positions, ours with -flash keeps SDPA's default kernel order (optimize(sdpa_kernel='default')), ours with -acct ends with its longest length again, the last step's memory recorded
#   (lab/memory_account.py), e.g. "ours:24 ours-tile-xs:24 unsloth:24 unsloth-xs:24"), CAP_24 / CAP_40 (22.0 / 38.5 GiB, lab.long_context.CAP_NOTE),
#   PROBES_24 / PROBES_40 (16384,32768 / 32768,65536: lengths where every layer is already checkpointed,
#   so the linear fit is of the regime the edge is in; PROBES_<pair, - as _>_<card>, e.g. PROBES_unsloth_xs_24, a
#   pair's own), MODEL (llama-3.1-8b-shape).
# Unsloth reads a checkpoint folder: the 16 GB bf16 random-weight checkpoint is built once, under /tmp,
# on the first Unsloth pair's GPU while ours' drivers already run; Unsloth's drivers start when it is done.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
DEADLINE_S=${DEADLINE_S:-520}
PAIRS=${PAIRS:-ours:24 ours:40 unsloth:24 unsloth:40}
CAP_24=${CAP_24:-22.0}; CAP_40=${CAP_40:-38.5}
PROBES_24=${PROBES_24:-16384,32768}; PROBES_40=${PROBES_40:-32768,65536}
MODEL=${MODEL:-llama-3.1-8b-shape}
source "$(dirname "$0")/../gpu_env.sh"
long_context_call long_context_log.txt
export QLORA_NB_LONG_CONTEXT_CMD="OUT=\$OUT DEADLINE_S=$DEADLINE_S PAIRS='$PAIRS' bash lab/gpu/long_context/gpu_long_context.sh"
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$(( $(nproc) / 4 ))}
nvidia-smi -L
echo "[gpu_long_context] setup done at $(elapsed) s; unsloth site: ${QLORA_NB_UNSLOTH_SITE:-none}"

driver() {  # GPU NAME CARD: one bisect driver in the background, its deadline what is left less the merge
  local gpu=$1 name=$2 card=$3 cap probes extra=()
  local peer=${name%%-*}
  case $name in *-xs*) extra+=(--alloc-conf expandable_segments:True) ;; esac
  case $name in *-tile*) extra+=(--tile-mlp "${TILE_ROWS:-4096}") ;; esac
  case $name in *-acct*) extra+=(--account) ;; esac
  case $name in *-flash*) extra+=(--sdpa-kernel default) ;; esac
  local own="PROBES_${name//-/_}_$card"  # a pair's own probes (PROBES_ours_xs_24), else the card's
  eval "cap=\$CAP_$card; probes=\${$own:-\$PROBES_$card}"
  local budget=$(( $(left) - 20 ))
  echo "[gpu_long_context] GPU $gpu: $name @ $card GB (cap $cap GiB), deadline $budget s, probes $probes"
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 $(( budget + 10 )) python3 -m lab.long_context bisect --peer "$peer" \
    --cap-gib "$cap" --card-gb "$card" --model "$MODEL" --probe "$probes" --deadline-s "$budget" "${extra[@]}" \
    --out "$OUT/${name}_${card}.json" --work "/tmp/long_context/${name}_${card}" > "$OUT/${name}_${card}.log" 2>&1 &
  pids+=($!)
}

i=0; build_gpu=""; later=(); pids=()
for pair in $PAIRS; do
  peer=${pair%%:*}; card=${pair#*:}
  if [ "${peer%%-*}" = unsloth ]; then later+=("$i $peer $card"); [ -z "$build_gpu" ] && build_gpu=$i
  else driver "$i" "$peer" "$card"; fi
  i=$(( i + 1 ))
done
if [ ${#later[@]} -gt 0 ]; then
  t=$(date +%s)
  CUDA_VISIBLE_DEVICES=$build_gpu python3 -c "from qlora_nb_utils import models; print(models.materialize('$MODEL'))" \
    || echo "[gpu_long_context] building the $MODEL checkpoint failed: Unsloth's tries will say why"
  echo "[gpu_long_context] Unsloth's checkpoint ready after $(( $(date +%s) - t )) s"
  for item in "${later[@]}"; do driver $item; done
fi
# the drivers only: a bare `wait` also waits for the `tee` of the log's process substitution, which
# ends only when this script does (a call that used it hung here until its time limit)
wait "${pids[@]}"
echo "[gpu_long_context] drivers done at $(elapsed) s"
for f in "$OUT"/*_24.log "$OUT"/*_40.log; do [ -f "$f" ] && grep -h "^\[long_context\]" "$f"; done
tar -czf "$OUT/tries.tgz" -C /tmp/long_context --exclude=inductor . 2>/dev/null
shopt -s nullglob
files=("$OUT"/ours_*.json "$OUT"/ours-*_*.json "$OUT"/unsloth_*.json "$OUT"/unsloth-*_*.json)
python3 -m lab.long_context merge "${files[@]}" --out-dir "$OUT"
echo "[gpu_long_context] done at $(elapsed) s"
