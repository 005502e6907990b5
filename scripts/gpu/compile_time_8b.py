"""Cold and warm compile of the 8B shape through optimize(), each start in a fresh process.

Why: issue 20's targets are a cold compile of the 8B shape under 90 s (regional compilation and
cache artifacts count) and a warm start under 20 s. bench.compile_time measures one start in a
new process with its own Inductor cache folder; this runs the cases in order of what they
answer and rewrites OUT/compile_time_8b_<gpu>.json after each, so a time limit keeps what ran:

1. regional, cold (empty cache), saving torch.compiler's cache artifacts;
2. regional, warm: a fresh cache folder loaded from those artifacts (a new machine);
3. regional, warm: the same cache folder as 1 (the same machine, a new process);
4. whole, cold, saving artifacts; 5. whole from its artifacts.

Use (GPU machine, repo root, after sourcing gpu_env.sh):
    python3 scripts/gpu/compile_time_8b.py OUT_DIR [BATCH=8] [SEQ=1024] [BUDGET_S=540]
"""

import json
import sys
import time
from pathlib import Path

import torch

from qlora_nb_utils import env, models
from qlora_nb_utils.bench.compile_time import measure

out_dir = Path(sys.argv[1])
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
seq = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
budget = float(sys.argv[4]) if len(sys.argv) > 4 else 540.0
t_start = time.perf_counter()
name = "llama-3.1-8b-shape"
gpu = next((t.lower() for t in ("H100", "H200", "A100") if t in torch.cuda.get_device_name()), "gpu")
work = Path("/tmp/ct8b")
result = {"device": env.device_info("cuda"), "versions": env.versions(),
          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
          "command": "python3 scripts/gpu/compile_time_8b.py " + " ".join(sys.argv[1:]),
          "model": name, "batch_size": batch, "seq_len": seq, "steps": 4,
          "note": "compile_s = first step - median steady step, in a new process; process_s adds imports, "
                  "the 8B load and quantization; each case's own Inductor/Triton cache folder",
          "cases": []}
t0 = time.perf_counter()
models.materialize(name)
result["materialize_s"] = time.perf_counter() - t0
path = out_dir / f"compile_time_8b_{gpu}.json"
cases = [
    ("regional-cold", "regional", "r_cold", {"save_artifacts": work / "r.bin"}),
    ("regional-artifacts", "regional", "r_art", {"load_artifacts": work / "r.bin"}),
    ("regional-same-cache", "regional", "r_cold", {}),
    ("whole-cold", "whole", "w_cold", {"save_artifacts": work / "w.bin"}),
    ("whole-artifacts", "whole", "w_art", {"load_artifacts": work / "w.bin"}),
]
need = {"regional": 150, "whole": 330}
for label, scope, folder, extra in cases:
    left = budget - (time.perf_counter() - t_start)
    if left < need[scope]:
        result["cases"].append({"case": label, "skipped": f"{left:.0f} s of the budget left"})
        continue
    work.mkdir(parents=True, exist_ok=True)
    try:
        r = measure(model=name, scope=scope, cache_dir=work / folder, device="cuda", dtype="bfloat16",
                    batch_size=batch, seq_len=seq, steps=4, timeout_s=left - 5, **extra)
        r = {k: v for k, v in r.items() if k != "optimize"} | {"choices": r["optimize"]["choices"]}
        result["cases"].append({"case": label, **r})
    except Exception as err:  # keep the others
        result["cases"].append({"case": label, "error": str(err)[-600:]})
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(label, {k: result["cases"][-1].get(k) for k in ("compile_s", "first_step_s", "median_step_ms",
                                                          "process_s", "compilations", "error")}, flush=True)
path.write_text(json.dumps(result, indent=1) + "\n")
