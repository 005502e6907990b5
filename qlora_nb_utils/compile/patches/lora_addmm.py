"""Add each LoRA update into its base layer's output with one ``addmm``: fewer activation buffers.

Not a graph-break workaround: a memory (and speed) patch. PEFT's ``Linear4bit.forward``
computes a LoRA projection as ``result = base(x).clone()``, ``out = lora_B(lora_A(x)) * scaling``,
``result = result + out``. Compiled, that is the base output, the ``lora_B`` matmul's output and
their sum: three output-sized buffers where one is needed. With every layer checkpointed, the
backward's recompute of one MLP holds several of them alive at once beside the base outputs (a
memory profile's live tensors at the peak, allocated in PEFT's ``lora/bnb.py``). Here the update
is one matmul that adds into the base output itself
(:func:`qlora_nb_utils.ops.lora_update.add_lora_`, in place: an out-of-place ``torch.addmm``
made cuBLAS copy the base output first, time spent in every step). The
backward is the sum's (the base gets the output gradient as it is; ``A`` and ``B`` their usual
gradients from the saved ``x@A^T`` and ``x``), so what is saved does not grow. When ``x@A^T``
comes out in another dtype than the base output, or the base layer has a bias (Qwen2's q, k and
v: its output is a view, which an in-place Function under Dynamo cannot take), it is the
out-of-place ``torch.addmm``.

:func:`apply` sets an instance ``forward`` on each PEFT ``lora.bnb.Linear4bit`` (and plain
``lora.Linear``) of the model, nothing process-wide. The replacement handles the plain case
(one active adapter, vanilla LoRA, not merged, adapters enabled, no ``adapter_names``, and
under autocast or with the LoRA weights in the base output's dtype) and hands every other call
to PEFT's own forward, unchanged. Values differ from PEFT's only by rounding: the sum is
rounded once in the matmul's epilogue, where PEFT rounds the update, its scaling and the sum.

With ``nf4_rows`` (what ``optimize()`` passes when its ``nf4_dequant`` patch is on), a layer over an
NF4 weight that :func:`~qlora_nb_utils.compile.patches.nf4_dequant.make_lora_route` accepts runs
as one :func:`~qlora_nb_utils.ops.lora_update.nf4_lora_linear`: the update first, the base matmul
adding into it, forward and backward (one input gradient, not two summed). PEFT's scaling, its
identity dropout and the LoRA weights cast to the input's dtype under autocast are kept; any
other layer, or a call outside the route, takes the path above.

Siblings that read the same input (:data:`GROUPS`: a decoder layer's ``q_proj``, ``k_proj`` and
``v_proj``; ``gate_proj`` and ``up_proj``) run as one
:func:`~qlora_nb_utils.ops.lora_update.nf4_lora_linears` when every one of them takes that route
(``group=True``, the default): the first member called computes the whole group and leaves the
others' outputs on the group's state, which the next members take if they are called with the
very same input tensor (anything else: their own call, as above). The input is then read once
for the group's ``x @ A^T`` and ``A`` gradients, and the group has one input gradient.

Smallest check (``tests/test_lora_addmm.py``)::

    with lora_addmm.patched(model):
        loss = torch.compile(step, fullgraph=True)(batch)   # 0 breaks; loss, LoRA grads as unpatched
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

import torch

from ...ops.lora_update import add_lora_, nf4_lora_linear, nf4_lora_linears
from ...reversible import PatchHandle, check_versions, set_attribute

__all__ = ["VERIFIED_ON", "SUPPORTED", "GROUPS", "apply", "patched", "find_layers", "find_groups"]

NAME = "lora_addmm"

#: Versions this patch was verified on (CPU: tests here; CUDA: the repository's GPU runs of it).
VERIFIED_ON = {"torch": "2.13.0 (cpu), 2.11.0+cu130 (cuda)", "peft": "0.21.2"}

#: Sibling LoRA layers (attribute names under one parent) that a decoder layer calls on the same input.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

#: Versions the patch accepts; outside them it refuses (PEFT's forward is what it stands in for).
SUPPORTED = {"peft": ">=0.17,<0.22", "torch": ">=2.6"}


def _lora_classes() -> tuple[type, ...]:
    from peft.tuners.lora import layer

    classes: list[type] = [layer.Linear]
    try:
        from peft.tuners.lora import bnb

        classes.append(bnb.Linear4bit)
    except (ImportError, AttributeError):  # PEFT without bitsandbytes: plain Linear only
        pass
    return tuple(classes)


def find_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The PEFT LoRA linear layers of ``model`` this patch would replace the forward of."""
    classes = _lora_classes()
    return [m for m in model.modules() if type(m) in classes]


