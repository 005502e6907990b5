"""The options of ``qlora-nb train`` and their checks, made before any model loads.

Why a module of its own: bad input must fail first. ``qlora-nb train`` calls :func:`check_options`
before anything else (a wrong folder, mode, backend, data file, or a ``--resume`` that does not
match the checkpoint fails in seconds, not after minutes of loading), and an output folder
holding a run is never overwritten unless asked. The checks need the option table
(:data:`DEFAULTS`, the CLI's defaults too) and the identity of a run (:func:`run_meta`, what a
resumed run must share with its checkpoint), and nothing of the run itself: the run
(:mod:`.finetuning`) uses them, they never use it. The options that are ``optimize()``'s
(:data:`OPTIMIZE_KEYS`) are checked by building the one
:class:`~qlora_nb_utils.compile.OptimizeOptions` the run then trains with, not by hand here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checkpoint import CHECKPOINT, check_resume, data_fingerprint, model_fingerprint

__all__ = ["DEFAULTS", "OUTPUTS", "PACKING_CHOICES", "BACKENDS", "OPTIMIZE_KEYS", "check_options", "run_meta"]

#: The options of :func:`~.finetuning.finetune` and their defaults (the CLI's defaults too).
DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m", "data": None, "steps": 60, "batch_size": 4, "seq_len": 128, "lr": 2e-4,
    "warmup_steps": 5, "lora_r": 16, "lora_alpha": 32, "eval_every": 20, "eval_size": 32, "save_every": 20,
    "mode": "auto", "backend": "inductor", "max_memory_gib": None, "grad_ckpt": "auto", "device": "auto",
    "dtype": "auto", "seed": 0, "check_parity": 0, "packing": "auto", "scope": "auto", "compile_cache": "auto",
    "autotune": "auto", "step_graph": "auto",
}
#: What ``backend`` accepts: Inductor (the fast path), and the two that train the same model without
#: Inductor: ``aot_eager`` (AOTAutograd's graphs run as they are) and ``eager`` (Dynamo's graph run as
#: traced). Torch registers more names (test-only ones, others that need packages this project does
#: not install); a run refuses them before any model loads rather than failing at the first step.
BACKENDS = ("inductor", "aot_eager", "eager")
#: The options of a run that are ``optimize()``'s, by the same names: :func:`check_options` builds
#: them into one :class:`~qlora_nb_utils.compile.OptimizeOptions`, whose checks are the only ones.
OPTIMIZE_KEYS = ("mode", "backend", "max_memory_gib", "grad_ckpt", "scope", "compile_cache", "autotune",
                 "step_graph")
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
    if opts["packing"] not in PACKING_CHOICES:
        raise ValueError(f"packing must be 'auto', True or False, got {opts['packing']!r}")


def check_options(*, out: str | Path, resume: bool = False, overwrite: bool = False,
                  **options: Any) -> dict[str, Any]:
    """Check every option of :func:`~.finetuning.finetune` without loading a model; return them completed.

    Checked: the numbers, the model (:func:`qlora_nb_utils.models.check_model_source`), the
    options that are ``optimize()``'s (:data:`OPTIMIZE_KEYS`, by building them into one
    :class:`~qlora_nb_utils.compile.OptimizeOptions`), ``backend`` (:data:`BACKENDS`, the ones a
    run trains with), device and dtype names, the data (``data.validate_source``, line by line), the output folder (a folder
    holding a run is refused without ``resume`` or ``overwrite``) and, with ``resume``, the
    checkpoint (it must exist, be of this run, per ``meta.json``, and have steps left).

    Returns:
        The options (defaults filled in) plus ``out``, ``resume``, ``overwrite``, ``meta``,
        ``optimize_options`` (the checked :class:`~qlora_nb_utils.compile.OptimizeOptions`; the run
        adds the steps it has left) and, with ``resume``, ``resume_history``.

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
    from ..compile import OptimizeOptions
    from ..data import validate_source
    from ..models import check_model_source

    check_model_source(opts["model"])
    optimize_options = OptimizeOptions.from_dict({k: opts[k] for k in OPTIMIZE_KEYS})
    if opts["backend"] not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {opts['backend']!r}")
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
    opts.update(out=out, resume=resume, overwrite=overwrite, meta=run_meta(opts), optimize_options=optimize_options)
    if resume:
        history = check_resume(out, opts["meta"])
        if history["steps_done"] >= opts["steps"]:
            raise ValueError(f"--resume: the checkpoint in {out} has done {history['steps_done']} steps already; "
                             f"pass --steps larger than that to train further")
        opts["resume_history"] = history
    return opts
