"""How the step reaches the GPU: Inductor's CUDA graphs (``mode``), its kernels' autotuning, and the
training loop's captured step (``step_graph``): three choices of :mod:`.choices`' table that weigh
the same thing, a LoRA step's many small kernel launches against a longer first step or memory held.

Why a module of its own: the decision table (:mod:`.choices`) holds every other rule; these three
read each other (autotuning follows the mode, the captured step stands in for Inductor's CUDA graphs
where those do not apply), and are read together.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .choices import Choice
from .options import AUTOTUNE_MODES

__all__ = ["MAX_CUDAGRAPH_SHAPES", "MAX_STEP_GRAPHS", "choose_mode", "choose_autotune", "choose_step_graph"]

#: At most this many distinct batch shapes get CUDA graphs (one graph each) under ``mode="auto"``.
MAX_CUDAGRAPH_SHAPES = 4


def choose_mode(asked: str | None, backend: Any, scope: str, device: torch.device,
                shapes: Sequence[tuple[int, int]] | None) -> Choice:
    """The Inductor mode (None: the default): CUDA graphs where few shapes are shown on CUDA (the
    LoRA step is many small kernels, launch-bound; one graph per shape, each costing memory)."""
    if asked != "auto":
        return Choice(None if asked == "default" else asked, "asked for")
    if backend != "inductor":
        return Choice(None, f"backend {backend!r}")
    if scope == "regional":
        return Choice(None, "regional scope: no CUDA graphs")
    if device.type != "cuda":
        return Choice(None, f"no CUDA graphs on {device.type}")
    if shapes is None:
        return Choice(None, "shapes not shown: no CUDA graphs")
    if len(shapes) <= MAX_CUDAGRAPH_SHAPES:
        return Choice("reduce-overhead", f"{len(shapes)} batch shape(s): CUDA graphs")
    return Choice(None, f"{len(shapes)} batch shapes > {MAX_CUDAGRAPH_SHAPES}: no CUDA graphs")


#: The most batch shapes whose whole step is captured (:func:`choose_step_graph`); a graph each, in
#: one memory pool.
MAX_STEP_GRAPHS = 2


def choose_step_graph(asked: bool | str, *, device: torch.device, scope: str, cuda_graphs: bool,
                      shapes: Sequence[tuple[int, int]] | None, packed: bool, attention: str,
                      ckpt_layers: int, offload: bool, memory_target: bool) -> Choice:
    """Whether the training loop captures each batch shape's whole step (forward, backward, clipping,
    the optimizer's update) as one CUDA graph and replays it (:mod:`qlora_nb_utils.training.step_graph`).

    In regional scope the compiled layers launch their kernels one call at a time, and where the
    model is small the host's launches are the step; one replay launches the step at once. What a
    capture cannot hold keeps it off under ``"auto"``: a CPU; Inductor's own CUDA graphs (whole
    scope); more than :data:`MAX_STEP_GRAPHS` batch shapes, or none shown; per-batch masks built
    from the batch (packed documents, attention other than causal-only SDPA); checkpointed or
    offloaded layers (their recompute reads the RNG state and host copies); a memory target (a
    capture keeps its pool for the run). ``True`` is refused where it cannot hold, with the reason.
    """
    blockers = [why for bad, why in (
        (device.type != "cuda", f"no CUDA graphs on {device.type}"),
        (scope != "regional" or cuda_graphs, "whole scope: the compiled graph is the step (Inductor's CUDA graphs "
                                             "where they apply)"),
        (shapes is None, "batch shapes not shown"),
        (shapes is not None and len(shapes) > MAX_STEP_GRAPHS,
         f"{len(shapes or ())} batch shapes > {MAX_STEP_GRAPHS}"),
        (packed or attention != "causal", "each batch's attention mask is built from its values"),
        (ckpt_layers > 0 or offload, "checkpointed layers recompute outside a capture's reach"),
        (memory_target, "a memory target: a capture's memory pool stays for the run"),
    ) if bad]
    if asked is False:
        return Choice(False, "asked for")
    if asked is True:
        if blockers:
            raise ValueError(f"step_graph=True: the step cannot be captured here: {blockers[0]}; use 'auto' or False")
        return Choice(True, "asked for")
    if blockers:
        return Choice(False, blockers[0])
    return Choice(True, f"{len(shapes)} batch shape(s): each step captured once as a CUDA graph (forward, backward, "
                        "optimizer) and replayed, one launch for the host")


def choose_autotune(asked: bool | str, mode: str | None, backend: Any, reduction_filter: bool) -> Choice:
    """Autotuning only when asked: without it each Inductor kernel is compiled in one configuration and
    none is benchmarked on the first step (``prepare.one_config_available``: ``reduction_filter``, whether
    this torch can hold a reduction to one); a max-autotune ``mode`` (the plan's) is asking."""
    if mode in AUTOTUNE_MODES:
        return Choice(True, f"mode {mode!r} benchmarks kernel variants on the first step")
    if asked is True:
        return Choice(True, "asked for: Inductor's candidate configurations of a kernel, benchmarked on the "
                            "first step")
    if asked is False:
        return Choice(False, "asked for")
    if backend != "inductor":
        return Choice(False, f"backend {backend!r}: no Inductor kernels")
    why = "each Inductor kernel compiled in one configuration, none benchmarked on the first step"
    if not reduction_filter:
        why += " (reductions keep their candidates: this torch cannot filter them)"
    return Choice(False, why + "; autotune=True benchmarks them")
