"""The README's CPU start figures: ``qlora-nb train``'s first step and the main job, cold and warm.

Wrote: results/compile_time/start_cpu.json
Rerun: python -m lab.cpu_start lab/results/compile_time/start_cpu.json   (this 2-core machine, quiet:
    nothing else using its cores; about 12 minutes)

Why: the README says what a user waits for on a laptop-class CPU: ``qlora-nb train`` at its defaults
(SmolLM2-135M, 4 x 128) until its first step, and the main job (``qlora-nb bench --out DIR``) as a
whole. Each run is one process started as a user starts it. ``cold``: a fresh
``TORCHINDUCTOR_CACHE_DIR``/``TRITON_CACHE_DIR`` and no token cache; ``warm``: the previous cold
run's folders. ``qlora-nb train`` runs 2 steps (the time to its first step is what is read, from
its ``metrics.json``: launch to the end of the first optimizer step); the main job's figure is
its wall time from launch to exit.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "qlora_nb_utils.cli"]
TRAIN_SHAPES = [("4x128", []), ("4x256", ["--seq-len", "256"])]


def _env(folder: Path) -> dict:
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"), "TRITON_CACHE_DIR": str(folder / "triton"),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _cold(folder: Path) -> None:
    from qlora_nb_utils.data import batch_cache, token_cache

    shutil.rmtree(token_cache.default_dir(), ignore_errors=True)
    shutil.rmtree(batch_cache.default_dir(), ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)


def _train(shape: str, extra: list[str], cache: str, folder: Path) -> dict:
    out = folder / f"train-{shape}-{cache}"
    argv = ["train", "--steps", "2", "--no-progress", "--out", str(out), "--overwrite", *extra]
    t0 = time.time()
    res = subprocess.run(CLI + argv, env=_env(folder), capture_output=True, text=True, cwd=ROOT)
    row = {"what": "qlora-nb train", "shape": shape, "cache": cache, "command": "qlora-nb " + " ".join(argv),
           "exit": res.returncode, "process_s": round(time.time() - t0, 2)}
    if res.returncode == 0:
        m = json.loads((out / "metrics.json").read_text())
        row.update(time_to_first_step_s=m["time_to_first_step_s"], first_step_s=m["first_step_s"],
                   compile_s=m["compile_s"], start_phases_s=m["start_phases_s"], scope=m["optimize"]["choices"]["scope"])
    else:
        row["error"] = res.stdout[-2000:] + res.stderr[-2000:]
    return row


def _main_job(cache: str, folder: Path) -> dict:
    argv = ["bench", "--out", str(folder / f"bench-{cache}")]
    t0 = time.time()
    res = subprocess.run(CLI + argv, env=_env(folder), capture_output=True, text=True, cwd=ROOT)
    return {"what": "main job", "cache": cache, "command": "qlora-nb bench --out DIR", "exit": res.returncode,
            "wall_s": round(time.time() - t0, 1), **({} if res.returncode == 0 else {"error": res.stderr[-2000:]})}


def main(out_json: str) -> int:
    from qlora_nb_utils import env

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape, extra in TRAIN_SHAPES:
            for i in range(2):
                folder = Path(tmp) / f"t-{shape}-{i}"
                _cold(folder)
                runs.append(_train(shape, extra, "cold", folder))
                print(runs[-1], flush=True)
        for i in range(2):
            folder = Path(tmp) / f"mj-{i}"
            _cold(folder)
            runs.append(_main_job("cold", folder))
            print(runs[-1], flush=True)
        runs.append(_main_job("warm", folder))
        print(runs[-1], flush=True)
    record = {"what": __doc__.split("\n")[0], "runs": runs, "cpus": os.cpu_count(),
              "device": env.device_info(env.resolve_device_dtype("cpu", "auto")[0]), "versions": env.versions(),
              "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m lab.cpu_start " + out_json}
    Path(out_json).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(r["exit"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
