"""Two checks of packed training that the packing benchmark's runs are too short to settle.

Why it exists: :mod:`lab.peers.packed` times every library on the same packed
batches, and its ``ours-packed`` run also judges the loss of the first steps against the recipe
uncompiled, with a floor from one other eager run (the rows permuted). At 8B, 4 steps and one
floor sample left one step over its floor (5.1e-3 against 4.6e-3), which says as much about the
floor as about the run. Each check here is a process of its own (``python -m`` this module),
loads the model as ``ours-packed`` does, trains the very same batches
(:func:`~lab.peers.packed.build_data`), and writes into the packing results
file (``results/packing_<gpu>.json``) under a key of its own, so the benchmark's ``runs`` and its
report are left as they are:

* ``loss``: ``optimize()`` on the packed batches for ``steps`` steps, then the same recipe
  uncompiled (``Optimized.eager``) from the same LoRA start, once in the batches' order and
  ``floor_runs`` times more with the rows of each batch in other seeded orders
  (:func:`qlora_nb_utils.training.parity.permute_rows`). The floor at a step is the largest
  difference between any two of those eager runs (every pair, not one); the compiled run's
  difference from the first eager run is recorded per step beside it. Key ``loss_checks``.
* ``kernel``: one document-attention kernel (``flex_attention``, ``varlen``, ``sdpa``) asked of
  ``optimize(doc_attention=...)``, timed as ``ours-packed`` is (real tokens/s, peak GiB), with
  the compilations over every packed batch of one epoch, the graph breaks of the compiled module
  on a packed batch, and the same loss check on its first steps. Key ``doc_attention``; its
  ``comparison`` sets each kernel's per-step losses against flex attention's (the same batches,
  the same LoRA start), with flex's floor.

    python -m lab.peers.packed_checks loss --model llama-3.1-8b-shape --data kjv \\
        --rows 4 --steps 8 --floor-runs 3 --out lab/results/packing/packing_h100.json
    python -m lab.peers.packed_checks kernel --kernel varlen --model llama-3.2-1b-shape \\
        --data kjv --rows 8 --steps 10 --out lab/results/packing/packing_h100.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["pairwise_floor", "loss_verdict", "compare_kernels", "run_loss_check", "run_kernel"]

MEAN_FACTOR = 1.5  # as training.parity.judge: the run's mean difference may be at most this x the floor's


def pairwise_floor(eager_runs: Sequence[Sequence[float]]) -> list[float]:
    """Per step, the largest ``|a - b|`` over every pair of eager runs (at least two runs).

    Raises:
        ValueError: fewer than two runs, or runs of different lengths.
    """
    if len(eager_runs) < 2 or len({len(r) for r in eager_runs}) != 1:
        raise ValueError(f"need >= 2 eager runs of one length, got lengths {[len(r) for r in eager_runs]}")
    return [max(abs(float(a[i]) - float(b[i])) for a, b in itertools.combinations(eager_runs, 2))
            for i in range(len(eager_runs[0]))]


def loss_verdict(compiled: Sequence[float], eager_runs: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The compiled run against the first eager run, judged against :func:`pairwise_floor`.

    Returns:
        Per step: ``diffs`` (compiled against the first eager run), ``floor_diffs`` (the pairwise
        floor), ``over_step_floor`` (the diff above that step's floor); and ``floor_max``,
        ``max_abs_loss_diff``, ``steps_over_floor`` (steps whose diff exceeds ``floor_max``),
        ``steps_over_step_floor``, ``within_floor`` (no step over ``floor_max`` and the mean diff at
        most 1.5 x the floor's mean: :func:`qlora_nb_utils.training.parity.judge`'s rule) and
        ``every_step_within_its_floor`` (the stricter, step by step).
    """
    floor = pairwise_floor(eager_runs)
    diffs = [abs(float(c) - float(e)) for c, e in zip(compiled, eager_runs[0])]
    floor_max, floor_mean = max(floor), sum(floor) / len(floor)
    over = [i for i, d in enumerate(diffs) if d > floor_max]
    over_step = [i for i, (d, f) in enumerate(zip(diffs, floor)) if d > f]
    mean = sum(diffs) / len(diffs)
    return {"steps": len(diffs), "eager_runs": len(eager_runs), "diffs": diffs, "floor_diffs": floor,
            "over_step_floor": [d > f for d, f in zip(diffs, floor)], "floor_max": floor_max,
            "floor_mean": floor_mean, "max_abs_loss_diff": max(diffs), "mean_abs_loss_diff": mean,
            "steps_over_floor": over, "steps_over_step_floor": over_step,
            "within_floor": not over and mean <= MEAN_FACTOR * floor_mean,
            "every_step_within_its_floor": not over_step}


