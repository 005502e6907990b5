#!/usr/bin/env bash
# Writes: $OUT_DIR/held_peak.json (committed as results/held_peak_<gpu>.json), arm_*.json, held_peak_log.txt
# Rerun: bash lab/gpu/memory/gpu_held_peak.sh "$OUT" [GIB=8.06] [LIMIT_S=170]
#   (on the lent GPU machine, repository root; carry .whl .gpucache)
# Issue 20: what is alive at the peak of ours held to Unsloth's 8.06 GiB at 8B, 8 x 1024
# (optimize(max_memory_gib=...), every layer checkpointed and offloaded), recompute on and off,
# one process each (lab/gpu/memory/held_peak.py).
set -uo pipefail
out=${1:?usage: lab/gpu/memory/gpu_held_peak.sh OUT_DIR [GIB] [LIMIT_S]}
gib=${2:-8.06}
limit=${3:-170}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L
export QLORA_NB_HELD_CMD="bash lab/gpu/memory/gpu_held_peak.sh \$OUT $gib $limit (code: ${COMMIT:-unknown commit} + working tree)"
python3 lab/gpu/memory/held_peak.py driver "$out" --gib "$gib" --limit-s "$limit" 2>&1 | tee "$out/held_peak_log.txt"
python3 - "$out/held_peak.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, a in d["arms"].items():
    print(name, a.get("error"), a.get("optimize", "")[:300])
    print("  peak alloc", a.get("peak_allocated_gib"), "reserved", a.get("peak_reserved_gib"), "resident", a.get("resident_before_step_gib"), "losses", a.get("losses"))
    b = a.get("breakdown") or {}
    print("  categories", b.get("categories"))
    for r in (a.get("live_at_peak") or {}).get("by_site", [])[:12]:
        print("   ", r)
PY
