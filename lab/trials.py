"""Process-wide settings a lab trial makes in the process it measures, before the product runs.

Why a module of its own: a trial that changes something the product reads for the whole process
(bitsandbytes' CUDA row threshold, under the NF4 patch) is set the same way by each lab tool that
runs it (``lab/gpu/compile_time/cold_start.py``'s children, ``lab.context_parallel try``), so the
setting and what it records live once. They are lab-only: a user sets the fused LoRA route's rows
with ``optimize(lora_min_rows=...)``, which leaves the process-wide threshold alone.
"""

from __future__ import annotations

__all__ = ["nf4_min_rows"]


def nf4_min_rows(rows: int) -> int:
    """The NF4 patch's CUDA row threshold set to ``rows`` for this process: the fused LoRA route and
    the one-pass dequantize taken past ``rows`` rows, not past bitsandbytes' own. Returns ``rows``
    (what the trial records)."""
    from qlora_nb_utils.compile.patches import nf4_dequant

    nf4_dequant._cuda_rows = lambda: rows
    return rows