def _benchmark_flex(bench_runs: Sequence[dict], model: str, data: str) -> dict | None:
    """The benchmark's ``ours-packed`` row of ``model``/``data`` that ran flex attention, as a kernel row."""
    for r in bench_runs:
        if (r.get("name"), r.get("model"), r.get("data")) == ("ours-packed", model, data) and "error" not in r \
                and (r.get("optimize") or {}).get("doc_attention") == "flex_attention" and r.get("parity"):
            return {**r, "loss_check": {"floor_max": r["parity"]["floor_max_abs_loss_diff"],
                                        "steps": len(r["losses"])}, "from": "runs: ours-packed (another call)"}
    return None


def compare_kernels(runs: Sequence[dict], bench_runs: Sequence[dict] = ()) -> dict[str, Any]:
    """Each kernel's losses against flex attention's, per step, with flex's floor (same batches and start).

    Flex's figures are its own kernel run, or else the benchmark's ``ours-packed`` row that ran flex
    (``bench_runs``; the entry's ``flex_from`` says which).
    """
    by = {(r["model"], r["data"], r["kernel"], r.get("scope", "whole")): r for r in runs if "error" not in r}
    out = {}
    for (model, data, kernel, scope), run in by.items():
        flex = by.get((model, data, "flex_attention", scope)) or (
            _benchmark_flex(bench_runs, model, data) if scope == "whole" else None)
        if kernel == "flex_attention" or flex is None or "loss_check" not in flex:
            continue
        n = min(len(run["losses"]), len(flex["losses"]))
        diffs = [abs(a - b) for a, b in zip(run["losses"][:n], flex["losses"][:n])]
        floor = flex["loss_check"]["floor_max"]
        out[f"{model}/{data}/{kernel}" + ("" if scope == "whole" else f"/{scope}")] = {
            "flex_from": flex.get("from", "doc_attention: flex_attention"),
            "same_call": run.get("call") is not None and run.get("call") == flex.get("call"),
            "steps": n, "diffs_vs_flex": diffs, "flex_floor_max": floor, "within_flex_floor": max(diffs) <= floor,
            "real_tokens_per_s_vs_flex": run["real_tokens_per_s"] / flex["real_tokens_per_s"],
            "peak_mem_gib_vs_flex": run["peak_mem_gib"] / flex["peak_mem_gib"]}
    return out


def _setup(model_name: str, data: str, rows: int, seq_len: int, seed: int):
    from lab.peers.packed import _full, build_data
    from qlora_nb_utils import env, models

    device, dtype = env.resolve_device_dtype("auto", "auto")
    model, tok = models.load_model(model_name, quant="nf4", lora=True, lora_r=16, lora_alpha=32, dtype=dtype,
                                   device=device, prepare_kbit=True, gradient_checkpointing=False, seed=seed)
    packed, _, info = build_data(tok, data, seq_len=seq_len, rows=rows, seed=seed)
    return model, device, dtype, _full(packed), packed, info


def _eager_runs(model, opt, batches: list, start: dict, floor_runs: int, lr: float, seed: int,
                on_run=None) -> list[list[float]]:
    """The recipe uncompiled from ``start``: the batches' order, then ``floor_runs`` permuted orders."""
    from qlora_nb_utils.training.loop import TrainConfig, load_trainable_state, train
    from qlora_nb_utils.training.parity import permute_rows

    cfg = TrainConfig(steps=len(batches), lr=lr, seed=seed, progress=False)
    runs = []
    for k in range(floor_runs + 1):
        these = batches if k == 0 else permute_rows(batches, seed=k)
        load_trainable_state(model, start)
        runs.append([float(x) for x in train(model, these, cfg, forward=opt.eager, label="eager")["loss"]])
        if on_run:
            on_run(runs)
    return runs


