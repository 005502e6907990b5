"""Reading the compile matrix's results: merge parts, pick the fullest file of a folder, tables.

Why it exists apart from :mod:`qlora_nb_utils.bench.matrix`: running the matrix needs a model,
torch and a GPU; reading its results needs none of them, and the notebooks, the CLI's
``report`` and the tools read far more often than anything runs. What a results file means is
decided here, once: the matrix's axes (:data:`CONFIGS`, :data:`LENGTHS`, :data:`SCOPES`) and
the order of its cells, what an option missing from an older file meant, and :func:`config_lr`,
the one rule for which learning rate a config trains at (``run_matrix`` trains with it, and
:func:`cell_lr` reads it back for files whose cells did not record their ``lr``).
:mod:`qlora_nb_utils.bench.matrix` re-exports every public name, so ``matrix.parity_table`` and
the like keep working.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from .markdown import table_header

__all__ = ["CONFIGS", "LENGTHS", "SCOPES", "cell_lr", "config_lr", "largest_matrix", "markdown_table",
           "merge_results", "parity_table", "summary_frame"]

#: name -> (quant, lora)
CONFIGS = {"base": ("none", False), "lora": ("none", True), "qlora": ("nf4", True)}
LENGTHS = ("fixed", "variable")
SCOPES = ("whole", "regional")

_ORDER = {"config": list(CONFIGS), "grad_ckpt": [False, True], "lengths": list(LENGTHS), "scope": list(SCOPES)}
_SAME = ("model", "steps", "batch_size", "max_len", "dtype", "backend", "mode", "lr", "warmup", "seed",
         "eager_numerics", "base_fp32_master")
#: What an option missing from a part meant (parts written before the option existed).
_OPTION_DEFAULTS = {"eager_numerics": False, "base_fp32_master": False}


def merge_results(results: Iterable[dict[str, Any]], command: str | None = None) -> dict[str, Any]:
    """One matrix result from several runs over parts of the matrix (e.g. one process per config).

    The parts must come from the same device, library versions and options; the cells are put
    in the matrix's order (config, checkpointing, lengths, scope). A cell present twice is an
    error, not silently dropped.

    Args:
        results: `run_matrix` results (dicts, as loaded from their JSON files).
        command: the command that produced all parts (defaults to the first part's).

    Raises:
        ValueError: when there is nothing to merge, the parts disagree on device, versions or
            options, or two parts hold the same cell.
    """
    parts = list(results)
    if not parts:
        raise ValueError("no matrix results to merge")
    first = parts[0]
    for other in parts[1:]:
        if other["device"].get("name") != first["device"].get("name"):
            raise ValueError(f"parts ran on different devices: {first['device'].get('name')} vs {other['device'].get('name')}")
        if other["versions"] != first["versions"]:
            raise ValueError("parts ran with different library versions")
        diff = [k for k in _SAME if other["options"].get(k, _OPTION_DEFAULTS.get(k))
                != first["options"].get(k, _OPTION_DEFAULTS.get(k))]
        if diff:
            raise ValueError(f"parts ran with different options: {diff}")
    # base_lr only acts on base cells: the parts that hold some must agree on it (None: `lr`).
    base_lrs = {p["options"].get("base_lr") for p in parts if any(c["config"] == "base" for c in p["cells"])}
    if len(base_lrs) > 1:
        raise ValueError(f"parts with base cells ran with different base_lr: {sorted(map(str, base_lrs))}")
    cells, seen = [], set()
    for part in parts:
        for cell in part["cells"]:
            key = tuple(cell[k] for k in _ORDER)
            if key in seen:
                raise ValueError(f"cell {dict(zip(_ORDER, key))} appears in more than one part")
            seen.add(key)
            cells.append(cell)
    cells.sort(key=lambda c: tuple(_ORDER[k].index(c[k]) for k in _ORDER))
    merged = {k: v for k, v in first.items() if k != "cells"}
    merged["date"] = min(p["date"] for p in parts)
    merged["command"] = command or first["command"]
    merged["parts"] = len(parts)
    merged["options"] = dict(first["options"], base_lr=next(iter(base_lrs), None))
    merged["cells"] = cells
    return merged


def largest_matrix(folder: str | Path) -> Path | None:
    """The matrix results file (`compile_matrix_<device>.json`) in `folder` with the most cells.

    A folder may hold one file per device, some of them partial runs; the fullest is the one to
    show. None when `folder` holds none or does not exist (the caller says where results live:
    nothing here assumes a folder layout).
    """
    found = sorted(Path(folder).glob("compile_matrix_*.json"))
    return max(found, key=lambda f: len(json.loads(f.read_text())["cells"])) if found else None


def summary_frame(result: dict[str, Any]):
    """The cells as a pandas DataFrame with the columns the notebooks show."""
    import pandas as pd

    cols = ["config", "grad_ckpt", "lengths", "scope", "graph_breaks", "fullgraph_ok", "compilations",
            "max_abs_loss_diff", "peak_mem_gib", "eager_peak_mem_gib", "steady_peak_mem_gib",
            "eager_steady_peak_mem_gib", "median_step_ms", "eager_median_step_ms"]
    frame = pd.DataFrame(result["cells"])
    return frame[[c for c in cols if c in frame]]  # files written before steady peaks lack those two


def config_lr(config: str, lr: float, base_lr: float | None = None) -> float:
    """The learning rate `config` trains at: `base_lr` for the full fine-tune ("base") when given, else `lr`."""
    return base_lr if config == "base" and base_lr is not None else lr


def cell_lr(result: dict[str, Any], cell: dict[str, Any]) -> float:
    """The learning rate `cell` trained with (files written before cells recorded it: the options')."""
    if "lr" in cell:
        return cell["lr"]
    return config_lr(cell["config"], result["options"]["lr"], result["options"].get("base_lr"))


def _per_step(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) for x, y in zip(a, b)]


def _ranges(runs: list[list[float]], max_key: str, mean_key: str) -> dict[str, float | None]:
    """min and max over `runs` of each run's max and mean per-step difference (None without runs)."""
    maxes, means = [max(d) for d in runs], [sum(d) / len(d) for d in runs]
    return {f"{max_key} min": min(maxes, default=None), f"{max_key} max": max(maxes, default=None),
            f"{mean_key} min": min(means, default=None), f"{mean_key} max": max(means, default=None)}


def parity_table(result: dict[str, Any], noise: Iterable[dict[str, Any]] = (), target: float = 5e-3):
    """Loss parity per config: compiled against eager, next to eager against eager.

    For each config of the matrix `result`: the range over its cells of the max and of the mean
    per-step |loss compiled - loss eager| over the run, the cells within `target`, and the same
    two statistics for the eager-vs-eager runs in `noise` (files whose cells' `losses` hold an
    ``"eager"`` run and runs that differ from it in one thing, such as SDPA's kernel or the order
    of a batch's rows) of that config trained at the same learning rate (the fp32-master full fine-tune is the noise
    file's "base-fp32"). A perturbation whose run equals the plain eager run bit for bit (a
    repeat, or a flag that changed nothing) is left out: it is not a second sample of the drift.

    The max over the run is what the parity `target` bounds; the mean says whether a cell's
    difference is of the floor's kind or larger, since one step's spike decides the max.
    Returns a pandas DataFrame indexed by config, in the matrix's config order.
    """
    import pandas as pd

    noise = list(noise)
    rows = {}
    for name in [c for c in CONFIGS if any(cell["config"] == c for cell in result["cells"])]:
        cells = [c for c in result["cells"] if c["config"] == name and c.get("losses") is not None]
        lrs = {cell_lr(result, c) for c in cells}
        steps = [_per_step(c["losses"], c["eager_losses"]) for c in cells]
        floor_name = "base-fp32" if name == "base" and result["options"].get("base_fp32_master") else name
        floors = []
        for n in noise:
            for c in n["cells"]:
                lr = c.get("lr", n["options"]["lr"])  # files before per-cell lr trained every config at one
                if c["config"] != floor_name or lr not in lrs:
                    continue
                eager = c["losses"]["eager"]
                floors += [d for label, run in c["losses"].items() if label != "eager"
                           for d in [_per_step(run, eager)] if max(d) > 0]
        rows[name] = {
            "lr": ", ".join(f"{x:g}" for x in sorted(lrs)), "cells": len(cells),
            **_ranges(steps, "max diff", "mean diff"),
            f"cells within {target:g}": sum(max(d) <= target for d in steps),
            "eager runs": len(floors), **_ranges(floors, "eager max", "eager mean"),
        }
    return pd.DataFrame(rows).T


def markdown_table(path: str | Path) -> str:
    """The cells of a matrix results file as a Markdown table (what the README shows)."""
    res = json.loads(Path(path).read_text())
    steady = any(c.get("eager_steady_peak_mem_gib") is not None for c in res["cells"])
    rows = table_header(["config", "grad ckpt", "lengths", "scope", "breaks", "fullgraph", "compilations",
                         "max loss diff", "peak GiB compiled / eager",
                         *(["steady peak GiB compiled / eager"] if steady else []), "ms/step compiled / eager"])
    for c in res["cells"]:
        mem = f"{c['peak_mem_gib']:.2f} / {c['eager_peak_mem_gib']:.2f}" if c["peak_mem_gib"] is not None else "-"
        if steady:
            mem += (f" | {c['steady_peak_mem_gib']:.2f} / {c['eager_steady_peak_mem_gib']:.2f}"
                    if c.get("steady_peak_mem_gib") is not None else " | -")
        ms = f"{c['median_step_ms']:.1f} / {c['eager_median_step_ms']:.1f}" if c["median_step_ms"] is not None else "-"
        diff = f"{c['max_abs_loss_diff']:.1e}" if c["max_abs_loss_diff"] is not None else "-"
        rows.append(f"| {c['config']} | {'on' if c['grad_ckpt'] else 'off'} | {c['lengths']} | {c['scope']} "
                    f"| {c['graph_breaks']} | {'ok' if c['fullgraph_ok'] else 'FAILS'} | {c['compilations']} "
                    f"| {diff} | {mem} | {ms} |")
    return f"`{Path(path).name}`: {res['device']['name']}, torch {res['versions']['torch']}, {res['date']}, " \
           f"{res['options']['model']} {res['options']['dtype']}, batch {res['options']['batch_size']}, " \
           f"{res['options']['steps']} steps, {len(res['cells'])} cells\n\n" + "\n".join(rows) + "\n"
