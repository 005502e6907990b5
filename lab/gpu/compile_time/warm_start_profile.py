"""Where a warm start's load goes: one warm 8B start under cProfile (issue 20's warm start).

Wrote: results/warm_start_profile_<gpu>.json (from OUT/warm_start_profile.json)
Rerun: bash lab/gpu/compile_time/gpu_warm_start_profile.sh OUT  (GPU machine, repo root; carry .whl .gpucache)

Why: ``lab/results/compile_time/warm_start_h100.json`` splits a warm start into imports (13.3-15.0 s), load (4.9 s
from a pre-quantized NF4 checkpoint, 5.8 s from the bf16 one) and compile (3.1-4.4 s), against a
20 s target. The load is ours to shorten, and "load" there is the tokenizer, ``from_pretrained``,
PEFT's LoRA layers and the batches (``bench.compile_time.load_case``). This runs a cold start
(its Inductor cache folder filled), then the same start warm, in a new process under
``cProfile``, from the pre-quantized checkpoint, and keeps the cumulative seconds of the calls a
start is made of, and the top functions by cumulative time. cProfile slows pure-Python code
(the imports most), so the split is read as shares, with the unprofiled warm starts of
``lab/results/compile_time/warm_start_h100.json`` for the absolute times.

    python3 lab/gpu/compile_time/warm_start_profile.py OUT_DIR
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

MODEL = os.environ.get("WARM_START_PROFILE_MODEL", "llama-3.1-8b-shape")  # tiny: a CPU smoke run
SHAPE = {"scope": "regional", "batch_size": 2, "seq_len": 1024, "steps": 4}
#: The calls a start is made of: (label, file suffix, function name) as cProfile names them.
PARTS = [
    ("imports (bench.compile_time._import_timed)", "compile_time.py", "_import_timed"),
    ("load: everything (load_case)", "compile_time.py", "load_case"),
    ("load: load_model", "load.py", "load_model"),
    ("load: tokenizer", "load.py", "load_tokenizer"),
    ("load: from_pretrained and its config", "load.py", "_load_base"),
    ("load: nf4_config (AutoConfig)", "prequantized.py", "nf4_config"),
    ("load: PEFT's LoRA layers", "load.py", "_add_lora"),
    ("load: the batches (make_bench_batches)", "main_job.py", "make_bench_batches"),
    ("optimize()", "fast_path.py", "optimize"),
    ("train (first steps, compile included)", "loop.py", "train"),
]


def main(out_dir: str) -> int:
    import torch

    from qlora_nb_utils import env, models
    from qlora_nb_utils.bench import compile_time

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("WARM_START_WORK", "/tmp/warm_start_profile"))
    work.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = {"what": __doc__.split("\n\n")[0], "device": env.device_info(dev), "versions": env.versions(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": os.environ.get("QLORA_NB_PROFILE_CMD", " ".join(sys.argv)), "tool": "lab/gpu/compile_time/warm_start_profile.py",
           "model": MODEL, **SHAPE, "phases_s": {}}
    t = time.monotonic()
    models.materialize(MODEL) if MODEL in models.MODEL_NAMES else None
    nf4 = work / f"{MODEL}-nf4"
    if not (nf4 / "config.json").exists():
        subprocess.run([sys.executable, "-c", f"from qlora_nb_utils import models; models.save_nf4({MODEL!r}, "
                        f"{str(nf4)!r}, overwrite=True)"], check=True)
    res["phases_s"]["build_and_save_nf4"] = round(time.monotonic() - t, 1)
    cache = work / "inductor"
    common = {"scope": SHAPE["scope"], "cache_dir": cache, "device": dev.type, "dtype": "bfloat16",
              "batch_size": SHAPE["batch_size"], "seq_len": SHAPE["seq_len"], "steps": SHAPE["steps"]}
    t = time.monotonic()
    cold = compile_time.measure(model=str(nf4), timeout_s=400, **common)
    res["cold"] = {k: cold.get(k) for k in ("time_to_first_step_s", "import_s", "load_s", "compile_s")}
    res["phases_s"]["cold"] = round(time.monotonic() - t, 1)
    prof = work / "warm.prof"
    t = time.monotonic()
    try:
        warm = compile_time.measure(model=str(nf4), timeout_s=400, profile_to=prof, **common)
    except RuntimeError as exc:
        warm = None
        res["error"] = str(exc)[-3000:]
    res["phases_s"]["warm_profiled"] = round(time.monotonic() - t, 1)
    if warm is not None:
        res["warm_profiled"] = {k: warm.get(k) for k in ("time_to_first_step_s", "import_s", "imports", "load_s",
                                                         "compile_s", "cache_counters")}
        stats = pstats.Stats(str(prof))
        table = stats.stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
        parts = {}
        for label, suffix, name in PARTS:
            hits = [v[3] for (f, _, n), v in table.items() if n == name and f.endswith(suffix)]
            parts[label] = round(max(hits), 3) if hits else None
        res["parts_cumulative_s"] = parts
        top = sorted(((v[3], v[2], f, n) for (f, _, n), v in table.items()), reverse=True)[:80]
        res["top_cumulative"] = [{"cumulative_s": round(ct, 3), "self_s": round(tt, 3),
                                  "where": f"{Path(f).name}:{n}", "file": f} for ct, tt, f, n in top]
    (out / "warm_start_profile.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(json.dumps({k: res.get(k) for k in ("cold", "warm_profiled", "parts_cumulative_s", "phases_s", "error")},
                     indent=1, default=str))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
