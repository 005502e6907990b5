#!/usr/bin/env bash
# Writes: $OUT_DIR/profile_8b_<gpu>.json (committed as results/profile_8b_<gpu>.json), profile_8b_log.txt,
#   children_logs.tar.gz
# Rerun: bash lab/gpu/step/gpu_profile_8b.sh "$OUT" 540   (on the lent GPU machine, repository root;
#   carry .whl .gpucache .unsloth)
# Where the time and the memory go at llama-3.1-8b-shape, 8 x 1024: ours through optimize() and
# Unsloth, checkpointing off and on, each in its own process (lab/gpu/step/profile_8b.py says how they
# share the GPU), kernel time grouped by lab.profile, the live set at the memory
# peak, median step, peak GiB, MFU; plus the NF4 dequantize microbench of a 14336 x 4096 weight.
#
# Usage: bash lab/gpu/step/gpu_profile_8b.sh OUT_DIR [DEADLINE_S=540]
#   env PROFILE_JOBS=ours_ckpt_off,ours_ckpt_on (a subset of the jobs), PROFILE_SCOPE=regional (ours' scope),
#   PROFILE_TAG=now (writes profile_8b_<gpu>_now.json, beside the committed file)
set -uo pipefail
out=${1:?usage: lab/gpu/step/gpu_profile_8b.sh OUT_DIR [DEADLINE_S]}
deadline=${2:-540}
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
unsloth_site
nvidia-smi -L
export QLORA_NB_PROFILE_CMD="PROFILE_JOBS=${PROFILE_JOBS:-} PROFILE_SCOPE=${PROFILE_SCOPE:-} PROFILE_TAG=${PROFILE_TAG:-} bash lab/gpu/step/gpu_profile_8b.sh \$OUT $deadline"
python3 lab/gpu/step/profile_8b.py driver "$out" --deadline "$deadline" 2>&1 | tee "$out/profile_8b_log.txt"
