#!/usr/bin/env bash
# Follow-up to tools/gpu_fsdp.sh on the same 2-GPU machine kind: what limits 2-GPU scaling, and
# how much of the 1-vs-2-GPU loss difference is bf16 noise. Usage, from the repository root:
#     OUT=/some/dir bash tools/gpu_fsdp_check.sh        (~5 minutes)
#  1. nvidia-smi topo -m and an NCCL all-gather bandwidth probe (2 processes, 1 GiB per rank)
#  2. scaling_1 again, ALONE on GPU 0 (the first run had it beside parity_1 on the other GPU)
#  3. noise_1: 1 GPU, global batch 2 in ONE micro-batch of 2 (parity_1 took 2 micro-batches of 1):
#     the same mathematics, other kernels; |noise_1 - parity_1| is the bf16 noise floor
#  4. fp32_1 / fp32_2: the parity pair in float32 (10 steps): the FSDP arithmetic without bf16 noise
# Writes $OUT/fsdp2_check.json (diffs, tokens/s, bandwidth) and $OUT/runs.tgz (every log).
set -euo pipefail
OUT=${OUT:-$PWD/out/fsdp2_check}
mkdir -p "$OUT"
T0=$(date +%s)
source "$(dirname "$0")/gpu_env.sh"
RUNS=/tmp/fsdp_check_runs
mkdir -p "$RUNS"
{ nvidia-smi -L; nvidia-smi topo -m; env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)' || true; } > "$RUNS/topo.txt" 2>&1
cat "$RUNS/topo.txt"

cat > /tmp/ag_probe.py <<'EOF'
import json, os, sys, time, torch, torch.distributed as dist
dist.init_process_group("nccl")
r, w = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(r)
n = 512 * 2**20  # bf16 elements per rank: 1 GiB
x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
y = torch.empty(n * w, dtype=torch.bfloat16, device="cuda")
for _ in range(3):
    dist.all_gather_into_tensor(y, x)
torch.cuda.synchronize(); dist.barrier()
ts = []
for _ in range(10):
    torch.cuda.synchronize(); t = time.perf_counter()
    dist.all_gather_into_tensor(y, x)
    torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
ts.sort(); med = ts[len(ts) // 2]
if r == 0:
    gib = n * 2 / 2**30
    json.dump({"bytes_per_rank_gib": gib, "median_s": med,
               "algbw_gib_s": gib * w / med, "busbw_gib_s": gib * (w - 1) / med}, open(sys.argv[1], "w"))
    print("all_gather", gib, "GiB/rank, median", med, "s, busbw", gib * (w - 1) / med, "GiB/s")
dist.destroy_process_group()
EOF
timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 /tmp/ag_probe.py "$RUNS/allgather.json" \
  || echo "[check] all-gather probe failed" | tee -a "$RUNS/errors.txt"

MODEL=${MODEL:-llama-3.1-8b-shape}
timeout 240 python3 -c "from qlora_nb_utils import models; print(models.materialize('$MODEL'))" 2>&1 | tail -1
COMMON=(--model "$MODEL" --quant nf4 --seq-len 2048 --pack --device cuda
        --compile --backend inductor --no-fullgraph --lr 2e-4 --seed 0 --timing-warmup 3 --no-adapter)
run() {  # run NAME TIMEOUT_S GPUS NPROC ARGS...
  local name=$1 limit=$2 gpus=$3 nproc=$4
  shift 4
  echo "[check] $name on GPU(s) $gpus ($(($(date +%s) - T0)) s elapsed)"
  CUDA_VISIBLE_DEVICES=$gpus timeout --signal=TERM --kill-after=20 "$limit" \
    python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    -m qlora_nb_utils.distributed.fsdp_train "${COMMON[@]}" "$@" --out "$RUNS/$name" > "$RUNS/$name.log" 2>&1 \
    || { echo "[check] $name FAILED (exit $?)" | tee -a "$RUNS/errors.txt"; tail -20 "$RUNS/$name.log"; }
}
run scaling_1 150 0 1 --dtype bfloat16 --steps 12 --global-batch-size 1
run noise_1 200 0 1 --dtype bfloat16 --steps 30 --global-batch-size 2 --micro-batch-size 2 &
P1=$!
run fp32_1 200 1 1 --dtype float32 --steps 10 --global-batch-size 2 --micro-batch-size 1 &
P2=$!
wait $P1 || true; wait $P2 || true
run fp32_2 180 0,1 2 --dtype float32 --steps 10 --global-batch-size 2 --micro-batch-size 1

python3 - "$RUNS" "$OUT" "$0" <<'EOF' || echo "[check] summary failed"
import json, sys, datetime, torch
from pathlib import Path
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
def s(n):
    p = runs / n / "summary.json"
    return json.loads(p.read_text()) if p.is_file() else None
def steps(n):
    p = runs / n / "log.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.is_file() else []
res = {"command": sys.argv[3], "device_name": torch.cuda.get_device_name(0),
       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
       "topo": (runs / "topo.txt").read_text(),
       "allgather": json.loads((runs / "allgather.json").read_text()) if (runs / "allgather.json").is_file() else None,
       "runs": {}}
for n in ("scaling_1", "noise_1", "fp32_1", "fp32_2"):
    sm = s(n)
    res["runs"][n] = None if sm is None else {k: sm.get(k) for k in (
        "world_size", "tokens_per_s", "median_step_ms", "peak_mem_gib_per_gpu", "peak_mem_gib", "losses",
        "graph_breaks", "compile", "versions", "command")}
    if sm is not None:
        res["runs"][n]["step_ms"] = [r["step_ms"] for r in steps(n)]
def diff(a, b):
    if not a or not b:
        return None
    la, lb = a["losses"], b["losses"]
    return max(abs(x - y) for x, y in zip(la, lb))
res["max_abs_loss_diff_fp32_1_vs_2"] = diff(res["runs"]["fp32_1"], res["runs"]["fp32_2"])
res["noise_1_losses_note"] = "compare with parity_1 of results/fsdp2_h200.json (same global batches, 2 micro-batches of 1)"
(out / "fsdp2_check.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
print(json.dumps({k: v for k, v in res.items() if k not in ("runs", "topo")}, default=str))
for n, v in res["runs"].items():
    print(n, None if v is None else (v["tokens_per_s"], v["median_step_ms"], v["losses"][:3]))
EOF
tar -czf "$OUT/runs.tgz" -C "$RUNS" --exclude='*.pt' --exclude='ckpt' --exclude='adapter' .
echo "[check] finished in $(($(date +%s) - T0)) s"
