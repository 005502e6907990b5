"""``qlora-nb train``: fine-tune a model on your data through the fast path, and keep the result.

Why it exists: everything else in the package measures; this is what a user runs to get an
adapter. It is the measured recipe end to end: the model loaded as QLoRA (NF4 base, LoRA on
every linear layer), compiled by :func:`qlora_nb_utils.compile.optimize` (which says what it
chose), trained by the package's own loop (:func:`~qlora_nb_utils.training.loop.train`), judged
on held-out examples (:func:`~qlora_nb_utils.training.evaluation.evaluate`), and saved as a PEFT
adapter that ``PeftModel.from_pretrained`` loads. What a run leaves in ``out``: ``adapter/``,
``checkpoint/`` (resumable, :mod:`.checkpoint`), ``metrics.json`` and ``loss_curve.png``.

Decisions, and why:

* **Bad input fails first.** :func:`check_options` runs before any model loads (a wrong folder,
  mode, backend, data file, or a ``--resume`` that does not match the checkpoint fails in
  seconds, not after minutes of loading), and an output folder holding a run is never
  overwritten unless asked.
* **Padding: buckets of a quarter of ``seq_len``** (``PaddingCollator`` ``"multiple"``), so at
  most 4 batch shapes. On a GPU that lets ``optimize`` choose CUDA graphs (one per shape); on a
  CPU it compiles once (several lengths are marked dynamic from the first call, one length is
  static). ``"longest"`` wastes fewer pad tokens but shows many shapes, so no CUDA graphs;
  ``"fixed"`` shows one shape but pads every short example to ``seq_len``. At ``seq_len`` 128 on
  the shipped data nearly every row is cut to 128, so the buckets are one shape there.
* **Packing where it pays** (``packing="auto"``): when the bucketed batches would be more than
  :data:`PACK_WHEN_PADDING_OVER` padding, the epoch is packed instead (whole examples in rows of
  ``seq_len``, each attending to itself only: :func:`~qlora_nb_utils.data.build_packed_batches`),
  and the choice is stated with both pad fractions. On the shipped data at ``seq_len`` 128
  nearly every example fills a row, so nothing is packed; at 1024 a padded batch is mostly
  padding. The held-out batches stay padded: the loss per learned token is the same either way.
* **Data order from the seed**: the batches of one epoch are built in a seeded order and step
  ``i`` trains on batch ``i mod len``, so a resumed run sees what the uninterrupted one saw.
* **LR**: linear warm-up, then constant; a resume with a larger ``steps`` simply goes on.
* **Defaults fit a laptop CPU**: SmolLM2-135M (real weights, so the losses mean something),
  batch 4 x 128 tokens, 60 steps, held-out loss every 20 steps on 32 examples: 3 min 15 s on 2
  CPU cores from a cold compile cache (94 s compiling), 2 min 28 s warm; the held-out loss goes
  from 3.99 to 3.40.
"""

from __future__ import annotations

import datetime as _dt
import json
import shlex
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from .checkpoint import (
    CHECKPOINT,
    FinetuneInterrupted,
    StopSignals,
    check_resume,
    data_fingerprint,
    latest_checkpoint,
    model_fingerprint,
)

__all__ = ["DEFAULTS", "OUTPUTS", "PACK_WHEN_PADDING_OVER", "check_options", "build_finetune_batches", "finetune",
           "run_meta"]

#: The options of :func:`finetune` and their defaults (the CLI's defaults too).
DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m", "data": None, "steps": 60, "batch_size": 4, "seq_len": 128, "lr": 2e-4,
    "warmup_steps": 5, "lora_r": 16, "lora_alpha": 32, "eval_every": 20, "eval_size": 32, "save_every": 20,
    "mode": "auto", "backend": "inductor", "max_memory_gib": None, "grad_ckpt": "auto", "device": "auto",
    "dtype": "auto", "seed": 0, "check_parity": 0, "packing": "auto",
}
#: ``packing="auto"`` packs when the padded batches would hold more than this share of padding.
PACK_WHEN_PADDING_OVER = 0.25
#: What ``packing`` accepts.
PACKING_CHOICES = ("auto", True, False)
#: What a run writes into its output folder (``--overwrite`` removes exactly these).
OUTPUTS = ("metrics.json", "loss_curve.png", "adapter", CHECKPOINT, CHECKPOINT + ".tmp", CHECKPOINT + ".old")
_POSITIVE = ("steps", "batch_size", "seq_len", "lora_r")
_NON_NEGATIVE = ("warmup_steps", "eval_every", "save_every", "check_parity")


