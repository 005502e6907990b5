"""`qlora-nb`: the command line for what the notebooks do, for scripts and CI.

`qlora-nb bench` is the main job: the same QLoRA fine-tune eager and compiled, side by
side, a table on the terminal and `results.json` + a loss-curve PNG in `--out`.
`qlora-nb diagnose` reports graph breaks, the `fullgraph=True` verdict and compilations over
a list of sequence lengths; with `--strict` it fails (exit 1) on any break, a failed
fullgraph compile, or more compilations than `--max-compilations`, so CI can guard it.
`qlora-nb train` fine-tunes; `qlora-nb export` merges a run's adapter into a plain checkpoint and
`qlora-nb generate` talks to a run, so that the result of training can be used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ._paths import check_out_dir, check_out_file

if TYPE_CHECKING:
    from .reversible import PatchHandle

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


#: models.MODEL_NAMES in words, for every --model (tests/test_models.py checks each names them all)
_MODEL_HELP = ("tiny, smollm2-135m, smollm2-135m-5l, llama-3.2-1b-shape, llama-3.2-1b-shape-4l, llama-3.1-8b-shape, "
               "llama-3.1-8b-shape-4l, an HF id or a path (a model folder)")


def _add_model_args(p: argparse.ArgumentParser, default_model: str) -> None:
    auto = "; default auto: smollm2-135m-5l on a CPU, smollm2-135m on a GPU" if default_model == "auto" else ""
    p.add_argument("--model", default=default_model, help=_MODEL_HELP + auto)
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
    _add_model_args(b, "auto")
    b.add_argument("--steps", type=_positive_int, default=12)
    b.add_argument("--seq-len", type=_positive_int, default=128)
    b.add_argument("--padding", choices=("fixed", "multiple", "longest"), default="fixed")
    b.add_argument("--lr", type=float, default=2e-4)
    b.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    b.add_argument("--mode", default="auto", help="the fast path's mode: auto (optimize() chooses: CUDA graphs for "
                   "fixed shapes on a GPU), default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs")
    b.add_argument("--backend", default="inductor")
    b.add_argument("--grad-ckpt", choices=("auto", "on", "off"), default="auto",
                   help="the fast path's checkpointing: auto (off, or the fewest layers that fit --max-memory-gib)")
    b.add_argument("--max-memory-gib", type=float, default=None, help="the fast path's peak-memory target")
    b.add_argument("--scope", choices=("auto", "whole", "regional"), default="auto",
                   help="what the fast path compiles: auto (by what pays over --steps), whole (one graph: the "
                        "fastest step on a GPU) or regional (one decoder layer's graph, reused)")
    b.add_argument("--packing", action="store_true", help="packed against padded on the same examples, in real "
                   "tokens/s: hf-eager (packed), fast-padded, fast (packed; the whole epoch if --steps allows)")
    b.add_argument("--limit", type=_positive_int, default=None, help="read only the first N examples of the data")
    b.add_argument("--doc-attention", default="auto", choices=("auto", "flex_attention", "sdpa"),
                   help="with --packing: the per-document attention kernel (auto: flex on CUDA, sdpa elsewhere)")
    b.add_argument("--data", default=None, help="a JSONL file (prompt/response, prompt/completion or chat messages) "
                   "or a datasets folder (default: the shipped KJV set)")
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
    d.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None,
                   help="through optimize(), the fast path users train with (default: on, unless --regional, "
                   "--no-patches or --attn other than sdpa ask for the prepare_for_compile path)")
    d.add_argument("--seq-lens", type=_seq_lens, default=[64], help="comma-separated, e.g. 64,80,96")
    d.add_argument("--max-compilations", type=_positive_int, default=2)
    d.add_argument("--backend", default="inductor", help="backend of the run over --seq-lens (breaks are backend-independent)")
    d.add_argument("--json", dest="json_path", default=None, help="also write the report here")
    d.add_argument("--strict", action="store_true", help="exit 1 on any break, fullgraph failure or too many compilations")
    _add_train_parser(sub)
    _add_use_parsers(sub)
    q = sub.add_parser("quantize", help="save a model as a pre-quantized NF4 checkpoint: later loads read it as it "
                       "is (about a third of the bytes, no quantization), the fastest start")
    q.add_argument("model", help=_MODEL_HELP)
    q.add_argument("out", help="the folder to write (must not exist or be empty, unless --overwrite)")
    q.add_argument("--device", default="auto", help="where to quantize: auto (cuda if available), cpu or cuda[:N]")
    q.add_argument("--dtype", default="bfloat16", help="the dtype the weights are read in before quantizing "
                   "(train in the same one: bfloat16, float16 or float32)")
    q.add_argument("--no-double-quant", action="store_true", help="do not quantize the NF4 scales too")
    q.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    r = sub.add_parser("report", help="Markdown tables of the results files qlora-nb bench and the compile matrix write")
    r.add_argument("files", nargs="+", help="results files written by qlora-nb bench or bench.matrix.run_matrix")
    return parser


def _add_train_parser(sub) -> None:
    """`qlora-nb train`: its defaults are `training.finetuning.DEFAULTS`, repeated so that `--help` imports no torch."""
    t = sub.add_parser("train", help="fine-tune a model on your data (QLoRA, compiled); adapter, checkpoint, metrics")
    t.add_argument("--model", default="smollm2-135m", help=f"{_MODEL_HELP}; default: smollm2-135m")
    t.add_argument("--data", default=None, help="a JSONL file (prompt/response, prompt/completion or chat messages) "
                   "or a folder saved by datasets' save_to_disk (default: the shipped KJV set)")
    t.add_argument("--steps", type=_positive_int, default=60)
    t.add_argument("--out", default="runs/train", help="folder for adapter/, checkpoint/, metrics.json, loss_curve.png")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    t.add_argument("--overwrite", action="store_true", help="delete the run in --out first")
    t.add_argument("--save-every", type=_non_negative_int, default=20, help="checkpoint every K steps (0: at the end)")
    t.add_argument("--eval-every", type=_non_negative_int, default=20, help="held-out loss every K steps (0: at the end)")
    t.add_argument("--eval-size", type=_positive_int, default=32, help="held-out examples")
    t.add_argument("--batch-size", type=_positive_int, default=4)
    t.add_argument("--seq-len", type=_positive_int, default=128)
    t.add_argument("--lr", type=float, default=2e-4)
    t.add_argument("--warmup-steps", type=_non_negative_int, default=5)
    t.add_argument("--lora-r", type=_positive_int, default=16)
    t.add_argument("--lora-alpha", type=float, default=32)
    t.add_argument("--mode", default="auto", help="auto, default, reduce-overhead, max-autotune, ...")
    t.add_argument("--backend", default="inductor",
                   help="inductor (compiled), aot_eager or eager (the same model without Inductor)")
    t.add_argument("--max-memory-gib", type=float, default=None, help="peak-memory target: checkpoint layers to fit")
    t.add_argument("--grad-ckpt", choices=("auto", "on", "off"), default="auto")
    t.add_argument("--scope", choices=("auto", "whole", "regional"), default="auto",
                   help="what compiles: auto (by what pays over --steps: one decoder layer's graph reused by every "
                        "layer for a short job, the whole model for a long one on a GPU), whole or regional")
    t.add_argument("--compile-cache", choices=("auto", "on", "off"), default="auto",
                   help="keep the compiled graphs for the next run in the package's cache folder (auto: on a GPU)")
    t.add_argument("--autotune", choices=("auto", "on", "off"), default="auto",
                   help="benchmark each compiled kernel's candidate configurations on the first step (auto: only "
                        "under a max-autotune --mode; otherwise one configuration each, a shorter first step)")
    t.add_argument("--step-graph", dest="step_graph", choices=("auto", "on", "off"), default="auto",
                   help="capture each batch shape's whole step as one CUDA graph and replay it (auto: on a GPU "
                        "in regional scope with few batch shapes; off: every step launched from the host)")
    t.add_argument("--packing", choices=("auto", "on", "off"), default="auto",
                   help="pack whole examples into rows of --seq-len, each attending to itself only (auto: when "
                        "padded batches would be more than a quarter padding)")
    t.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:N]")
    t.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--check-parity", type=_non_negative_int, default=0,
                   help="first K steps eager, eager on rows permuted two ways and compiled, judged against that "
                        "floor (then undone)")
    t.add_argument("--no-progress", action="store_true")


def _add_use_parsers(sub) -> None:
    """`qlora-nb export` and `qlora-nb generate`: what a user does with a run that `train` wrote."""
    e = sub.add_parser("export", help="a trained run as one Hugging Face checkpoint: the adapter merged into the "
                       "base it was trained against (NF4, dequantized); needs neither PEFT nor bitsandbytes to load")
    e.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by qlora-nb train --out")
    e.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    e.add_argument("--base", choices=("nf4", "original"), default="nf4",
                   help="nf4: the NF4 base dequantized, the model that was trained (default); original: the "
                        "unquantized base (not the model that was trained: a warning says so)")
    e.add_argument("--dtype", default="auto", help="the saved weights' dtype (auto: the run's compute dtype)")
    e.add_argument("--device", default="cpu", help="where to load and merge: cpu (default), cuda[:N] or auto")
    e.add_argument("--gguf", choices=("f16", "q8_0"), default=None,
                   help="write one GGUF file (llama.cpp, Ollama) of this type instead of the checkpoint folder "
                        "(Llama family, Qwen2, Qwen3)")
    g = sub.add_parser("generate", help="a completion from a trained run (NF4 base + adapter, as trained), "
                       "streamed; greedy unless --temperature")
    g.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by qlora-nb train --out (with --merged: "
                   "one written by qlora-nb export)")
    g.add_argument("prompt", help="the prompt (rendered with the tokenizer's chat template when it has one)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64)
    g.add_argument("--merged", action="store_true", help="RUN_DIR is an exported model (qlora-nb export)")
    g.add_argument("--device", default="auto", help="auto (cuda if available: bf16), cpu (fp32) or cuda[:N]")
    g.add_argument("--no-chat-template", action="store_true", help="continue the prompt as typed")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sampled")


def _export(args: argparse.Namespace) -> int:
    from .training.export import export_run

    # export_run checks the run and --out before any model loads
    export_run(args.run_dir, args.out, base=args.base, dtype=args.dtype, device=args.device, gguf=args.gguf,
               log=lambda line: print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .training.generate import load_trained, stream_completion

    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    # load_trained checks the run (or the exported folder) before any model loads
    model, tok = load_trained(args.run_dir, merged=args.merged, device=args.device)
    text = stream_completion(model, tok, args.prompt, max_new_tokens=args.max_new_tokens,
                             chat_template=not args.no_chat_template, temperature=args.temperature)
    if not text.strip():
        print("(no text: the model ended its answer at once)", file=sys.stderr)
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from .models import check_model_source
    from .models.prequantized import save_nf4

    check_out_dir(args.out, what="OUT", empty=not args.overwrite)  # before the model loads
    check_model_source(args.model)
    try:
        folder = save_nf4(args.model, args.out, dtype=args.dtype, device=args.device,
                          double_quant=not args.no_double_quant, overwrite=args.overwrite)
    except FileExistsError:
        raise ValueError(f"{args.out} exists and is not empty: pass --overwrite to replace it") from None
    size = sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".safetensors")
    print(f"wrote {folder} ({size / 2**30:.2f} GiB of weights); train on it with --model {folder}")
    return 0


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


#: What an ``auto|on|off`` flag passes on: the option's own "auto", True or False.
_SWITCH = {"auto": "auto", "on": True, "off": False}


def _train_options(args: argparse.Namespace) -> dict:
    keys = ("model", "data", "steps", "batch_size", "seq_len", "lr", "warmup_steps", "lora_r", "lora_alpha",
            "eval_every", "eval_size", "save_every", "mode", "backend", "max_memory_gib", "device", "dtype", "seed",
            "check_parity", "scope")
    opts = {k: getattr(args, k) for k in keys}
    opts.update({k: _SWITCH[getattr(args, k)] for k in ("grad_ckpt", "compile_cache", "autotune", "packing",
                                                        "step_graph")})
    return opts


def _train(args: argparse.Namespace) -> int:
    from .training.checkpoint import FinetuneInterrupted
    from .training.finetuning import check_options, finetune

    opts = _train_options(args)
    checked = check_options(out=args.out, resume=args.resume, overwrite=args.overwrite, **opts)  # before any model loads
    if args.max_memory_gib is not None:  # before CUDA starts: the allocator reads its settings once
        from .env import prefer_expandable_segments

        print(f"qlora-nb train: allocator: {prefer_expandable_segments()[1]}", file=sys.stderr)
    try:
        finetune(out=args.out, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
                 command=args.command_line, checked=checked, **opts)
    except FinetuneInterrupted as stop:
        return stop.exit_code
    return 0


def _report(args: argparse.Namespace) -> int:
    """Markdown tables of the files `qlora-nb bench` and the compile matrix write (the lab's own files: `python -m lab.report`)."""
    from .bench import main_job as bench
    from .bench import matrix
    from .plots import load_results

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"results file(s) not found: {', '.join(missing)}")
    loaded = {f: load_results(f) for f in args.files}
    kinds = {f: _kind(f, r) for f, r in loaded.items()}
    benches = [f for f, kind in kinds.items() if kind == "bench"]
    if benches:
        print(bench.markdown_table(benches), end="")
    for f in (f for f, kind in kinds.items() if kind == "matrix"):
        print("\n" + matrix.markdown_table(f), end="")
    return 0


