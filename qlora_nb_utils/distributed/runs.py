"""A run of any parallel layout: what its ranks share, and the parent process that reads it.

Why this module exists: the three layouts (``fsdp_train``, ``pipeline_train``, ``context_parallel``)
differ in how they split the model and the batch, and in nothing a user reads. They take the same
model, data, batch, optimizer and output options (:func:`add_common_arguments`, ``qlora-nb train``'s
names), check them before any model loads (:func:`check_common`; the ``--optimize KEY=VALUE``
options once, as one ``compile.OptimizeOptions``: :func:`optimize_knobs`), and do the same around
their own loop on every rank (:class:`RankRun`: the process group, the seed, the optimizer, one
JSON line per step in ``OUT/log.jsonl``, the shared fields of ``OUT/summary.json``:
:func:`summary_fields`). Those live here, once, so that a field or an option means the same in
every layout.

The parent side joins no process group and needs no torch: notebook 07 and any script that
compares runs start ``torchrun`` as child processes (:func:`launch`) and read their
``log.jsonl`` and ``summary.json`` (:func:`read_log`, :func:`compare_runs`). Importing this module
imports nothing heavy; torch is imported by the rank-side functions when they run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .._paths import pythonpath_with_package
from ..startup import defer_sklearn

__all__ = ["LAYOUTS", "OPTIMIZERS", "make_optimizer", "exit_after_run", "launch", "read_log", "compare_runs", "DTYPE_CHOICES", "add_common_arguments", "add_sharding_arguments",
           "check_common", "optimize_knobs", "world_size_from_env", "run_main", "memory_target_gib", "compute_dtype", "max_over_ranks",
           "graph_break_total", "timed_records", "command_line", "summary_fields", "RankRun"]


#: the parallel layouts of the one launcher (``qlora_nb_utils.distributed.launch --layout``), named here, below
#: the launcher, so that driving a run needs no import of it
LAYOUTS = ("fsdp", "pipeline", "context")


# ----------------------------------------------------------------------------- driving runs
def launch(nproc: int, args: Sequence[str], *, timeout: float | None = None, echo: bool = True,
           layout: str | None = None):
    """Run ``torchrun --standalone --nproc-per-node nproc -m qlora_nb_utils.distributed.fsdp_train args``,
    or, with ``layout``, ``-m qlora_nb_utils.distributed.launch --layout LAYOUT args``.

    What the notebook and the repository's FSDP2 scripts call. ``OMP_NUM_THREADS`` is left to torchrun
    (1 per process when nproc > 1) unless already set. With ``echo``, the run's one-line reports
    (``[fsdp_train]``, ``[pipeline]``, ``[context_parallel]``) are printed.

    Returns:
        The ``subprocess.CompletedProcess`` (stdout and stderr captured as text).

    Raises:
        ValueError: ``layout`` is not one of the launcher's (before anything runs).
        RuntimeError: the run failed; the message holds the tail of its output.
    """
    import subprocess

    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    entry = (["qlora_nb_utils.distributed.fsdp_train"] if layout is None
             else ["qlora_nb_utils.distributed.launch", "--layout", layout])
    env = {**os.environ, "PYTHONPATH": pythonpath_with_package(os.environ.get("PYTHONPATH"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", *entry, *map(str, args)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if echo:
        for line in result.stdout.splitlines():
            if line.startswith(("[fsdp_train]", "[pipeline]", "[context_parallel]")):
                print(line, flush=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {result.returncode}:\n"
                           f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result


def read_log(path: str | Path) -> list[dict]:
    """The per-step records of a ``log.jsonl`` (later lines win for a repeated step)."""
    path = Path(path)
    if not path.is_file():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def _load_summary(folder: str | Path) -> dict:
    path = Path(folder) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"no summary.json in {folder}: did the run finish?")
    return json.loads(path.read_text())


def compare_runs(parity_one: str | Path, parity_n: str | Path, scaling_one: str | Path | None = None) -> dict:
    """The FSDP2 results record from finished runs (the lab keeps one per device).

    Args:
        parity_one: a 1-rank run at global batch G.
        parity_n: an N-rank run at the same global batch G and seed (per-rank batch G/N).
        scaling_one: a 1-rank run at global batch G/N (the N-rank run's per-rank batch), for
            the throughput comparison at the same per-GPU batch; None uses ``parity_one``.

    Returns:
        ``world_size``, ``tokens_per_s`` (``{"1": ..., "N": ...}``), ``scaling``,
        ``peak_mem_gib_per_gpu`` (same keys), ``max_abs_loss_diff`` (over the common steps),
        ``losses``, ``graph_breaks`` and ``compile`` per world size, ``per_gpu_batch``,
        ``device``, ``versions``, ``commands``, ``date``.

    Raises:
        ValueError: the parity runs differ in steps or global batch, or are not 1 and N ranks.
    """
    one, many = _load_summary(parity_one), _load_summary(parity_n)
    speed_one = _load_summary(scaling_one) if scaling_one is not None else one
    n = many["world_size"]
    if one["world_size"] != 1 or speed_one["world_size"] != 1 or n < 2:
        raise ValueError(f"need 1-rank runs and an N>=2-rank run; got {one['world_size']}, "
                         f"{speed_one['world_size']} and {n}")
    g1, gn = one["options"]["global_batch_size"], many["options"]["global_batch_size"]
    if g1 != gn or len(one["losses"]) != len(many["losses"]):
        raise ValueError(f"parity runs differ: global batch {g1} vs {gn}, steps "
                         f"{len(one['losses'])} vs {len(many['losses'])}")
    diffs = [abs(a - b) for a, b in zip(one["losses"], many["losses"])]
    key_n = str(n)
    tps = {"1": speed_one["tokens_per_s"], key_n: many["tokens_per_s"]}
    return {
        "world_size": n,
        "per_gpu_batch": {"1": speed_one["options"]["global_batch_size"], key_n: gn // n},
        "global_batch_for_parity": g1,
        "seq_len": many["options"]["seq_len"],
        "model": many["model"],
        "dtype": many["dtype"],
        "nf4": many["nf4"],
        "quant_storage": many["quant_storage"],
        "tokens_per_s": tps,
        "scaling": (tps[key_n] / tps["1"]) if tps["1"] and tps[key_n] else None,
        "peak_mem_gib_per_gpu": {"1": speed_one["peak_mem_gib_per_gpu"], key_n: many["peak_mem_gib_per_gpu"]},
        "max_abs_loss_diff": max(diffs) if diffs else None,
        "losses": {"1": one["losses"], key_n: many["losses"]},
        "graph_breaks": {"1": one["graph_breaks"], key_n: many["graph_breaks"]},
        "compile": {"1": one["compile"], key_n: many["compile"]},
        "first_step_s": {"1": one["first_step_s"], key_n: many["first_step_s"]},
        "device": many["device"],
        "versions": many["versions"],
        "commands": {"parity_1": one["command"], f"parity_{n}": many["command"],
                     "scaling_1": speed_one["command"]},
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }


# ----------------------------------------------------------------------------- the shared options
#: ``--dtype``: the compute dtype; ``auto`` is bfloat16 on CUDA, float32 on a CPU.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def add_common_arguments(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """The options every layout takes (model, data, batch, optimizer, output), by ``qlora-nb train``'s names.

    Args:
        p: the layout's parser.
        **defaults: the layout's own defaults, by destination (``seq_len=1024``, ...).
    """
    p.add_argument("--model", default="tiny", help="a named model (models.MODEL_NAMES), a folder or a hub id")
    p.add_argument("--build", default="load", choices=("load", "layerwise"),
                   help="load: the named or given checkpoint; layerwise: the named shape with random NF4 weights, "
                        "made one linear layer at a time on the device (the pipeline layout: each rank only its "
                        "own layers)")
    p.add_argument("--data", default=None,
                   help="prompt/response, prompt/completion or chat JSONL, or a save_to_disk folder "
                        "(default: the shipped set)")
    p.add_argument("--out", required=True, help="output folder (log.jsonl, summary.json, adapter/)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps in total")
    p.add_argument("--global-batch-size", "--batch-size", dest="global_batch_size", type=int, default=4,
                   help="rows per optimizer step, all ranks together")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="rows per forward (default: fsdp, the whole per-rank batch; pipeline, 1; context, "
                        "the whole batch)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    p.add_argument("--pack", action="store_true", help="pack whole examples into rows of --seq-len")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="compute dtype; auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--backend", default="inductor", help="torch.compile backend ('eager' traces only)")
    p.add_argument("--optimize", action="append", default=[], metavar="KEY=VALUE",
                   help="an optimize() option on every rank (e.g. grad_ckpt=true, offload=true, "
                        "lora_addmm=unfused); repeatable; checked before any model loads")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", "--warmup-steps", dest="warmup", type=int, default=0,
                   help="linear learning-rate warm-up steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="<= 0 disables clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-warmup", type=int, default=3, help="steps left out of the tokens/s median")
    p.add_argument("--eval", action="store_true",
                   help="after training, the mean loss over the first global batch (summary: eval_loss)")
    p.add_argument("--no-adapter", action="store_true", help="do not save the adapter at the end")
    if defaults:
        p.set_defaults(**defaults)


def add_sharding_arguments(p: argparse.ArgumentParser) -> None:
    """The FSDP2 options of the layouts that shard the weights over the ranks (fsdp, context)."""
    from .fsdp import FROZEN_MODES, NF4_MODES

    p.add_argument("--nf4", default="auto", choices=("auto",) + tuple(NF4_MODES),
                   help="the 4-bit base weights: shard (what auto means, on every device) splits them over "
                        "the ranks, the words stored as float32 (--quant-storage auto) so that no 16-bit "
                        "all-gather changes a byte, and checksums them after the first all-gather; replicate "
                        "keeps them whole on every rank (no all-gather traffic for them, no memory saved)")
    p.add_argument("--frozen", default="auto", choices=("auto",) + tuple(FROZEN_MODES),
                   help="the other frozen weights (embeddings, LM head, norms): shard splits them over the "
                        "ranks; replicate keeps them whole on every rank (more memory, no all-gather traffic "
                        "for them); auto: replicate on CUDA, shard on CPU")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPUOffloadPolicy")
    p.add_argument("--check-bytes", action="store_true",
                   help="compare every packed 4-bit byte after the first all-gather with a copy taken "
                        "before sharding (summary: bytes_check)")


def check_common(args: argparse.Namespace, *, layout: str, fixed: Mapping[str, Any] | None = None,
                 flags: Mapping[str, str] | None = None) -> None:
    """Check the shared options (before any model loads) and parse ``--optimize`` once.

    Sets ``args.optimize_knobs``: the ``optimize()`` keywords ``--optimize`` names, checked
    (:func:`optimize_knobs`); a layout passes them on without parsing them again.

    Raises:
        ValueError: with a message that says what to change.
    """
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1; got {args.steps}")
    if args.seq_len < 8:
        raise ValueError(f"--seq-len must be >= 8; got {args.seq_len}")
    if args.global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1; got {args.global_batch_size}")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1; got {args.micro_batch_size}")
    if args.timing_warmup < 0:
        raise ValueError(f"--timing-warmup must be >= 0; got {args.timing_warmup}")
    args.optimize_knobs = optimize_knobs(args.optimize, layout=layout, fixed=fixed, flags=flags)


def optimize_knobs(pairs: Sequence[str], *, layout: str, fixed: Mapping[str, Any] | None = None,
                   flags: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``--optimize KEY=VALUE`` pairs as the ``optimize()`` keywords they name, checked once.

    The pairs, with what the layout sets itself (``fixed``), make one
    :class:`~qlora_nb_utils.compile.OptimizeOptions`: an unknown key or a bad value (or a value
    that does not go with the layout's) is refused here, before any model loads, not on every
    rank after it.

    Args:
        pairs: the ``--optimize`` values.
        layout: the layout's name, for the messages.
        fixed: the ``optimize()`` options the layout sets itself; the command line may not name them.
        flags: for a fixed option set by a command-line flag of its own, that flag (the message names it).

    Returns:
        The options the pairs name, with their checked values.

    Raises:
        ValueError: a malformed pair, an unknown option, a bad value, an option the layout sets.
    """
    from ..compile import OptimizeOptions
    from .fast import optimize_options

    fixed, flags = dict(fixed or {}), dict(flags or {})
    given = optimize_options(pairs)
    for key in given:
        if key in fixed:
            where = f": use {flags[key]}" if key in flags else ""
            raise ValueError(f"--optimize {key}=... is set by the {layout} layout itself{where}")
    try:
        checked = OptimizeOptions.from_dict({**fixed, **given})
    except TypeError as err:  # an unknown key
        raise ValueError(f"--optimize: {err}") from None
    except ValueError as err:
        raise ValueError(f"--optimize: {err}") from None
    return {key: getattr(checked, key) for key in given}


def world_size_from_env() -> int:
    """The world size ``torchrun`` set (1 outside it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_main(parser: argparse.ArgumentParser, validate: Callable, run: Callable,
             argv: Sequence[str] | None = None) -> int:
    """Parse, validate (before any model loads; bad input exits with status 2 and the message), run.

    Returns:
        The exit status (0).
    """
    args = parser.parse_args(argv)
    try:
        args = validate(args, world_size_from_env())
    except ValueError as exc:
        parser.error(str(exc))
    if memory_target_gib(args) is not None and getattr(args, "device", "auto") != "cpu":
        # before CUDA starts (the allocator reads its settings once), as qlora-nb train does
        from ..env import prefer_expandable_segments

        _, why = prefer_expandable_segments()
        if os.environ.get("RANK", "0") == "0":
            print(f"launch: allocator: {why}", file=sys.stderr, flush=True)
    defer_sklearn()  # as qlora-nb train does, in every rank: transformers loads next
    run(args)
    return 0


def memory_target_gib(args: argparse.Namespace) -> float | None:
    """The memory a run was told to stay under, in GiB: ``--max-memory-gib`` (context), the pipeline's
    cap ``--max-mem-gib``, or ``--optimize max_memory_gib=...``; None without one.

    Why it matters beyond the plan: a plan that fits its target in allocated memory can still run out
    under the card's (or the cap's) limit when the allocator's free memory is cut into fixed segments
    that the next large block does not fit. A run with a target therefore asks for expandable
    segments (:func:`qlora_nb_utils.env.prefer_expandable_segments`), as ``qlora-nb train`` does.
    """
    for name in ("max_memory_gib", "max_mem_gib"):
        value = getattr(args, name, None)
        if value is not None:
            return float(value)
    value = (getattr(args, "optimize_knobs", None) or {}).get("max_memory_gib")
    return float(value) if value is not None else None


def exit_after_run(code: int) -> None:
    """End a rank's process with ``code`` once its run is done, without the interpreter's teardown.

    Why: after a finished run (the process group left, every file written), gloo's threads can abort
    the interpreter's own exit ("terminate called without an active exception"), and torchrun then
    reports a run that did all its work as failed. The streams and the logging handlers are flushed
    first; only the C++ destructors are skipped. Each rank module's ``__main__`` ends with it.
    """
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


# ----------------------------------------------------------------------------- on every rank
def compute_dtype(name: str, device):
    """``--dtype`` as a torch dtype (``auto``: bfloat16 on CUDA, float32 elsewhere)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def max_over_ranks(value: float, device) -> float:
    """``value``'s maximum over the ranks (every rank calls it together)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def graph_break_total() -> tuple[int, list[str]]:
    """Dynamo's graph breaks so far in this process, and their reasons (-1: the counters moved)."""
    try:
        from torch._dynamo.utils import counters

        breaks = counters["graph_break"]
        return int(sum(breaks.values())), [str(r).splitlines()[0] for r in breaks]
    except Exception:  # private counters moved: report unknown
        return -1, []


