"""``python -m lab.estimate_check``: optimize()'s memory estimate beside the peak each long-context try measured.

Why it exists: ``optimize(max_memory_gib=...)`` chooses checkpointing, offload, the MLP pieces, the LoRA
route and the kept attention outputs from an estimate fitted on short sequences
(``qlora_nb_utils.compile.memory_estimate``). Where it overshoots, the plan takes savings the step did
not need (slower than it could be at a given memory); where it falls short, a choice placed under the
target can run out of memory. This table is what a refit of its terms starts from: for every committed
try of ours, the estimate the plan printed for the choices it made (parsed from ``optimize()``'s
description, so exactly what the plan saw), the peak allocated and reserved, and their differences.

Reads: ``lab/results/long_context/call*_ours*.json`` (driver records, each run with its description, or
single tries) and
``lab/results/long_context/kept_attention_h200_runs/call*/ours*.json`` (one try each).
Writes: ``--out`` (default ``lab/results/long_context/estimate_vs_peak_h200.json``): {"kind", "what",
"rows": [{"label", "seq_len", "cap_gib", "ckpt_layers", "offload", "tile_mlp", "keep_attention",
"estimate_gib", "peak_mem_gib", "reserved_gib", "peak_minus_estimate_gib", "reserved_minus_estimate_gib",
"source"}], "peak_minus_estimate_fit": the line through the tiled rows' differences, device, versions,
date, command}. Failed tries (no peak) and tries that forced the MLP pieces or the kept outputs (choices
the printed estimate does not count) are left out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from lab.long_context_search import fit_line, runs_of
from lab.paths import RESULTS

HERE = RESULTS / "long_context"
#: the estimate of the choices made: the MLP pieces' figure when the plan chose them, else checkpointing's
_TILED = re.compile(r"each MLP in pieces of \d+ positions: ([\d.]+) GiB")
_CKPT = re.compile(r"ckpt_layers=\d+/\d+ \(estimated peak ([\d.]+) GiB")


def _choice(description: str, name: str) -> str | None:
    m = re.search(rf"(?:^|; |optimize: ){name}=([^ ;]+)", description)
    return m.group(1) if m else None


def estimate_of(description: str) -> float | None:
    """The plan's estimate for the choices it made, from its description (None: no memory target)."""
    m = _TILED.search(description) or _CKPT.search(description)
    return float(m.group(1)) if m else None


def asked(description: str) -> list[str]:
    """The choices the try forced (``name=value (asked for ...``): the description gives no estimate for them."""
    return re.findall(r"(?:^|; |optimize: )(tile_mlp|keep_attention|ckpt_layers|offload)=[^ ;]+ \(asked for", description)


def row_of(run: dict, source: str) -> dict | None:
    """One try as a row; None for a failed try, one without a memory target, or one with a choice forced
    that the estimate does not count (the MLP pieces, the kept outputs asked for)."""
    desc = run.get("optimize") or ""
    est, peak = estimate_of(desc), run.get("peak_mem_gib")
    forced = any(a in ("tile_mlp", "keep_attention") for a in asked(desc)) or _choice(desc, "keep_attention") == "True"
    if est is None or peak is None or not run.get("ok") or forced:  # True: asked for, before the choice had a place
        return None
    reserved = run.get("reserved_gib")
    return {"label": f"{run['seq_len']} @ {run.get('cap_gib')} GiB ({source})", "seq_len": run["seq_len"],
            "cap_gib": run.get("cap_gib"), "ckpt_layers": _choice(desc, "ckpt_layers"),
            "offload": _choice(desc, "offload"), "tile_mlp": _choice(desc, "tile_mlp"),
            "keep_attention": _choice(desc, "keep_attention") or "False", "estimate_gib": est,
            "peak_mem_gib": peak, "reserved_gib": reserved, "peak_minus_estimate_gib": peak - est,
            "reserved_minus_estimate_gib": None if reserved is None else reserved - est, "source": source}


def collect(here: Path = HERE) -> tuple[list[dict], dict]:
    rows, stamp = [], {}
    for path in sorted(here.glob("call*_ours*.json")):
        rec = json.loads(path.read_text())
        for run in runs_of(rec):  # a driver record, or one try
            row = row_of({**run, "cap_gib": run.get("cap_gib", rec.get("cap_gib"))}, path.name)
            if row:
                rows.append(row)
                stamp = stamp or {k: rec.get(k) for k in ("device", "versions")}
    for path in sorted(here.glob("kept_attention_h200_runs/call*/ours*.json")):
        row = row_of(json.loads(path.read_text()), str(path.relative_to(here)))
        if row:
            rows.append(row)
    unique = {}
    for row in rows:  # a try merged into a driver record and kept as its own file: once
        unique.setdefault((row["seq_len"], row["cap_gib"], row["estimate_gib"], row["peak_mem_gib"]), row)
    return sorted(unique.values(), key=lambda r: (r["cap_gib"], r["seq_len"], r["source"])), stamp


def fit(rows: list[dict]) -> dict | None:
    """Least squares ``peak - estimate = a + b * L`` over the rows whose MLP ran in pieces with offloaded
    inputs (the longest lengths' regime); None with fewer than two lengths."""
    pts = [(r["seq_len"], r["peak_minus_estimate_gib"]) for r in rows
           if r["tile_mlp"] not in (None, "0") and r["offload"] == "True"]
    line = fit_line(pts)
    if line is None:
        return None
    return {"rows": "the MLP in pieces, inputs offloaded", "points": len(pts), "intercept_gib": line["a_gib"],
            "per_token_kib": line["b_gib_per_token"] * 2**20,
            "max_abs_residual_gib": max(abs(r) for r in line["residuals_gib"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "estimate_vs_peak_h200.json"))
    args = parser.parse_args(argv)
    rows, stamp = collect()
    if not rows:
        print("[estimate_check] no try with a description and a peak under", HERE, file=sys.stderr)
        return 1
    import datetime as _dt

    record = {"kind": "estimate_vs_peak",
              "what": "optimize()'s memory estimate for the choices it made (from its description) beside each "
                      "long-context try's measured peak, Llama-3.1-8B shape QLoRA, batch 1, one document",
              **stamp, "date": _dt.date.today().isoformat(),
              "command": "python -m lab.estimate_check " + " ".join(argv if argv is not None else sys.argv[1:]),
              "peak_minus_estimate_fit": fit(rows), "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print("[estimate_check] fit:", record["peak_minus_estimate_fit"])
    for r in rows:
        print(f"[estimate_check] {r['seq_len']:>7} cap {r['cap_gib']:>4}: estimate {r['estimate_gib']:6.2f}  "
              f"peak {r['peak_mem_gib']:6.2f}  ({r['peak_minus_estimate_gib']:+.2f})  tile={r['tile_mlp']} "
              f"offload={r['offload']} keep={r['keep_attention']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
