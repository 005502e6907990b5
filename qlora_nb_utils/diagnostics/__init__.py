"""Compile diagnostics you can trust: graph breaks, compilations, recompilations, compile time.

Why this module exists: the whole point of the notebooks is a QLoRA training step that
``torch.compile`` captures in one graph, compiles a handful of times and then leaves alone.
Each of those claims needs a number, and the obvious sources disagree with each other:

* ``torch._dynamo.explain`` computes ``graph_break_count`` as *graphs - 1*. A break whose
  graph on one side is empty is not counted at all, a break inside an inlined call can be
  counted twice with one reason, and we have measured a non-zero count with an empty
  ``break_reasons`` list. So :func:`graph_breaks` cross-checks explain with Dynamo's
  ``counters["graph_break"]`` and, when both are silent, with the error that a
  ``fullgraph=True`` compile raises (:func:`check_fullgraph`), and says which source
  the reasons came from.
* "How many times did it compile, and why again?" is answered by counting what reaches
  the backend (:class:`CompileCounter` wraps the real backend) and by reading the reason
  Dynamo itself records for each recompilation: the ``CompilationMetrics`` records of
  ``torch._dynamo.utils`` (no global state touched), or, where those are missing, the
  ``recompiles`` logging artifact captured by a handler that is removed afterwards.

Everything here uses Dynamo internals that move between releases (verified on torch 2.13;
the lead's GPU box runs 2.11), so each private access is guarded and degrades to a
documented fallback instead of failing. Nothing is changed at import time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import logging
import re
import time
import warnings
from typing import Any, Callable

import torch

__all__ = [
    "BreakReport",
    "FullgraphResult",
    "CompileCounter",
    "graph_breaks",
    "check_fullgraph",
    "diagnose_model",
    "format_report",
]

_DROP_LINE = re.compile(r"^\s*(Hint:|Developer debug context:|For more details|Set TORCHDYNAMO)")
_FILE_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<fn>\S+))?')
_COMPILE_ID_PREFIX = re.compile(r"^\s*(?:-\s*)?!?\d+(?:/\d+)+:\s*")


# ----------------------------------------------------------------------------- text helpers
def _summarise(text: str) -> str:
    """Keep the headline and the ``Explanation:`` line of a Dynamo message, drop the hints."""
    lines = [ln.strip() for ln in str(text).strip().splitlines()]
    keep = [lines[0]] if lines else []
    keep += [ln for ln in lines[1:] if ln.startswith("Explanation:")]
    keep = [ln for ln in keep if ln and not _DROP_LINE.match(ln)]
    return "\n".join(keep) if keep else str(text).strip()[:500]


def _user_location(text: str) -> tuple[str | None, str | None]:
    """Return ("file:line", source line) of the innermost frame under "from user code:"."""
    lines = str(text).splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("from user code"))
    except StopIteration:
        return None, None
    location, code = None, None
    for i in range(start + 1, len(lines)):
        match = _FILE_LINE.match(lines[i])
        if match:
            location = f"{match['file']}:{match['line']}"
            code = lines[i + 1].strip() if i + 1 < len(lines) else None
    return location, code


def _strip_compile_id(reason: str) -> str:
    """``"0/1: tensor 'x' size mismatch..."`` -> ``"tensor 'x' size mismatch..."``."""
    return _COMPILE_ID_PREFIX.sub("", reason.strip(), count=1)


# ----------------------------------------------------------------------------- graph breaks
@dataclasses.dataclass
class BreakReport:
    """What :func:`graph_breaks` found.

    Attributes:
        graph_count: Graphs Dynamo built (from ``explain``).
        graph_break_count: ``explain``'s count (graphs - 1).
        break_reasons: Deduplicated ``{"reason", "location", "count"}`` dicts; ``location``
            is ``"file:line"`` of the innermost user frame, or None when unknown.
        ops_count: ``explain``'s op count (``call_function`` nodes over all graphs).
        reasons_source: Where the reasons came from: ``"explain"``, ``"counters"``
            (Dynamo's ``counters["graph_break"]``), both (``"explain+counters"``),
            ``"fullgraph"`` (the error of a ``fullgraph=True`` compile) or ``"none"``.
        counted_breaks: Breaks recorded in ``counters["graph_break"]`` during the run
            (None if the counters are unavailable). It can exceed ``graph_break_count``:
            a break next to an empty graph does not add a graph.
    """

    graph_count: int
    graph_break_count: int
    break_reasons: list[dict[str, Any]]
    ops_count: int
    reasons_source: str
    counted_breaks: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return dataclasses.asdict(self)


def _graph_break_counter() -> collections.Counter | None:
    try:
        from torch._dynamo.utils import counters

        return collections.Counter(counters["graph_break"])
    except Exception:  # private API: missing or renamed
        return None


def _dedupe(reasons: list[tuple[str, str | None]]) -> list[dict[str, Any]]:
    seen: dict[tuple[str, str | None], int] = {}
    for key in reasons:
        seen[key] = seen.get(key, 0) + 1
    return [{"reason": r, "location": loc, "count": n} for (r, loc), n in seen.items()]


def _explain_reasons(out: Any) -> list[tuple[str, str | None]]:
    reasons = []
    for item in getattr(out, "break_reasons", None) or []:
        stack = getattr(item, "user_stack", None) or []
        location = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else None
        reasons.append((_summarise(getattr(item, "reason", item)), location))
    return reasons


def graph_breaks(fn: Callable, *args: Any, **kwargs: Any) -> BreakReport:
    """Count graph breaks of ``fn(*args, **kwargs)`` and say why they happen.

    Runs ``torch._dynamo.explain`` (which resets Dynamo before and after and runs ``fn``
    once). Reasons that Dynamo's graph-break counters recorded but explain missed are
    added without a location. If there are still no reasons while explain counts breaks
    (or built no graph at all), the reason comes from a ``fullgraph=True`` compile, which
    runs ``fn`` once more.

    Args:
        fn: The function (or module) to trace.
        *args: Positional arguments for ``fn``.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        A :class:`BreakReport`. ``graph_break_count`` is never negative (explain says -1
        when Dynamo skipped the whole frame; then ``graph_count`` is 0).
    """
    before = _graph_break_counter()
    out = torch._dynamo.explain(fn)(*args, **kwargs)
    after = _graph_break_counter()
    counted = None if before is None or after is None else after - before
    reasons = _explain_reasons(out)
    sources = ["explain"] if reasons else []
    known = {r for r, _ in reasons}
    extra = [(_summarise(r), None) for r, n in (counted or {}).items() for _ in range(n)]
    extra = [item for item in extra if item[0] not in known]
    if extra:
        reasons += extra
        sources.append("counters")
    if not reasons and (out.graph_break_count > 0 or out.graph_count == 0):
        result = check_fullgraph(fn, *args, **kwargs)
        if not result.ok:
            reasons, sources = [(result.error or "", result.location)], ["fullgraph"]
    return BreakReport(
        graph_count=int(out.graph_count),
        graph_break_count=max(0, int(out.graph_break_count)),
        break_reasons=_dedupe(reasons),
        ops_count=int(out.op_count),
        reasons_source="+".join(sources) or "none",
        counted_breaks=None if counted is None else int(sum(counted.values())),
    )


# ----------------------------------------------------------------------------- fullgraph
@dataclasses.dataclass
class FullgraphResult:
    """Outcome of :func:`check_fullgraph`.

    Attributes:
        ok: True when ``fn`` compiled as one graph and ran.
        error: The first meaningful lines of the Dynamo error (headline, explanation and
            the user code location), or None.
        error_type: The exception class name (e.g. ``"Unsupported"``), or None.
        location: ``"file:line"`` of the offending user code, when the error names it.
    """

    ok: bool
    error: str | None = None
    error_type: str | None = None
    location: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return dataclasses.asdict(self)


def check_fullgraph(fn: Callable, *args: Any, backend: Any = "eager", **kwargs: Any) -> FullgraphResult:
    """Compile ``fn`` with ``fullgraph=True``, run it once and report the first break.

    Dynamo is reset before (so the compile really happens) and after (so the caller's
    caches hold nothing from this check). Note that the reset clears *all* Dynamo caches.

    Args:
        fn: The function (or module) to compile.
        *args: Positional arguments for ``fn``.
        backend: The backend to compile with; ``"eager"`` is enough to find graph breaks.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        A :class:`FullgraphResult`. Errors that are not Dynamo's propagate.
    """
    torch._dynamo.reset()
    try:
        torch.compile(fn, fullgraph=True, backend=backend)(*args, **kwargs)
    except torch._dynamo.exc.TorchDynamoException as exc:
        location, code = _user_location(str(exc))
        error = _summarise(str(exc))
        if location:
            error += f"\n  at {location}" + (f": {code}" if code else "")
        return FullgraphResult(False, error, type(exc).__name__, location)
    finally:
        torch._dynamo.reset()
    return FullgraphResult(True)


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
        start = time.perf_counter()
        compile_id = _current_compile_id()
        try:
            return self._inner(gm, example_inputs, **kwargs)
        except Exception as exc:
            if _is_restart(exc):
                self._counter._record_restart(compile_id, type(exc).__name__)
            raise
        finally:
            self._counter._record_graph(compile_id, time.perf_counter() - start)

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

    Don't call ``torch.compiler.reset()`` (or :func:`graph_breaks`) while a counter is
    counting: compile ids restart from 0 and the metrics can no longer be told apart.
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

    def _record_graph(self, compile_id: tuple[str | None, int | None], seconds: float) -> None:
        self._graphs.append((compile_id[0], compile_id[1], seconds))

    def _record_restart(self, compile_id: tuple[str | None, int | None], name: str) -> None:
        self._restarts.append((compile_id[0], name))

    def _metrics(self) -> list[Any]:
        """Compilation metrics recorded since the start for compiles this counter saw."""
        ids = {cid for cid, _, _ in self._graphs if cid is not None}
        old = {id(m) for m in self._metrics_before}
        return [m for m in _compilation_metrics() if id(m) not in old and str(m.compile_id) in ids]

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


# ----------------------------------------------------------------------------- whole model
def _loss_of(model: Callable) -> Callable:
    def loss_fn(**batch: Any) -> torch.Tensor:
        return model(**batch).loss

    return loss_fn


def diagnose_model(model: Any, batch: dict[str, Any], *, compile_kwargs: dict | None = None,
                   seq_lens: list[int] | None = None, make_batch: Callable[[int], dict] | None = None,
                   backward: bool = True) -> dict[str, Any]:
    """Graph breaks, fullgraph check and (optionally) recompilations of a HF-style model.

    The break and fullgraph checks trace with Dynamo alone (eager backend): the backend does
    not decide where graphs break. Dynamo is reset before and after each step, so the
    caller's compiled caches are cleared.

    Args:
        model: A module called as ``model(**batch)`` whose output has ``.loss``.
        batch: One batch for the break and fullgraph checks.
        compile_kwargs: For the seq-len run: ``backend`` (default ``"inductor"``), ``mode``,
            ``dynamic``, ``fullgraph``, ``options``.
        seq_lens: Sequence lengths to run the compiled model on, in order.
        make_batch: ``make_batch(seq_len) -> batch``; required with ``seq_lens``.
        backward: Also run ``loss.backward()`` in the seq-len run (grads are cleared after).

    Returns:
        A JSON-ready dict with keys ``graph_breaks``, ``break_reasons``, ``fullgraph_ok``,
        ``fullgraph_error``, ``compilations``, ``recompilations``, ``recompile_reasons``,
        ``compile_s``, ``seq_lens`` (and ``restarts``, ``restart_reasons``,
        ``backward_compilations``, ``reasons_source``); the compile counts are None when no
        seq-len run was asked for.

    Raises:
        ValueError: When ``seq_lens`` is given without ``make_batch`` or on bad compile_kwargs.
    """
    if seq_lens and make_batch is None:
        raise ValueError("seq_lens needs make_batch(seq_len) -> batch")
    kwargs = dict(compile_kwargs or {})
    unknown = set(kwargs) - {"backend", "mode", "dynamic", "fullgraph", "options"}
    if unknown:
        raise ValueError(f"unknown compile_kwargs {sorted(unknown)}; use backend, mode, dynamic, fullgraph, options")
    breaks = graph_breaks(_loss_of(model), **batch)
    full = check_fullgraph(_loss_of(model), **batch)
    result: dict[str, Any] = {
        "graph_breaks": breaks.graph_break_count,
        "break_reasons": breaks.break_reasons,
        "fullgraph_ok": full.ok,
        "fullgraph_error": full.error,
        "compilations": None, "recompilations": None, "recompile_reasons": None,
        "restarts": None, "restart_reasons": None, "backward_compilations": None, "compile_s": None,
        "reasons_source": None,
        "seq_lens": list(seq_lens or []),
    }
    if seq_lens:
        result.update(_count_over_seq_lens(model, seq_lens, make_batch, kwargs, backward))
    return result


def _count_over_seq_lens(model: Any, seq_lens: list[int], make_batch: Callable, kwargs: dict,
                         backward: bool) -> dict[str, Any]:
    torch._dynamo.reset()
    try:
        with CompileCounter(backend=kwargs.pop("backend", "inductor")) as counter:
            compiled = counter.compile(model, **kwargs)
            for seq_len in seq_lens:
                loss = compiled(**make_batch(seq_len)).loss
                if backward:
                    loss.backward()
                    model.zero_grad(set_to_none=True)
        counts = counter.to_dict()
    finally:
        torch._dynamo.reset()
    counts.pop("backend_s")
    return counts


# ----------------------------------------------------------------------------- report
def format_report(d: dict[str, Any]) -> str:
    """Render a :func:`diagnose_model` dict as a short text table (rich when available).

    Args:
        d: The dict returned by :func:`diagnose_model` (missing keys show as "-").

    Returns:
        Plain text, ready to print.
    """
    def show(key: str) -> str:
        value = d.get(key)
        if value is None:
            return "-"
        return f"{value:.2f} s" if key == "compile_s" else str(value)

    rows = [("graph breaks", show("graph_breaks")), ("fullgraph", "ok" if d.get("fullgraph_ok") else "FAILS"),
            ("seq lens", ", ".join(map(str, d.get("seq_lens") or [])) or "-"),
            ("compilations", show("compilations")), ("recompilations", show("recompilations")),
            ("compile time", show("compile_s"))]
    notes = [f"break: {r['reason'].splitlines()[0]} ({r.get('location') or '?'})" for r in d.get("break_reasons") or []]
    if d.get("fullgraph_error"):
        notes.append("fullgraph: " + d["fullgraph_error"].splitlines()[0])
    notes += [f"recompile: {r}" for r in d.get("recompile_reasons") or []]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(k) for k, _ in rows)
        return "\n".join([f"{k:<{width}}  {v}" for k, v in rows] + notes)
    table = Table(title="torch.compile diagnostics", show_header=False)
    for key, value in rows:
        table.add_row(key, value)
    buf = io.StringIO()
    console = Console(file=buf, width=110, force_terminal=False, color_system=None)
    console.print(table)
    for note in notes:
        console.print(note, markup=False, highlight=False)
    return buf.getvalue().rstrip()
