"""The FSDP2 1-vs-N-GPU comparison as a Markdown table and a loss PNG, read from ``fsdp2_*.json``.

Why it exists: the README's numbers must be the file's numbers. ``qlora-nb report
lab/results/fsdp/fsdp2_h200.json`` prints the table and writes the loss plot next to the JSON; nothing
here measures or recomputes a figure except the ratio of tokens/s against 1 GPU (the file's
``scaling``). The file is written by ``lab/gpu/fsdp/gpu_fsdp.sh`` from
:func:`qlora_nb_utils.distributed.fsdp_train.compare_runs`; its companion ``fsdp2_*_diag.json`` explains a
past failure and is not a results file, so it is recognised and kept apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qlora_nb_utils.bench.markdown import table_header

__all__ = ["is_fsdp2_file", "is_fsdp2_diag_file", "markdown_table", "write_plot", "sharded_record"]


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

    The same figure ``lab/gpu/fsdp/gpu_fsdp.sh`` draws (:func:`qlora_nb_utils.plots.plot_loss_curves`).

    Returns:
        The paths written (none when the file holds no losses).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import pandas as pd

    from qlora_nb_utils import plots

    rows = [{"run": f"{n} GPU", "step": i, "loss": v}
            for n in _sizes(results) for i, v in enumerate(results["losses"].get(n) or [])]
    if not rows:
        return []
    path = Path(json_path).with_name(f"{Path(json_path).stem}_loss.png")
    fig = plots.plot_loss_curves(pd.DataFrame(rows), path=path,
                                 title=f"{results.get('model')}: 1 vs {results['world_size']} GPUs (FSDP2)")
    plt.close(fig)
    return [path]


def _median(xs: list) -> float | None:
    import statistics

    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _summary(folder: Path) -> dict | None:
    path = Path(folder) / "summary.json"
    import json

    return json.loads(path.read_text()) if path.is_file() else None


def sharded_record(runs: str | Path, probe: str | Path | None = None, big: str | Path | None = None,
                   command: str = "") -> dict:
    """``fsdp2_sharded_<gpu>.json`` from the run folders of ``lab/gpu/fsdp/gpu_fsdp_sharded.sh``.

    Args:
        runs: a folder with ``parity_1`` and ``floor_1`` (1 GPU, global batch G, the floor run
            with the rows of every batch permuted), ``parity_2`` (2 GPUs, global batch G,
            ``--check-bytes``) and ``scaling_1_<i>`` / ``scaling_2_<i>`` (the same per-GPU batch
            on 1 and 2 GPUs, run alone, repeat i).
        probe: the ``nf4_probe`` JSON, kept as ``corruption_probe``.
        big: the ``big_model`` JSON, kept as ``big_model``.
        command: the command line that produced the runs.

    Returns:
        The record (``nf4``, ``world_size``, ``scaling`` = median of ``scaling_runs``,
        ``max_abs_loss_diff``, ``floor_max``, ``within_floor``, ``peak_mem_gib_per_gpu``,
        ``bytes_equal_after_allgather``, ``big_model``, the table fields of :func:`markdown_table`,
        ``device``, ``versions``, ``date``, ``command``, ``missing_runs``); a run that did not
        finish leaves its fields None and is listed in ``missing_runs``.
    """
    import datetime as _dt
    import json

    from qlora_nb_utils.training.parity import judge

    runs = Path(runs)
    names = sorted(p.name for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []
    got = {n: _summary(runs / n) for n in names}
    got = {n: v for n, v in got.items() if v is not None}
    p1, fl, p2 = got.get("parity_1"), got.get("floor_1"), got.get("parity_2")
    repeats = sorted({n.rsplit("_", 1)[1] for n in got if n.startswith("scaling_")})
    pairs = [(got[f"scaling_1_{i}"], got[f"scaling_2_{i}"]) for i in repeats
             if f"scaling_1_{i}" in got and f"scaling_2_{i}" in got]
    ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in pairs if a.get("tokens_per_s") and b.get("tokens_per_s")]
    verdict = judge(p1["losses"], fl["losses"], p2["losses"]) if p1 and fl and p2 else {}
    ref = p2 or next(iter(got.values()), {})
    check = (p2 or {}).get("bytes_check") or {}
    expected = {"parity_1", "floor_1", "parity_2"} | {f"scaling_{n}_{i}" for i in (repeats or ["1"]) for n in (1, 2)}
    return {
        "nf4": "shard" if (p2 or {}).get("nf4") == "shard" else (p2 or {}).get("nf4"),
        "world_size": (p2 or {}).get("world_size", 2),
        "scaling": _median(ratios), "scaling_runs": ratios,
        "scaling_spread": (max(ratios) - min(ratios)) if ratios else None,
        "max_abs_loss_diff": verdict.get("max_abs_loss_diff"),
        "floor_max": verdict.get("floor_max_abs_loss_diff"),
        "within_floor": verdict.get("within_floor"), "steps_over_floor": verdict.get("steps_over_floor"),
        "peak_mem_gib_per_gpu": {"1": _median([a["peak_mem_gib_per_gpu"] for a, _ in pairs]),
                                 "2": _median([b["peak_mem_gib_per_gpu"] for _, b in pairs])},
        "bytes_equal_after_allgather": check.get("equal"), "bytes_check": check or None,
        "big_model": json.loads(Path(big).read_text()) if big and Path(big).is_file() else None,
        "corruption_probe": json.loads(Path(probe).read_text()) if probe and Path(probe).is_file() else None,
        # the fields markdown_table reads (1 vs 2 GPUs at the same per-GPU batch, medians)
        "tokens_per_s": {"1": _median([a["tokens_per_s"] for a, _ in pairs]), "2": _median([b["tokens_per_s"] for _, b in pairs])},
        "per_gpu_batch": {"1": pairs[0][0]["options"]["global_batch_size"] if pairs else None,
                          "2": pairs[0][1]["options"]["global_batch_size"] // 2 if pairs else None},
        "losses": {"1": (p1 or {}).get("losses"), "2": (p2 or {}).get("losses"), "floor_1": (fl or {}).get("losses")},
        "graph_breaks": {"1": (p1 or {}).get("graph_breaks"), "2": (p2 or {}).get("graph_breaks")},
        "compile": {"1": (p1 or {}).get("compile"), "2": (p2 or {}).get("compile")},
        "first_step_s": {"1": (p1 or {}).get("first_step_s"), "2": (p2 or {}).get("first_step_s")},
        "model": ref.get("model"), "dtype": ref.get("dtype"), "seq_len": (ref.get("options") or {}).get("seq_len"),
        "quant_storage": ref.get("quant_storage"), "frozen": ref.get("frozen"),
        "device": ref.get("device"), "versions": ref.get("versions"),
        "run_commands": {n: v.get("command") for n, v in got.items()},
        "command": command, "missing_runs": sorted(expected - set(got)),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }
