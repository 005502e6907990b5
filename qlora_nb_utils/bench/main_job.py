"""The main job, ``qlora-nb bench``: HF eager, plain ``torch.compile`` and the fast path, side by side.

Why three runs: the question a user asks is "how much faster and leaner is the fast path than
what I do today?", and the answer is only honest when the runs see the same things. One model
is loaded the HF way (``prepare_model_for_kbit_training`` + PEFT, NF4), its LoRA weights are
snapshotted, and every run starts from that snapshot, on the very same list of batches, with
the same seed:

* ``hf-eager``: the HF default recipe, eager (the baseline of every ratio);
* ``plain-compile``: the same model under plain ``torch.compile`` (what one line buys);
* ``fast``: :func:`qlora_nb_utils.optimize` (the recipe, with the choices it states).

Parity is judged against the floor (:mod:`qlora_nb_utils.training.parity`): each compiled run
is compared with the eager run of its own recipe (``hf-eager`` for plain compile; the fast
recipe run uncompiled, ``fast-eager``, for ``fast``), and the floor is that eager run again with
the rows of each batch permuted, in two seeded orders (the floor at a step is the larger). Step times are medians after warm-up; compilation is counted
and timed apart. Everything lands in one JSON-ready dict with the device, library versions,
command and date, so that a figure quoted anywhere can be traced to the run that produced it.

Every option is checked before anything loads (:func:`validate_options`): a bad mode, backend,
model folder or data file fails in a second, not after the eager run. The options that are
``optimize()``'s (:data:`OPTIMIZE_KEYS`) are checked by building the one
:class:`~qlora_nb_utils.compile.OptimizeOptions` the fast runs are made with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import data as qdata
from .. import diagnostics, models
from ..env import default_dtype, resolve_device_dtype  # re-exported: bench.resolve_device_dtype
from ..training.loop import TrainConfig, load_trainable_state, summarize, train, trainable_state
from ..training.parity import permute_rows
from .markdown import table_header
from .pairwise import compare, compiled_run, mark_dynamic, side_by_side, warm_shapes  # re-exported
from .record import compile_fields, parity_fields, results_header, vs_hf_eager

__all__ = [
    "DEFAULTS",
    "RUNS",
    "compare",
    "compiled_run",
    "mark_dynamic",
    "default_dtype",
    "resolve_device_dtype",
    "make_bench_batches",
    "AUTO_MODEL",
    "run_bench",
    "validate_options",
    "OPTIMIZE_KEYS",
    "warm_shapes",
    "side_by_side",
    "write_results",
]

PADDING_POLICIES = ("fixed", "multiple", "longest")
#: The runs of the main job, in the order they run and appear.
RUNS = ("hf-eager", "plain-compile", "fast")

#: ``model="auto"``: what the main job runs on each device type. A CPU compiles and steps through
#: every layer slowly, so it gets 5 of SmolLM2's 30 layers (real weights, minutes in all); a GPU
#: gets the whole model.
AUTO_MODEL = {"cpu": "smollm2-135m-5l", "cuda": "smollm2-135m"}

DEFAULTS: dict[str, Any] = {
    "model": "auto",
    "quant": "nf4",
    "steps": 12,
    "batch_size": 4,
    "seq_len": 128,
    "padding": "fixed",
    "device": "auto",
    "dtype": "auto",
    "lora_r": 16,
    "lora_alpha": 32,
    "lr": 2e-4,
    "warmup": 2,
    "seed": 0,
    "mode": "auto",
    "backend": "inductor",
    "data": None,
    "attn_implementation": "sdpa",
    "grad_ckpt": "auto",
    "max_memory_gib": None,
    "packing": False,
    "limit": None,
    "doc_attention": "auto",
    "scope": "auto",
}


#: The options of the job that are ``optimize()``'s, by the same names: :func:`validate_options`
#: builds them into one :class:`~qlora_nb_utils.compile.OptimizeOptions`, whose checks are the only ones.
OPTIMIZE_KEYS = ("mode", "backend", "scope", "grad_ckpt", "max_memory_gib", "doc_attention")


def validate_options(options: dict[str, Any]) -> dict[str, Any]:
    """Fill in :data:`DEFAULTS` and check every option without loading a model or the data.

    Returns:
        The full options, and under ``optimize_options`` the checked
        :class:`~qlora_nb_utils.compile.OptimizeOptions` of :data:`OPTIMIZE_KEYS` (the fast runs'; a
        run adds what it knows, like its steps).

    Raises:
        ValueError: an unknown option or a bad value (the message lists the valid ones), a
            model name/folder that is not a model, a data file that is not valid.
        FileNotFoundError: the data file does not exist.
    """
    from ..compile import OptimizeOptions, valid_backends

    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown bench option(s) {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    opts = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None or k == "max_memory_gib"}}
    if opts["padding"] not in PADDING_POLICIES:
        raise ValueError(f"padding must be one of {PADDING_POLICIES}, got {opts['padding']!r}")
    for key in ("steps", "batch_size", "seq_len"):
        if int(opts[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {opts[key]}")
    if not 0 <= int(opts["warmup"]) < int(opts["steps"]):
        raise ValueError(f"warmup ({opts['warmup']}) must be >= 0 and smaller than steps ({opts['steps']})")
    optimize_options = OptimizeOptions.from_dict({k: opts[k] for k in OPTIMIZE_KEYS})
    if opts["backend"] not in valid_backends():
        raise ValueError(f"backend must be one of {valid_backends()}, got {opts['backend']!r}")
    if opts["packing"] not in (True, False):
        raise ValueError(f"packing must be True or False, got {opts['packing']!r}")
    limit = opts["limit"]
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or an integer >= 1, got {limit!r}")
    if opts["quant"] not in models.QUANT_CHOICES:
        raise ValueError(f"quant must be one of {list(models.QUANT_CHOICES)}, got {opts['quant']!r}")
    device, _ = resolve_device_dtype(opts["device"], opts["dtype"])
    if opts["model"] == "auto":
        opts["model"] = AUTO_MODEL.get(device.type, AUTO_MODEL["cuda"])
    models.check_model_source(opts["model"])
    if opts["data"] is not None:
        qdata.validate_source(opts["data"])
    opts["optimize_options"] = optimize_options
    return opts


def make_bench_batches(tokenizer, *, batch_size: int, seq_len: int, steps: int, padding: str = "fixed", data=None,
                       seed: int = 0, limit: int | None = None):
    """The list of micro-batches every run trains on, built once from the data.

    Returns:
        (batches, padding_stats) where batches is a list of `steps` dicts of CPU tensors.
    """
    batches = qdata.build_batches(tokenizer, batch_size=batch_size, steps=steps, max_len=seq_len,
                                  padding=padding, data=data, seed=seed, require_all=True, limit=limit)
    return batches, qdata.padding_stats(batches)


def run_bench(progress: bool = True, log=print, command: str | None = None, **options: Any) -> dict[str, Any]:
    """Run HF eager, plain compile and the fast path on the same batches, and compare them.

    Args:
        progress: show progress bars.
        log: where one-line status messages go (`print` by default).
        command: the command line to record in the results (defaults to `sys.argv`).
        **options: any of `DEFAULTS`; those of :data:`OPTIMIZE_KEYS` go to `optimize()`;
            `packing=True` runs :func:`~qlora_nb_utils.bench.packing_job.run_packing_bench` instead
            (packed against padded on the same examples; `limit` picks them).

    Returns:
        The results dict (see the module docstring and `write_results`): device, versions,
        command, date, model, options, `optimize` (its description and choices), `runs` (one
        dict per name of :data:`RUNS`: median step, tokens/s, peak memory, losses, compilations,
        parity against its floor, ratios to hf-eager), `reference_runs` (the eager runs the
        parity is measured with), `history`, `padding`; and, for the older readers, `eager`
        (hf-eager) and `compiled` (fast) summaries with `speedup`, `max_abs_loss_diff`,
        `graph_breaks`, `fullgraph_ok`, `compilations`, `recompilations`, `compile_s`.

    Raises:
        ValueError: for an unknown option or a bad value, before anything loads.
    """
    from ..compile.fast_path import optimize

    opts = validate_options(options)
    if opts["packing"]:
        from .packing_job import run_packing_bench

        return run_packing_bench(opts, progress=progress, log=log, command=command)
    device, dtype = resolve_device_dtype(opts["device"], opts["dtype"])
    log(f"==> loading {opts['model']} ({opts['quant']}, {dtype}) on {device}, the HF way (kbit prep + LoRA)")
    model, tok = models.load_model(
        opts["model"], quant=opts["quant"], lora=True, lora_r=opts["lora_r"], lora_alpha=opts["lora_alpha"],
        dtype=dtype, device=device, attn_implementation=opts["attn_implementation"], seed=opts["seed"],
        prepare_kbit=opts["quant"] == "nf4",
    )
    batches, pad_stats = make_bench_batches(
        tok, batch_size=opts["batch_size"], seq_len=opts["seq_len"], steps=opts["steps"],
        padding=opts["padding"], data=opts["data"], seed=opts["seed"], limit=opts["limit"],
    )
    cfg = TrainConfig(steps=opts["steps"], lr=opts["lr"], seed=opts["seed"], progress=progress)
    permuted = [permute_rows(batches, seed=opts["seed"] + k) for k in (1, 2)]  # two orders: the floor's range
    start = trainable_state(model)
    hist: dict[str, Any] = {}

    def run(name, forward=None, data=batches):
        log(f"==> {name}")
        load_trainable_state(model, start)
        hist[name] = train(model, data, cfg, forward=forward, label=name)

    run("hf-eager")
    for k, data in enumerate(permuted, 1):
        run(f"hf-eager-permuted{k}", data=data)
    log("==> graph-break check of the plain model (explain + fullgraph)")
    first = {k: v.to(device) for k, v in batches[0].items()}
    breaks, full = diagnostics.graph_breaks(model, **first), diagnostics.check_fullgraph(model, **first)
    torch.compiler.reset()
    plain = diagnostics.CompileCounter(backend=opts["backend"])
    run("plain-compile", forward=plain.compile(model))
    torch.compiler.reset()

    load_trainable_state(model, start)
    opt = optimize(model, opts["optimize_options"], batches=batches, steps=opts["steps"])
    log(f"==> {opt.description}")
    try:
        run("fast-eager", forward=opt.eager)
        for k, data in enumerate(permuted, 1):
            run(f"fast-eager-permuted{k}", forward=opt.eager, data=data)
        fast_breaks = diagnostics.graph_breaks(opt.eager_prepared, **opt.prepare(**first))
        torch.compiler.reset()
        run("fast", forward=opt.forward)
    finally:
        opt.undo()
    return _assemble(opts, device, dtype, hist, pad_stats, command, {
        "plain": plain, "fast": opt.counter, "breaks": breaks, "full": full, "fast_breaks": fast_breaks,
        # compiled with fullgraph=True and trained: a break would have raised
        "fast_fullgraph": bool(opt.fast.prepared.options["fullgraph"]),
        "optimize": {"description": opt.description, "choices": {k: str(v) for k, v in opt.choices.items()}}})


def _assemble(opts, device, dtype, hist, pad_stats, command, extra) -> dict[str, Any]:
    warm = int(opts["warmup"])
    summ = {name: summarize(h, warm) for name, h in hist.items()}
    base = summ["hf-eager"]
    b, s = int(opts["batch_size"]), int(opts["seq_len"])

    def row(name: str, counter, eager: str) -> dict[str, Any]:
        r = {"name": name, "batch_size": b, "seq_len": s, **summ[name]}
        r.update(vs_hf_eager(r, base))
        if counter is None:
            return {**r, "compilations": 0, "max_abs_loss_diff": 0.0}
        r.update(parity_fields(summ, eager, r["losses"]))
        r["max_abs_loss_diff_vs_hf_eager"] = max(abs(x - y) for x, y in zip(base["losses"], r["losses"]))
        r.update(compile_fields(counter.to_dict()))
        return r

    runs = [row("hf-eager", None, ""), row("plain-compile", extra["plain"], "hf-eager"),
            row("fast", extra["fast"], "fast-eager")]
    runs[1].update(graph_breaks=int(extra["breaks"].graph_break_count), fullgraph_ok=bool(extra["full"].ok))
    runs[2].update(graph_breaks=int(extra["fast_breaks"].graph_break_count), fullgraph_ok=extra["fast_fullgraph"],
                   optimize=extra["optimize"]["description"])
    fast = runs[2]
    return {
        **results_header(opts, device, dtype, command, extra["optimize"]),
        "runs": runs,
        "reference_runs": {n: s for n, s in summ.items() if n not in RUNS},
        # the older readers' keys: hf-eager against the fast path
        "eager": base, "compiled": summ["fast"], "speedup": fast["speedup_vs_hf_eager"],
        "max_abs_loss_diff": fast["max_abs_loss_diff"], "graph_breaks": fast["graph_breaks"],
        "break_reasons": list(extra["fast_breaks"].break_reasons), "fullgraph_ok": fast["fullgraph_ok"],
        "compilations": fast["compilations"], "recompilations": fast["recompilations"],
        "recompile_reasons": fast["recompile_reasons"], "compile_s": fast["compile_s"],
        "padding": pad_stats,
        "history": {k: h.to_dict(orient="list") for k, h in hist.items()},
    }


def write_results(results: dict[str, Any], out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    """Write `results.json` (and `loss_curves.png`) into `out_dir`.

    Returns:
        name -> path of each file written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json"}
    paths["json"].write_text(json.dumps(results, indent=2, default=str) + "\n")
    if plot:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from .. import plots

        paths["loss_png"] = out / "loss_curves.png"
        plot = plots.plot_fast_path if "runs" in results else plots.plot_loss_curves
        fig = plot(results, path=paths["loss_png"])
        import matplotlib.pyplot as plt

        plt.close(fig)
    return paths


