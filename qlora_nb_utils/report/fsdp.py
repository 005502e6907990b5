"""The FSDP2 1-vs-N-GPU comparison as a Markdown table and a loss PNG, read from ``fsdp2_*.json``.

Why it exists: the README's numbers must be the file's numbers. ``qlora-nb report
results/fsdp2_h200.json`` prints the table and writes the loss plot next to the JSON; nothing
here measures or recomputes a figure except the ratio of tokens/s against 1 GPU (the file's
``scaling``). The file is written by ``scripts/gpu/gpu_fsdp.sh`` from
:func:`qlora_nb_utils.distributed.fsdp_train.compare_runs`; its companion ``fsdp2_*_diag.json`` explains a
past failure and is not a results file, so it is recognised and kept apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .markdown import table_header

__all__ = ["is_fsdp2_file", "is_fsdp2_diag_file", "markdown_table", "write_plot"]


def is_fsdp2_file(results: dict) -> bool:
    """True for a results dict written by :func:`qlora_nb_utils.distributed.fsdp_train.compare_runs`."""
    return ("world_size" in results and isinstance(results.get("tokens_per_s"), dict)
            and isinstance(results.get("losses"), dict))


def is_fsdp2_diag_file(results: dict) -> bool:
    """True for an FSDP2 diagnostic record (``fsdp2_*_diag.json``): findings, not a run to tabulate."""
    return not is_fsdp2_file(results) and any(k.startswith("diag_") for k in results)


def _sizes(results: dict) -> list[str]:
    return sorted(results["tokens_per_s"], key=int)


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(results: dict, name: str = "") -> str:
    """The Markdown table of an FSDP2 results dict: one row per world size.

    Args:
        results: the loaded JSON.
        name: the file name shown in the heading line.

    Returns:
        A heading line, the table and the loss-parity line, ending with a newline.
    """
    dev, ver = results.get("device", {}), results.get("versions", {})
    versions = ", ".join(f"{k} {ver[k]}" for k in ("torch", "transformers", "peft", "bitsandbytes") if k in ver)
    head = (f"`{name}`: {dev.get('name', results.get('device_name', '?'))}, {versions}, {results.get('date')}, "
            f"{results.get('model')} {results.get('dtype', '')}, seq len {results.get('seq_len')}, "
            f"NF4 {results.get('nf4')} (quant storage {results.get('quant_storage')})")
    rows = [head, "", *table_header(["GPUs", "per-GPU batch", "tokens/s", "scaling vs 1 GPU", "peak GiB per GPU",
                                     "graph breaks", "compilations", "first step s"])]
    tps = results["tokens_per_s"]
    for n in _sizes(results):
        scaling = tps[n] / tps["1"] if tps.get("1") and tps[n] else None
        breaks = (results.get("graph_breaks", {}).get(n) or {}).get("total")
        compiles = (results.get("compile", {}).get(n) or {}).get("compilations")
        rows.append(
            f"| {n} | {_fmt(results.get('per_gpu_batch', {}).get(n), 'd')} | {_fmt(tps[n], '.0f')} "
            f"| {_fmt(scaling, '.2f')}x | {_fmt(results.get('peak_mem_gib_per_gpu', {}).get(n), '.2f')} "
            f"| {_fmt(breaks, 'd')} | {_fmt(compiles, 'd')} | {_fmt(results.get('first_step_s', {}).get(n), '.1f')} |")
    n_max = _sizes(results)[-1]
    steps = min((len(v) for v in results["losses"].values()), default=0)
    rows += ["", f"Max |loss diff| 1 vs {n_max} GPUs over the {steps} steps: "
                 f"{_fmt(results.get('max_abs_loss_diff'), '.1e')}"]
    if results.get("scaling_baseline"):
        rows.append(f"1-GPU tokens/s, peak GiB and batch from: {results['scaling_baseline']}")
    return "\n".join(rows) + "\n"


def write_plot(results: dict, json_path: str | Path) -> list[Path]:
    """Write ``<stem>_loss.png`` next to the JSON: the loss per step of each world size, |diff| beneath.

    The same figure ``scripts/gpu/gpu_fsdp.sh`` draws (:func:`qlora_nb_utils.report.plots.plot_loss_curves`).

    Returns:
        The paths written (none when the file holds no losses).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import pandas as pd

    from . import plots

    rows = [{"run": f"{n} GPU", "step": i, "loss": v}
            for n in _sizes(results) for i, v in enumerate(results["losses"].get(n) or [])]
    if not rows:
        return []
    path = Path(json_path).with_name(f"{Path(json_path).stem}_loss.png")
    fig = plots.plot_loss_curves(pd.DataFrame(rows), path=path,
                                 title=f"{results.get('model')}: 1 vs {results['world_size']} GPUs (FSDP2)")
    plt.close(fig)
    return [path]
