"""``python -m lab.index``: every results file as rows of one tidy table, and the pages made from it.

Why it exists: each results file has the shape of the run that wrote it (a peers file, a packing
benchmark, an FSDP2 record, a profile), and a reader per shape does not scale past a few files.
This module reads them all the same way: the file's own record (device, date, versions, command,
the code's commit where the file names one) and one row per measured number, with the
configuration it was measured at (the path of names that leads to it: run, variant, shape, ...).
``lab/results/index.csv`` is that table, committed; ``lab/RESULTS.md`` and the README's headline
table are generated from it, and ``tests/lab/test_index.py`` regenerates all three and compares.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from lab import pages
from lab.paths import RESULTS, ROOT

INDEX = RESULTS / "index.csv"
COLUMNS = ("topic", "source", "device", "date", "commit", "versions", "configuration", "metric", "value")

#: the numbers a row is made of: times, rates, memory, losses and their differences, counts of
#: compilations and breaks, speed-ups. Anything else (seeds, sizes, settings) is configuration.
METRIC = re.compile(
    r"(_ms|_s|_gib|_gb|_mib|tokens_per_s|tok_s|tok_per_s|mfu|speedup|_x|loss|loss_diff|_diff|compilations|"
    r"graph_breaks|recompilations|tflops|_ratio|_share|_fraction|waste|max_seq_len)(_per_gpu)?$"
    r"|^(speedup|scaling|vs_[a-z_]+)$")
#: numbers that match METRIC but are settings or listings, not results: targets and memory limits
#: asked for, memory caps set, the device's total memory, and cProfile's per-function listing of an import
NOT_METRIC = re.compile(r"^(target|max_memory|total_mem|budget|cap_)|^(self_s|cumulative_s)$")
#: keys whose value names a container in a configuration path
#: containers of per-step or per-kernel listings: their numbers are in the file, not in the table
LISTINGS = {"history", "timeline", "steps", "losses", "top_self_cuda", "top_self_cpu", "kernels", "top"}
NAME_KEYS = ("setting", "name", "ours", "peer", "variant", "library", "run", "arm", "case", "label", "shape",
             "mode", "scope")
VERSION_KEYS = ("torch", "transformers", "peft", "bitsandbytes", "triton", "cuda")


def _device(record: dict) -> str:
    dev = record.get("device")
    if isinstance(dev, dict):
        name, count = dev.get("name") or dev.get("type") or "", dev.get("count") or dev.get("gpus")
        return f"{count} x {name}" if isinstance(count, int) and count > 1 else str(name)
    if isinstance(dev, list):
        return " + ".join(sorted({_device({"device": d}) for d in dev}))
    return str(dev or "")


def _versions(record: dict) -> str:
    versions = record.get("versions")
    if not isinstance(versions, dict):
        return ""
    return " ".join(f"{k}={versions[k]}" for k in VERSION_KEYS if versions.get(k))


def _commit(record: dict) -> str:
    """The code's commit(s) the file names (hex ids found under a commit-like key), else ""."""
    for key in ("commit", "git_commit", "code_commit", "code_at", "code_at_calls"):
        if key in record:
            found = re.findall(r"\b[0-9a-f]{7,40}\b", json.dumps(record[key]))
            return " ".join(dict.fromkeys(h[:7] for h in found))
    return ""


def _label(item: Any, index: int) -> str:
    if isinstance(item, dict):
        parts = [str(item[k]) for k in NAME_KEYS if isinstance(item.get(k), (str, int)) and k != "shape"]
        for size in ("batch_size", "seq_len"):
            if isinstance(item.get(size), int):
                parts.append(f"{size[0]}{item[size]}")
        if parts:
            return " ".join(parts)
    return str(index)


def _stamp(node: dict, stamp: dict[str, str]) -> dict[str, str]:
    """The device, date and versions a nested record states for itself (a run merged into a file
    written on another day keeps its own: its ``date``, else its ``call_date``), over those of the records
    around it."""
    own = {}
    # a row merged from an earlier call keeps that call's date (``call_date``) when it has no ``date`` of its own
    date = node.get("date") if isinstance(node.get("date"), str) else node.get("call_date")
    if isinstance(date, str) and re.match(r"\d{4}-\d{2}-\d{2}", date):
        own["date"] = date[:10]
    if isinstance(node.get("device"), (dict, list)):  # a string is often a setting ("cuda"), not a record's card
        own["device"] = _device(node)
    if isinstance(node.get("versions"), dict):
        own["versions"] = _versions(node)
    return {**stamp, **own}


def _leaves(node: Any, path: tuple[str, ...], stamp: dict[str, str] | None = None
            ) -> Iterator[tuple[tuple[str, ...], str, float, dict[str, str]]]:
    stamp = stamp or {}
    if isinstance(node, dict):
        stamp = _stamp(node, stamp)
        for key, value in node.items():
            if isinstance(value, bool):
                continue
            is_metric = METRIC.search(str(key)) and not NOT_METRIC.search(str(key))
            if isinstance(value, (int, float)) and is_metric:
                yield path, str(key), float(value), stamp
            elif is_metric and isinstance(value, dict) and value and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
                for sub, v in value.items():  # e.g. peak_mem_gib_per_gpu {"1": .., "2": ..}: one row per entry
                    yield path, f"{key}.{sub}", float(v), stamp
            elif isinstance(value, (dict, list)) and key not in LISTINGS:
                yield from _leaves(value, path + (str(key),), stamp)
    elif isinstance(node, list):
        labels = [_label(item, i) for i, item in enumerate(node)]
        for i, (item, label) in enumerate(zip(node, labels)):
            if isinstance(item, (dict, list)):
                unique = label if labels.count(label) == 1 else f"{label} #{i}"
                yield from _leaves(item, path + (unique,), stamp)


def rows_of(path: Path) -> list[dict[str, str]]:
    """One row per measured number of the results file ``path`` (a JSON object)."""
    record = json.loads(path.read_text())
    if not isinstance(record, dict):
        raise ValueError(f"{path}: a results file is a JSON object, not a {type(record).__name__}")
    base = {"topic": path.parent.name, "source": path.relative_to(ROOT).as_posix(), "device": _device(record),
            "date": str(record.get("date", ""))[:10], "commit": _commit(record), "versions": _versions(record)}
    rows = []
    for where, metric, value, stamp in _leaves(record, ()):
        rows.append({**base, **stamp, "configuration": "/".join(where), "metric": metric, "value": f"{value:.6g}"})
    return rows


def build_index(results: Path = RESULTS) -> list[dict[str, str]]:
    """The rows of every ``results/<topic>/*.json``, in path order."""
    rows = []
    for path in sorted(results.glob("*/*.json")):
        rows.extend(rows_of(path))
    return rows


def index_csv(rows: list[dict[str, str]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def read_index(path: Path = INDEX) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.index", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with what is committed; write nothing")
    args = parser.parse_args(argv)
    rows = build_index()
    wanted = {INDEX: index_csv(rows), pages.RESULTS_MD: pages.results_md(rows),
              pages.README: pages.readme_with_headline(pages.README.read_text(), rows)}
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        wanted[nb] = pages.notebook_with_badge(nb.read_text(), nb.name)
    stale = [p for p, text in wanted.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"stale: {p.relative_to(ROOT)} (run python -m lab.index)", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
        print(f"wrote {p.relative_to(ROOT)}")
    print(f"{len(rows)} rows from {len({r['source'] for r in rows})} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
