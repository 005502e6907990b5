#!/usr/bin/env bash
# Wrote: lab/results/matrix/compile_parity_h200.json
# Rerun: OUT=$OUT BUDGET=440 bash lab/gpu/matrix/gpu_parity.sh
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache)
# bf16 loss parity on the GPU (issue 3's 5e-3 target), one call on one GPU (~8 minutes):
#   parity_default.json         matrix cells lora,qlora,base x fixed x whole, inductor as is
#   parity_eager_numerics.json  the same cells with --eager-numerics (emulate_precision_casts)
#   regional_variable.json      lora,qlora x variable x regional: compilations after the
#                               restart fix (ops.static_floats.with_static_floats)
#   noise.json                  eager vs eager (lab/gpu/matrix/bf16_noise.py): the floor
# The four run side by side (timings in these files mean nothing; losses and counts do).
# Usage (GPU machine, carry .whl .gpucache): OUT=/dir bash lab/gpu/matrix/gpu_parity.sh
set -uo pipefail
OUT=${OUT:?set OUT}
source "$(dirname "$0")/../gpu_env.sh"
export TORCHINDUCTOR_COMPILE_THREADS=4 OMP_NUM_THREADS=2
nvidia-smi -L
BUDGET=${BUDGET:-450}
python3 -c "from qlora_nb_utils import models; models.materialize('llama-3.2-1b-shape')" 2>&1 | tail -1
m() {  # m NAME ARGS...
  local name=$1; shift
  timeout --kill-after=10 $((BUDGET + 60)) python3 -W ignore -m qlora_nb_utils.bench.matrix --model llama-3.2-1b-shape \
    --steps 30 --batch-size 4 --max-len 256 --warmup 5 --time-budget-s "$BUDGET" \
    --command "OUT=\$OUT bash lab/gpu/matrix/gpu_parity.sh ($name)" --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "[gpu_parity] $name exit $?"
}
m parity_default --configs lora,qlora,base --grad-ckpt off --lengths fixed --scopes whole &
m parity_eager_numerics --configs lora,qlora,base --grad-ckpt off --lengths fixed --scopes whole --eager-numerics &
m regional_variable --configs lora,qlora --grad-ckpt off --lengths variable --scopes regional &
timeout $((BUDGET + 60)) python3 -W ignore lab/gpu/matrix/bf16_noise.py --out "$OUT/noise.json" > "$OUT/noise.log" 2>&1 &
wait
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in ("parity_default", "parity_eager_numerics", "regional_variable"):
    p = out / f"{name}.json"
    if not p.exists():
        print(name, "missing"); continue
    for c in json.loads(p.read_text())["cells"]:
        print(name, c["config"], c["lengths"], c["scope"], "compilations", c["compilations"], "restarts", c.get("restarts"),
              "max_diff", c["max_abs_loss_diff"], "first", c.get("first_step_loss_diff"), "err", c.get("compiled_error"))
p = out / "noise.json"
if p.exists():
    for c in json.loads(p.read_text())["cells"]:
        print("noise", c["config"], c["max_abs_loss_diff_repeat"], c["max_abs_loss_diff_flipped"], c["first_step_loss_diff_flipped"])
PY
