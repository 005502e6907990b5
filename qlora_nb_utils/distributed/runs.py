"""Driving ``fsdp_train`` runs from a parent process and reading what they wrote.

Why this module exists: notebook 07 and any script that compares FSDP2 runs start the
``torchrun`` runs as child processes and then read their ``log.jsonl`` and ``summary.json`` into
one record; that side joins no process group and needs no torch, so it lives apart from the
entry point and imports nothing heavy. Rank 0 of a run uses :func:`read_log` as well, to
build its summary from the log it appended to.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from .._paths import pythonpath_with_package

__all__ = ["launch", "read_log", "compare_runs"]


# ----------------------------------------------------------------------------- driving runs
def launch(nproc: int, args: Sequence[str], *, timeout: float | None = None, echo: bool = True):
    """Run ``torchrun --standalone --nproc-per-node nproc -m qlora_nb_utils.distributed.fsdp_train args``.

    What the notebook and the repository's FSDP2 scripts call. ``OMP_NUM_THREADS`` is left to torchrun
    (1 per process when nproc > 1) unless already set.

    Returns:
        The ``subprocess.CompletedProcess`` (stdout and stderr captured as text).

    Raises:
        RuntimeError: the run failed; the message holds the tail of its output.
    """
    import subprocess

    env = {**os.environ, "PYTHONPATH": pythonpath_with_package(os.environ.get("PYTHONPATH"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "qlora_nb_utils.distributed.fsdp_train", *map(str, args)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if echo:
        for line in result.stdout.splitlines():
            if line.startswith("[fsdp_train]"):
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