def _plain(layer: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The single adapter's name when this call is the plain case (module docstring), else None."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A.keys()]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    name = active[0]
    if getattr(layer, "use_dora", {}).get(name, False) or x.dim() < 2:
        return None
    if getattr(layer.lora_B[name], "bias", None) is not None:  # PEFT's lora_bias: B has a bias the update needs
        return None
    return name


def _fused_args(layer: Any, x: torch.Tensor, route: Callable[[Any, torch.Tensor], tuple | None]) -> tuple | None:
    """``(a, b, scaling, weight_args)`` when ``layer``'s call on ``x`` takes the fused NF4 route, else None."""
    name = _plain(layer, x, (), {})
    if name is None:
        return None
    lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
    weight_args = route(layer.base_layer, x)
    if weight_args is None or not isinstance(layer.lora_dropout[name], torch.nn.Identity) or not (
            torch.is_autocast_enabled(x.device.type) or lora_A.weight.dtype == lora_B.weight.dtype == x.dtype):
        return None
    # autocast's casts, done here (differentiable) as lora_A/B would
    return lora_A.weight.to(x.dtype), lora_B.weight.to(x.dtype), layer.scaling[name], weight_args


#: The attribute through which a grouped LoRA layer names its :class:`_Group` (while patched).
GROUP_ATTR = "_qlora_lora_group"


class _Group:
    """Sibling layers that read the same input, and what the first one called left for the others."""

    def __init__(self, layers: list, wide: bool = False) -> None:
        self.layers = layers
        self.wide = wide
        #: False: each member runs on its own (a caller that runs the members inside a checkpointed
        #: region, where leaving outputs on the group is a side effect Dynamo refuses, turns it off)
        self.active = True
        self.x: torch.Tensor | None = None
        self.outs: tuple | None = None
        self.pending = (False,) * len(layers)

    def clear(self) -> None:
        self.x, self.outs, self.pending = None, None, (False,) * len(self.layers)


def _grouped(group: _Group, index: int, x: torch.Tensor, route: Callable) -> torch.Tensor | None:
    """Member ``index``'s output from the group's call on ``x`` (made now if needed), or None: its own call."""
    if group.x is x and group.pending[index]:
        out = group.outs[index]
        pending = group.pending[:index] + (False,) + group.pending[index + 1:]
        if any(pending):
            group.pending = pending
        else:
            group.clear()
        return out
    members = [_fused_args(layer, x, route) for layer in group.layers]
    if any(m is None for m in members):
        return None
    outs = nf4_lora_linears(x, members, wide=group.wide)
    group.x, group.outs = x, outs
    group.pending = tuple(i != index for i in range(len(members)))
    return outs[index]


def _forward(self: Any, x: torch.Tensor, *args: Any, in_place: bool = True,
             route: Callable[[Any, torch.Tensor], tuple | None] | None = None,
             group: _Group | None = None, index: int = 0, **kwargs: Any) -> torch.Tensor:
    name = _plain(self, x, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    if group is not None and group.active and route is not None:
        out = _grouped(group, index, x, route)
        if out is not None:
            return out
    lora_A, lora_B = self.lora_A[name], self.lora_B[name]
    autocast = torch.is_autocast_enabled(x.device.type)
    fused = _fused_args(self, x, route) if route is not None else None
    if fused is not None:
        return nf4_lora_linear(x, *fused)
    if not autocast and not lora_A.weight.dtype == lora_B.weight.dtype == x.dtype:
        return type(self).forward(self, x, *args, **kwargs)  # PEFT casts in and out: its own path
    result = self.base_layer(x)
    if not autocast and result.dtype != x.dtype:
        return type(self).forward(self, x, *args, **kwargs)  # (the base output unused: rare, and dead code compiled)
    xa = lora_A(self.lora_dropout[name](x))
    # a base with a bias returns a view (addmm, then a reshape): Dynamo cannot trace an in-place
    # Function on a view of a graph intermediate (a shape error in its backward), so out of place
    biased = getattr(self.base_layer, "bias", None) is not None
    if in_place and not biased and xa.dtype == result.dtype and result.is_contiguous():  # no copy of the base output
        b = lora_B.weight if lora_B.weight.dtype == result.dtype else lora_B.weight.to(result.dtype)  # autocast's cast
        return add_lora_(result, xa, b, self.scaling[name])
    out = torch.addmm(result.reshape(-1, result.shape[-1]), xa.reshape(-1, xa.shape[-1]), lora_B.weight.t(),
                      alpha=self.scaling[name])  # autocast casts and rounds
    return out.view(result.shape)


def _make_forward(in_place: bool, route: Callable | None, group: _Group | None = None, index: int = 0) -> Callable:
    def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _forward(self, x, *args, in_place=in_place, route=route, group=group, index=index, **kwargs)

    return forward


def find_groups(model: torch.nn.Module, layers: list | None = None) -> list[list]:
    """The :data:`GROUPS` of ``model``: lists of at least two sibling LoRA layers (of ``layers``,
    default :func:`find_layers`) with the same input size, in call order."""
    chosen = {id(m) for m in (find_layers(model) if layers is None else layers)}
    out = []
    for parent in model.modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            members = [m for m in members if m is not None and id(m) in chosen]
            if len(members) >= 2 and len({m.in_features for m in members}) == 1:
                out.append(members)
    return out


def apply(model: torch.nn.Module, in_place: bool = True, nf4_rows: dict[str, int] | None = None,
          group: bool = True, wide: bool = False) -> PatchHandle:
    """Give every PEFT LoRA linear layer of ``model`` the one-matmul update (module docstring).

    ``in_place=False``: the out-of-place ``torch.addmm`` (a copy of each base output, so a little
    slower, but one tensor fewer at the peak), which ``optimize()`` takes when a memory target
    is not met otherwise.

    ``nf4_rows``: layers over an NF4 weight run as one ``nf4_lora_linear`` past this many input
    rows per device type (module docstring; the ``forward_min_rows`` of the ``nf4_dequant``
    patch's details). None: never.

    ``group``: with ``nf4_rows``, the :data:`GROUPS` run as one ``nf4_lora_linears`` each
    (module docstring). False: every layer on its own.

    ``wide``: with ``group``, each group member's output is one GEMM over ``[x | s x A^T]`` and
    ``[W_i | B_i]`` (``nf4_lora_linears(wide=True)``): no update tensor is written.

    Returns:
        A :class:`PatchHandle`; ``details["layers"]`` is how many layers were patched,
        ``details["in_place"]`` which update they use, ``details["nf4_layers"]`` how many have an
        NF4 base that may take the fused route (0 without ``nf4_rows``), ``details["groups"]``
        how many groups of siblings share one call (0 without ``nf4_rows`` or with ``group=False``).

    Raises:
        RuntimeError: Unsupported versions.
        ValueError: ``model`` has no PEFT LoRA linear layer.
    """
    check_versions(NAME, SUPPORTED, VERIFIED_ON)
    layers = find_layers(model)
    if not layers:
        raise ValueError("lora_addmm: the model has no PEFT LoRA linear layer")
    route, nf4 = None, 0
    if nf4_rows is not None:
        from .nf4_dequant import holds_nf4, make_lora_route

        route = make_lora_route(dict(nf4_rows))
        nf4 = sum(holds_nf4(layer.base_layer) for layer in layers)
    groups = ([_Group(members, bool(wide)) for members in find_groups(model, layers)]
              if route is not None and group else [])
    handle = PatchHandle(NAME, {"layers": len(layers), "in_place": bool(in_place), "nf4_layers": nf4,
                                "groups": len(groups), "wide": bool(wide and groups)})
    place = {id(layer): (g, i) for g in groups for i, layer in enumerate(g.layers)}
    for layer in layers:
        forward = _make_forward(bool(in_place), route, *place.get(id(layer), (None, 0)))
        set_attribute(handle, layer, "forward", types.MethodType(forward, layer))
        if id(layer) in place:  # its group, for a patch that must run the members apart
            set_attribute(handle, layer, GROUP_ATTR, place[id(layer)][0])
    for g in groups:
        handle.add_undo(g.clear)  # nothing left on a group's state after undo
    return handle


@contextlib.contextmanager
def patched(model: torch.nn.Module, in_place: bool = True,
            nf4_rows: dict[str, int] | None = None, group: bool = True,
            wide: bool = False) -> Iterator[PatchHandle]:
    """:func:`apply` for the duration of the block."""
    handle = apply(model, in_place, nf4_rows, group, wide)
    try:
        yield handle
    finally:
        handle.undo()