def markdown_table(paths: list[str | Path]) -> str:
    """A Markdown table of bench results files (what the README shows): one row per run.

    Files of the three-run main job give a row each for ``hf-eager``, ``plain-compile`` and
    ``fast``; an older two-run file (eager against compiled) gives its one row.

    Args:
        paths: `results.json` files written by `qlora-nb bench`.

    Returns:
        The table, ending with a newline.
    """
    rows = table_header(["file", "device", "model", "batch x len", "run", "ms/step", "speedup vs hf-eager",
                         "real tokens/s", "peak GiB", "compilations", "max / mean loss diff vs its eager",
                         "floor max / mean", "within floor"])
    files = []
    for path in paths:
        r = json.loads(Path(path).read_text())
        # a file gathered from several calls holds each call whole
        files += [(path, call) for call in r["calls"].values()] if r.get("kind") == "fast_path" else [(path, r)]
    for path, r in files:
        o = r["options"]
        head = (f"| `{Path(path).name}` | {r['device']['name']} | {r['model']} ({o['quant']}, {o['dtype']}) "
                f"| {o['batch_size']} x {o['seq_len']}")
        if "runs" not in r:  # a two-run file from before the fast path
            c = r["compiled"]
            rows.append(f"{head} | compiled (2-run file) | {c['median_step_ms']:.1f} | {r['speedup']:.2f}x "
                        f"| {c['tokens_per_s']:.0f} | {c['peak_mem_gib']:.2f} | {r['compilations']} "
                        f"| {r['max_abs_loss_diff']:.1e} / - | - | - |")
            continue
        for run in r["runs"]:
            floor = (f"{run['floor_max_abs_loss_diff']:.1e} / {run['floor_mean_abs_loss_diff']:.1e}"
                     if "floor_max_abs_loss_diff" in run else "-")
            diff = (f"{run['max_abs_loss_diff']:.1e} / {run['mean_abs_loss_diff']:.1e}"
                    if "mean_abs_loss_diff" in run else "-")
            within = "-" if "within_floor" not in run else ("yes" if run["within_floor"] else "**no**")
            rows.append(f"{head} | {run['name']} | {run['median_step_ms']:.1f} | {run['speedup_vs_hf_eager']:.2f}x "
                        f"| {run['tokens_per_s']:.0f} | {run['peak_mem_gib']:.2f} | {run['compilations']} "
                        f"| {diff} | {floor} | {within} |")
    return "\n".join(rows) + "\n"