def run_meta(opts: dict[str, Any]) -> dict[str, Any]:
    """The identity of a run (``meta.json``): what a resumed run must share with the checkpoint."""
    keys = ("lora_r", "lora_alpha", "batch_size", "seq_len", "eval_size", "seed", "packing")
    return {**model_fingerprint(opts["model"]), **data_fingerprint(opts["data"]), "quant": "nf4",
            **{k: opts[k] for k in keys}}


def _check_numbers(opts: dict[str, Any]) -> None:
    for key in _POSITIVE:
        if not isinstance(opts[key], int) or opts[key] < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {opts[key]!r}")
    for key in _NON_NEGATIVE:
        if not isinstance(opts[key], int) or opts[key] < 0:
            raise ValueError(f"{key} must be an integer >= 0, got {opts[key]!r}")
    if opts["seq_len"] < 8:
        raise ValueError(f"seq_len must be >= 8, got {opts['seq_len']}")
    if opts["eval_size"] is None or opts["eval_size"] < 1:
        raise ValueError(f"eval_size must be an integer >= 1, got {opts['eval_size']!r}")
    for key in ("lr", "lora_alpha"):
        if not opts[key] > 0:
            raise ValueError(f"{key} must be > 0, got {opts[key]!r}")
    if opts["max_memory_gib"] is not None and not opts["max_memory_gib"] > 0:
        raise ValueError(f"max_memory_gib must be > 0, got {opts['max_memory_gib']!r}")
    if opts["grad_ckpt"] not in ("auto", True, False):
        raise ValueError(f"grad_ckpt must be 'auto', True or False, got {opts['grad_ckpt']!r}")
    if opts["packing"] not in PACKING_CHOICES:
        raise ValueError(f"packing must be 'auto', True or False, got {opts['packing']!r}")


def check_options(*, out: str | Path, resume: bool = False, overwrite: bool = False,
                  **options: Any) -> dict[str, Any]:
    """Check every option of :func:`finetune` without loading a model; return them completed.

    Checked: the numbers, the model (:func:`qlora_nb_utils.models.check_model_source`), ``mode``
    (``compile.fast_path.MODES``), ``backend`` (``compile.valid_backends()``), device and dtype
    names, the data (``data.validate_source``, line by line), the output folder (a folder
    holding a run is refused without ``resume`` or ``overwrite``) and, with ``resume``, the
    checkpoint (it must exist, be of this run, per ``meta.json``, and have steps left).

    Returns:
        The options (defaults filled in) plus ``out``, ``resume``, ``overwrite``, ``meta`` and,
        with ``resume``, ``resume_history``.

    Raises:
        ValueError: a bad option, model, mode, backend, data (``DataFormatError``), a folder that
            holds a run, or a checkpoint of another run or with no steps left.
        FileNotFoundError: the data, or (with ``resume``) the checkpoint, does not exist.
    """
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    opts = {**DEFAULTS, **options}
    _check_numbers(opts)
    from .. import env
    from ..compile import valid_backends
    from ..compile.fast_path import MODES
    from ..data import validate_source
    from ..models import check_model_source

    check_model_source(opts["model"])
    if opts["mode"] not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {opts['mode']!r}")
    if opts["backend"] not in valid_backends():
        raise ValueError(f"backend must be one of {valid_backends()}, got {opts['backend']!r}")
    env.resolve_device_dtype(opts["device"], opts["dtype"])
    n = validate_source(opts["data"])
    if n <= opts["batch_size"]:
        raise ValueError(f"the data has {n} example(s): too few for batches of {opts['batch_size']} "
                         "plus held-out examples")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if resume and overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite deletes it: pass one")
    held = [name for name in ("metrics.json", CHECKPOINT, CHECKPOINT + ".old") if (out / name).exists()]
    if held and not (resume or overwrite):
        raise ValueError(f"{out} already holds a run ({', '.join(held)}); pass --resume to continue it "
                         "or --overwrite to start anew, or choose another --out")
    opts.update(out=out, resume=resume, overwrite=overwrite, meta=run_meta(opts))
    if resume:
        history = check_resume(out, opts["meta"])
        if history["steps_done"] >= opts["steps"]:
            raise ValueError(f"--resume: the checkpoint in {out} has done {history['steps_done']} steps already; "
                             f"pass --steps larger than that to train further")
        opts["resume_history"] = history
    return opts


