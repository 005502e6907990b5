#!/usr/bin/env bash
# Wrote: lab/results/long_context/context_parallel_small_h200/ckpt_*.json (OUT/one_ckpt.json, plain_ckpt.json, cp2_again.json)
# Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_cp_ckpt_check.sh   (a lent 2-GPU machine, repository root; carry .whl .gpucache)
# Why: at the 1B shape, one row of 2048 tokens, 16 steps, 2-GPU context parallel's loss left one GPU's by 0.079
# after the first update, against a floor of 1e-3 (gpu_context_parallel.sh with MODEL=llama-3.2-1b-shape
# SHORT=2048 STEPS_SHORT=16 REPEAT_ONE=1 LONG="" ABOVE=""). The 2-GPU plan checkpoints every layer; the one-GPU
# plan none. Here: the same one-GPU code with every layer checkpointed (GPU 0), the one-GPU fast path with every
# layer checkpointed (GPU 1), then the 2-GPU run once more (its own repeat).
set -uo pipefail
source lab/gpu/gpu_env.sh
models_outside_tree
export TORCHINDUCTOR_COMPILE_THREADS=16
common=(--seq-len 2048 --steps 16 --model llama-3.2-1b-shape --cap-gib 22.0)
cp_try one_ckpt 1 0 "${common[@]}" --optimize ckpt_layers=16 &
p=$!
cp_try plain_ckpt 1 1 "${common[@]}" --plain --optimize ckpt_layers=16
wait $p
cp_try cp2_again 2 0,1 "${common[@]}"
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for n in ("one_ckpt", "plain_ckpt", "cp2_again"):
    try:
        d = json.load(open(f"{out}/{n}.json"))
        print(n, d.get("choices", {}).get("ckpt_layers"), [round(x, 5) for x in d.get("losses", [])][:6])
    except Exception as e:
        print(n, "no record", e)
PY
tar -C $OUT -cf $OUT/logs.tar one_ckpt.log plain_ckpt.log cp2_again.log && rm $OUT/*.log
