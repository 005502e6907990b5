#!/usr/bin/env bash
# Wrote: lab/results/long_context/context_parallel_small_h200/ (OUT/grad_pairs.json, weight_pairs.json, each try's
#   record; summary.json reads them)
# Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_cp_grads.sh   (a lent 2-GPU machine, repository root; carry .whl .gpucache)
# Why: at the 1B shape (one row of 2048 tokens) 2-GPU context parallel's loss after AdamW's first step sits 0.079
# above one GPU's, twice over, with every layer checkpointed or not on one GPU (gpu_cp_ckpt_check.sh). AdamW's
# first step moves each element by the learning rate in its gradient's sign, so the first step's gradients are
# compared element by element: 2 GPUs against one, and two pairs on one GPU that differ in how, not what, they
# compute (the same code twice; the fast path as a user gets it). After the first update (--probe-step1): the
# weights compared the same way (weight_pairs.json), and each run's loss of the row twice with no update between
# (a forward reading a weight from before the update would give two values).
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
source lab/gpu/gpu_env.sh
models_outside_tree
export TORCHINDUCTOR_COMPILE_THREADS=16
SEQ=${SEQ:-2048}; MODEL=${MODEL:-llama-3.2-1b-shape}
common=(--seq-len "$SEQ" --steps 2 --model "$MODEL" --cap-gib 22.0)
g=/tmp/cp_grads; mkdir -p $g
tr() { local name=$1 n=$2 dev=$3; shift 3; cp_try "$name" "$n" "$dev" "${common[@]}" "$@" --dump-grads "$g/$name.pt" \
  --probe-step1 "$g/${name}_w.pt"; }
tr cp2 2 0,1
tr one 1 0 & p=$!
tr plain 1 1 --plain
wait $p
tr one_again 1 0
python3 -m lab.context_parallel grad-pairs cp2=$g/cp2.pt one=$g/one.pt one_again=$g/one_again.pt plain=$g/plain.pt \
  --pair cp2:one --pair one_again:one --pair plain:one --out $OUT/grad_pairs.json
python3 -m lab.context_parallel grad-pairs cp2=$g/cp2_w.pt one=$g/one_w.pt one_again=$g/one_again_w.pt plain=$g/plain_w.pt \
  --pair cp2:one --pair one_again:one --pair plain:one --out $OUT/weight_pairs.json
python3 -c "
import json, sys
for n in ('cp2', 'one', 'one_again', 'plain'):
    d = json.load(open('$OUT/%s.json' % n)); print(n, d.get('losses'), 'probe', d.get('probe_losses'))"
tar -C $OUT -cf $OUT/logs.tar cp2.log one.log plain.log one_again.log && rm $OUT/*.log
