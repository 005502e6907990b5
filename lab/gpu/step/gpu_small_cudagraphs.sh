#!/usr/bin/env bash
# Wrote: lab/results/step/small_cudagraphs_h200.json (OUT/small_cudagraphs_<arm>.json, step_overhead.py's JSON of
#   each arm, gathered under the arm names), beside OUT/small_cudagraphs_log.txt
# Rerun: OUT=$OUT bash lab/gpu/step/gpu_small_cudagraphs.sh [ARMS]   (the lent GPU machine, repository root;
#   carry .whl .gpucache)
# Why: at SmolLM2-135M's shape (4 x 128) the step is the host's; CUDA graphs cut it to a fraction, but
# the cold-start runs of `--mode reduce-overhead` paid 7-10 s on their second step (where cudagraph
# trees record) and a longer first step, more than 60 steps win back. Each arm is `qlora-nb train`'s own
# Run in its own process with empty compile caches, its first and second steps profiled one by one.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
source "$(dirname "$0")/../gpu_env.sh"
models_outside_tree
steps=${STEPS:-30}
run_arm() {  # NAME ARGS...
  local name=$1; shift
  local cache; cache=$(mktemp -d)
  echo "== $name: $*"
  TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton timeout ${ARM_TIMEOUT:-150} \
    python3 lab/gpu/step/step_overhead.py "$OUT/small_cudagraphs_$name.json" --steps "$steps" --settle 4 "$@" 2>&1 \
    | grep -v "^\s*$" | head -80
  rm -rf "$cache"
}
for arm in ${1:-regional regional-graphs regional-graphs-noasserts whole-graphs whole-graphs-noasserts}; do
  case $arm in
    regional) run_arm $arm --scope regional --mode default ;;
    regional-graphs) run_arm $arm --scope regional --mode reduce-overhead --profile-steps 0,1 ;;
    regional-graphs-noasserts) run_arm $arm --scope regional --mode reduce-overhead --profile-steps 1 \
        --inductor triton.slow_path_cudagraph_asserts=False ;;
    whole-graphs) run_arm $arm --scope whole --mode reduce-overhead --profile-steps 1 ;;
    whole-graphs-noasserts) run_arm $arm --scope whole --mode reduce-overhead --profile-steps 1 \
        --inductor triton.slow_path_cudagraph_asserts=False ;;
    *) echo "unknown arm $arm" ;;
  esac
done 2>&1 | tee "$OUT/small_cudagraphs_log.txt"