def _kind(path: str, results: dict) -> str:
    """"bench" or "matrix".

    Raises:
        ValueError: for a JSON that is neither, naming the file (rather than a KeyError later).
    """
    if not isinstance(results, dict):
        raise ValueError(f"{path}: not a results file (a JSON {type(results).__name__}, expected an object)")
    if results.get("kind") == "fast_path" or ("optimize" in results and "runs" in results):
        return "bench"  # the three-run main job (one call, or gathered calls of several shapes)
    if "cells" in results:
        return "matrix"
    if isinstance(results.get("eager"), dict) and isinstance(results.get("compiled"), dict):
        return "bench"
    raise ValueError(f"{path}: not a results file of qlora-nb bench or the compile matrix (peers, packing, FSDP2 "
                     f"and compute files: python -m lab.report); its keys are {sorted(results)[:8]}")


def _bench(args: argparse.Namespace) -> int:
    from .bench import main_job as bench

    check_out_dir(args.out)  # before anything loads: the results of minutes of training must have a place
    results = bench.run_bench(
        progress=not args.no_progress, command=args.command_line,
        model=args.model, quant=args.quant, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        padding=args.padding, device=args.device, dtype=args.dtype, lr=args.lr, warmup=args.warmup,
        seed=args.seed, mode=args.mode, backend=args.backend, data=args.data,
        grad_ckpt=_SWITCH[args.grad_ckpt], max_memory_gib=args.max_memory_gib,
        packing=args.packing, limit=args.limit, doc_attention=args.doc_attention, scope=args.scope,
    )
    paths = bench.write_results(results, args.out)
    print_bench_table(results)
    for path in paths.values():
        print(f"wrote {path}")
    return 0


