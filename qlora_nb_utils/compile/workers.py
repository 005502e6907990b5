"""Inductor's compile workers, started while a run still loads its data and model.

Why this module exists: a cold first step compiles dozens of Triton kernels, and Inductor
compiles them in a pool of worker processes. Torch starts that pool only when Dynamo hands
its first graph to Inductor, and each worker must import torch before it takes a kernel, so
the first compile begins by waiting for its workers. A training run knows much earlier that
it will compile: before it tokenizes its data and loads its model, work that leaves the
machine's other cores idle. Starting the pool there lets the workers come up meanwhile.

What starts is torch's own pool, through the function the inductor backend itself calls on
its first graph (``torch._inductor.async_compile.maybe_warm_pool``): the same workers, the
same ``compile_threads``, and torch's own switches still rule (``TORCH_WARM_POOL=0`` or
``TORCHINDUCTOR_COMPILE_THREADS=1`` keep it from starting). Nothing is patched; where the
function is missing (another torch) the run simply starts the pool later, as torch does.
Only a CUDA run on the inductor backend asks: a CPU run compiles C++ in the process, and
the other backends compile no kernels.
"""

from __future__ import annotations

from typing import Any

__all__ = ["start_compile_workers"]


def start_compile_workers(device: Any, backend: str = "inductor") -> bool:
    """Start Inductor's compile workers now, for a run that will compile on ``device``.

    Args:
        device: the run's device (a ``torch.device`` or its name).
        backend: the compile backend the run uses; only ``"inductor"`` compiles kernels.

    Returns:
        True when torch's pool was asked to start here (torch may still keep it off, as its
        settings say); False when the run has no use for it, or this torch lacks the function.
    """
    import torch

    if torch.device(device).type != "cuda" or backend != "inductor":
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # another torch: the backend starts the pool at the first graph, as before
        return False
    maybe_warm_pool()
    return True
