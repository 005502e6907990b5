"""Count what ``torch.compile`` compiled, recompiled and restarted, why, and how long it took.

Why this module lives in ``compile``: :func:`~qlora_nb_utils.compile.prepare_for_compile` and
:class:`~qlora_nb_utils.compile.CompiledOptimizer` count every compilation they make, so the
number of compilations is a fact on what they return rather than a guess; the counter is
therefore part of compiling, below ``diagnostics``, which uses it too and re-exports it
(``from qlora_nb_utils.diagnostics import CompileCounter`` keeps working).

"How many times did it compile, and why again?" is answered by counting what reaches the
backend (:class:`CompileCounter` wraps the real backend) and by reading the reason Dynamo
itself records for each recompilation: the ``CompilationMetrics`` records of
``torch._dynamo.utils`` (no global state touched), or, where those are missing, the
``recompiles`` logging artifact captured by a handler that is removed afterwards. These are
Dynamo internals that move between releases (verified on torch 2.13; the lead's GPU box runs
2.11), so each private access is guarded and degrades to a documented fallback instead of
failing. Nothing is changed at import time.
"""

from __future__ import annotations

import functools
import logging
import re
import time
import warnings
from typing import Any, Callable

import torch

from .saved_values import release_saved_values, runs_graph_as_traced

__all__ = ["CompileCounter"]

_COMPILE_ID_PREFIX = re.compile(r"^\s*(?:-\s*)?!?\d+(?:/\d+)+:\s*")


def _strip_compile_id(reason: str) -> str:
    """``"0/1: tensor 'x' size mismatch..."`` -> ``"tensor 'x' size mismatch..."``."""
    return _COMPILE_ID_PREFIX.sub("", reason.strip(), count=1)


# ----------------------------------------------------------------------------- backends
def _resolve_backend(backend: Any, mode: str | None, options: dict | None, dynamic: bool | None) -> Callable:
    """Turn (backend, mode, options) into one callable, as ``torch.compile`` would."""
    if mode is not None and options is not None:
        raise ValueError("pass either mode or options, not both (torch.compile refuses the pair)")
    if backend == "inductor":
        try:
            return torch._TorchCompileInductorWrapper(mode, options, dynamic)
        except AttributeError:  # private class gone: rebuild what it does
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = dict(list_mode_options(mode, dynamic)) if mode and mode != "default" else {}
            patches.update(options or {})
            return functools.partial(compile_fx, config_patches=patches)
        except RuntimeError as exc:  # unknown mode or option
            raise ValueError(f"invalid inductor mode/options: {exc}") from exc
    if isinstance(backend, str):
        try:
            fn = torch._dynamo.lookup_backend(backend)
        except torch._dynamo.exc.InvalidBackend:
            raise ValueError(f"unknown backend {backend!r}; known: {torch._dynamo.list_backends()}") from None
    elif callable(backend):
        fn = backend
    else:
        raise ValueError(f"backend must be a name or a callable, got {type(backend).__name__}")
    extra = {k: v for k, v in (("mode", mode), ("options", options)) if v and v != "default"}
    return functools.partial(fn, **extra) if extra else fn


