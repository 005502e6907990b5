"""Autograd Functions under a backend that runs Dynamo's graph as traced: saved tensors freed at backward.

Why this module exists: Dynamo traces a ``torch.autograd.Function`` (the chunked loss, the
in-place LoRA update, bitsandbytes' 4-bit matmul, ...) into the higher-order operator
``autograd_function_apply(fwd, bwd, *args)``: ``fwd`` returns the outputs and the values the
backward needs, ``bwd`` takes the gradients and those values. Inductor and ``aot_eager`` trace
that operator again with AOTAutograd, whose compiled Function saves them with
``ctx.save_for_backward``: freed when the backward has run. A backend that runs the FX graph as
Dynamo traced it (``eager``) runs the operator's own Python implementation instead, which makes
a new ``autograd.Function`` class on every call and keeps the values in a closure of that
class, not in the autograd graph. Nothing frees them at backward: they live as long as the
class, which sits in a reference cycle that only a full garbage collection breaks, and not
even that where a saved tensor's autograd history leads back to the class through the C++
graph (the in-place LoRA update's saved input does, on a CPU as on a GPU). So every step kept
every Function's saved activations, and a GPU ran out of memory after a few dozen steps.

:func:`release_saved_values` rewrites such a graph before the backend gets it: each ``fwd``
body hands its saved values over in one small holder (the values detached, so the holder
holds no autograd history), and each ``bwd`` body takes them from the holder and empties it
when it is done, as ``save_for_backward`` releases them. The arithmetic of both bodies is
untouched; only where the values wait between forward and backward changes. A second backward
through the same step (``retain_graph=True``) then finds the holder empty and says so, where
the operator's own implementation would have run it; training never does that.

The rewrite reads the graph, not torch's private code: a call of the operator whose ``fwd``
body returns ``(outputs, saved_values)`` and whose ``bwd`` body takes the saved values as its
last inputs (torch 2.4 to 2.13 all build it so). A call that does not look like that is left
as it is and named in a warning, so the leak it may keep is not silent.
:func:`runs_graph_as_traced` names the backends that need it; :class:`~.counting.CompileCounter`
applies it to every graph it hands such a backend.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["GRAPH_AS_TRACED_BACKENDS", "runs_graph_as_traced", "release_saved_values", "SavedValues"]

#: registered Dynamo backends that run the traced FX graph itself (no AOTAutograd).
GRAPH_AS_TRACED_BACKENDS = ("eager", "eager_noexcept", "eager_debug")


def runs_graph_as_traced(backend: Any) -> bool:
    """Whether ``backend`` (a name) runs Dynamo's graph as traced, autograd Functions included."""
    return isinstance(backend, str) and backend in GRAPH_AS_TRACED_BACKENDS


class SavedValues:
    """What one ``fwd`` call saved for its ``bwd``, held until that backward has run."""

    __slots__ = ("values",)

    def __init__(self, values: tuple) -> None:
        self.values: tuple | None = values

    def take(self, index: int) -> Any:
        if self.values is None:
            raise RuntimeError("an autograd Function's saved values were freed by the backward that ran through this "
                               "step already (backend 'eager' releases them as save_for_backward does): a second "
                               "backward through the same graph needs another backend, e.g. 'aot_eager'")
        return self.values[index]


def _hold(*values: Any) -> SavedValues:
    return SavedValues(tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in values))


def _take(held: SavedValues, index: int) -> Any:
    return held.take(index)


def _release(held: SavedValues) -> None:
    held.values = None


def _operator():
    hop = getattr(getattr(torch.ops, "higher_order", None), "autograd_function_apply", None)
    if hop is None:
        from torch._functorch.autograd_function import autograd_function_apply as hop
    return hop


def _submodule(owner: torch.fx.GraphModule, node: Any) -> torch.fx.GraphModule | None:
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    sub = owner
    for part in str(node.target).split("."):
        sub = getattr(sub, part, None)
    return sub if isinstance(sub, torch.fx.GraphModule) else None


def _saved_outputs(fwd: torch.fx.GraphModule):
    """``(output node, outputs, saved nodes)`` of a ``fwd`` body, or None when it is shaped otherwise."""
    out = next((n for n in reversed(fwd.graph.nodes) if n.op == "output"), None)
    if out is None or len(out.args) != 1:
        return None
    result = out.args[0]
    if not isinstance(result, (tuple, list)) or len(result) != 2 or not isinstance(result[1], (tuple, list)):
        return None
    if not all(isinstance(v, torch.fx.Node) for v in result[1]):
        return None
    return out, result[0], list(result[1])


def _rewrite_pair(fwd: torch.fx.GraphModule, bwd: torch.fx.GraphModule) -> bool:
    """Route one ``fwd``/``bwd`` pair's saved values through a :class:`SavedValues`; False if not recognised."""
    found = _saved_outputs(fwd)
    placeholders = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    if found is None:
        return False
    out, outputs, saved = found
    if not saved:
        return True  # nothing waits for the backward
    if len(placeholders) < len(saved) or any(n.target is _take for n in bwd.graph.nodes):
        return False
    with fwd.graph.inserting_before(out):
        held = fwd.graph.call_function(_hold, tuple(saved))
    out.args = ((outputs, (held,)),)
    old = placeholders[-len(saved):]
    with bwd.graph.inserting_after(placeholders[-1]):
        held_in = bwd.graph.placeholder("saved_values_holder")
    anchor = held_in
    for i, node in enumerate(old):
        with bwd.graph.inserting_after(anchor):
            anchor = bwd.graph.call_function(_take, (held_in, i))
        node.replace_all_uses_with(anchor)
    for node in old:
        bwd.graph.erase_node(node)
    bwd_out = next(n for n in reversed(bwd.graph.nodes) if n.op == "output")
    with bwd.graph.inserting_before(bwd_out):
        bwd.graph.call_function(_release, (held_in,))
    fwd.recompile()
    bwd.recompile()
    return True


def release_saved_values(gm: torch.fx.GraphModule) -> int:
    """Rewrite every ``autograd_function_apply`` in ``gm`` (nested graphs included) in place.

    Returns:
        How many ``fwd``/``bwd`` pairs now free their saved values at backward.

    Warns:
        RuntimeWarning: a call whose bodies are not shaped as this module expects (left as traced).
    """
    hop = _operator()
    done: set[int] = set()
    count = 0
    for owner in list(gm.modules()):
        if not isinstance(owner, torch.fx.GraphModule):
            continue
        for node in list(owner.graph.nodes):
            if node.op != "call_function" or node.target is not hop or len(node.args) < 2:
                continue
            fwd, bwd = _submodule(owner, node.args[0]), _submodule(owner, node.args[1])
            if fwd is None or bwd is None:
                ok = False
            elif id(fwd) in done:
                continue
            else:
                ok = _rewrite_pair(fwd, bwd)
            if not ok:
                warnings.warn(f"backend 'eager': the autograd Function call {node.name!r} is not shaped as "
                              "qlora_nb_utils.compile.saved_values expects; its saved tensors stay until the "
                              "garbage collector frees them", RuntimeWarning, stacklevel=2)
                continue
            done.add(id(fwd))
            count += 1
    return count
