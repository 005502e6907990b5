"""Where a fresh process's imports spend their time on the GPU machine (issue 20's warm start).

Why: a warm start on the GPU machine spends more of its time importing than compiling, most of it
under ``import peft`` (which imports transformers' auto classes and bitsandbytes, and bitsandbytes
Dynamo and Inductor). The GPU image ships torch without bytecode and sets
``PYTHONDONTWRITEBYTECODE``, so its processes compiled torch's sources at every start until
``gpu_env.sh`` wrote the bytecode as ``pip install`` does; the record's ``bytecode`` says which
kind of call it was (``import_times_h200.json``: torch without it, ``import_times_bytecode_h200.json``: with).
This runs ``python -X importtime -c "import X"`` in fresh processes, twice each (the second with the
file cache warm), and keeps each module's cumulative time, the largest first.

    python3 lab/gpu/compile_time/import_times.py OUT.json [TARGET ...]

A target is a module, or several joined by commas, imported in that order in one process: ``train``
stands for what ``qlora-nb train`` imports before its first line (as ``cold_start.py`` times them).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import time

TARGETS = ("torch", "transformers", "bitsandbytes", "peft", "qlora_nb_utils")
ALIASES = {"train": "torch,transformers,peft,qlora_nb_utils.training.finetuning,qlora_nb_utils.compile.fast_path,"
                    "qlora_nb_utils.models.load"}


def one(target: str) -> dict:
    t0 = time.perf_counter()
    modules = ALIASES.get(target, target).replace(",", ", ")
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {modules}"], capture_output=True,
                         text=True, timeout=300)
    wall = time.perf_counter() - t0
    rows = []
    for line in res.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        self_us, cum_us, name = line.split(":", 1)[1].split("|", 2)
        rows.append({"module": name.strip(), "self_s": int(self_us) / 1e6, "cumulative_s": int(cum_us) / 1e6})
    top = sorted(rows, key=lambda r: -r["cumulative_s"])[:40]
    return {"target": target, "wall_s": wall, "rc": res.returncode, "modules": len(rows), "top": top,
            "self_top": sorted(rows, key=lambda r: -r["self_s"])[:25]}


def main(out: str, targets: tuple[str, ...] = TARGETS) -> None:
    from qlora_nb_utils import env  # the timed imports run in processes of their own

    res = {"what": "python -X importtime per target, fresh processes (lab/gpu/compile_time/import_times.py)",
           "device": env.device_info(), "versions": env.versions(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": os.environ.get("QLORA_NB_IMPORT_CMD", "python3 lab/gpu/compile_time/import_times.py OUT.json"),
           "bytecode": os.environ.get("QLORA_NB_BYTECODE", "not recorded (the image as it is)"),
           "python": sys.version.split()[0], "cpus": os.cpu_count(), "runs": []}
    for round_ in (1, 2):
        for target in targets:
            r = one(target)
            r["round"] = round_
            res["runs"].append(r)
            print(round_, target, f"{r['wall_s']:.2f} s", [(x["module"], round(x["cumulative_s"], 2)) for x in r["top"][:6]],
                  flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2:]) or TARGETS)
