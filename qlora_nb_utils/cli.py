"""`qlora-nb`: the command line for what the notebooks do, for scripts and CI.

`qlora-nb bench` is the main job: the same QLoRA fine-tune eager and compiled, side by
side, a table on the terminal and `results.json` + a loss-curve PNG in `--out`.
`qlora-nb diagnose` reports graph breaks, the `fullgraph=True` verdict and compilations over
a list of sequence lengths; with `--strict` it fails (exit 1) on any break, a failed
fullgraph compile, or more compilations than `--max-compilations`, so CI can guard it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

#: models.ATTN_CHOICES, repeated so that `--help` imports no torch (tests/test_bench.py checks they agree)
ATTN_CHOICES = ("sdpa", "eager", "flex_attention")

__all__ = ["main", "build_parser"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seq_lens(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not lens or min(lens) < 2:
        raise argparse.ArgumentTypeError(f"sequence lengths must be integers >= 2, got {text!r}")
    return lens


def _add_model_args(p: argparse.ArgumentParser, default_model: str) -> None:
    p.add_argument("--model", default=default_model,
                   help="tiny, smollm2-135m, llama-3.2-1b-shape, llama-3.2-1b-shape-4l, "
                        "llama-3.1-8b-shape, an HF id or a path")
    p.add_argument("--quant", choices=("nf4", "none"), default="nf4")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--batch-size", type=_positive_int, default=4)
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="qlora-nb", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="eager vs compiled QLoRA fine-tune, side by side")
    _add_model_args(b, "smollm2-135m")
    b.add_argument("--steps", type=_positive_int, default=30)
    b.add_argument("--seq-len", type=_positive_int, default=128)
    b.add_argument("--padding", choices=("fixed", "multiple", "longest"), default="fixed")
    b.add_argument("--lr", type=float, default=2e-4)
    b.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    b.add_argument("--mode", default=None, help="torch.compile mode (default, reduce-overhead, max-autotune, ...)")
    b.add_argument("--backend", default="inductor")
    b.add_argument("--data", default=None, help="a JSONL file with prompt/response (default: the shipped KJV set)")
    b.add_argument("--out", default="out", help="folder for results.json and loss_curves.png")
    b.add_argument("--no-progress", action="store_true")

    d = sub.add_parser("diagnose", help="graph breaks, fullgraph check, compilations over sequence lengths")
    _add_model_args(d, "tiny")
    d.add_argument("--no-lora", action="store_true", help="the base model without adapters")
    d.add_argument("--grad-ckpt", action="store_true", help="enable gradient checkpointing the way users do")
    d.add_argument("--regional", action="store_true", help="compile each decoder layer instead of the whole model")
    d.add_argument("--no-patches", action="store_true", help="report upstream as it is, without prepare_for_compile")
    d.add_argument("--attn", default="sdpa", choices=ATTN_CHOICES,
                   help="attention implementation (flex_attention trains on CUDA only)")
    d.add_argument("--causal-attn", action="store_true",
                   help="causal-only --attn (sdpa or flex_attention) without the padding mask, as "
                   "qlora_nb_utils.ops.attention.use_causal_attention; the batches are right-padded")
    d.add_argument("--flex-block-mask", default="graph", choices=["graph", "precomputed"],
                   help="with --attn flex_attention: build the BlockMask in the compiled graph (graph) or pass "
                   "each batch the causal BlockMask built outside it (precomputed; right-padded batches)")
    d.add_argument("--seq-lens", type=_seq_lens, default=[64], help="comma-separated, e.g. 64,80,96")
    d.add_argument("--max-compilations", type=_positive_int, default=2)
    d.add_argument("--backend", default="inductor", help="backend of the run over --seq-lens (breaks are backend-independent)")
    d.add_argument("--json", dest="json_path", default=None, help="also write the report here")
    d.add_argument("--strict", action="store_true", help="exit 1 on any break, fullgraph failure or too many compilations")
    r = sub.add_parser("report", help="Markdown tables of bench, matrix, peers and FSDP2 results files (peers, FSDP2: "
                       "plots too)")
    r.add_argument("files", nargs="+", help="results files written by qlora-nb bench, matrix.run_matrix, peers.run_peers "
                   "or scripts/gpu/gpu_fsdp.sh (for a peers or FSDP2 file the PNG plots are written next to it; an FSDP2 "
                   "diagnostic file is skipped with a note)")
    return parser


def _kind(path: str, results: dict) -> str | None:
    """Which results file this is ("bench", "matrix", "peers", "fsdp2"); None for an FSDP2 diagnostic.

    Raises:
        ValueError: for a JSON that is none of these, naming the file (rather than a KeyError later).
    """
    from .report import fsdp as fsdp_report
    from .report import peers as peers_report

    if not isinstance(results, dict):
        raise ValueError(f"{path}: not a results file (a JSON {type(results).__name__}, expected an object)")
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
                     f"scripts/gpu/gpu_fsdp.sh (FSDP2); its keys are {sorted(results)[:8]}")


def _report(args: argparse.Namespace) -> int:
    from .bench import main_job as bench
    from .bench import matrix
    from .report import fsdp as fsdp_report
    from .report import peers as peers_report
    from .report.plots import load_results

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"results file(s) not found: {', '.join(missing)}")
    loaded = {f: load_results(f) for f in args.files}
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
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import main_job as bench

    results = bench.run_bench(
        progress=not args.no_progress, command=args.command_line,
        model=args.model, quant=args.quant, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        padding=args.padding, device=args.device, dtype=args.dtype, lr=args.lr, warmup=args.warmup,
        seed=args.seed, mode=args.mode, backend=args.backend, data=args.data,
    )
    paths = bench.write_results(results, args.out)
    print_bench_table(results)
    for path in paths.values():
        print(f"wrote {path}")
    return 0


def print_bench_table(results: dict) -> None:
    """Print the bench results as a table (rich when available)."""
    from rich.console import Console
    from rich.table import Table

    e, c = results["eager"], results["compiled"]
    table = Table(title=f"{results['model']} on {results['device'].get('name', '?')}: eager vs compiled")
    for col in ("", "eager", "compiled"):
        table.add_column(col, justify="right" if col else "left")
    table.add_row("median step (ms)", f"{e['median_step_ms']:.1f}", f"{c['median_step_ms']:.1f}")
    table.add_row("tokens/s", f"{e['tokens_per_s']:.0f}", f"{c['tokens_per_s']:.0f}")
    table.add_row("peak memory (GiB)", f"{e['peak_mem_gib']:.2f}", f"{c['peak_mem_gib']:.2f}")
    table.add_row("first step (s)", f"{e['first_step_s']:.1f}", f"{c['first_step_s']:.1f}")
    table.add_row("final loss", f"{e['losses'][-1]:.4f}", f"{c['losses'][-1]:.4f}")
    console = Console()
    console.print(table)
    console.print(
        f"speedup {results['speedup']:.2f}x | graph breaks {results['graph_breaks']} | "
        f"fullgraph {'ok' if results['fullgraph_ok'] else 'FAILED'} | compilations {results['compilations']} "
        f"(recompilations {results['recompilations']}) | compile {results['compile_s']:.1f} s | "
        f"max |loss diff| {results['max_abs_loss_diff']:.2e}"
    )


def _diagnose(args: argparse.Namespace) -> int:
    from . import diagnostics
    from .diagnostics import checks
    from .ops import attention

    # --causal-attn: the model is loaded inside checks.diagnose, so the stock mask function is
    # swapped for the run (make_length_batcher pads on the right, as the causal mask needs)
    causal = attention.causal_masks_for(args.attn) if args.causal_attn else contextlib.nullcontext()
    with causal:
        report = checks.diagnose(
            model=args.model, quant=args.quant, lora=not args.no_lora, grad_ckpt=args.grad_ckpt,
            prepare=not args.no_patches, scope="regional" if args.regional else "whole",
            seq_lens=args.seq_lens, batch_size=args.batch_size, device=args.device, dtype=args.dtype, seed=args.seed,
            compile_kwargs={"backend": args.backend}, attn=args.attn, flex_block_mask=args.flex_block_mask,
        )
    report["causal_attn"] = args.causal_attn
    print(diagnostics.format_report(report))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json_path}")
    problems = checks.problems(report, max_compilations=args.max_compilations)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if (args.strict and problems) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `qlora-nb`.

    Returns:
        The exit code (0 ok, 1 a `--strict` check failed, 2 bad arguments or input).
    """
    args = build_parser().parse_args(argv)
    args.command_line = "qlora-nb " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    handler = {"bench": _bench, "diagnose": _diagnose, "report": _report}[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"qlora-nb {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
