"""Graph breaks and the fullgraph check, with reasons you can trust.

Why this module exists: a QLoRA step that ``torch.compile`` captures in one graph is the point
of the notebooks, and the obvious count of graph breaks is wrong. ``torch._dynamo.explain``
computes ``graph_break_count`` as *graphs - 1*: a break whose graph on one side is empty is
not counted at all, a break inside an inlined call can be counted twice with one reason, and
a non-zero count can come with an empty ``break_reasons`` list. So
:func:`graph_breaks` cross-checks explain with Dynamo's ``counters["graph_break"]`` and, when
both are silent, with the error that a ``fullgraph=True`` compile raises
(:func:`check_fullgraph`), and says which source the reasons came from. Dynamo's internals
move between releases, so each private access is guarded and degrades to a documented
fallback instead of failing.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any, Callable

import torch

__all__ = ["BreakReport", "FullgraphResult", "graph_breaks", "check_fullgraph"]

_DROP_LINE = re.compile(r"^\s*(Hint:|Developer debug context:|For more details|Set TORCHDYNAMO)")
_FILE_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<fn>\S+))?')


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
