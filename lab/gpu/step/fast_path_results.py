"""Gather the GPU calls of lab/gpu/step/gpu_fast_path.sh into the committed results files.

Wrote: results/fast_path_<gpu>.json (+ fast_path_<gpu>_<b>x<s>.png), results/odd_lengths_<gpu>.json
Rerun: python3 lab/gpu/step/fast_path_results.py --gpu h100 DIR... (each DIR: one call's $OUT)

Each bench call wrote ``bench_<b>x<s>/results.json`` (one ``qlora-nb bench`` run: device,
versions, command, date, the three runs with their floors); this keeps every file whole under
``calls`` and lists the runs of every shape under ``runs``, so the 4 x 512 and 16 x 1024 runs
sit in one file. The odd-lengths call wrote ``odd_lengths.json`` (a ``qlora-nb diagnose`` report),
copied as it is.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", required=True, help="name in the file names, e.g. h100")
    parser.add_argument("--results", default="results")
    parser.add_argument("dirs", nargs="+")
    args = parser.parse_args()
    res = Path(args.results)
    target = res / f"fast_path_{args.gpu}.json"
    merged = json.loads(target.read_text()) if target.is_file() else {"calls": {}, "runs": []}
    for d in map(Path, args.dirs):
        for f in sorted(d.glob("bench_*/results.json")):
            call = json.loads(f.read_text())
            shape = f.parent.name.removeprefix("bench_")
            merged["calls"][shape] = call
            merged["runs"] = [r for r in merged["runs"] if f"{r['batch_size']}x{r['seq_len']}" != shape]
            merged["runs"] += call["runs"]
            png = f.parent / "loss_curves.png"
            if png.is_file():
                shutil.copyfile(png, res / f"fast_path_{args.gpu}_{shape}.png")
        odd = d / "odd_lengths.json"
        if odd.is_file():
            shutil.copyfile(odd, res / f"odd_lengths_{args.gpu}.json")
    first = next(iter(merged["calls"].values()), None)
    if first:
        calls = list(merged["calls"].values())
        merged.update(kind="fast_path", device=first["device"], versions=first["versions"],
                      command=" ; ".join(c["command"] for c in calls), date=max(c["date"] for c in calls),
                      what="qlora-nb bench (lab/gpu/step/gpu_fast_path.sh): hf-eager, plain-compile and fast "
                           "(optimize()) on the same batches, per shape; parity against the eager floor")
    merged["runs"].sort(key=lambda r: (r["batch_size"] * r["seq_len"], ("hf-eager", "plain-compile", "fast").index(r["name"])))
    target.write_text(json.dumps(merged, indent=2) + "\n")
    print(f"wrote {target}: {len(merged['runs'])} runs")


if __name__ == "__main__":
    main()