def print_bench_table(results: dict) -> None:
    """Print the bench results as a table (rich): HF eager, plain compile and the fast path."""
    from rich.console import Console
    from rich.table import Table

    if "runs" not in results:  # a two-run file from before the fast path
        results = {**results, "runs": [{"name": "eager", **results["eager"]}, {"name": "compiled", **results["compiled"]}]}
    runs = results["runs"]
    o = results["options"]
    table = Table(title=f"{results['model']} on {results['device'].get('name', '?')}: "
                        f"{o['batch_size']} x {o['seq_len']}")
    table.add_column("", justify="left")
    for run in runs:
        table.add_column(run["name"], justify="right")

    def cells(fmt, key):
        return [fmt(run[key]) if run.get(key) is not None else "-" for run in runs]

    table.add_row("median step (ms)", *cells(lambda v: f"{v:.1f}", "median_step_ms"))
    table.add_row("speedup vs hf-eager", *cells(lambda v: f"{v:.2f}x", "speedup_vs_hf_eager"))
    table.add_row("real tokens/s", *cells(lambda v: f"{v:.0f}", "tokens_per_s"))
    if any("pad_fraction" in run for run in runs):
        table.add_row("pad tokens", *cells(lambda v: f"{v:.0%}", "pad_fraction"))
    table.add_row("peak memory (GiB)", *cells(lambda v: f"{v:.2f}", "peak_mem_gib"))
    table.add_row("first step (s)", *cells(lambda v: f"{v:.1f}", "first_step_s"))
    table.add_row("compilations", *cells(str, "compilations"))
    table.add_row("graph breaks", *cells(str, "graph_breaks"))
    table.add_row("max |loss diff| vs its eager", *cells(lambda v: f"{v:.1e}", "max_abs_loss_diff"))
    table.add_row("floor max (eager, rows permuted)", *cells(lambda v: f"{v:.1e}", "floor_max_abs_loss_diff"))
    table.add_row("mean diff / floor mean", *[
        f"{r['mean_abs_loss_diff']:.1e} / {r['floor_mean_abs_loss_diff']:.1e}" if "mean_abs_loss_diff" in r else "-"
        for r in runs])
    table.add_row("within the floor", *["-" if "within_floor" not in r else ("yes" if r["within_floor"] else "NO")
                                        for r in runs])
    console = Console()
    console.print(table)
    if results.get("optimize"):
        console.print(results["optimize"]["description"])


