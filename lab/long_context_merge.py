"""Merge the long-context drivers' files into one record per GPU: ``lab/results/long_context/long_context_<gpu>.json``.

Why apart from :mod:`lab.long_context`: that module measures (a try, the driver); this one only
combines what the drivers wrote; what both need is :mod:`lab.long_context_search`. Files of one
variant and cap from several calls (or an earlier merged file) become one variant with all their
runs, each naming its source file, and the bracket is recomputed over all of them.

    python -m lab.long_context merge OUT/ours_22.json OUT/unsloth_22.json ... --out-dir OUT
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from lab.long_context_search import CAP_NOTE, PEERS, STEP, bracket, runs_of, stamp

#: every merged run has these (None where a failed try has none); the extras where the try wrote them
RUN_FIELDS = ("seq_len", "ok", "peak_mem_gib", "reserved_gib", "step_s", "tokens_per_s", "first_step_s", "cpu_ram_gib",
              "graph_breaks", "compilations")
RUN_EXTRAS = ("oom", "timeout", "error", "load_s", "wall_s", "compile_s", "choices", "peak_mem_gib_at_failure",
              "reserved_gib_at_failure")


def gpu_tag(device: Any) -> str:
    name = device.get("name", "") if isinstance(device, dict) else str(device or "")
    return next((t.lower() for t in ("H200", "H100", "A100", "L4") if t in name), "gpu")


def variant_key(rec: dict) -> str:
    """A bisection file's key in the merged record: its peer (``ours``, ``unsloth``), then what it ran with
    besides: the MLP in pieces (``_tile4096``), an allocator setting (``_expandable_segments`` for
    ``expandable_segments:True``), a build of the product apart from the others (``engine``, e.g.
    ``_mlp_op`` for the MLP tiled as one operator, kept apart from the runs of earlier builds), the attention
    output kept for the recompute asked for (``_kept_attention``) or refused (``_no_kept_attention``).

    Not a key: exact-size host buffers for the offloaded inputs (``exact_host_buffers``), the product's default
    since they were measured; they change the CPU RAM a run takes, not what the GPU holds, so runs with and
    without them bound each other's edge."""
    key = rec["peer"]
    if rec.get("tile_mlp"):
        key += f"_tile{rec['tile_mlp']}"
    if rec.get("sdpa_kernel") and rec["sdpa_kernel"] != "auto":
        key += f"_sdpa_{rec['sdpa_kernel']}"
    if rec.get("engine"):
        key += f"_{rec['engine']}"
    kept = rec.get("keep_attention")  # True: a try of the flag's first form
    if kept in (True, "on"):
        key += "_kept_attention"
    elif kept == "off":
        key += "_no_kept_attention"
    if rec.get("alloc_conf"):
        key += "_" + re.sub(r"[^a-z0-9]+", "_", rec["alloc_conf"].split(":")[0].lower()).strip("_")
    return key


def _expand(rec: dict, source: str) -> list[dict]:
    """A driver's file as is; one try's file (``lab.long_context try``) as a driver record of that one run;
    an earlier merged file as one driver record per (variant, cap) it holds."""
    if rec.get("kind") != "long_context":
        extra = {} if "runs" in rec else {"max_seq_len": rec["seq_len"] if rec.get("ok") else None}  # one try
        return [{**rec, **extra, "runs": [{**x, "source": source} for x in runs_of(rec)]}]
    out = []
    for b in rec["budgets"]:
        for key in [k[: -len("_runs")] for k in b if k.endswith("_runs") and b[k]]:
            peer = key.split("_", 1)[0]
            out.append({"peer": peer, "cap_gib": b["cap_gib"], "card": b.get("card"),
                        "alloc_conf": b.get(f"{key}_alloc_conf"), "tile_mlp": b.get(f"{key}_tile_mlp"),
                        "sdpa_kernel": b.get(f"{key}_sdpa_kernel"), "engine": b.get(f"{key}_engine"),
                        "exact_host_buffers": b.get(f"{key}_exact_host_buffers"),
                        "keep_attention": b.get(f"{key}_keep_attention"),
                        "stopped": b.get(f"{key}_stopped"), "prediction": b.get(f"{key}_prediction"),
                        "max_seq_len": b.get(f"{key}_max_seq_len"), "edge_found": b.get(f"{key}_edge_found"),
                        "bracket": b.get(f"{key}_bracket"),
                        "memory_account": b.get(f"{key}_memory_account"), "device": rec.get("device"),
                        "versions": (rec.get("versions") or {}).get("unsloth_process") if peer == "unsloth"
                        else {k: v for k, v in (rec.get("versions") or {}).items() if k != "unsloth_process"},
                        "runs": [{**x, "source": x.get("source", source)} for x in b[f"{key}_runs"]]})
    return out


