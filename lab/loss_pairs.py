"""Loss pairs across calls: the largest per-step loss difference of named pairs of try records.

Wrote: lab/results/long_context/context_parallel_h200_same_choices.json
Rerun: python -m lab.loss_pairs --out lab/results/long_context/context_parallel_h200_same_choices.json \
  --run cp2=lab/results/long_context/context_parallel_h200_plans_apart/cp2_65536.json \
  --run one=lab/results/long_context/plan_knobs_h200/plain_tile0_ce32.json \
  --run one_pieces=lab/results/long_context/plan_knobs_h200/plain_tile4096_ce32.json \
  --run one_pieces_ce64=lab/results/long_context/context_parallel_h200_plans_apart/one_65536.json \
  --pair cp2:one --pair one:one_pieces --pair one_pieces:one_pieces_ce64 \
  --floors-from lab/results/long_context/context_parallel_h200_plans_apart/context_parallel_h200.json

Why: the context-parallel merge pairs the 2-GPU run with the one-GPU runs of its own call, and when
each layout makes its own plan (the one GPU puts its MLP in pieces, the two do not) that pair
differs by the plan as well as by the layout. A one-GPU run from another call with the 2-GPU plan's
choices forced is the pair that differs by the layout alone. The records carry their own device,
versions and command; a pair across calls is honest where the runs repeat (the same try in two calls
gave the same losses to 5e-5 here). Floors are read from a merged record's floor pairs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path


def apart(a: list[float], b: list[float]) -> float:
    """The largest per-step difference of two loss lists (over the steps both ran)."""
    return max(abs(x - y) for x, y in zip(a, b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.loss_pairs")
    p.add_argument("--run", action="append", required=True, metavar="NAME=PATH", help="a try record with losses")
    p.add_argument("--pair", action="append", required=True, metavar="A:B")
    p.add_argument("--floors-from", action="append", default=[], metavar="PATH",
                   help="a merged context-parallel record: its loss_check.floor_pairs are the floors")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    runs = {}
    for item in args.run:
        name, _, path = item.partition("=")
        rec = json.loads(Path(path).read_text())
        if not rec.get("losses"):
            raise ValueError(f"{path}: no losses")
        runs[name] = {"path": path, "losses": rec["losses"], "world_size": rec.get("world_size"),
                      "choices": {k: rec.get("choices", {}).get(k) for k in ("tile_mlp", "loss", "ckpt_layers", "offload")},
                      "commit": rec.get("commit"), "device": rec.get("device"), "versions": rec.get("versions")}
    pairs = {}
    for item in args.pair:
        a, _, b = item.partition(":")
        pairs[f"{a}_vs_{b}"] = {"max_abs_loss_diff": apart(runs[a]["losses"], runs[b]["losses"]),
                                "per_step": [abs(x - y) for x, y in zip(runs[a]["losses"], runs[b]["losses"])]}
    floors = {}
    for path in args.floors_from:
        found = json.loads(Path(path).read_text()).get("loss_check", {}).get("floor_pairs") or {}
        if not found:
            raise ValueError(f"{path}: no loss_check.floor_pairs")
        floors.update({name: {"max_abs_loss_diff": value, "source": path} for name, value in found.items()
                       if value is not None})
    floor_max = max((f["max_abs_loss_diff"] for f in floors.values()), default=None)
    for pair in pairs.values():
        pair["within_floor"] = None if floor_max is None else pair["max_abs_loss_diff"] <= floor_max
    first = next(iter(runs.values()))
    rec = {"what": __doc__.split("\n\n")[2].replace("\n", " "), "runs": runs, "pairs": pairs, "floors": floors,
           "floor_max": floor_max, "device": first["device"], "versions": first["versions"],
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python -m lab.loss_pairs", *(argv if argv is not None else sys.argv[1:])])}
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    for name, pair in pairs.items():
        print(f"[loss_pairs] {name}: {pair['max_abs_loss_diff']:.2e} (floor {floor_max}), within {pair['within_floor']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
