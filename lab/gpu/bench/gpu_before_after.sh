#!/usr/bin/env bash
# Writes: $OUT/<tree>/bench/results.json and $OUT/<tree>/train/metrics.json for tree in old, new, and
#   their logs; lab/gpu/bench/before_after_results.py compares them into lab/results/bench/before_after_<gpu>.json.
# Rerun: git archive --format=tar.gz -o .whl/tree_OLD.tgz OLD qlora_nb_utils data configs pyproject.toml;
#   OUT=$OUT OLD=OLD bash lab/gpu/bench/gpu_before_after.sh (one GPU; carry .whl .gpucache).
# The same commands from two trees in one call: the main job (qlora-nb bench) and qlora-nb train
# --packing on at the Llama-3.2-1B shape, from commit OLD (unpacked from .whl/tree_OLD.tgz into /tmp)
# and from this working tree. What optimize() chose and the first losses must be the same.
set -uo pipefail
OUT=${OUT:-$PWD/out/before_after}
OLD=${OLD:-54d0294}
source "$(dirname "$0")/../gpu_env.sh"
models_outside_tree
mkdir -p /tmp/tree_old && tar -xzf ".whl/tree_$OLD.tgz" -C /tmp/tree_old
nvidia-smi -L | tee "$OUT/gpus.txt"
BENCH=(bench --model llama-3.2-1b-shape --device cuda --steps 6 --warmup 2 --batch-size 4 --seq-len 256 --no-progress)
TRAIN=(train --model llama-3.2-1b-shape --device cuda --steps 6 --eval-every 0 --eval-size 8 --seq-len 256 --packing on
       --no-progress)
for job in ${JOBS:-bench train}; do  # a pair at a time: a job cut short still leaves the other pair whole
  for tree in new old; do
    root=$PWD; [ "$tree" = old ] && root=/tmp/tree_old
    mkdir -p "$OUT/$tree"
    if [ "$job" = bench ]; then args=("${BENCH[@]}"); cap=${CAP_BENCH:-165}; else args=("${TRAIN[@]}"); cap=${CAP_TRAIN:-105}; fi
    echo "[before_after] $tree $job"
    (cd "$root" && PYTHONPATH=/tmp/site:$root timeout --kill-after=10 "$cap" \
      python3 -m qlora_nb_utils.cli "${args[@]}" --out "$OUT/$tree/$job") > "$OUT/$tree/$job.log" 2>&1
    echo "[before_after] $tree $job exit $?"; tail -3 "$OUT/$tree/$job.log"
  done
done
echo "OLD=$OLD" > "$OUT/trees.txt"
