"""The fields of a bench results file that both main jobs write: where, with what and when it ran,
each run's ratios to ``hf-eager``, its parity against its eager floor, and its compilations.

Why it exists apart: the padded main job (:mod:`.main_job`) and its packed variant
(:mod:`.packing_job`) write the same record; each job imports it, and neither imports the other
for it (the padded job hands ``packing=True`` over to the packed one).
"""

from __future__ import annotations

import datetime as _dt
import shlex
import sys
from typing import Any

from .. import env
from ..training.parity import judge


def results_header(opts: dict[str, Any], device, dtype, command: str | None, optimize: dict,
                   caller: str = "run_bench()") -> dict[str, Any]:
    """What every bench results file starts with: where, with what, how and when it ran.

    ``command`` None: this process's command line (``caller`` when there is none, e.g. in a notebook).
    """
    if command is None:
        command = shlex.join(sys.argv) if sys.argv and sys.argv[0] else caller
    return {
        "device": env.device_info(device),
        "versions": env.versions(),
        "command": command,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": opts["model"],
        "options": {**{k: v for k, v in opts.items() if k != "optimize_options"},  # the same options, as given
                    "dtype": str(dtype).replace("torch.", ""), "device": str(device)},
        "optimize": optimize,
    }


def vs_hf_eager(run: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """A run's step-time and peak-memory ratios to the ``hf-eager`` baseline's summary."""
    return {"speedup_vs_hf_eager": base["median_step_ms"] / run["median_step_ms"],
            "peak_mem_vs_hf_eager": run["peak_mem_gib"] / base["peak_mem_gib"] if base["peak_mem_gib"] else None}


def parity_fields(summ: dict[str, Any], eager: str, losses: list[float]) -> dict[str, Any]:
    """A compiled run's losses judged against its eager run ``eager`` and that run's two-order floor.

    ``summ`` holds the summaries of ``eager`` and ``eager-permuted1/2``
    (:func:`qlora_nb_utils.training.parity.judge` says what passes).
    """
    verdict = judge(summ[eager]["losses"], [summ[f"{eager}-permuted{k}"]["losses"] for k in (1, 2)], losses)
    return {**{k: v for k, v in verdict.items() if k not in ("floor_diffs", "diffs")},
            "parity_against": eager, "floor_diffs": verdict["floor_diffs"], "diffs": verdict["diffs"]}


def compile_fields(stats: dict[str, Any]) -> dict[str, Any]:
    """What a run reports of its compilations, from a ``CompileCounter.to_dict()``."""
    return {k: stats[k] for k in ("compilations", "recompilations", "recompile_reasons", "compile_s")}
