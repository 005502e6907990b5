"""The peer comparison as a Markdown table and PNG plots, read from a ``peers_*.json`` file.

Why it exists: the README's numbers must be the file's numbers. ``qlora-nb report
results/peers_h100.json`` prints the table and writes the plots next to the JSON; nothing here
measures or recomputes a figure except ratios between figures of the file (speed-up against
``hf-eager`` at the same shape, and the largest loss difference against it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qlora_nb_utils.bench.markdown import table_header

__all__ = ["is_peers_file", "markdown_table", "write_plots", "loss_diff"]


def is_peers_file(results: dict) -> bool:
    """True for a results dict written by :func:`lab.peers.run_peers`.

    Other results files with runs say what they are (``kind``: the compute job's
    ``peers_compute``, the offload script's ``offload``); a peers file has no ``kind``.
    """
    return isinstance(results.get("runs"), list) and "kind" not in results


def _shape(run: dict) -> tuple[int, int]:
    return int(run["batch_size"]), int(run["seq_len"])


def _baseline(runs: list[dict], shape: tuple[int, int]) -> dict | None:
    return next((r for r in runs if r["name"] == "hf-eager" and _shape(r) == shape and "error" not in r), None)


def loss_diff(run: dict, base: dict | None) -> float | None:
    """Largest |loss difference| over the steps both runs have (None when not comparable)."""
    if base is None or "error" in run or not run.get("losses") or not base.get("losses"):
        return None
    return max(abs(a - b) for a, b in zip(run["losses"], base["losses"]))


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def real_tokens_per_s(results: dict, run: dict) -> float:
    """Non-padding tokens per second of a run, the same count for every peer of a shape.

    Taken from the shape's recorded padding statistics (real tokens over the batches, per step)
    and the run's median step time, so a peer that reports padded tokens/s (Unsloth's runner
    does: batch x length) is put on the same footing; without those statistics the run's own
    `tokens_per_s` is returned.
    """
    shape = results.get("shapes", {}).get(f"{run['batch_size']}x{run['seq_len']}", {})
    pad = shape.get("padding")
    if not pad or not pad.get("batches"):
        return float(run["tokens_per_s"])
    return pad["real_tokens"] / pad["batches"] / (run["median_step_ms"] / 1000.0)


def markdown_table(results: dict, name: str = "") -> str:
    """The Markdown table of a peers results dict: one row per run, grouped by shape.

    Args:
        results: the loaded JSON.
        name: the file name shown in the heading line.

    Returns:
        A heading line and the table, ending with a newline.
    """
    dev, ver = results["device"], results["versions"]
    head = (f"`{name}`: {dev.get('name', '?')}, torch {ver.get('torch')}, {results['date']}, "
            f"{results['model']} {results.get('dtype', '')}, matmul peak {results['peak_tflops']:.1f} TFLOP/s (measured)")
    rows = [head, "", *table_header(["name", "batch x seq", "ms/step", "speedup vs hf-eager", "real tokens/s", "MFU",
                                     "peak GiB", "compile s", "max loss diff vs hf-eager"])]
    runs = results["runs"]
    for shape in sorted({_shape(r) for r in runs}, key=lambda s: (s[0] * s[1], s)):
        base = _baseline(runs, shape)
        for r in (r for r in runs if _shape(r) == shape):
            label = f"{shape[0]} x {shape[1]}"
            if "error" in r:
                rows.append(f"| {r['name']} | {label} | error: {r['error'][:160].replace('|', '/')} |" + " |" * 6)
                continue
            speed = base["median_step_ms"] / r["median_step_ms"] if base else None
            mfu = None if r.get("mfu") is None else 100 * r["mfu"]
            rows.append(
                f"| {r['name']} | {label} | {r['median_step_ms']:.1f} | {_fmt(speed, '.2f')}x "
                f"| {real_tokens_per_s(results, r):.0f} | {_fmt(mfu, '.1f')}% | {r['peak_mem_gib']:.2f} "
                f"| {_fmt(r.get('compile_s'), '.1f')} | {_fmt(loss_diff(r, base), '.1e')} |")
    pads = [f"{k}: {100 * v['padding']['waste_fraction']:.0f}%" for k, v in results.get("shapes", {}).items()
            if "padding" in v]
    if pads:
        rows += ["", "Padding share of the tokens per shape (real tokens/s counts only the others): " + ", ".join(pads)]
    return "\n".join(rows) + "\n"


def write_plots(results: dict, json_path: str | Path) -> list[Path]:
    """Write ``<stem>_loss_curves.png``, ``<stem>_step_ms.png``, ``<stem>_peak_mem.png`` next to the JSON.

    One panel per shape; runs with an error are left out of the panels (the table shows them).

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    json_path = Path(json_path)
    runs = [r for r in results["runs"] if "error" not in r]
    shapes = sorted({_shape(r) for r in runs}, key=lambda s: (s[0] * s[1], s))
    if not shapes:
        return []
    written = []
    for kind in ("loss_curves", "step_ms", "peak_mem"):
        fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            here = [r for r in runs if _shape(r) == shape]
            if kind == "loss_curves":
                for i, r in enumerate(here):
                    ax.plot(range(len(r["losses"])), r["losses"], ["-", "--", ":", "-."][i % 4], marker="o", ms=2,
                            label=r["name"])
                ax.set_xlabel("optimizer step")
                ax.set_ylabel("training loss")
                ax.legend(fontsize=8)
            else:
                key, label = ("median_step_ms", "median step (ms)") if kind == "step_ms" else ("peak_mem_gib", "peak memory (GiB)")
                bars = ax.bar([r["name"] for r in here], [r[key] for r in here], color="tab:blue")
                ax.bar_label(bars, fmt="%.3g", fontsize=8)
                ax.set_ylabel(label)
                ax.tick_params(axis="x", rotation=45, labelsize=8)
            ax.set_title(f"{results['model']}, {shape[0]} x {shape[1]}")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = json_path.with_name(f"{json_path.stem}_{kind}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
