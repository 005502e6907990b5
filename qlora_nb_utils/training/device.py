"""Timing and memory on the device a run trains on, measured the same way by every runner.

Why a module of its own: the explicit loop, the FSDP2 entry, the TRL peer and the optimizer
bench each time steps and read peak memory. A step time means something only when the host
waits for the device before reading the clock, and "peak memory" must be one quantity for every
run that is compared: on CUDA the allocator's ``max_memory_allocated``, on a CPU the process's
resident set size (no allocator tracks CPU peaks). One definition, used by all of them.
"""

from __future__ import annotations

import torch

__all__ = ["sync", "reset_peak", "peak_mem_gib"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU), so a clock read after it is true."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    """Start a new CUDA peak-memory window (a no-op on a CPU: its peak is the process's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mem_gib(device: torch.device) -> float:
    """Peak memory in GiB: CUDA's ``max_memory_allocated``, else the process's resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**30
    except ImportError:  # psutil comes with accelerate; stay correct without it
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
