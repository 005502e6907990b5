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

``--from FILE`` (a ``python -m lab.estimate_peaks`` record, many plans measured in one process after the
estimate became an upper bound) writes the same table from that file instead, with ``check``: whether
every row's estimate is at least its peak and at most :data:`MAX_RATIO` times it. :func:`estimate_for`
computes today's estimate for a recorded try's choices (the 8B shape's config, the weights as the lab's
memory account measured them between steps): ``tests/lab/test_estimate_check.py`` holds it against every
recorded peak.
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


#: the most an estimate may exceed the measured peak, as a multiple of it
MAX_RATIO = 1.2


def rows_from(record: dict) -> list[dict]:
    """The measured rows of a ``lab.estimate_peaks`` record, each with its plan's choices, estimate and peak."""
    rows = []
    for run in record.get("runs", []):
        if not run.get("ok") or run.get("peak_mem_gib") is None or run.get("estimate_gib") is None:
            continue
        c, est, peak = run.get("choices") or {}, run["estimate_gib"], run["peak_mem_gib"]
        rows.append({"label": f"{run['seq_len']} @ {run['target_gib']:g} GiB {run.get('knobs') or ''}".strip(),
                     "seq_len": run["seq_len"], "cap_gib": run["target_gib"], "knobs": run.get("knobs") or {},
                     "scope": c.get("scope"), "ckpt_layers": c.get("ckpt_layers"), "offload": c.get("offload"),
                     "tile_mlp": c.get("tile_mlp"), "keep_attention": c.get("keep_attention", "False"),
                     "sdpa_kernel": c.get("sdpa_kernel"), "estimate_gib": est, "peak_mem_gib": peak,
                     "reserved_gib": run.get("reserved_gib"), "estimate_over_peak": est / peak,
                     "peak_minus_estimate_gib": peak - est, "step_s": run.get("step_s")})
    return rows


def check(rows: list[dict]) -> dict:
    """Whether every row's estimate is an upper bound of its peak within :data:`MAX_RATIO`, and the spread."""
    ratios = [r["estimate_gib"] / r["peak_mem_gib"] for r in rows]
    return {"rows": len(rows), "max_ratio_allowed": MAX_RATIO,
            "every_row_within": bool(rows) and all(1.0 <= x <= MAX_RATIO for x in ratios),
            "min_ratio": min(ratios, default=None), "max_ratio": max(ratios, default=None),
            "lengths": sorted({r["seq_len"] for r in rows}),
            "plans": sorted({f"ckpt {r['ckpt_layers']} offload {r['offload']} tile {r['tile_mlp']} "
                             f"keep {r['keep_attention']}" for r in rows})}


def shape_8b(here: Path = HERE):
    """The 8B shape as the estimate reads it: its config's sizes, and the bytes held between steps as the
    lab's memory account measured them on the GPU (frozen NF4 weights; the fp32 adapter, its gradient and
    AdamW's two moments, four times the adapter)."""
    from qlora_nb_utils import models
    from qlora_nb_utils.compile.memory_estimate import Shape

    account = json.loads((here / "call5_7_ours_mlp_op_24.json").read_text())["memory_account"]["between_steps"]
    frozen = next(v for k, v in account.items() if k.startswith("frozen"))
    adapter = account["adapter parameters"]
    c = models.model_config("llama-3.1-8b-shape")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return Shape(layers=c.num_hidden_layers, hidden=c.hidden_size, intermediate=c.intermediate_size,
                 heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=head_dim, vocab=c.vocab_size,
                 static_bytes=int((frozen + 4 * adapter) * 2**30), grad_bytes=int(adapter * 2**30),
                 group_weight_elems=max(2 * c.intermediate_size * c.hidden_size,
                                        (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim * c.hidden_size))


def estimate_for(run: dict, shape) -> float:
    """Today's estimate for the choices a recorded try's plan made (its ``choices``), batch 1."""
    from qlora_nb_utils.compile.memory_estimate import peak_from_terms, terms_of

    c = run["choices"]
    chunks = int(re.search(r"x(\d+)", c.get("loss", "x4")).group(1))
    terms = terms_of(shape, 1, run["seq_len"], ce_chunks=chunks, act_bytes=2, recompute=c.get("recompute") == "elementwise",
                     lora_in_place=c.get("lora_addmm") == "True")
    keep = c.get("keep_attention", "False")
    offload = c.get("offload") == "True"
    kept = {"True": "host" if offload else "device", "host": "host", "device": "device"}.get(keep, False)
    return peak_from_terms(terms, int(c["ckpt_layers"].split("/")[0]), offload, int(c.get("tile_mlp") or 0), kept)


def recorded_tries(here: Path = HERE) -> list[tuple[str, dict]]:
    """Every ok try of ours with a measured peak and its choices: (source, run), each once."""
    seen, out = set(), []
    paths = sorted(here.glob("call*_ours*.json")) + sorted(here.glob("kept_attention_h200_runs/call*/ours*.json"))
    for path in paths:
        for run in runs_of(json.loads(path.read_text())):
            if not run.get("ok") or run.get("peak_mem_gib") is None or not run.get("choices"):
                continue
            key = (run["seq_len"], run["peak_mem_gib"], tuple(sorted(run["choices"].items())))
            if key not in seen:
                seen.add(key)
                out.append((str(path.relative_to(here)), run))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "estimate_vs_peak_h200.json"))
    parser.add_argument("--from", dest="source", type=Path, nargs="+",
                        help="lab.estimate_peaks records, one per call (see the docstring)")
    args = parser.parse_args(argv)
    if args.source:
        return _from_measured(args.source, Path(args.out), argv)
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


def _from_measured(sources: list[Path], out: Path, argv: list[str] | None) -> int:
    records = [json.loads(path.read_text()) for path in sources]
    record = {**records[0], "runs": [run for rec in records for run in rec.get("runs", [])],
              "command": " ; ".join(str(rec.get("command")) for rec in records)}
    rows = sorted(rows_from(record), key=lambda r: (r["seq_len"], r["cap_gib"]))
    if not rows:
        print(f"[estimate_check] no measured row in {', '.join(map(str, sources))}", file=sys.stderr)
        return 1
    result = {"kind": "estimate_vs_peak",
              "what": "optimize()'s memory estimate for the plan it chose (stated in its description) beside the step's "
                      "measured peak (torch.cuda.max_memory_allocated), Llama-3.1-8B shape QLoRA, batch 1, one document, "
                      "many plans and lengths measured in one process (python -m lab.estimate_peaks)",
              "device": record.get("device"), "versions": record.get("versions"), "date": record.get("date"),
              "command": record.get("command"),
              "written_by": "python -m lab.estimate_check " + " ".join(argv if argv is not None else sys.argv[1:]),
              "check": check(rows), "rows": rows,
              "failed": [{k: r.get(k) for k in ("seq_len", "target_gib", "knobs", "estimate_gib", "error")}
                         for r in record.get("runs", []) if not r.get("ok")]}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("[estimate_check] check:", result["check"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
