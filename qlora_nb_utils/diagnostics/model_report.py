"""Diagnose a whole HF-style model in one call, and render the result as a short table.

Why this module exists: the questions asked of a model are always the same three (does its
loss break the graph, does a ``fullgraph=True`` compile succeed, how often does it compile over
a list of sequence lengths), and their answers belong in one JSON-ready dict that can be saved
or printed. :func:`diagnose_model` asks them with :mod:`.breaks` and the
:class:`~qlora_nb_utils.compile.CompileCounter`; ``checks.diagnose`` (the CLI's ``diagnose``)
calls it when asked not to prepare the model, and :func:`format_report` renders the dict.
"""

from __future__ import annotations

import io
from typing import Any, Callable

import torch

from ..compile.counting import CompileCounter
from .breaks import check_fullgraph, graph_breaks

__all__ = ["diagnose_model", "format_report"]


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
