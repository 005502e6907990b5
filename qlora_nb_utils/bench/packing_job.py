"""``qlora-nb bench --packing``: packed against padded on the same examples, in real tokens per second.

Why it exists: on the shipped data most of a padded batch is padding (more of it the longer the
batch), so a faster step of padded batches is mostly faster padding. The
number a user cares about is real (non-pad) tokens per second, counted one way for every run
(:func:`qlora_nb_utils.data.real_tokens`). This job trains, from one LoRA start and on the same
examples (the data, or its first ``limit`` examples, in the seed's order):

* ``hf-eager``: the HF model eager on the packed batches (the dense document mask), the
  baseline of the speed ratios;
* ``fast-padded``: :func:`~qlora_nb_utils.compile.optimize` on the same examples padded as
  ``qlora-nb bench`` pads them (``padding``, ``fixed`` by default);
* ``fast``: :func:`~qlora_nb_utils.compile.optimize` on the packed batches, over the whole
  epoch when ``steps`` allows, so its compilation count is the epoch's (the target is 1).

Parity is judged as in the main job: ``fast`` against the packed recipe uncompiled
(``fast-eager``), with the floor from that eager run with the rows of each batch in two other
orders (:mod:`qlora_nb_utils.training.parity`). The results dict has the main job's shape
(``runs``, ``history``, device, versions, command, date), so ``qlora-nb report`` and the plot
read it, plus what the packing checks name: ``packing`` (true), ``pad_fraction``,
``real_tokens_per_s``, ``graph_breaks``, ``compilations``, ``max_abs_loss_diff``, and the
packed/padded ratio ``real_tokens_speedup_vs_padded``.
"""

from __future__ import annotations

from typing import Any

from .. import data as qdata
from .. import diagnostics, models
from ..env import resolve_device_dtype
from ..ops.doc_attention import with_document_mask
from ..training.loop import TrainConfig, load_trainable_state, summarize, train, trainable_state
from ..training.parity import permute_rows
from .record import compile_fields, parity_fields, results_header, vs_hf_eager

__all__ = ["PACKING_RUNS", "run_packing_bench"]

#: The runs of ``bench --packing``, in the order they run and appear.
PACKING_RUNS = ("hf-eager", "fast-padded", "fast")


def _pad_fraction(batches: list[dict]) -> float:
    slots = sum(int(b["input_ids"].numel()) for b in batches)
    return 1.0 - sum(qdata.real_tokens(b) for b in batches) / slots


def run_packing_bench(opts: dict[str, Any], progress: bool = True, log=print, command: str | None = None) -> dict:
    """Run ``hf-eager`` (packed), ``fast-padded`` and ``fast`` (packed) on the same examples.

    Args:
        opts: the main job's options, already checked (``bench.main_job.validate_options``);
            ``limit`` picks the examples (None: all), ``steps`` caps the batches of every run.
        progress: show progress bars.
        log: where one-line status messages go.
        command: the command line to record (default: ``sys.argv``).

    Returns:
        The results dict (module docstring).

    Raises:
        ValueError: the examples give fewer packed batches than ``warmup`` + 1.
    """
    from ..compile.fast_path import optimize

    device, dtype = resolve_device_dtype(opts["device"], opts["dtype"])
    log(f"==> loading {opts['model']} ({opts['quant']}, {dtype}) on {device}, the HF way (kbit prep + LoRA)")
    model, tok = models.load_model(
        opts["model"], quant=opts["quant"], lora=True, lora_r=opts["lora_r"], lora_alpha=opts["lora_alpha"],
        dtype=dtype, device=device, attn_implementation="sdpa", seed=opts["seed"], prepare_kbit=opts["quant"] == "nf4")
    b, s = int(opts["batch_size"]), int(opts["seq_len"])
    epoch, stats = qdata.build_packed_batches(tok, batch_size=b, max_len=s, data=opts["data"], limit=opts["limit"],
                                              seed=opts["seed"])
    steps = min(int(opts["steps"]), len(epoch))
    if steps <= int(opts["warmup"]):
        raise ValueError(f"the examples pack into {len(epoch)} batches, not more than warmup={opts['warmup']}: "
                         "use more examples (limit) or a smaller warmup")
    packed = epoch[:steps]
    padded = qdata.build_batches(tok, batch_size=b, steps=steps, max_len=s, padding=opts["padding"],
                                 data=opts["data"], limit=opts["limit"], seed=opts["seed"])
    log(f"==> {stats.documents} examples: {len(epoch)} packed batches of {b} x {s} ({stats.pad_fraction:.0%} padding); "
        f"padded, {_pad_fraction(padded):.0%} padding; {steps} steps each")
    cfg = TrainConfig(steps=steps, lr=opts["lr"], seed=opts["seed"], progress=progress)
    start = trainable_state(model)
    hist: dict[str, Any] = {}

    def run(name, forward, batches):
        log(f"==> {name}")
        load_trainable_state(model, start)
        hist[name] = train(model, batches, cfg, forward=forward, label=name)

    run("hf-eager", with_document_mask(model, "sdpa"), packed)
    opt = optimize(model, opts["optimize_options"], batches=padded, steps=steps)  # doc_attention: packed only
    try:
        run("fast-padded", opt.forward, padded)
        padded_stats = opt.counter.to_dict()
    finally:
        opt.undo()
    _reset()
    load_trainable_state(model, start)
    opt = optimize(model, opts["optimize_options"], batches=packed, steps=steps)
    log(f"==> {opt.description}")
    try:
        run("fast-eager", opt.eager, packed)
        for k in (1, 2):
            run(f"fast-eager-permuted{k}", opt.eager, permute_rows(packed, seed=opts["seed"] + k))
        breaks = _breaks_of(opt, packed[0], device)
        _reset()
        run("fast", opt.forward, packed)
        fast_stats = opt.counter.to_dict()
        description = opt.description
        choices = {k: str(v) for k, v in opt.choices.items()}
        fullgraph = bool(opt.fast.prepared.options["fullgraph"])
    finally:
        opt.undo()
    return _assemble(opts, device, dtype, hist, command, stats, {
        "padded_pad_fraction": _pad_fraction(padded), "packed_pad_fraction": _pad_fraction(packed),
        "padded_stats": padded_stats, "fast_stats": fast_stats, "breaks": breaks, "fullgraph": fullgraph,
        "epoch_batches": len(epoch), "steps": steps,
        "optimize": {"description": description, "choices": choices}})


