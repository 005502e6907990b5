#!/usr/bin/env bash
# Writes: $OUT/big_variants.tgz (one folder per variant: pipeline_h200.json, summary.json, log.jsonl, status,
#   the log's last lines) and $OUT/big_variants.txt (each step: variant, step, ms, every rank's allocator retries
#   so far, every rank's peak GiB). Unpack into lab/results/fsdp/pipeline_70b_cap_h200_runs/call<N>_<v>/ with
#   commit.txt, then python lab/gpu/fsdp/big_cap_results.py (its docstring).
# Rerun: OUT=$OUT VARIANTS="a:40,40:--optim adamw8bit b:39,41:" bash lab/gpu/fsdp/gpu_big_variants.sh
#   (nvidia-h200-x2, from the repository root; carry .whl .gpucache)
# The 70B shape on the pipeline layout under the 22 GiB cap (gpu_pipeline.sh's big_70b run, PHASE=big), once per
# variant, one after the other in one call: VARIANTS is a space-separated list of NAME:SPLIT:EXTRA[:CAP[:STEPS]],
# NAME one letter, SPLIT the layers per stage (--layers-per-stage), EXTRA launcher options with commas for spaces
# ("--optim,adamw8bit"), CAP the GiB each process may use (default $CAP, 22), STEPS the steps (default $BIG_STEPS, 4). Each variant gets at most PER_RUN seconds (200) and is skipped when the call's
# BUDGET (560 s) no longer holds it.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
T0=$(date +%s)
BUDGET=${BUDGET:-560}; PER_RUN=${PER_RUN:-200}
WORK=$PWD/out/big_variants
mkdir -p "$OUT"
rm -rf "$WORK"; mkdir -p "$WORK"
for v in ${VARIANTS:?set VARIANTS}; do
  IFS=: read -r name split extra vcap vsteps <<< "$v"
  left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 120 ]; then echo "[big_variants] skip $name: ${left} s left"; continue; fi
  echo "[big_variants] $name: split $split, extra '${extra//,/ }', cap ${vcap:-${CAP:-22}} GiB, ${vsteps:-${BIG_STEPS:-4}} steps ($(( $(date +%s) - T0 )) s elapsed)"
  OUT=$WORK/$name PHASE=big ONLY=big_70b BUDGET=$(( left < PER_RUN ? left : PER_RUN )) CAP=${vcap:-${CAP:-22}} BIG_STEPS=${vsteps:-${BIG_STEPS:-4}} \
    BIG_SPLIT=$split BIG_EXTRA="${extra//,/ }" BIG_RETRY_MIN_S=9999 bash lab/gpu/fsdp/gpu_pipeline.sh > "$WORK/$name.stdout" 2>&1
  grep "^\[pipeline\]" "$WORK/$name.stdout" | tail -2
  keep=$WORK/keep/$name; mkdir -p "$keep"
  cp "$WORK/$name"/pipeline_*.json "$WORK/$name/runs/big_70b/summary.json" "$WORK/$name/runs/big_70b/log.jsonl" \
    "$WORK/$name/runs/big_70b.status" "$keep/" 2>/dev/null
  cp "$WORK/$name"/runs/big_70b/profile_rank*.json "$keep/" 2>/dev/null
  tail -40 "$WORK/$name/runs/big_70b.log" | cut -c1-400 > "$keep/tail.log" 2>/dev/null
  python3 - "$name" "$WORK/$name/runs/big_70b/log.jsonl" <<'PY' | tee -a "$OUT/big_variants.txt"
import json, sys
from pathlib import Path
log = Path(sys.argv[2])
for line in (log.read_text().splitlines() if log.is_file() else []):
    r = json.loads(line)
    print(sys.argv[1], r["step"], round(r["step_ms"]), r.get("alloc_retries"),
          [round(p, 2) for p in r.get("peak_mem_gib_per_rank", [])])
PY
done
tar czf "$OUT/big_variants.tgz" -C "$WORK/keep" .
echo "[big_variants] finished in $(( $(date +%s) - T0 )) s"
