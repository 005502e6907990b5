"""Figures for the notebooks and reports, drawn from what a run recorded.

A plot must never recompute what it shows: it reads a history DataFrame or a results JSON
written by a real run, so that a figure pasted into a report is exactly the numbers in the
committed file. Each function takes either form, returns the matplotlib Figure, and saves it
when given a path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import pandas as pd

__all__ = ["load_results", "loss_frame", "plot_loss_curves", "plot_fast_path", "plot_step_time", "plot_memory"]


def load_results(source: str | Path | Mapping) -> dict:
    """Read a results JSON (or pass a dict through).

    Raises:
        FileNotFoundError: when the file does not exist.
        ValueError: when the file is not JSON.
    """
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"results file not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def _runs_of(results: Mapping) -> dict[str, Mapping]:
    runs = {k: results[k] for k in ("eager", "compiled") if isinstance(results.get(k), Mapping)}
    if not runs:
        raise ValueError("results hold no 'eager' or 'compiled' run")
    return runs


def loss_frame(data: pd.DataFrame | str | Path | Mapping) -> pd.DataFrame:
    """Long-format losses (`run`, `step`, `loss`) from a history DataFrame or results.

    Args:
        data: a DataFrame with `run`, `step`, `loss` columns (as `train.train` returns,
            concatenated over runs), or a results JSON path/dict with per-run `losses`.
    """
    if isinstance(data, pd.DataFrame):
        missing = {"run", "step", "loss"} - set(data.columns)
        if missing:
            raise ValueError(f"history lacks columns {sorted(missing)}")
        return data[["run", "step", "loss"]]
    rows = [
        {"run": name, "step": i, "loss": loss}
        for name, run in _runs_of(load_results(data)).items()
        for i, loss in enumerate(run["losses"])
    ]
    return pd.DataFrame(rows)


def _finish(fig, path: str | Path | None):
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def plot_loss_curves(data, *, title: str | None = None, path: str | Path | None = None):
    """Eager and compiled loss per step on one figure, with |difference| beneath.

    Args:
        data: see `loss_frame`.
        title: figure title; defaults to the model name when the results carry one.
        path: save the PNG there too.

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    frame = loss_frame(data)
    runs = list(dict.fromkeys(frame["run"]))
    fig, (ax, axd) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        part = frame[frame["run"] == run]
        ax.plot(part["step"], part["loss"], styles[i % len(styles)], marker="o", ms=3, label=run)
    ax.set_ylabel("training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    if len(runs) >= 2:
        wide = frame.pivot_table(index="step", columns="run", values="loss")
        diff = (wide[runs[1]] - wide[runs[0]]).abs()
        axd.plot(diff.index, diff.values, color="tab:red")
        axd.set_ylabel(f"|{runs[1]} - {runs[0]}|")
        axd.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    axd.set_xlabel("optimizer step")
    axd.grid(alpha=0.3)
    if title is None and not isinstance(data, pd.DataFrame):
        title = f"{load_results(data).get('model', '')}: eager vs compiled"
    if title:
        ax.set_title(title)
    return _finish(fig, path)


def _bar(values: Mapping[str, float], ylabel: str, title: str, path):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = list(values)
    bars = ax.bar(names, [values[n] for n in names], color=["tab:blue", "tab:orange", "tab:green", "tab:red"][: len(names)])
    ax.bar_label(bars, fmt="%.3g")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return _finish(fig, path)


def plot_step_time(results, *, path: str | Path | None = None):
    """Median steady-state step time per run, as bars (compile time is not in it)."""
    runs = _runs_of(load_results(results))
    return _bar({k: v["median_step_ms"] for k, v in runs.items()}, "median step time (ms)", "step time, after warm-up", path)


def plot_memory(results, *, path: str | Path | None = None):
    """Peak memory per run, as bars."""
    res = load_results(results)
    runs = _runs_of(res)
    return _bar({k: v["peak_mem_gib"] for k, v in runs.items()}, "peak memory (GiB)", "peak memory", path)


def plot_fast_path(results: Mapping, *, path: str | Path | None = None):
    """The main job's figure: the loss of each run, and the fast path's parity against the floor.

    Top: per-step loss of ``hf-eager``, ``plain-compile``, ``fast-eager`` (the recipe uncompiled)
    and ``fast``. Bottom: ``|fast - fast-eager|`` beside the floor ``|fast-eager permuted -
    fast-eager|`` (the same examples, rows in another order) and the two limits the verdict judges
    by (:func:`qlora_nb_utils.training.parity.judge`): every step at most ``max_factor`` x the
    floor's largest (solid), and the run's mean (dotted, red) at most ``mean_factor`` x the floor's
    mean (dotted, gray). The panel's title is the verdict, with both limits
    (:func:`~qlora_nb_utils.training.parity.verdict_text`).

    Args:
        results: a ``qlora-nb bench`` results dict (with ``runs`` and ``history``).
        path: save the PNG there too.

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    from .training.parity import MAX_FACTOR, MEAN_FACTOR, limits, verdict_text

    hist = results["history"]
    fig, (ax, axd) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for name, style in (("hf-eager", "-"), ("plain-compile", "--"), ("fast-eager", ":"), ("fast", "-.")):
        if name in hist:
            ax.plot(hist[name]["step"], hist[name]["loss"], style, marker="o", ms=3, label=name)
    ax.set_ylabel("training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fast = next(r for r in results["runs"] if r["name"] == "fast")
    steps = list(range(len(fast["diffs"])))
    max_limit, mean_limit = limits(fast)
    max_factor, mean_factor = fast.get("max_factor", MAX_FACTOR), fast.get("mean_factor", MEAN_FACTOR)
    axd.plot(steps, fast["diffs"], color="tab:red", marker="o", ms=3, label="|fast - fast-eager|")
    axd.plot(steps, fast["floor_diffs"], color="tab:gray", marker=".", ms=3, label="floor: rows permuted")
    axd.axhline(fast["floor_max_abs_loss_diff"], color="tab:gray", ls="--", lw=1, label="floor max")
    axd.axhline(max_limit, color="black", ls="-", lw=1, label=f"limit: {max_factor:g} x floor max")
    axd.axhline(fast["mean_abs_loss_diff"], color="tab:red", ls=":", lw=1, label="mean |fast - fast-eager|")
    axd.axhline(mean_limit, color="tab:gray", ls=":", lw=1.5, label=f"mean limit: {mean_factor:g} x floor mean")
    axd.set_title(verdict_text(fast).replace("; ", ";\n"), fontsize=8)
    axd.set_ylabel("|loss difference|")
    axd.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    axd.set_xlabel("optimizer step")
    top = max([max_limit, mean_limit, *fast["diffs"], *fast["floor_diffs"]])
    if top > 0:  # room above the highest line for the legend
        axd.set_ylim(0, 1.6 * top)
    axd.legend(fontsize=7, ncol=3, loc="upper left")
    axd.grid(alpha=0.3)
    device = results.get("device", {}).get("name", "")
    fig.suptitle(f"{results.get('model', '')} on {device}: fast path "
                 f"{'within' if fast.get('within_floor') else 'OUTSIDE'} the floor")
    return _finish(fig, path)