class _CountingBackend:
    """A Dynamo backend that records each graph it receives, then delegates."""

    def __init__(self, inner: Callable, counter: CompileCounter) -> None:
        self._inner = inner
        self._counter = counter

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
        start, handed_at = time.perf_counter(), time.time()
        compile_id = _current_compile_id()
        try:
            if runs_graph_as_traced(self._counter.backend):  # else each step's saved tensors are kept
                release_saved_values(gm)
            return self._inner(gm, example_inputs, **kwargs)
        except Exception as exc:
            if _is_restart(exc):
                self._counter._record_restart(compile_id, type(exc).__name__)
            raise
        finally:
            self._counter._record_graph(compile_id, time.perf_counter() - start, handed_at)

    def __getattr__(self, name: str) -> Any:  # reset(), get_compiler_config(), compiler_name
        if name.startswith("__") or name in ("_inner", "_counter"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def _is_restart(exc: BaseException) -> bool:
    """True for Dynamo's ``RestartAnalysis`` family: the frame is traced again, same compile id."""
    try:
        from torch._dynamo.exc import RestartAnalysis
    except ImportError:  # private module moved
        return type(exc).__name__.endswith("RestartAnalysis")
    return isinstance(exc, RestartAnalysis)


def _current_compile_id() -> tuple[str | None, int | None]:
    """(str(CompileId), frame_compile_id) of the compile in progress, or (None, None)."""
    try:
        cid = torch._guards.CompileContext.current_compile_id()
    except Exception:
        return None, None
    if cid is None:
        return None, None
    return str(cid), getattr(cid, "frame_compile_id", None)


# ----------------------------------------------------------------------------- recompile reasons
def _metrics_supported() -> bool:
    try:
        from torch._dynamo.utils import CompilationMetrics, get_compilation_metrics  # noqa: F401

        return "recompile_reason" in CompilationMetrics.__dataclass_fields__
    except Exception:
        return False


def _handed_over(metric: Any, handed: list[float]) -> bool:
    """Whether a Dynamo record is of a graph handed to a counter at the times ``handed`` (seconds
    since the epoch): a forward's record spans one of them, a lazy backward's ends after the first.
    True where this torch's records carry no times: the id alone decides."""
    start, end = getattr(metric, "start_time_us", None), getattr(metric, "end_time_us", None)
    if start is None or end is None:
        return True
    if metric.is_forward is False:
        return end / 1e6 >= min(handed)
    return any(start / 1e6 <= t <= end / 1e6 for t in handed)


def _compilation_metrics() -> list[Any]:
    try:
        from torch._dynamo.utils import get_compilation_metrics

        return get_compilation_metrics()
    except Exception:
        return []


class _RecompileLogCapture(logging.Handler):
    """Capture Dynamo's ``recompiles`` log artifact without printing it; undo on exit.

    Enables the artifact in torch's log state (not through ``torch._logging.set_logs``,
    which would replace the user's whole logging configuration), attaches itself to the
    artifact logger with propagation off, and restores level, propagation and state.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[tuple[str | None, str]] = []
        self._saved: tuple | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((_current_compile_id()[0], record.getMessage()))

    @staticmethod
    def _logger() -> logging.Logger:
        try:
            return torch._dynamo.guards.recompiles_log
        except AttributeError:
            return logging.getLogger("torch._dynamo.guards.__recompiles")

    def __enter__(self) -> _RecompileLogCapture:
        from torch._logging import _internal

        state, log = _internal._get_log_state(), self._logger()
        added = not state.is_artifact_enabled("recompiles")
        self._saved = (state, added, log, log.level, log.propagate)
        state.enable_artifact("recompiles")
        log.setLevel(logging.DEBUG)
        log.propagate = False
        log.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is None:
            return
        state, added, log, level, propagate = self._saved
        log.removeHandler(self)
        log.setLevel(level)
        log.propagate = propagate
        if added:
            state.artifact_names.discard("recompiles")
        self._saved = None

    def reasons(self, compile_ids: set[str]) -> list[str]:
        """First guard failure of each captured message that belongs to ``compile_ids``."""
        out = []
        for cid, message in self.records:
            if cid is not None and cid not in compile_ids:
                continue
            failures = [ln for ln in message.splitlines() if ln.strip().startswith("- ")]
            out.append(_strip_compile_id(failures[0]) if failures else message.strip())
        return out


# ----------------------------------------------------------------------------- compile counter
class CompileCounter:
    """Count what ``torch.compile`` actually compiled, recompiled, and why.

    Definitions (what each number means):

    * ``compilations``: forward graphs Dynamo handed to the backend. A function with one
      graph break compiles two graphs (the part before the break and the resume function).
    * ``recompilations``: those of them compiled for a frame that Dynamo had compiled
      before (``CompileId.frame_compile_id > 0``): a guard failed, e.g. a new shape.
    * ``recompile_reasons``: the first failed guard of each recompilation, as Dynamo
      words it (``"tensor 'x' size mismatch at index 1. expected 64, actual 80"``).
    * ``restarts``: graphs among ``compilations`` whose backend call raised one of Dynamo's
      ``RestartAnalysis`` exceptions (e.g. ``TensorifyScalarRestartAnalysis``: a float input
      had to be specialized): Dynamo traces the frame again and hands the backend a new
      graph under the *same* compile id, so such a compilation has no recompile reason.
      ``restart_reasons`` names the exceptions, in order.
    * ``backward_compilations``: backward graphs AOTAutograd compiled lazily at the first
      ``.backward()`` (static shapes). With dynamic shapes AOTAutograd compiles the backward
      together with the forward; that time is in the forward's and is not counted here.
      None when the source (compilation metrics) is unavailable.
    * ``compile_s``: Dynamo's own accounting: whole-frame compile time of each forward
      (tracing + AOTAutograd + backend) plus each lazy backward compile. Falls back to
      ``backend_s`` when the metrics are unavailable.
    * ``backend_s``: wall time spent inside the wrapped backend only (our own timer).

    Recompile reasons come from Dynamo's ``CompilationMetrics`` records (``"metrics"``), or
    from the ``recompiles`` log artifact (``"logs"``; only inside ``with counter:``).

    Example:
        >>> counter = CompileCounter(backend="eager")
        >>> f = counter.compile(torch.sin, dynamic=False)
        >>> _ = f(torch.ones(2)); _ = f(torch.ones(3))
        >>> counter.compilations, counter.recompilations
        (2, 1)

    Compile ids restart from 0 after ``torch.compiler.reset()``, so another trace under an id
    this counter saw (:func:`graph_breaks`' ``explain``, a compile with another backend) would
    read as its own: a forward record counts only when Dynamo's own start and end times for it
    span the moment this counter's backend was handed the graph, and a backward record only
    when it ends after that moment (:func:`_handed_over`).
    """

    def __init__(self, backend: Any = "inductor", *, reasons_from: str = "auto") -> None:
        """Create a counter.

        Args:
            backend: The real backend: ``"inductor"``, ``"eager"``, ``"aot_eager"``, any
                registered name, or a backend callable.
            reasons_from: ``"auto"`` (metrics when this torch has them, else logs),
                ``"metrics"`` or ``"logs"``.

        Raises:
            ValueError: On an unknown ``reasons_from``.
        """
        if reasons_from not in ("auto", "metrics", "logs"):
            raise ValueError(f"reasons_from must be 'auto', 'metrics' or 'logs', got {reasons_from!r}")
        if reasons_from == "auto":
            reasons_from = "metrics" if _metrics_supported() else "logs"
        self.backend = backend
        self.reasons_source = reasons_from
        self._capture: _RecompileLogCapture | None = None
        self._start()

    def _start(self) -> None:
        self._graphs: list[tuple[str | None, int | None, float]] = []
        self._handed: dict[str | None, list[float]] = {}  # compile id -> when the backend was handed it
        self._restarts: list[tuple[str | None, str]] = []
        self._metrics_before = _compilation_metrics()  # keeps the old records alive

    def __enter__(self) -> CompileCounter:
        """Start counting afresh (and, for log-based reasons, start capturing)."""
        self._start()
        if self.reasons_source == "logs":
            try:
                self._capture = _RecompileLogCapture().__enter__()
            except Exception as exc:  # private logging API changed: count, but without reasons
                warnings.warn(f"recompile reasons unavailable: {exc!r}", RuntimeWarning, stacklevel=2)
                self._capture = None
        return self

    def __exit__(self, *exc: Any) -> None:
        """Stop capturing logs (restoring torch's logging state); counts stay readable."""
        if self._capture is not None:
            self._capture.__exit__(*exc)

    def as_backend(self, *, mode: str | None = None, options: dict | None = None,
                   dynamic: bool | None = None) -> Callable:
        """Return a counting backend callable for ``torch.compile(..., backend=...)``.

        Args:
            mode: An inductor mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``...);
                for other backends it is passed on as ``mode=`` like torch.compile does.
            options: Inductor config options (or backend options for other backends).
            dynamic: Forwarded to inductor's mode options (as torch.compile does).

        Raises:
            ValueError: On an unknown backend or mode, or both mode and options.
        """
        return _CountingBackend(_resolve_backend(self.backend, mode, options, dynamic), self)

    def compile(self, model_or_fn: Any, *, mode: str | None = None, dynamic: bool | None = None,
                fullgraph: bool = False, options: dict | None = None) -> Any:
        """``torch.compile`` with this counter's backend installed.

        Args:
            model_or_fn: A module or function.
            mode: See :meth:`as_backend`.
            dynamic: ``torch.compile``'s ``dynamic``.
            fullgraph: ``torch.compile``'s ``fullgraph``.
            options: See :meth:`as_backend`.

        Returns:
            The compiled module or function.
        """
        backend = self.as_backend(mode=mode, options=options, dynamic=dynamic)
        return torch.compile(model_or_fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph)

    def _record_graph(self, compile_id: tuple[str | None, int | None], seconds: float, handed_at: float) -> None:
        self._graphs.append((compile_id[0], compile_id[1], seconds))
        self._handed.setdefault(compile_id[0], []).append(handed_at)

    def _record_restart(self, compile_id: tuple[str | None, int | None], name: str) -> None:
        self._restarts.append((compile_id[0], name))

    def _metrics(self) -> list[Any]:
        """Compilation metrics recorded since the start for compiles this counter saw."""
        old = {id(m) for m in self._metrics_before}
        return [m for m in _compilation_metrics() if id(m) not in old and str(m.compile_id) in self._handed
                and _handed_over(m, self._handed[str(m.compile_id)])]

    @property
    def compilations(self) -> int:
        """Forward graphs handed to the backend."""
        return len(self._graphs)

    @property
    def recompilations(self) -> int:
        """Graphs compiled for a frame that had been compiled before."""
        return sum(1 for _, n, _ in self._graphs if n)

    @property
    def recompile_reasons(self) -> list[str]:
        """The first failed guard of each recompilation, in order."""
        if self.reasons_source == "logs":
            ids = {cid for cid, _, _ in self._graphs if cid is not None}
            return self._capture.reasons(ids) if self._capture else []
        return [_strip_compile_id(m.recompile_reason) for m in self._metrics()
                if m.is_forward is not False and getattr(m, "recompile_reason", None)]

    @property
    def restarts(self) -> int:
        """Backend calls Dynamo abandoned to restart its analysis (counted in ``compilations``)."""
        return len(self._restarts)

    @property
    def restart_reasons(self) -> list[str]:
        """``"<compile id>: <exception name>"`` of each restart, in order."""
        return [f"{cid}: {name}" for cid, name in self._restarts]

    @property
    def backward_compilations(self) -> int | None:
        """Backward graphs compiled lazily (see the class docstring), or None if unknown."""
        if not _metrics_supported():
            return None
        return sum(1 for m in self._metrics() if m.is_forward is False)

    @property
    def backend_s(self) -> float:
        """Seconds spent inside the wrapped backend (forward graphs)."""
        return sum(s for _, _, s in self._graphs)

    @property
    def compile_s(self) -> float:
        """Dynamo's total compile time for the graphs counted (see the class docstring)."""
        metrics = self._metrics()
        if not metrics:
            return self.backend_s
        fwd = sum(m.entire_frame_compile_time_s or 0.0 for m in metrics if m.is_forward is not False)
        bwd = sum((getattr(m, "duration_us", None) or 0) / 1e6 for m in metrics if m.is_forward is False)
        return fwd + bwd

    def to_dict(self) -> dict[str, Any]:
        """Return the counts as a JSON-ready dict."""
        return {
            "compilations": self.compilations,
            "recompilations": self.recompilations,
            "recompile_reasons": self.recompile_reasons,
            "restarts": self.restarts,
            "restart_reasons": self.restart_reasons,
            "backward_compilations": self.backward_compilations,
            "compile_s": round(self.compile_s, 4),
            "backend_s": round(self.backend_s, 4),
            "reasons_source": self.reasons_source,
        }
