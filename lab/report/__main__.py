"""``python -m lab.report FILE...``: Markdown tables (and PNG plots beside each file) of any results file.

Why it exists: the README's and ``lab/RESULTS.md``'s numbers must be the files' numbers. It reads
every kind the lab writes (bench, compile matrix, peers, packing, FSDP2, compute-bound peers and
their offload points) and dispatches to the reader of each; ``qlora-nb report`` in the product
reads only the two kinds the product itself writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _kind(path: str, results: dict) -> str | None:
    """Which results file this is ("bench", "matrix", "packing", "peers", "fsdp2"); None for an FSDP2 diagnostic.

    Raises:
        ValueError: for a JSON that is none of these, naming the file (rather than a KeyError later).
    """
    from lab.report import fsdp as fsdp_report
    from lab.report import peers as peers_report

    if not isinstance(results, dict):
        raise ValueError(f"{path}: not a results file (a JSON {type(results).__name__}, expected an object)")
    if results.get("kind") in ("peers_compute", "offload"):
        return results["kind"]  # the compute-bound peers file (its table and trade-off plot), and the offload points it plots
    if results.get("kind") == "fast_path" or ("optimize" in results and "runs" in results):
        return "bench"  # the three-run main job (one call, or gathered calls of several shapes)
    from lab.report import packing as packing_report

    if packing_report.is_packing_file(results):
        return "packing"  # the packing benchmark (its runs carry packed/library/data)
    if peers_report.is_peers_file(results):
        return "peers"
    if "cells" in results:
        return "matrix"
    if fsdp_report.is_fsdp2_file(results):
        return "fsdp2"
    if isinstance(results.get("eager"), dict) and isinstance(results.get("compiled"), dict):
        return "bench"
    if fsdp_report.is_fsdp2_diag_file(results):
        return None
    if results.get("partial"):
        raise ValueError(f"{path}: a partial FSDP2 results file (finished runs: {results.get('finished_runs')}, "
                         f"missing: {results.get('missing_runs')}); nothing to compare")
    raise ValueError(f"{path}: not a results file of qlora-nb bench, matrix.run_matrix, peers.run_peers or "
                     f"lab/gpu/fsdp/gpu_fsdp.sh (FSDP2); its keys are {sorted(results)[:8]}")


def report(files: list[str]) -> int:
    from lab.report import fsdp as fsdp_report
    from lab.report import peers as peers_report
    from qlora_nb_utils.bench import main_job as bench
    from qlora_nb_utils.bench import matrix
    from qlora_nb_utils.plots import load_results

    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"results file(s) not found: {', '.join(missing)}")
    loaded = {f: load_results(f) for f in files}
    kinds = {f: _kind(f, r) for f, r in loaded.items()}
    for f in (f for f, kind in kinds.items() if kind is None):
        print(f"skipped {f}: an FSDP2 diagnostic record, not a results file", file=sys.stderr)
    benches = [f for f, kind in kinds.items() if kind == "bench"]
    if benches:
        print(bench.markdown_table(benches), end="")
    for f in (f for f, kind in kinds.items() if kind == "matrix"):
        print("\n" + matrix.markdown_table(f), end="")
    for f in (f for f, kind in kinds.items() if kind == "peers"):
        print("\n" + peers_report.markdown_table(loaded[f], Path(f).name), end="")
        for png in peers_report.write_plots(loaded[f], f):
            print(f"wrote {png}", file=sys.stderr)
    for f in (f for f, kind in kinds.items() if kind == "fsdp2"):
        print("\n" + fsdp_report.markdown_table(loaded[f], Path(f).name), end="")
        for png in fsdp_report.write_plot(loaded[f], f):
            print(f"wrote {png}", file=sys.stderr)
    _report_compute(loaded, kinds)
    _report_packing(loaded, kinds)
    return 0


def _report_packing(loaded: dict, kinds: dict) -> None:
    """The packing benchmark's tables, targets and trade-off plot (written next to each file)."""
    from lab.report import packing as packing_report

    for f in (f for f, kind in kinds.items() if kind == "packing"):
        print("\n" + packing_report.markdown_table(loaded[f], Path(f).name), end="")
        png = packing_report.write_plot(loaded[f], f)
        print(f"wrote {png}" if png else f"{f}: no run without an error, no plot", file=sys.stderr)


def _report_compute(loaded: dict, kinds: dict) -> None:
    """The compute-bound peers' table and trade-off plot (with the offload files named beside it, else those next to it)."""
    from lab.report import peers_compute

    offload = [(Path(f).name, loaded[f]) for f, kind in kinds.items() if kind == "offload"]
    for f in (f for f, kind in kinds.items() if kind == "peers_compute"):
        print("\n" + peers_compute.markdown_table(loaded[f], Path(f).name), end="")
        png = peers_compute.write_tradeoff_plot(f, loaded[f], offload)
        print(f"wrote {png}" if png else f"{f}: no run at the trade-off shape, no plot", file=sys.stderr)
    if offload and "peers_compute" not in kinds.values():
        print("offload files are plotted with a peers_compute file (python -m lab.report peers_compute_<gpu>.json ...)",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.report", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="results files (for a peers, packing, FSDP2 or compute file the "
                        "PNG plots are written next to it; an FSDP2 diagnostic file is skipped with a note)")
    args = parser.parse_args(argv)
    try:
        return report(args.files)
    except (FileNotFoundError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