def _header(command: str | None) -> dict[str, Any]:
    from qlora_nb_utils import env

    return {"device": env.device_info("auto"), "versions": env.versions(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command or shlex.join(sys.argv),
            # the GPU call's id (gpu_packing_checks.sh sets it): rows sharing it ran on one machine, one after another
            "call": os.environ.get("QLORA_NB_CALL")}


def _save(out: Path, key: str, entry: dict, match: tuple[str, ...]) -> None:
    """Put ``entry`` into ``out``'s list ``key`` (``doc_attention``: its ``runs``), replacing a match."""
    from lab.peers.process import _write_json

    results = json.loads(out.read_text()) if out.is_file() else {}
    if key == "doc_attention":
        section = results.setdefault("doc_attention", {"runs": []})
        rows = section["runs"]
        for r in rows:  # rows from before the scope was recorded ran the default, one graph
            r.setdefault("scope", "whole")
    else:
        rows = results.setdefault(key, [])
    rows[:] = [r for r in rows if tuple(r.get(m) for m in match) != tuple(entry.get(m) for m in match)] + [entry]
    if key == "doc_attention":
        section["comparison"] = compare_kernels(rows, results.get("runs", []))
        section["how"] = KERNEL_HOW
    _write_json(out, results)


def run_loss_check(model_name: str, data: str, *, rows: int, seq_len: int, steps: int, floor_runs: int,
                   out: str | Path, seed: int = 0, lr: float = 2e-4, scope: str = "whole",
                   doc_attention: str = "auto", command: str | None = None) -> dict[str, Any]:
    """The ``loss`` check (module docstring), written into ``out`` after every eager run."""
    from qlora_nb_utils.compile.fast_path import optimize
    from qlora_nb_utils.training.loop import TrainConfig, train, trainable_state

    out = Path(out)
    model, device, dtype, batches, _, _ = _setup(model_name, data, rows, seq_len, seed)
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches[:steps]]
    opt = optimize(model, batches=batches, dtype=dtype, scope=scope, doc_attention=doc_attention)
    entry = {"model": model_name, "data": data, "rows": rows, "seq_len": seq_len, "lr": lr, "seed": seed,
             "scope": scope, "doc_attention": opt.choices["doc_attention"],
             "optimize": {k: str(v) for k, v in opt.choices.items()}, **_header(command), "how": LOSS_HOW}
    start = trainable_state(model)
    try:
        cfg = TrainConfig(steps=len(batches), lr=lr, seed=seed, progress=False)
        compiled = [float(x) for x in train(model, batches, cfg, forward=opt.forward, label="compiled")["loss"]]
        entry.update(compiled_losses=compiled, compilations=opt.counter.to_dict().get("compilations"))

        def save(runs):
            entry["eager_losses"] = runs
            if len(runs) >= 2:
                entry.update(loss_verdict(compiled, runs))
            _save(out, "loss_checks", entry, ("model", "data", "doc_attention", "scope"))

        _eager_runs(model, opt, batches, start, floor_runs, lr, seed, on_run=save)
    finally:
        opt.undo()
    return entry


def run_kernel(model_name: str, data: str, kernel: str, *, rows: int, seq_len: int, steps: int, warmup: int,
               parity_steps: int, floor_runs: int, out: str | Path, seed: int = 0, lr: float = 2e-4,
               epoch: bool = True, scope: str = "whole", command: str | None = None) -> dict[str, Any]:
    """The ``kernel`` run (module docstring) in ``scope``; an error row when the kernel fails."""
    import traceback

    import torch

    out = Path(out)
    entry: dict[str, Any] = {"model": model_name, "data": data, "kernel": kernel, "scope": scope, "rows": rows,
                             "seq_len": seq_len, **_header(command)}
    try:
        entry.update(_kernel_run(model_name, data, kernel, rows, seq_len, steps, warmup, parity_steps, floor_runs,
                                 seed, lr, epoch, scope))
    except Exception as exc:  # the row says what blocked the kernel
        entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        entry["traceback_tail"] = traceback.format_exc()[-3000:]
    if torch.cuda.is_available():
        entry.setdefault("max_memory_allocated_gib", torch.cuda.max_memory_allocated() / 2**30)
    _save(out, "doc_attention", entry, ("model", "data", "kernel", "scope"))
    return entry


