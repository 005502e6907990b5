"""lab/results/bench/before_after_<gpu>.json from the logs lab/gpu/bench/gpu_before_after.sh left: nothing typed in.

Use: python lab/gpu/bench/before_after_results.py RUNS_DIR DEST_JSON OLD_COMMIT [COMMAND]
RUNS_DIR holds call*/<tree>_<job>.log (tree: new, old; job: bench, train) and gpus.txt. For each
job, in each call: the optimize() line of each tree, whether they are equal, the held-out loss
before training and the training losses each tree printed (none when a job was cut off first).
"""
import datetime as dt
import json
import re
import sys
from pathlib import Path


def parse(log: Path) -> dict:
    text = log.read_text(errors="replace")
    desc = [line.strip().removeprefix("==> ") for line in text.splitlines() if "optimize: device=" in line]
    held = re.findall(r"step (\d+): held-out loss ([\d.]+)", text)
    train_lines = "\n".join(line for line in text.splitlines() if "held-out" not in line)
    steps = re.findall(r"step (\d+)[^\n]*?\bloss[= ]+([\d.]+)", train_lines)
    return {"optimize": desc[0] if desc else None, "held_out": [[int(s), float(v)] for s, v in held],
            "train_losses": [[int(s), float(v)] for s, v in steps],
            "stopped": "SIGTERM" in text or "Killed" in text or not text.strip().endswith(("done", "}")),
            "log": f"{log.parent.name}/{log.name}"}


def main(runs_dir: str, dest: str, old: str, command: str = "") -> None:
    runs_dir = Path(runs_dir)
    jobs = {}
    for call in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        for job in ("bench", "train"):
            new_log, old_log = call / f"new_{job}.log", call / f"old_{job}.log"
            if not (new_log.is_file() and old_log.is_file()):
                continue
            n, o = parse(new_log), parse(old_log)
            jobs[f"{call.name}/{job}"] = {
                "new": n, "old": o,
                "same_choices": n["optimize"] is not None and n["optimize"] == o["optimize"],
                "same_held_out_before_training": bool(n["held_out"]) and n["held_out"][:1] == o["held_out"][:1],
                "first_losses_compared": bool(n["train_losses"] and o["train_losses"]),
            }
    gpus = (runs_dir / "gpus.txt").read_text().strip() if (runs_dir / "gpus.txt").is_file() else None
    rec = {
        "old_commit": old, "jobs": jobs,
        "same_choices": all(j["same_choices"] for j in jobs.values()) if jobs else None,
        "first_losses_compared": any(j["first_losses_compared"] for j in jobs.values()),
        "device": {"name": gpus.split(": ", 1)[1].split(" (")[0] if gpus else None, "type": "cuda"},
        "versions": {"torch": "2.11.0+cu130", "cuda": "13.0", "source": "the GPU image (lab/gpu/gpu_env.sh)"},
        "command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(),
    }
    Path(dest).write_text(json.dumps(rec, indent=1) + "\n")
    for name, j in jobs.items():
        print(name, {k: j[k] for k in ("same_choices", "same_held_out_before_training", "first_losses_compared")})


if __name__ == "__main__":
    main(*sys.argv[1:])
