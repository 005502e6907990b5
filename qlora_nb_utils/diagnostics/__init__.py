"""Compile diagnostics you can trust: graph breaks, compilations, recompilations, compile time.

The whole point of the notebooks is a QLoRA training step that ``torch.compile`` captures in
one graph, compiles a handful of times and then leaves alone. Each of those claims needs a
number, and the obvious sources disagree with each other; this subpackage measures them in a
way that can be checked, and judges a run against the project's targets.

Entry points (imported lazily, on first use; importing the subpackage imports no torch):

* :func:`graph_breaks` (a :class:`BreakReport`) and :func:`check_fullgraph` (a
  :class:`FullgraphResult`), in :mod:`.breaks`: how many graph breaks, and why.
* :class:`CompileCounter`: compilations, recompilations and their reasons, compile time. It
  lives in :mod:`qlora_nb_utils.compile.counting` (``prepare_for_compile`` counts with it) and
  is re-exported here.
* :func:`diagnose_model` and :func:`format_report`, in :mod:`.model_report`: all of the above
  for one HF-style model, as a dict and as a short table.
* :func:`diagnose` and :func:`problems`, in :mod:`.checks`: load one named configuration,
  diagnose it, and list what misses the targets (the CLI's ``diagnose``).
* :func:`recording`, :func:`live_at_peak` and :func:`site_of`, in :mod:`.memprof`: which
  allocations make a CUDA memory peak.
* :func:`saved_for_backward` (a :class:`SavedTensors`), in :mod:`.saved`: which tensors a
  step keeps for its backward, on any device.
"""

from .._lazy import lazy_exports

#: Public name -> the module under this package that defines it.
_EXPORTS = {
    # lazy_exports prefixes one dot: "..compile.counting" is qlora_nb_utils.compile.counting
    **dict.fromkeys(("BreakReport", "FullgraphResult", "graph_breaks", "check_fullgraph"), "breaks"),
    **dict.fromkeys(("CompileCounter",), ".compile.counting"),
    **dict.fromkeys(("diagnose_model", "format_report"), "model_report"),
    **dict.fromkeys(("FLEX_BLOCK_MASKS", "diagnose", "problems"), "checks"),
    **dict.fromkeys(("recording", "live_at_peak", "site_of"), "memprof"),
    **dict.fromkeys(("SavedTensors", "saved_for_backward"), "saved"),
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
