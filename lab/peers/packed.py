"""The packing benchmark: packed and padded training of the same examples, one process per run.

Why it exists: issue 19's question is real (non-pad) tokens per second at a given memory, so
every run here trains the same examples, packed (:func:`qlora_nb_utils.data.packing.pack_examples`,
best-fit decreasing into rows of ``seq_len``) or padded (one example per row, fixed padding to
``seq_len``, the padding collator :func:`qlora_nb_utils.data.build_batches` uses), and counts
its tokens one way: :func:`qlora_nb_utils.data.packing.real_tokens` of each step's batch as
written. Packed and padded batches have the same shape ``(rows, seq_len)``, so a padded step
does the same work on fewer real tokens; every packed run trains the very same packed batches
(the same documents and real tokens per step), each library its own way
(:mod:`lab.peers.packed_batches`):

* ``ours-packed`` / ``ours-padded``: :func:`qlora_nb_utils.optimize` making every choice, on the
  packed / padded batches; ``ours-packed`` also counts the compilations over one whole epoch of
  packed batches and compares its loss with the recipe uncompiled (:mod:`.ours`).
* ``ours-lowmem-packed``: ``ours-packed`` with ``optimize(max_memory_gib=T)``, checkpointing (and
  offload) chosen by optimize()'s estimate to fit T. T is ``--lowmem-gib``: a number, or
  ``unsloth`` (the default): the lowest peak of the Unsloth runs (``unsloth``, ``unsloth-packed``)
  already measured on the same model and data in this results file, so the run is held to
  Unsloth's memory at every shape without a per-model constant (the first 1B row used a fixed
  9.5 GiB, under Unsloth's 9.61). The row records T and where it came from.
* ``hf-eager-packed`` / ``hf-eager``: the HF recipe eager; packed through transformers' own
  restarting-``position_ids`` path (SDPA).
* ``trl-sft-packed``: TRL ``SFTTrainer(padding_free=True)``, eager.
* ``unsloth-packed`` / ``unsloth``: Unsloth's padding-free input, or padded.

A run that cannot run is a row with ``error`` (what blocked it). The results file is rewritten
after every run (a time-out loses only that run). A run whose expected seconds (``needs_s``) no
longer fit the budget is skipped with that reason, so a cheaper run after it can still go. Data sets: ``kjv`` (the shipped
``data/kjv_continue_train.jsonl``) and ``long-tail`` (:mod:`lab.lengths`).

    python -m lab.peers.packed --model llama-3.2-1b-shape --data kjv,long-tail \\
        --seq-len 1024 --rows 8 --steps 12 --warmup 4 --out lab/results/packing/packing_h100.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["RUNS", "LIBRARY", "build_data", "lowmem_target", "run_packing"]

#: Every run of the benchmark, in the order they are run (most wanted first).
RUNS = ("ours-packed", "ours-padded", "unsloth-packed", "hf-eager-packed", "trl-sft-packed", "hf-eager", "unsloth",
        "ours-lowmem-packed")
LIBRARY = {"ours": "ours", "hf": "hf", "trl": "trl", "unsloth": "unsloth"}
DATA_SETS = ("kjv", "long-tail")
#: Runs whose library flattens a packed batch into one row without its tail padding.
_FLATTENED = ("trl-sft-packed", "unsloth-packed")
_UNSLOTH_RUNS = ("unsloth", "unsloth-packed")


def lowmem_target(runs: Sequence[dict], model: str, data: str, spec: str | float) -> tuple[float | None, str]:
    """``ours-lowmem-packed``'s ``max_memory_gib`` and where it comes from.

    Args:
        runs: the results file's rows so far.
        model: the model of the run.
        data: its data set.
        spec: a number (GiB, taken as it is), or ``"unsloth"``: the lowest ``peak_mem_gib`` of the
            error-free Unsloth rows of the same model and data.

    Returns:
        ``(gib, how)``; ``gib`` is None (and ``how`` says why) when no Unsloth row can give it.

    Raises:
        ValueError: ``spec`` is neither a positive number nor ``"unsloth"``.
    """
    if spec != "unsloth":
        try:
            gib = float(spec)
        except (TypeError, ValueError):
            gib = -1.0
        if not gib > 0:
            raise ValueError(f"lowmem_gib must be a number > 0 or 'unsloth', got {spec!r}")
        return gib, f"--lowmem-gib {gib:g}"
    peaks = {r["name"]: r["peak_mem_gib"] for r in runs if r["model"] == model and r["data"] == data
             and r["name"] in _UNSLOTH_RUNS and "error" not in r and r.get("peak_mem_gib")}
    if not peaks:
        return None, (f"no Unsloth peak measured on {model} / {data} to hold to (run unsloth or unsloth-packed "
                      "first, or pass --lowmem-gib N)")
    name = min(peaks, key=peaks.get)
    return peaks[name], f"the lowest Unsloth peak on this model and data: {name} {peaks[name]:.2f} GiB"


def _library(name: str) -> str:
    return LIBRARY[name.split("-")[0]]


def build_data(tokenizer: Any, data: str, *, seq_len: int, rows: int, seed: int = 0,
               long_tail_examples: int = 800) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """The packed and the padded batches of the same examples, and what they hold.

    Args:
        tokenizer: the model's tokenizer (pad token, vocabulary size).
        data: ``"kjv"`` (the shipped data) or ``"long-tail"``.
        seq_len: the row length of both.
        rows: rows per batch of both.
        seed: the order of the packed rows and of the padded examples.
        long_tail_examples: how many examples ``long-tail`` draws.

    Returns:
        ``(packed, padded, info)``: the batches, and ``info`` (source, examples, tokens, the
        packing stats, the padded batches' pad fraction, examples cut to ``seq_len``).

    Raises:
        ValueError: an unknown data set.
    """
    from lab.lengths import long_tail_examples as draw
    from qlora_nb_utils import data as qdata

    if data == "kjv":
        examples = qdata.tokenize_examples(qdata.load_examples(None), tokenizer, max_len=1 << 20)
        source = "the shipped data/kjv_continue_train.jsonl, tokenized with the model's tokenizer"
    elif data == "long-tail":
        examples = draw(long_tail_examples, len(tokenizer), seed=seed)
        from lab import lengths as lt

        source = (f"synthetic token sequences, lengths log-normal (sigma {lt.LOGNORMAL_SIGMA}) with mean "
                  f"{lt.SHAREGPT_PROMPT_MEAN} + {lt.SHAREGPT_COMPLETION_MEAN} tokens, ShareGPT's per-round prompt and "
                  "completion means as recalled from arXiv:2306.04751 Table 1, not verified "
                  "(lab.lengths: source, numbers and assumptions)")
    else:
        raise ValueError(f"unknown data set {data!r}; valid: {list(DATA_SETS)}")
    pad = tokenizer.pad_token_id
    packed, stats = qdata.pack_examples(examples, seq_len, rows_per_batch=rows, pad_id=pad, truncate=True, seed=seed)
    cut = [{"input_ids": list(e["input_ids"])[:seq_len], "labels": list(e["labels"])[:seq_len]} for e in examples]
    if data == "kjv":  # the one builder (it tokenizes again, with its cut at seq_len: the same examples)
        padded = qdata.build_batches(tokenizer, batch_size=rows, steps=1 << 30, max_len=seq_len, padding="fixed",
                                     seed=seed)
    else:
        collator = qdata.PaddingCollator(pad_token_id=pad, policy="fixed", max_length=seq_len)
        padded = list(qdata.make_batches(cut, rows, collator, seed=seed))
    padded_real = sum(qdata.real_tokens(b) for b in padded)
    lengths = sorted(len(e["input_ids"]) for e in examples)
    info = {"source": source, "examples": len(examples), "seq_len": seq_len, "rows": rows,
            "lengths": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1],
                        "mean": sum(lengths) / len(lengths), "over_seq_len": sum(n > seq_len for n in lengths)},
            "packing": stats.to_dict(), "packed_batches": len(packed), "padded_batches": len(padded),
            "padded_pad_fraction": 1 - padded_real / sum(b["input_ids"].numel() for b in padded),
            "padded_real_tokens": padded_real,
            "padded_how": "one example per row, cut at seq_len, fixed padding to seq_len; the last partial batch "
                          "dropped (data.make_batches drop_last)"}
    return packed, padded, info


def _full(packed: list[dict]) -> list[dict]:
    """The packed batches without all-padding rows (the last batch's filler), for the timed runs."""
    return [b for b in packed if bool((b["document_ids"] != -1).any(dim=1).all())]


def _pad_fraction(batches: list[dict], steps: int) -> float:
    from qlora_nb_utils.data.packing import real_tokens

    used = [batches[i % len(batches)] for i in range(steps)]
    return 1 - sum(real_tokens(b) for b in used) / sum(b["input_ids"].numel() for b in used)


def _row(run: dict, *, model: str, data: str, packed: bool, pad_fraction: float) -> dict:
    name = run["name"]
    compilations = run.get("compilations")
    if compilations is None and name in ("hf-eager", "hf-eager-packed", "trl-sft-packed") and "error" not in run:
        compilations = 0  # eager: nothing compiled by the peer
    row = {"name": name, "library": _library(name), "model": model, "data": data, "packed": packed,
           "real_tokens_per_s": run.get("real_tokens_per_s", run.get("tokens_per_s")),
           "peak_mem_gib": run.get("peak_mem_gib"), "pad_fraction": pad_fraction, "compilations": compilations,
           "median_step_ms": run.get("median_step_ms"), "steps": run.get("steps")}
    if "error" in run:
        row["error"] = run["error"]
    keep = ("batch_size", "seq_len", "warmup", "losses", "step_ms", "compile_s", "first_step_s", "notes", "options",
            "optimize", "epoch_batches", "epoch_compilations", "epoch_how", "parity", "max_abs_loss_diff",
            "real_tokens", "versions", "traceback_tail", "wall_s", "memory_target")
    return row | {k: run[k] for k in keep if k in run}


def run_packing(model: str, data_sets: Sequence[str], *, seq_len: int, rows: int, steps: int, warmup: int,
                out: str | Path, runs: Sequence[str] = RUNS, seed: int = 0, lr: float = 2e-4,
                parity_steps: int = 6, long_tail_examples: int = 800, timeout_s: dict[str, float] | None = None,
                budget_s: float | None = None, command: str | None = None, epoch_data: Sequence[str] | None = None,
                data_outer: bool = False, needs_s: dict[str, float] | None = None, lowmem_gib: str | float = "unsloth",
                lowmem_scope: str = "whole",
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run each of ``runs`` on each data set in a process of its own; rows appended to ``out``.

    An existing ``out`` keeps its rows of other (model, data, name). A run that would start with
    less than ``needs_s[name]`` (default 30) seconds of ``budget_s`` left is a row with ``error``
    ("skipped"), and the next run is tried. ``lowmem_gib``: see :func:`lowmem_target`. ``epoch_data``: the
    data sets on which ``ours-packed`` runs the epoch check (default: all); ``data_outer``: every
    run on the first data set before any on the next (default: each run on every data set first).

    Raises:
        ValueError: an unknown run or data set, or ``warmup >= steps`` (before anything runs).
    """
    import torch

    from lab.peers.process import _write_json
    from qlora_nb_utils import env, models

    bad = [r for r in runs if r not in RUNS] + [d for d in data_sets if d not in DATA_SETS]
    if bad or not 0 <= warmup < steps:
        raise ValueError(f"unknown runs/data {bad} (valid: {list(RUNS)}, {list(DATA_SETS)}) or warmup >= steps")
    t0 = time.monotonic()
    out = Path(out)
    work = Path(tempfile.mkdtemp(prefix="packing_"))
    dev = env.resolve_device("auto")
    results = json.loads(out.read_text()) if out.is_file() else {}
    results.update({"device": env.device_info(dev), "versions": env.versions(),
                    "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "command": command or shlex.join(sys.argv)})
    results.setdefault("calls", []).append({k: results[k] for k in ("command", "date")})
    results.setdefault("runs", [])
    results.setdefault("data", {})
    tok = models.load_tokenizer(model)
    base = {"model": model, "steps": steps, "warmup": warmup, "lr": lr, "seed": seed, "lora_r": 16,
            "lora_alpha": 32, "device": str(dev), "dtype": "auto", "grad_ckpt": False, "peak_tflops": None}
    prepared = {}
    for data in data_sets:
        packed, padded, info = build_data(tok, data, seq_len=seq_len, rows=rows, seed=seed,
                                          long_tail_examples=long_tail_examples)
        results["data"][f"{model}/{data}"] = info
        timed = _full(packed)
        files = {"packed": work / f"{data}_packed.pt", "padded": work / f"{data}_padded.pt",
                 "epoch": work / f"{data}_epoch.pt"}
        torch.save(timed, files["packed"])
        torch.save(padded, files["padded"])
        torch.save(packed, files["epoch"])
        prepared[data] = (timed, padded, files)
        log(f"== {model} / {data}: {info['examples']} examples, packed pad fraction "
            f"{info['packing']['pad_fraction']:.3f}, padded {info['padded_pad_fraction']:.3f}")
    order = ([(n, d) for d in data_sets for n in runs] if data_outer  # a budget cut loses the last pairs only
             else [(n, d) for n in runs for d in data_sets])
    for name, data in order:
        timed, padded, files = prepared[data]
        is_packed = name.endswith("-packed")
        batches = timed if is_packed else padded
        n = min(steps, len(batches))
        limit = (timeout_s or {}).get(name, (timeout_s or {}).get("default", 300))
        if budget_s is not None:
            limit = min(limit, budget_s - (time.monotonic() - t0))
        needs = (needs_s or {}).get(name, 30)
        ctx = {**base, "batch_size": rows, "seq_len": seq_len}
        held = None
        if name == "ours-lowmem-packed":
            gib, how = lowmem_target(results["runs"], model, data, lowmem_gib)
            held = {"max_memory_gib": gib, "from": how, "scope": lowmem_scope}
            ctx["variants"] = {"lowmem-packed": {"auto": True, "max_memory_gib": gib, "scope": lowmem_scope}}
        results["runs"] = [r for r in results["runs"] if (r["model"], r["data"], r["name"]) != (model, data, name)]
        if held and held["max_memory_gib"] is None:
            run = {"name": name, "error": f"not run: {held['from']}"}
        elif limit < needs:
            run = {"name": name, "error": f"skipped: {limit:.0f} s of the budget left, it needs about {needs:.0f} s"}
        else:
            log(f"==> {name} on {data} ({n} steps, limit {limit:.0f} s)" + (f", held to {held}" if held else ""))
            epoch = epoch_data is None or data in epoch_data
            run = _one_run(name, data, n, limit, ctx, files if epoch else {**files, "epoch": None}, work,
                           parity_steps, warmup)
        if held:
            run["memory_target"] = held
        frac = 0.0 if name in _FLATTENED else _pad_fraction(batches, n)
        row = _row(run, model=model, data=data, packed=is_packed, pad_fraction=frac)
        results["runs"].append(row)
        _write_json(out, results)
        log(f"    {name}: " + (f"ERROR {row['error'][:300]}" if "error" in row else
                               f"{row['real_tokens_per_s']:.0f} real tok/s, {row['peak_mem_gib']:.2f} GiB, "
                               f"{row['median_step_ms']:.1f} ms/step, compilations {row['compilations']}"))
    results["notes"] = NOTES
    _write_json(out, results)
    return results


def _one_run(name: str, data: str, steps: int, limit: float, base: dict, files: dict, work: Path,
             parity_steps: int, warmup: int) -> dict:
    """One run in a process of its own (Unsloth's through its launcher); its run dict, or an error."""
    from lab.peers.process import _child_env, _run_child, _write_json
    from lab.peers.unsloth_launcher import _peer_unsloth

    is_packed = name.endswith("-packed")
    ctx = {**base, "name": name, "steps": steps, "warmup": min(warmup, steps - 1)}
    if name == "ours-packed":
        ctx["extra"] = {"epoch_batches": files["epoch"] and str(files["epoch"]),
                        "parity_steps": min(parity_steps, steps)}
    t0 = time.monotonic()
    batches = str(files["packed" if is_packed else "padded"])
    if name.startswith("unsloth"):
        run = _peer_unsloth(ctx, None, batches, limit)
    else:
        spec, run_path = work / f"spec_{data}_{name}.json", work / f"run_{data}_{name}.json"
        _write_json(spec, {**ctx, "batches": batches})
        # one Inductor cache for our runs (the same graph compiles once); a fresh one for any other
        cache = work / "inductor_ours" if name.startswith("ours") else Path(tempfile.mkdtemp(dir=work))
        cmd = [sys.executable, "-m", "lab.peers", "--spec", str(spec), "--out", str(run_path)]
        code, tail = _run_child(cmd, _child_env(name, cache), limit, work / f"log_{data}_{name}.txt")
        run = json.loads(run_path.read_text()) if run_path.is_file() else {"name": name, "error": (
            f"timed out after {limit:.0f} s" if code is None else f"exit code {code}") + f": {tail}"}
    run["wall_s"] = time.monotonic() - t0
    return run


NOTES = (
    "real_tokens_per_s: median over the steps after warm-up of real (non-pad) tokens / step time, the tokens "
    "counted by qlora_nb_utils.data.packing.real_tokens on each step's batch as written to the batches file, "
    "the same way for every library (Unsloth's child included). Packed and padded batches have one shape "
    "(rows x seq_len); packed runs train the very same packed batches (same documents, same real tokens per "
    "step); padded runs train the same examples one per row. pad_fraction: of the batches the run computed on "
    "(0 for trl-sft-packed and unsloth-packed, whose libraries flatten a packed batch into one row without its "
    "tail padding). compilations: optimize()'s counter for ours; 0 for the eager peers; null where the library "
    "compiles pieces of its own that are not counted (Unsloth). Each run is a process of its own; our two runs "
    "share one Inductor cache (the second data set's compile is warm: its compile_s is not a cold compile).")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m lab.peers.packed", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=",".join(DATA_SETS))
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--parity-steps", type=int, default=6)
    p.add_argument("--long-tail-examples", type=int, default=800)
    p.add_argument("--timeouts", default="{}", help='JSON: run name (or "default") -> seconds')
    p.add_argument("--needs", default="{}", help='JSON: run name -> the seconds it needs to start (default 30)')
    p.add_argument("--lowmem-gib", default="unsloth", help="ours-lowmem-packed's max_memory_gib: N or 'unsloth'")
    p.add_argument("--lowmem-scope", default="whole", choices=("whole", "regional"),
                   help="ours-lowmem-packed's optimize() scope (regional: one layer's compile, ~15 s at 8B)")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--epoch-data", default=None, help="data sets of ours-packed's epoch check (default: all)")
    p.add_argument("--data-outer", action="store_true", help="every run on one data set before the next")
    p.add_argument("--command", default=None, help="the command line to record")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    run_packing(a.model, a.data.split(","), seq_len=a.seq_len, rows=a.rows, steps=a.steps, warmup=a.warmup,
                out=a.out, runs=a.runs.split(","), parity_steps=a.parity_steps,
                long_tail_examples=a.long_tail_examples, timeout_s=json.loads(a.timeouts), budget_s=a.budget_s,
                command=a.command, epoch_data=a.epoch_data.split(",") if a.epoch_data else None,
                data_outer=a.data_outer, needs_s=json.loads(a.needs), lowmem_gib=a.lowmem_gib,
                lowmem_scope=a.lowmem_scope)
    return 0


if __name__ == "__main__":
    sys.exit(main())