def timed_records(records: list[dict], warmup: int, *, start: int = 0, or_last: bool = True) -> list[dict]:
    """The steps the throughput is measured on: those after ``warmup`` steps of this run (a resumed
    run's from ``start``); none left: the last step (``or_last``) or nothing."""
    timed = [r for r in records if r["step"] >= start + warmup and r.get("run_start", start) == start]
    return timed or (records[-1:] if or_last else [])


def _median(xs: list[float]) -> float | None:
    return float(sorted(xs)[len(xs) // 2]) if xs else None


def command_line(module: str) -> str:
    """The command that started this process: the module run with ``-m`` (else ``module``) and its arguments."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if not (name or "").startswith("qlora_nb_utils."):
        name = module
    return " ".join(shlex.quote(a) for a in [sys.executable, "-m", name, *sys.argv[1:]])


def summary_fields(args: argparse.Namespace, info, records: list[dict], *, dtype, peak: float, breaks_before: int,
                   module: str, start: int = 0, or_last: bool = True) -> dict:
    """The ``summary.json`` fields every layout writes (a layout adds its own).

    ``tokens_per_s`` is the median of the per-step rates after ``--timing-warmup`` steps, not total
    tokens over total time: one late recompilation (a step many times the others' length) must not
    set the throughput. ``peak_mem_gib_per_gpu`` is the maximum over the ranks; ``graph_breaks``
    holds this run's ``total`` and their ``reasons``.
    """
    from .. import env

    breaks_after, reasons = graph_break_total()
    timed = timed_records(records, args.timing_warmup, start=start, or_last=or_last)
    rate = lambda key: _median([r[key] / (r["step_ms"] / 1e3) for r in timed if r["step_ms"] > 0])  # noqa: E731
    return {
        "world_size": info.world_size,
        "backend": info.backend,
        "model": args.model,
        "options": dict(vars(args)),
        "dtype": str(dtype).replace("torch.", ""),
        "steps": len(records),
        "losses": [r["loss"] for r in records],
        "tokens_per_s": rate("tokens"),
        "tokens_per_s_padded": rate("tokens_padded"),
        "step_ms": [r["step_ms"] for r in records],
        "median_step_ms": _median([r["step_ms"] for r in timed]),
        "timed_steps": len(timed),
        "first_step_s": next((r["step_ms"] / 1e3 for r in records if r["step"] == start), None),
        "peak_mem_gib_per_gpu": peak,
        "graph_breaks": {"total": breaks_after - breaks_before if breaks_after >= 0 else None, "reasons": reasons},
        "device": env.device_info(info.device),
        "versions": env.versions(),
        "command": command_line(module),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }


class RankRun:
    """What every layout does on each rank around its own loop.

    Made at the start of a run: joins the process group ``torchrun`` set up, makes ``OUT`` (rank 0),
    seeds torch with ``--seed`` and notes the graph breaks so far. Then :meth:`optimizer`,
    :meth:`optimizer_step`, :meth:`log` once per step (every rank: the peak memory is the maximum
    over them; rank 0 appends the record to ``OUT/log.jsonl``), and :meth:`finish` with the summary.

    Attributes:
        args: the checked options. info: the rank's :class:`~.setup.DistInfo`. out: ``OUT``.
        log_path: ``OUT/log.jsonl``. dtype: the compute dtype. peak: the peak memory so far (GiB,
        the maximum over the ranks). breaks_before: Dynamo's graph breaks before the run.
    """

    def __init__(self, args: argparse.Namespace, *, tag: str, module: str):
        import torch

        from .setup import init_distributed

        self.args, self.tag, self.module = args, tag, module
        self.info = init_distributed(args.device)
        self.out = Path(args.out)
        self.log_path = self.out / "log.jsonl"
        if self.info.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        self.dtype = compute_dtype(args.dtype, self.info.device)
        torch.manual_seed(args.seed)
        self.breaks_before = graph_break_total()[0]
        self.peak = 0.0

    def say(self, text: str) -> None:
        """A line on rank 0's stdout, ``[tag] text``."""
        if self.info.is_main:
            print(f"[{self.tag}] {text}", flush=True)

    def reset_log(self, start: int = 0) -> None:
        """Rank 0: a new ``log.jsonl``, or (resuming at ``start``) the old one without steps from ``start`` on."""
        if not self.info.is_main:
            return
        if start and self.log_path.is_file():
            keep = [ln for ln in self.log_path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < start]
            self.log_path.write_text("".join(ln + "\n" for ln in keep))
        elif not start:
            self.log_path.unlink(missing_ok=True)

    def optimizer(self, params):
        """The optimizer ``--optim`` names (:func:`make_optimizer`; AdamW where a layout has no such
        option) over ``params``, and its linear warm-up over ``--warmup`` steps."""
        import torch

        opt = make_optimizer(getattr(self.args, "optim", "adamw"), params, self.args.lr)
        warm = max(self.args.warmup, 1)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))

    def optimizer_step(self, opt, sched, clip: Callable) -> tuple[float, float]:
        """Clip (``clip(max_norm)``, None when ``--max-grad-norm`` <= 0), step, zero the gradients.

        Returns:
            ``(grad_norm, lr)``: the norm before clipping and the learning rate of this step.
        """
        grad_norm = clip(self.args.max_grad_norm if self.args.max_grad_norm > 0 else None)
        lr = float(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return grad_norm, lr

    def clock(self) -> float:
        """The time now, once the device has finished what it was given."""
        from ..training.device import sync

        sync(self.info.device)
        return time.perf_counter()

    def log(self, rec: dict) -> dict:
        """Add the peak memory (maximum over the ranks, every rank calls this) and the world size to a
        step's record; rank 0 appends it to ``log.jsonl``. A loss that is not finite stops the run."""
        import math

        from ..training.device import peak_mem_gib

        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss is {rec['loss']} at step {rec['step']}")
        self.peak = max(self.peak, max_over_ranks(peak_mem_gib(self.info.device), self.info.device))
        rec.update(peak_mem_gib=self.peak, world_size=self.info.world_size)
        if self.info.is_main:
            with self.log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    def summary(self, records: list[dict], **kwargs: Any) -> dict:
        """:func:`summary_fields` of this run (``start``, ``or_last``: as there)."""
        return summary_fields(self.args, self.info, records, dtype=self.dtype, peak=self.peak,
                              breaks_before=self.breaks_before, module=self.module, **kwargs)

    def finish(self, summary: dict | None, **shown: Any) -> None:
        """Rank 0 writes ``summary.json`` and says the run's figures (``shown`` first); every rank
        then leaves the process group."""
        if self.info.is_main and summary is not None:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
            head = " ".join(f"{k}={v}" for k, v in {"world_size": self.info.world_size, **shown}.items())
            self.say(f"{head} steps={summary['steps']} final_loss={summary['losses'][-1]:.6f} "
                     f"tokens/s={summary['tokens_per_s']} graph_breaks={summary['graph_breaks']['total']}")
        self.stop()

    def stop(self) -> None:
        """Every rank waits for the others and leaves the process group."""
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


#: What ``--optim`` takes where a layout offers it: torch's AdamW (its two moments in fp32, 8 bytes per
#: LoRA weight) or bitsandbytes' 8-bit AdamW (its moments in 8 bits, blockwise scaled: 2 bytes per weight;
#: tensors under 4,096 elements keep fp32 moments), the QLoRA recipe's own way to shrink the LoRA state.
OPTIMIZERS = ("adamw", "adamw8bit")


def make_optimizer(name: str, params, lr: float):
    """AdamW without weight decay over ``params``: torch's (``"adamw"``) or bitsandbytes' 8-bit one
    (``"adamw8bit"``), each tensor's state its own (so split over the stages of a pipeline, it is the
    one-process optimizer's).

    Raises:
        ValueError: a name not in :data:`OPTIMIZERS`.
    """
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if name == "adamw8bit":
        from ..env import import_bitsandbytes

        return import_bitsandbytes().optim.AdamW8bit(params, lr=lr, weight_decay=0.0)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