def _use_fast(args: argparse.Namespace) -> bool:
    """--fast unless the options ask for the prepare_for_compile path; --fast with them is an error."""
    other = args.regional or args.no_patches or args.attn != "sdpa" or args.causal_attn
    if args.fast and other:
        raise ValueError("--fast is the optimize() path (whole model, patches, sdpa with its own attention choice); "
                         "drop --regional/--no-patches/--attn/--causal-attn, or pass --no-fast")
    return (not other) if args.fast is None else args.fast


def _diagnose(args: argparse.Namespace) -> int:
    from . import diagnostics
    from .diagnostics import checks
    from .ops import attention

    if args.json_path:
        check_out_file(args.json_path, what="--json")  # before the model loads
    # --causal-attn: the model is loaded inside checks.diagnose, so the stock mask function is
    # swapped for the run (make_length_batcher pads on the right, as the causal mask needs)
    causal = attention.causal_masks_for(args.attn) if args.causal_attn else contextlib.nullcontext()
    with causal:
        report = checks.diagnose(
            model=args.model, quant=args.quant, lora=not args.no_lora, grad_ckpt=args.grad_ckpt,
            prepare=not args.no_patches, scope="regional" if args.regional else "whole",
            seq_lens=args.seq_lens, batch_size=args.batch_size, device=args.device, dtype=args.dtype, seed=args.seed,
            compile_kwargs={"backend": args.backend}, attn=args.attn, flex_block_mask=args.flex_block_mask,
            fast=_use_fast(args),
        )
    report["causal_attn"] = args.causal_attn
    report["command"] = args.command_line
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
        The exit code (0 ok, 1 a `--strict` check failed, 2 bad arguments or input, 3 the command
        failed after its checks (the message names a file with the traceback), 130 interrupted).
    """
    args = build_parser().parse_args(argv)
    args.command_line = "qlora-nb " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    handler = {"bench": _bench, "diagnose": _diagnose, "report": _report, "train": _train,
               "quantize": _quantize, "export": _export, "generate": _generate}[args.command]
    prepare_command(args.command)
    try:
        return handler(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"qlora-nb {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qlora-nb {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a run that fails says what and where to look, not a screen of frames
        if os.environ.get(DEBUG_ENV):
            raise
        return _failed(args, err)


#: set to 1 to see a failed command's traceback on the terminal instead of in a file
DEBUG_ENV = "QLORA_NB_DEBUG"
#: The commands that import transformers and peft (the others start without them).
LOADS_MODELS = frozenset({"bench", "diagnose", "train", "quantize", "export", "generate"})


def prepare_command(command: str) -> PatchHandle | None:
    """What :func:`main` does before ``command``'s handler imports anything: for a command that loads
    models, scikit-learn imported only when something calls it (:func:`~qlora_nb_utils.startup.defer_sklearn`).

    Returns:
        The deferral's handle, or None (a command that loads no model, or nothing was changed).
    """
    if command not in LOADS_MODELS:
        return None
    from .startup import defer_sklearn

    return defer_sklearn()


def _out_of_memory_hint(target: float | None, estimate: float | None) -> str:
    """What to change after the GPU ran out of memory: never the option already given. Under a memory
    target the plan's estimate is an upper bound of what the step allocates, so what ran out was memory
    the target does not see (another process on the GPU, a card with less free than the target)."""
    if target is None:
        return ("the GPU ran out of memory: lower --batch-size or --seq-len, or give --max-memory-gib "
                "so that optimize() checkpoints and offloads to fit")
    said = f", its plan estimated at {estimate:.2f} GiB" if estimate is not None else ""
    return (f"the GPU ran out of memory under --max-memory-gib {target:g}{said}: give a --max-memory-gib no larger "
            f"than the memory the GPU has free (another process may hold some), or a shorter --seq-len or a "
            f"smaller --batch-size")


def _failed(args: argparse.Namespace, err: BaseException) -> int:
    """One message for a command that failed after its checks passed: what failed, a hint where one is
    known (memory, compilation), and the file holding the traceback (the run's --out folder when it
    exists, else the temporary folder). Exit code 3."""
    import tempfile
    import traceback

    import torch

    name = type(err).__name__
    if isinstance(err, torch.OutOfMemoryError):
        hint = _out_of_memory_hint(getattr(args, "max_memory_gib", None), getattr(err, "plan_estimate_gib", None))
    elif type(err).__module__.startswith("torch._dynamo") or type(err).__module__.startswith("torch._inductor"):
        hint = "torch.compile failed: --backend eager trains the same model without compiling"
    else:
        hint = ""
    out = getattr(args, "out", None)
    folder = Path(out) if out and Path(out).is_dir() else Path(tempfile.gettempdir())
    log = folder / f"qlora-nb-{args.command}-error.txt"
    try:
        log.write_text(f"{getattr(args, 'command_line', 'qlora-nb')}\n\n" + "".join(traceback.format_exception(err)))
        where = f"traceback in {log}"
    except OSError:
        where = f"set {DEBUG_ENV}=1 to see the traceback"
    first = str(err).strip().splitlines()[0][:400] if str(err).strip() else ""
    print(f"qlora-nb {args.command}: failed: {name}: {first}", file=sys.stderr)
    if hint:
        print(f"qlora-nb {args.command}: {hint}", file=sys.stderr)
    print(f"qlora-nb {args.command}: {where} ({DEBUG_ENV}=1 shows it here)", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