def _reset() -> None:
    import torch

    torch.compiler.reset()


def _breaks_of(opt, batch: dict, device) -> Any:
    """Graph breaks of the compiled module on one packed batch, its mask built outside as in training."""
    from ..ops.doc_attention import document_block_mask, document_dense_mask

    kw = {k: v.to(device) for k, v in batch.items()}
    docs = kw.pop("document_ids")
    flex = opt.choices["doc_attention"] == "flex_attention"
    kw["attention_mask"] = document_block_mask(docs) if flex else document_dense_mask(docs)
    return diagnostics.graph_breaks(opt.module, **kw)


def _assemble(opts, device, dtype, hist, command, stats, extra) -> dict[str, Any]:
    warm = int(opts["warmup"])
    summ = {name: summarize(h, warm) for name, h in hist.items()}
    base = summ["hf-eager"]
    b, s = int(opts["batch_size"]), int(opts["seq_len"])
    pad = {"hf-eager": extra["packed_pad_fraction"], "fast-padded": extra["padded_pad_fraction"],
           "fast": extra["packed_pad_fraction"]}
    runs = []
    for name in PACKING_RUNS:
        r = {"name": name, "batch_size": b, "seq_len": s, "packed": name != "fast-padded", **summ[name],
             "pad_fraction": pad[name]}
        r["real_tokens_per_s"] = r["tokens_per_s"]
        r.update(vs_hf_eager(r, base), real_tokens_vs_hf_eager=r["tokens_per_s"] / base["tokens_per_s"])
        runs.append(r)
    runs[0].update(compilations=0, max_abs_loss_diff=0.0)
    runs[1].update(compile_fields(extra["padded_stats"]))
    fast = runs[2]
    fast.update(parity_fields(summ, "fast-eager", fast["losses"]))
    fast.update(compile_fields(extra["fast_stats"]), graph_breaks=int(extra["breaks"].graph_break_count),
                fullgraph_ok=extra["fullgraph"], optimize=extra["optimize"]["description"])
    speedup = fast["tokens_per_s"] / runs[1]["tokens_per_s"]
    return {
        "kind": "bench_packing",
        **results_header(opts, device, dtype, command, extra["optimize"], caller="run_packing_bench()"),
        "packing": True,
        "packing_stats": stats.to_dict(),
        "epoch_batches": extra["epoch_batches"],
        "whole_epoch": extra["steps"] == extra["epoch_batches"],
        "pad_fraction": fast["pad_fraction"],
        "padded_pad_fraction": runs[1]["pad_fraction"],
        "real_tokens_per_s": fast["tokens_per_s"],
        "padded_real_tokens_per_s": runs[1]["tokens_per_s"],
        "real_tokens_speedup_vs_padded": speedup,
        "graph_breaks": fast["graph_breaks"], "fullgraph_ok": fast["fullgraph_ok"],
        "compilations": fast["compilations"], "recompilations": fast["recompilations"],
        "max_abs_loss_diff": fast["max_abs_loss_diff"], "within_floor": fast["within_floor"],
        "runs": runs,
        "reference_runs": {n: v for n, v in summ.items() if n not in PACKING_RUNS},
        "history": {k: h.to_dict(orient="list") for k, h in hist.items()},
    }