def _kernel_run(model_name, data, kernel, rows, seq_len, steps, warmup, parity_steps, floor_runs, seed, lr,
                epoch, scope="whole") -> dict[str, Any]:
    import torch

    from lab.peers.results import summarize_run
    from qlora_nb_utils import diagnostics
    from qlora_nb_utils.compile.fast_path import optimize
    from qlora_nb_utils.ops.doc_attention import document_attention_kwargs
    from qlora_nb_utils.training.loop import TrainConfig, train, trainable_state

    model, device, dtype, timed, every, _ = _setup(model_name, data, rows, seq_len, seed)
    timed = timed[:steps]
    opt = optimize(model, batches=timed, dtype=dtype, doc_attention=kernel, scope=scope)
    start = trainable_state(model)
    try:
        hist = train(model, timed, TrainConfig(steps=len(timed), lr=lr, seed=seed, progress=False),
                     forward=opt.forward, label=kernel)
        run = summarize_run(kernel, losses=list(hist["loss"]), step_ms=list(hist["step_ms"]),
                            tokens=list(hist["tokens"]), peak_mem_gib=float(hist["peak_mem_gib"].max()),
                            batch_size=rows, seq_len=seq_len, warmup=warmup, notes=opt.description)
        run["compilations"] = opt.counter.to_dict().get("compilations")
        run["optimize"] = {k: str(v) for k, v in opt.choices.items()}
        if epoch:  # a forward and backward of every packed batch of the epoch, as ours-packed's check
            for batch in every:
                opt.forward(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
                model.zero_grad(set_to_none=True)
            run.update(epoch_batches=len(every), epoch_compilations=opt.counter.to_dict().get("compilations"),
                       epoch_recompilations=opt.counter.to_dict().get("recompilations"))
        k = min(parity_steps, len(timed))
        first = [{kk: v.to(device) for kk, v in b.items()} for b in timed[:k]]
        eager = _eager_runs(model, opt, first, start, floor_runs, lr, seed)
        run["loss_check"] = loss_verdict(run["losses"][:k], eager) | {"eager_losses": eager}
        kw = opt.prepare(**first[0])
        kw.update(document_attention_kwargs(kw.pop("document_ids"), opt.choices["doc_attention"]))
        with torch.autocast(device.type, dtype=dtype, enabled=bool(opt.choices["autocast"])):
            report = diagnostics.graph_breaks(opt.module, **kw)  # resets Dynamo: the last thing here
        run.update(graph_breaks=int(report.graph_break_count), graph_count=int(report.graph_count))
    finally:
        opt.undo()
    run.pop("name", None)
    return run


LOSS_HOW = ("optimize() on the first packed batches (the benchmark's batches, the same LoRA start), then the "
            "recipe uncompiled (Optimized.eager) from that start: eager_losses[0] in the batches' order, the others "
            "with the rows of each batch permuted (seeds 1..n). floor_diffs: per step, the largest difference "
            "between any two eager runs; diffs: the compiled run against eager_losses[0]. within_floor: no step over "
            "floor_max and the mean diff at most 1.5 x the floor's mean (training.parity.judge's rule); "
            "every_step_within_its_floor: each step's diff at most that step's floor.")
KERNEL_HOW = ("each kernel: its own process, optimize(doc_attention=kernel) making every other choice, timed on "
              "the benchmark's packed batches (real tokens/s: median after warm-up, peak GiB of the timed steps); "
              "epoch_compilations after a forward and backward of every packed batch; graph_breaks: "
              "torch._dynamo.explain of the compiled module on a packed batch, its mask or cuts built outside; "
              "loss_check: the first steps against the recipe uncompiled (floor: every pair of eager runs). "
              "comparison: per step |loss - flex's loss| on the same batches from the same LoRA start, against "
              "flex's floor_max.")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m lab.peers.packed_checks",
                                description=__doc__.split("\n")[0])
    p.add_argument("check", choices=("loss", "kernel"))
    p.add_argument("--model", required=True)
    p.add_argument("--data", default="kjv")
    p.add_argument("--kernel", default="flex_attention", help="kernel: the doc_attention asked of optimize()")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--parity-steps", type=int, default=4)
    p.add_argument("--floor-runs", type=int, default=3, help="permuted eager runs beside the one in order")
    p.add_argument("--scope", default="whole", choices=("whole", "regional"))
    p.add_argument("--no-epoch", action="store_true")
    p.add_argument("--command", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.check == "loss":
        r = run_loss_check(a.model, a.data, rows=a.rows, seq_len=a.seq_len, steps=a.steps, floor_runs=a.floor_runs,
                           out=a.out, scope=a.scope, command=a.command)
        print(json.dumps({k: r.get(k) for k in ("diffs", "floor_diffs", "within_floor",
                                                "every_step_within_its_floor")}))
    else:
        r = run_kernel(a.model, a.data, a.kernel, rows=a.rows, seq_len=a.seq_len, steps=a.steps, warmup=a.warmup,
                       parity_steps=a.parity_steps, floor_runs=a.floor_runs, out=a.out, epoch=not a.no_epoch,
                       scope=a.scope, command=a.command)
        print(json.dumps({k: r.get(k) for k in ("kernel", "real_tokens_per_s", "peak_mem_gib", "compilations",
                                                "epoch_compilations", "graph_breaks", "error")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
