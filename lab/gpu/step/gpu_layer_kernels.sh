#!/usr/bin/env bash
# Writes: $OUT_DIR/layer_kernels_<gpu>.json (committed as results/layer_kernels_<gpu>.json),
#   layer_kernels_sources.json (the slowest Triton kernels' generated source), layer_kernels_log.txt,
#   unsloth_log.txt
# Rerun: bash lab/gpu/step/gpu_layer_kernels.sh "$OUT" [DEADLINE_S=500] [VARIANTS=all]
#   (on the lent GPU machine, repository root; carry .whl .gpucache .unsloth)
# Issue 20: one decoder layer's kernels at the 8B shape, 8 x 1024 (llama-3.1-8b-shape-4l), under
# optimize() variants (eager numerics, coordinate-descent tuning, multi-kernel, recompute,
# max-autotune), and Unsloth's on the same model and batches (lab/gpu/step/layer_kernels.py).
set -uo pipefail
out=${1:?usage: lab/gpu/step/gpu_layer_kernels.sh OUT_DIR [DEADLINE_S] [VARIANTS]}
deadline=${2:-500}
variants=${3:-}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
unsloth_site
nvidia-smi -L
export QLORA_NB_LAYER_CMD="bash lab/gpu/step/gpu_layer_kernels.sh \$OUT $deadline $variants (code: ${COMMIT:-unknown commit} + working tree)"
python3 lab/gpu/step/layer_kernels.py "$out" --deadline "$deadline" ${variants:+--variants "$variants"} 2>&1 \
  | tee "$out/layer_kernels_log.txt"
python3 - "$out" <<'PY'
import glob, json, sys
p = glob.glob(sys.argv[1] + "/layer_kernels_*.json")
d = json.load(open([x for x in p if "sources" not in x][0]))
rows = dict(d["variants"])
if "unsloth" in d:
    rows["UNSLOTH"] = d["unsloth"]
for name, r in rows.items():
    g = (r.get("kernels") or {}).get("groups", {})
    print(name, r.get("median_step_ms"), r.get("compile_s") or r.get("first_step_s"), r.get("error", "")[:300], r.get("skipped", ""))
    print("   ", {k: v["ms"] for k, v in g.items()})
    for t in (g.get("norm_rope_act") or {}).get("top", []):
        print("      ", t)
PY
