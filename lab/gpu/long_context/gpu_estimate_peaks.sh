#!/usr/bin/env bash
# Wrote: lab/results/long_context/estimate_vs_peak_h200.json (python -m lab.estimate_check --from the calls'
#   $OUT/estimate_peaks_<tag>.json files, merged; each call also writes $OUT/estimate_vs_peak_<tag>.json and its log)
# Rerun: OUT=$OUT TAG=a TRIES='16384:22,...' bash lab/gpu/long_context/gpu_estimate_peaks.sh   (one GPU, from the
#   repository root; carry .whl .gpucache)
# optimize()'s memory estimate beside the measured peak of the plan it chose, Llama-3.1-8B-shape QLoRA, batch 1:
# one process, one model, the tries in the order given, one step each (lab/estimate_peaks.py says how).
#
# env: OUT (required), TAG (names this call's files, default a), DEADLINE_S (520: the whole call), MODEL
#   (llama-3.1-8b-shape), TRIES (comma-separated LENGTH:TARGET_GIB[:knob=value;knob=value]; default: the first
#   call's, 16,384 to 163,840 tokens: no checkpointing (regional), some, kept outputs on the device and in host
#   memory, offload, the MLP in pieces).
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
DEADLINE_S=${DEADLINE_S:-520}
TAG=${TAG:-a}
MODEL=${MODEL:-llama-3.1-8b-shape}
TRIES=${TRIES:-16384:120:scope=regional,16384:22,16384:16,16384:30:keep_attention=True,32768:26,32768:19,65536:60,65536:22,98304:22,131072:24,163840:30}
source "$(dirname "$0")/../gpu_env.sh"
long_context_call "estimate_peaks_${TAG}_log.txt"
export QLORA_NB_ESTIMATE_PEAKS_CMD="OUT=\$OUT TAG=$TAG TRIES='$TRIES' bash lab/gpu/long_context/gpu_estimate_peaks.sh"
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$(( $(nproc) / 2 ))}
nvidia-smi -L 2>/dev/null || echo "[gpu_estimate_peaks] no GPU: a dry run"
budget=$(( $(left) - 25 ))
echo "[gpu_estimate_peaks] setup done at $(elapsed) s; tries $TRIES; deadline $budget s"
timeout -k 10 "$budget" python3 -m lab.estimate_peaks --model "$MODEL" --tries "$TRIES" --deadline-s "$(( budget - 15 ))" \
  --out "$OUT/estimate_peaks_${TAG}.json"
echo "[gpu_estimate_peaks] tries done at $(elapsed) s"
python3 -m lab.estimate_check --from "$OUT/estimate_peaks_${TAG}.json" --out "$OUT/estimate_vs_peak_${TAG}.json" \
  || echo "[gpu_estimate_peaks] no measured row (a CPU dry run measures no peak)"
echo "[gpu_estimate_peaks] done at $(elapsed) s"
