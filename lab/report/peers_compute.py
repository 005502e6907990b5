"""Issue 20's comparison and trade-off curve, read from ``peers_compute_<gpu>.json`` and the offload files.

Why it exists: issue 20 asks two things of the results: a table of ours against Unsloth at each
compute-bound shape (speed and memory ratios, the 1.1x-at-no-more-memory target), and a plot of
step time against peak memory at 8B, 8 x 1024, one point per setting: ours with checkpointing
off, on, offloaded, with more loss chunks, held to a memory budget by ``optimize()``, and
Unsloth's own points beside them. Both read committed results files only
(:mod:`lab.peers.compute` writes the first; ``lab/gpu/memory/gpu_offload.sh`` the
``kind: offload`` ones); nothing is measured or typed in here. A point says which file it comes
from, because files of different dates measure different code (the plot's legend names them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from qlora_nb_utils.bench.markdown import table_header

__all__ = ["is_compute_file", "is_offload_file", "markdown_table", "tradeoff_points", "plot_tradeoff",
           "TRADEOFF_SHAPE"]

#: The shape of the trade-off plot: model, batch, length (issue 20, deliverable 4).
TRADEOFF_SHAPE = ("llama-3.1-8b-shape", 8, 1024)


def is_compute_file(results: Mapping) -> bool:
    """True for a results dict of :func:`lab.peers.compute.run_compute`."""
    return results.get("kind") == "peers_compute"


def is_offload_file(results: Mapping) -> bool:
    """True for a results dict of ``lab/gpu/memory/gpu_offload.sh``."""
    return results.get("kind") == "offload"


def _f(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _cell(run: Mapping | None) -> str:
    if run is None:
        return "-"
    if "error" in run:
        return "error: " + str(run["error"])[:80].replace("|", "/")
    return (f"{_f(run.get('median_step_ms'), '.1f')} / {_f(run.get('peak_mem_gib'), '.2f')} / "
            f"{_f(run.get('mfu'), '.0f', 100)}%")


def markdown_table(results: Mapping, name: str = "") -> str:
    """Ours against Unsloth per setting: ms / GiB / MFU of each, the ratios, the target, compile s.

    Returns:
        A heading line and the table, ending with a newline.
    """
    dev, ver = results.get("device", {}), results.get("versions", {})
    head = (f"`{name}`: {dev.get('name', '?')}, torch {ver.get('torch')}, {results.get('date')}, "
            f"matmul peak {_f(results.get('peak_tflops'), '.0f')} TFLOP/s (measured); "
            f"target: >= {results.get('target_speedup', 1.1)}x Unsloth's speed at <= its peak memory")
    rows = [head, "", *table_header(["setting", "model, batch x len", "ckpt", "ours run (scope)",
                                     "Unsloth ms / GiB / MFU", "ours ms / GiB / MFU", "speed-up", "memory ratio",
                                     "target met", "compile s ours / Unsloth"])]
    runs = results.get("runs", [])
    for pair in results.get("vs_unsloth", []):
        ours = next((r for r in runs if r.get("setting") == pair["setting"] and r["name"] == pair["ours"]), None)
        uns = next((r for r in runs if r.get("setting") == pair["setting"] and r["name"] == pair["unsloth"]), None)
        held = f", held to {ours['max_memory_gib']:.2f} GiB" if ours and ours.get("max_memory_gib") else ""
        scope = (ours or {}).get("scope") or "-"
        rows.append(
            f"| {pair['setting']} | {str(pair.get('model', '')).replace('-shape', '')}, {pair.get('batch_size')} x "
            f"{pair.get('seq_len')} | {'on' if pair.get('grad_ckpt') else 'off'} | {pair['ours']} ({scope}{held}) "
            f"| {_cell(uns)} | {_cell(ours)} | {_f(pair.get('speedup'), '.2f')}x | {_f(pair.get('mem_ratio'), '.2f')}x "
            f"| {'yes' if pair.get('target_met') else 'no'} "
            f"| {_f((ours or {}).get('compile_s'), '.1f')} / {_f((uns or {}).get('compile_s'), '.1f')} |")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------- the trade-off curve


def _at_shape(model: Any, b: Any, s: Any, shape: Sequence) -> bool:
    return (model, b, s) == tuple(shape)


def _label_compute(run: Mapping) -> str:
    if run.get("library") == "unsloth":
        return "Unsloth, checkpointing " + ("on (offloaded)" if run.get("grad_ckpt") else "off")
    opt = run.get("optimize") or {}
    ck = opt.get("ckpt_layers", "on" if run.get("grad_ckpt") else "off")
    text = f"ours, ckpt {ck}"
    if opt.get("offload") == "True":
        text += " + offload"
    if run.get("max_memory_gib"):
        text += f" (max_memory_gib={run['max_memory_gib']:.2f})"
    return text


def tradeoff_points(compute: Mapping | None, others: Sequence[tuple[str, Mapping]] = (),
                    shape: Sequence = TRADEOFF_SHAPE, compute_name: str = "peers_compute") -> list[dict[str, Any]]:
    """The points of the trade-off plot at ``shape``, from the compute file and the offload files.

    Args:
        compute: the compute results dict (or None).
        others: ``(file name, results)`` of ``kind: offload`` files.
        shape: (model, batch, length).
        compute_name: the compute file's name, shown as the points' source.

    Returns:
        One dict per run that ran at ``shape`` without error: ``label``, ``library`` (``ours`` or
        ``unsloth``), ``source`` (file name and date), ``step_ms``, ``peak_gib``.
    """
    points = []
    if compute:
        src = f"{compute_name} ({str(compute.get('date', ''))[:10]})"
        for r in compute.get("runs", []):
            if "error" in r or not r.get("median_step_ms") or not r.get("peak_mem_gib"):
                continue
            if _at_shape(r.get("model"), r.get("batch_size"), r.get("seq_len"), shape):
                points.append({"label": _label_compute(r), "library": r.get("library", "ours"), "source": src,
                               "step_ms": float(r["median_step_ms"]), "peak_gib": float(r["peak_mem_gib"])})
    for name, res in others:
        if not is_offload_file(res) or not _at_shape(res.get("model"), res.get("batch_size"), res.get("seq_len"),
                                                     shape):
            continue
        src = f"{name} ({str(res.get('date', ''))[:10]})"
        for r in res.get("runs", []):
            if "error" in r or not r.get("median_step_ms") or not r.get("peak_alloc_gib"):
                continue
            points.append({"label": f"ours, {r['name']}", "library": "ours", "source": src,
                           "step_ms": float(r["median_step_ms"]), "peak_gib": float(r["peak_alloc_gib"])})
    return points


def plot_tradeoff(points: Sequence[Mapping], path: str | Path, title: str = "") -> Path:
    """Step time against peak memory, one numbered point per setting; Unsloth's as red crosses.

    Three panels: every point; the low-memory end enlarged (where checkpointing, offload and
    Unsloth crowd together); the numbered list of settings with their file.

    Raises:
        ValueError: no point to plot.
    """
    if not points:
        raise ValueError("no run at the trade-off shape in the given files")
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    sources = sorted({p["source"] for p in points if p["library"] != "unsloth"})
    markers = {src: "osD^v<>ph*Pd"[i % 12] for i, src in enumerate(sources)}  # more files than shapes: cycled
    fig, axes = plt.subplots(1, 3, figsize=(19, 6.5), gridspec_kw={"width_ratios": [1.1, 1.1, 0.9]})
    low = min(p["peak_gib"] for p in points)
    zoom = [p for p in points if p["peak_gib"] <= max(1.6 * low, low + 2.0)]
    for ax, here in ((axes[0], points), (axes[1], zoom)):
        for src in sources:
            mine = [p for p in here if p["source"] == src and p["library"] != "unsloth"]
            ax.scatter([p["peak_gib"] for p in mine], [p["step_ms"] for p in mine], marker=markers[src], s=45,
                       label=f"ours: {src}")
        uns = [p for p in here if p["library"] == "unsloth"]
        if uns:
            ax.scatter([p["peak_gib"] for p in uns], [p["step_ms"] for p in uns], marker="X", s=110,
                       color="tab:red", label=f"Unsloth: {uns[0]['source']}", zorder=3)
        for p in here:
            ax.annotate(str(points.index(p) + 1), (p["peak_gib"], p["step_ms"]), textcoords="offset points",
                        fontsize=8, xytext=(5, 4))
        ax.set_xlabel("peak memory allocated (GiB)")
        ax.set_ylabel("median step (ms)")
        ax.grid(alpha=0.3)
    fig.suptitle(title or "step time against peak memory", fontsize=11)
    axes[0].set_title("every setting", fontsize=10)
    axes[0].legend(fontsize=7, loc="upper right")
    axes[1].set_title(f"the low-memory end (peak <= {max(1.6 * low, low + 2.0):.1f} GiB)", fontsize=10)
    lines = [f"{i}. {p['label']}: {p['step_ms']:.0f} ms, {p['peak_gib']:.2f} GiB  [{p['source']}]"
             for i, p in enumerate(points, 1)]
    axes[2].axis("off")
    axes[2].text(0.0, 1.0, "\n".join(lines), va="top", ha="left", fontsize=7, family="monospace", wrap=True,
                 transform=axes[2].transAxes)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_tradeoff_plot(compute_path: str | Path, results: Mapping, others: Sequence[tuple[str, Mapping]] = (),
                        shape: Sequence = TRADEOFF_SHAPE) -> Path | None:
    """``<compute stem>_tradeoff.png`` beside the compute file; None when no run is at ``shape``.

    Args:
        compute_path: the compute file's path (the PNG goes beside it).
        results: its loaded dict.
        others: ``(file name, results)`` of offload files; when empty, the ``offload_*.json``
            files beside the compute file measured on the same GPU are read.
        shape: (model, batch, length).
    """
    import json

    compute_path = Path(compute_path)
    if not others:
        gpu = compute_path.stem.rsplit("_", 1)[-1]
        others = [(p.name, json.loads(p.read_text())) for p in sorted(compute_path.parent.glob(f"offload_{gpu}*.json"))]
    points = tradeoff_points(results, others, shape, compute_path.name)
    if not points:
        return None
    model, b, s = shape
    dev = results.get("device", {}).get("name", "")
    return plot_tradeoff(points, compute_path.with_name(f"{compute_path.stem}_tradeoff.png"),
                         f"{model}, {b} x {s}, NF4 + LoRA r 16: step time against peak memory ({dev})")
