"""The kept-attention calls' tries as one results file: tokens/s of the product, of the product without the
kept outputs, and of Unsloth, at each length, and their ratios, per call.

Run: python lab/gpu/long_context/kept_attention_results.py lab/results/long_context/kept_attention_h200_runs \
       lab/results/long_context/kept_attention_h200.json call14
  (the runs folder holds one folder per call of lab/gpu/long_context/gpu_kept_attention.sh, each with its
  ``<run>_<L>.json`` tries and ``check.json``; the last argument names the call whose numbers head the file).
Writes: {"kind": "kept_attention", "lengths": [...] (the headline call's), "calls": {name: {...}}, device,
  versions, date, command}. Every figure is read from the tries; the ratios are within one call.
Runs in a call: ``ours`` (optimize() as it chose on the day: keep_attention was False by default before
it became "auto"), ``ours_off`` (keep_attention=False), ``ours_kept`` (keep_attention=True), ``unsloth``;
where each kept its attention outputs is read from its record (or, in tries older than that field, from
optimize()'s description).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RUNS = ("ours", "ours_off", "ours_kept", "unsloth")
FIELDS = ("ok", "tokens_per_s", "step_s", "peak_mem_gib", "reserved_gib", "cpu_ram_gib", "compilations",
          "graph_breaks", "keep_attention", "keep_attention_chosen")
TARGET = 1.1  # the floor for tokens/s over Unsloth's at 16k and 32k under the 24 GB cap


def read_call(folder: Path) -> dict:
    """One call's tries by length: {L: {run: fields}}, with the operator check and the stamp."""
    lengths: dict[int, dict] = {}
    stamp: dict = {}
    for path in sorted(folder.glob("*_*.json")):
        m = re.fullmatch(r"(.+)_(\d+)", path.stem)
        if not m or m.group(1) not in RUNS:
            continue
        rec = json.loads(path.read_text())
        row = {k: rec.get(k) for k in FIELDS}
        row["losses"] = rec.get("losses")
        if rec.get("peer") == "ours" and row["keep_attention_chosen"] is None:  # a try before the field
            row["keep_attention_chosen"] = "host" if "attention output in host" in rec.get("optimize", "") else (
                "device" if "attention output in device" in rec.get("optimize", "") else False)
        lengths.setdefault(int(m.group(2)), {})[m.group(1)] = row
        if rec.get("peer") == "ours" and not stamp:
            stamp = {k: rec.get(k) for k in ("device", "versions", "date", "command", "cap_gib")}
    check = folder / "check.json"
    return {"lengths": lengths, "stamp": stamp,
            "operator_check": json.loads(check.read_text()) if check.is_file() else None}


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not (a and b and a.get("ok") and b.get("ok")):
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def _loss_diff(a: dict | None, b: dict | None) -> float | None:
    if not (a and b and a.get("losses") and b.get("losses")):
        return None
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def _kept(run: dict) -> bool:
    return run.get("keep_attention_chosen") not in (None, False, "False")


def summarize(call: dict) -> list[dict]:
    """Per length: the product as it ran (``vs_unsloth``), the run that kept attention outputs and the one
    that did not (``kept_*``, ``plain_*``: whichever runs chose so), their speed-up and loss difference."""
    rows = []
    for length, runs in sorted(call["lengths"].items()):
        ours, unsloth = runs.get("ours"), runs.get("unsloth")
        ours_runs = [r for name, r in runs.items() if name != "unsloth" and r.get("ok")]
        kept = next((r for r in ours_runs if _kept(r)), None)
        plain = next((r for r in ours_runs if not _kept(r)), None)
        rows.append({"shape": f"1 x {length}", "seq_len": length, "runs": runs,
                     "kept_where": kept.get("keep_attention_chosen") if kept else None,
                     "vs_unsloth": _ratio(ours, unsloth), "kept_vs_unsloth": _ratio(kept, unsloth),
                     "plain_vs_unsloth": _ratio(plain, unsloth), "kept_speedup": _ratio(kept, plain),
                     "kept_plain_max_abs_loss_diff": _loss_diff(kept, plain)})
    return rows


def main(runs_dir: str, out: str, headline: str) -> int:
    calls = {}
    for folder in sorted(Path(runs_dir).iterdir(), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)):
        if folder.is_dir():
            call = read_call(folder)
            calls[folder.name] = {"source": str(folder), **call["stamp"], "operator_check_ok":
                                  (call["operator_check"] or {}).get("ok"), "lengths": summarize(call)}
    head = calls[headline]
    met = [r["vs_unsloth"] is not None and r["vs_unsloth"] >= TARGET for r in head["lengths"]]
    record = {
        "kind": "kept_attention",
        "what": ("Llama-3.1-8B shape QLoRA (LoRA r=32 on every linear layer), one document of each length, "
                 "memory capped at each call's cap_gib (22: the 24 GB budget), expandable segments, 5 steps (tokens/s: the median "
                 "of the 4 after the compiling one); ours = optimize(max_memory_gib=cap_gib) as it chooses "
                 "(keep_attention='auto'), ours_off = the same with keep_attention=False, unsloth = its "
                 "offloaded checkpointing; each run its own process, one call per entry of calls"),
        "headline_call": headline, "target_vs_unsloth": TARGET, "target_met": all(met) and bool(met),
        "device": head.get("device"), "versions": head.get("versions"), "date": head.get("date"),
        "command": "OUT=$OUT BUDGET=520 bash lab/gpu/long_context/gpu_kept_attention.sh (nvidia-h200; carry .whl .gpucache "
                   ".unsloth); then python lab/gpu/long_context/kept_attention_results.py " + " ".join([runs_dir, out, headline]),
        "lengths": head["lengths"], "calls": calls,
    }
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    for r in head["lengths"]:
        print(f"[kept_attention] {r['shape']}: {r['vs_unsloth']:.3f}x Unsloth")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
