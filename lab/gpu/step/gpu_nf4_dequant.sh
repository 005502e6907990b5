#!/usr/bin/env bash
# Wrote: lab/results/step/nf4_dequant_h100.json (cp OUT/nf4_dequant.json results/nf4_dequant_<gpu>.json)
# Rerun: bash lab/gpu/step/gpu_nf4_dequant.sh OUT [BUDGET_S=380] [PARTS=all|ab]
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache .unsloth)
# The one-pass NF4 dequantize (ops/nf4_triton.py, issue 20): correctness against bitsandbytes on
# 8B weight shapes, a microbenchmark against bitsandbytes and Unsloth's fast_dequantize (its own
# process), and a 1B-shape optimize() step with the nf4_dequant patch and without; see
# lab/gpu/step/nf4_dequant_bench.py. BUDGET_S bounds the whole script: the A/B runs that would
# not fit are recorded as skipped.
set -euo pipefail
out=${1:?usage: lab/gpu/step/gpu_nf4_dequant.sh OUT_DIR [BUDGET_S]}
budget=${2:-380}
parts=${3:-all}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
unsloth_site
if [ -n "${QLORA_NB_UNSLOTH_SITE:-}" ]; then export UNSLOTH_DISABLE_STATISTICS=1; fi
nvidia-smi -L
export QLORA_NB_NF4_CMD="bash lab/gpu/step/gpu_nf4_dequant.sh $*"
python3 lab/gpu/step/nf4_dequant_bench.py main "$out/nf4_dequant.json" "$budget" "$parts"
python3 - "$out/nf4_dequant.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("correctness", []) if isinstance(d.get("correctness"), list) else [d.get("correctness")]:
    print("correct", r)
rows = d.get("microbench", []) if isinstance(d.get("microbench"), list) else []
rows += [r for r in d.get("unsloth", {}).get("rows", [])]
for r in rows:
    print(r.get("shape"), r["name"][:60].ljust(60), r.get("call_us"), r.get("kernel_us"), r.get("bitwise_equal_bnb"), r.get("error", "")[:100])
print("unsloth error:", d.get("unsloth", {}).get("error"))
ab = d.get("ab_step", {})
for r in ab.get("runs", []):
    print(r["name"], r.get("median_step_ms"), r.get("first_step_s"), r.get("dequant_kernels", {}).get("ms_per_step"), r.get("error", r.get("skipped", "")))
print("ab ratio", ab.get("patched_vs_unpatched_step"), "loss diff", ab.get("max_abs_loss_diff"), ab.get("error"))
print("phases", d.get("phases_s"))
PY