def _bucket(seq_len: int) -> int:
    """A quarter of ``seq_len``, rounded up to a multiple of 8: at most 4 padded lengths."""
    return ((seq_len + 3) // 4 + 7) // 8 * 8


def build_finetune_batches(tokenizer: Any, *, data: str | Path | None = None, batch_size: int = 4,
                           seq_len: int = 128, seed: int = 0, eval_size: int = 32,
                           log: Callable[[str], None] | None = None,
                           packing: bool | str = False) -> tuple[list, list, dict]:
    """The training and held-out batches of a run, and the held-out example shown as a sample.

    Training: one epoch of the training split, tokenized (prompt masked), shuffled by ``seed``,
    in batches of ``batch_size`` padded to buckets of a quarter of ``seq_len`` (module
    docstring), or packed (``packing=True``; ``"auto"``: packed when the padded batches would be
    more than :data:`PACK_WHEN_PADDING_OVER` padding, the choice logged). Held out:
    ``data.load_splits(eval_size)``'s held-out split, in order, padded. The same arguments give
    the same batches (what ``--resume`` relies on).

    Returns:
        ``(train_batches, heldout_batches, sample_example)``: lists of dicts of CPU tensors, and
        the first held-out example as it is in the data.
    """
    from ..data import (
        UNCUT,
        PaddingCollator,
        cut_tokenized,
        load_splits,
        make_batches,
        pack_tokenized,
        padding_stats,
        tokenize_examples,
    )

    train_ds, held_ds = load_splits(data, max_eval=eval_size, seed=seed)
    whole = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if packing is not False:  # tokenized once, whole: cut here for the padded batches, packed below
            whole = tokenize_examples(train_ds, tokenizer, max_len=UNCUT, cache=True)  # a restart reads it back
            rows = cut_tokenized(whole, seq_len)
        else:
            rows = tokenize_examples(train_ds, tokenizer, max_len=seq_len, cache=True)
        held = tokenize_examples(held_ds, tokenizer, max_len=seq_len, cache=True)
    for w in caught:
        (log or print)(f"note: {w.message} (--seq-len {seq_len})")
    collator = PaddingCollator(pad_token_id=tokenizer.pad_token_id, policy="multiple",
                               multiple_of=_bucket(seq_len), max_length=seq_len)
    train = list(make_batches(rows, batch_size, collator, seed=seed))
    heldout = list(make_batches(held, batch_size, collator, shuffle=False, drop_last=False))
    if packing is not False:
        waste = padding_stats(train)["waste_fraction"]
        if packing is True or waste > PACK_WHEN_PADDING_OVER:
            train, stats = pack_tokenized(whole, batch_size=batch_size, max_len=seq_len,
                                          pad_id=tokenizer.pad_token_id, seed=seed)
            why = "asked for" if packing is True else f"padded batches would be {waste:.0%} padding"
            (log or print)(f"==> packing: on ({why}): {len(train)} packed batches, {stats.pad_fraction:.0%} "
                           f"padding, {stats.truncated} example(s) cut to {seq_len} tokens")
        else:
            (log or print)(f"==> packing: off (padded batches are {waste:.0%} padding, "
                           f"<= {PACK_WHEN_PADDING_OVER:.0%})")
    else:
        (log or print)(f"==> packing: off (asked for): padded batches are "
                       f"{padding_stats(train)['waste_fraction']:.0%} padding")
    return train, heldout, dict(held_ds[0])


def _clear(out: Path) -> None:
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _resume_command(command: str | None, out: Path) -> str:
    if not command:
        return f"finetune(..., out={str(out)!r}, resume=True)"
    words = [w for w in shlex.split(command) if w != "--overwrite"]
    return shlex.join(words + ([] if "--resume" in words else ["--resume"]))


def finetune(*, out: str | Path = "runs/train", resume: bool = False, overwrite: bool = False, progress: bool = True,
             log: Callable[[str], None] = print, command: str | None = None, **options: Any) -> dict[str, Any]:
    """Fine-tune a model with QLoRA through the fast path; write adapter, checkpoint and metrics.

    Args:
        out: the output folder (module docstring); refused when it holds a run, unless
            ``resume`` or ``overwrite``.
        resume: continue the run in ``out`` from its checkpoint (same options; ``steps`` may grow).
        overwrite: delete the run in ``out`` first.
        progress: show a tqdm bar (loss, tokens/s, time left).
        log: where status lines go.
        command: the command line, recorded in the metrics and used for the resume hint.
        **options: any of :data:`DEFAULTS`: ``model`` (a name of ``models.MODEL_NAMES`` or a
            folder), ``data`` (None: the shipped data; a JSONL file or a ``save_to_disk``
            folder), ``steps``, ``batch_size``, ``seq_len``, ``lr``, ``warmup_steps``,
            ``lora_r``, ``lora_alpha``, ``eval_every`` / ``save_every`` (0: only at the end),
            ``eval_size``, ``mode``, ``backend``, ``max_memory_gib``, ``grad_ckpt``, ``packing``
            (``"auto"``: packed where padding would waste more than a quarter; True, False),
            (``"auto"``, True, False), ``device``, ``dtype``, ``seed``, ``check_parity`` (K > 0:
            K steps eager, eager on rows permuted two ways and compiled first, judged, then undone).

    Returns:
        The metrics, as written to ``out/metrics.json``.

    Raises:
        ValueError, FileNotFoundError: bad input, before any model loads (:func:`check_options`).
        FinetuneInterrupted: SIGINT or SIGTERM; the checkpoint was written first (``exit_code``).
    """
    started = time.perf_counter()
    opts = check_options(out=out, resume=resume, overwrite=overwrite, **options)
    out = opts["out"]
    if overwrite:
        _clear(out)
    out.mkdir(parents=True, exist_ok=True)
    from .finetuning_run import Run

    with StopSignals() as stop:
        run = Run(opts, stop=stop, progress=progress, log=log)
        try:
            run.prepare()
            run.train()
        except KeyboardInterrupt:
            raise _interrupted(run, stop, command) from None
        finally:
            run.release()  # opt.undo(), and the graph-break count closed
        metrics = run.metrics(command=command, wall_s=time.perf_counter() - started)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
        run.plot(metrics)
        run.summary(metrics)
    return metrics


def _interrupted(run: Any, stop: StopSignals, command: str | None) -> FinetuneInterrupted:
    import signal

    signum = stop.signum or signal.SIGINT
    saved = run.save_on_interrupt() if stop.at_boundary else None
    folder = latest_checkpoint(run.out)
    name = signal.Signals(signum).name
    if folder is None:
        message = f"{name}: stopped after {run.steps_done} step(s), before any checkpoint; nothing to resume"
    else:
        step = json.loads((folder / "history.json").read_text())["steps_done"]
        message = (f"{name}: stopped after {run.steps_done}/{run.opts['steps']} steps; "
                   f"checkpoint{' saved' if saved else ''} in {folder} (step {step})\n"
                   f"resume with: {_resume_command(command, run.out)}")
    run.log(message)
    return FinetuneInterrupted(signum, folder, run.steps_done, message)


def utc_now() -> str:
    """The date as the metrics record it."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