def _combine(recs: list[dict]) -> dict:
    """One variant's files from several calls as one: their runs together, the bracket over all of them."""
    if len(recs) == 1:
        return recs[0]
    runs = sorted((x for r in recs for x in r["runs"]), key=lambda x: x["seq_len"])
    lo, hi = bracket(runs)
    last = recs[-1]
    return {**last, "runs": runs, "max_seq_len": lo or None, "bracket": [lo, hi],
            "edge_found": hi is not None and hi - lo <= STEP and lo > 0,
            "stopped": "edge found" if hi is not None and hi - lo <= STEP else last.get("stopped"),
            "memory_account": next((r["memory_account"] for r in reversed(recs) if r.get("memory_account")), None)}


def merge(files: list[Path], primary: dict[str, str] | None = None) -> dict:
    """The per-(peer, cap) files as one record with a ``budgets`` list, one entry per cap.

    Files of the same variant and cap (several calls, or an earlier merged file) are combined: their
    runs together, each run naming its ``source`` file. ``primary`` names the variant that stands for
    a peer in its plain fields (``{"ours": "ours_expandable_segments"}``: ``ours_max_seq_len`` is that
    variant's, and ``ours_variant`` says so); several, comma-separated, name the first one each cap has
    (``"ours_mlp_op_expandable_segments,ours_expandable_segments"``: the newest build where it ran).
    """
    recs = [e for f in files for e in _expand(json.loads(Path(f).read_text()), Path(f).name)]
    caps = sorted({r["cap_gib"] for r in recs})
    budgets = []
    for cap in caps:
        groups: dict[str, list[dict]] = {}
        for r in recs:
            if r["cap_gib"] == cap:
                groups.setdefault(variant_key(r), []).append(r)
        by = {k: _combine(v) for k, v in groups.items()}
        for peer, wanted in (primary or {}).items():
            variant = next((v for v in wanted.split(",") if v in by), None)
            if variant is not None and variant != peer:
                if peer in by:  # the peer as it ran without a variant keeps its runs, under a key of its own
                    by[f"{peer}_plain"] = by.pop(peer)
                by[peer] = {**by.pop(variant), "variant": variant}
        card = next((r.get("card") for r in by.values() if r.get("card")), None)
        entry: dict[str, Any] = {"label": f"{card or '?'} card, cap {cap:g} GiB", "card": card, "cap_gib": cap}
        for peer in [*PEERS, *sorted(k for k in by if k not in PEERS)]:
            r = by.get(peer, {})
            for knob in ("alloc_conf", "tile_mlp", "sdpa_kernel", "engine", "exact_host_buffers", "keep_attention",
                         "variant"):
                if r.get(knob):
                    entry[f"{peer}_{knob}"] = r[knob]
            runs = sorted(r.get("runs", []), key=lambda x: x["seq_len"])
            entry[f"{peer}_max_seq_len"] = r.get("max_seq_len")
            entry[f"{peer}_edge_found"] = r.get("edge_found")
            entry[f"{peer}_bracket"] = r.get("bracket")
            entry[f"{peer}_stopped"] = r.get("stopped")
            entry[f"{peer}_prediction"] = r.get("prediction")
            if r.get("memory_account"):
                entry[f"{peer}_memory_account"] = r["memory_account"]
            entry[f"{peer}_runs"] = [{**{k: x.get(k) for k in RUN_FIELDS}, **{k: x[k] for k in RUN_EXTRAS if k in x}}
                                     for x in runs]
            if any(x.get("source") for x in runs):
                for y, x in zip(entry[f"{peer}_runs"], runs):
                    y["source"] = x.get("source")
        ours_ok = [x for x in entry["ours_runs"] if x.get("ok")]
        last = max(ours_ok, key=lambda x: x["seq_len"], default={})
        entry["graph_breaks"], entry["compilations"] = last.get("graph_breaks"), last.get("compilations")
        budgets.append(entry)
    device = next((r["device"] for r in recs if r.get("device")), None)
    # ours' process (env.versions) at the top level; Unsloth's own process (its bundle's trl) apart
    versions: dict[str, Any] = dict(next((r["versions"] for r in recs if r["peer"] == "ours" and r.get("versions")),
                                         {}))
    theirs = next((r["versions"] for r in recs if r["peer"] == "unsloth" and r.get("versions")), None)
    if theirs:
        versions.update({k: theirs.get(k) for k in ("unsloth", "unsloth_zoo")}, unsloth_process=theirs)
    return {"kind": "long_context",
            "what": "longest one-document sequence (batch 1, full causal attention) that trains 2 optimizer steps "
                    "of llama-3.1-8b-shape QLoRA (NF4, LoRA r 32 on every linear layer) under a memory cap, ours "
                    "(optimize(max_memory_gib=cap)) against Unsloth (offloaded checkpointing); one process per try",
            "cap_note": CAP_NOTE, "budgets": budgets, "device": device, "versions": versions,
            "sources": [Path(f).name for f in files], **stamp()}
