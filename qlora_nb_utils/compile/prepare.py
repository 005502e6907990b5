"""Prepare a (Q)LoRA model for ``torch.compile``: patches, checkpointing, scope, optimizer.

Why this module exists: "call ``torch.compile(model)``" is one line, but a QLoRA training
step only compiles into few graphs with zero breaks, and keeps checkpointing's memory
saving, when a few decisions are made together, each easy to get subtly wrong on its own:

* **Patches.** With gradient checkpointing on, transformers' require-grad hook and its
  ``use_cache`` warning break the graph (see :mod:`qlora_nb_utils.compile.patches`). ``patches="auto"``
  applies the ones whose targets the model actually has, reversibly.
* **Gradient checkpointing.** Inside a region Dynamo traces, ``torch.utils.checkpoint`` is
  captured as the ``tag_activation_checkpoint`` higher-order op (reentrant or not) and
  AOTAutograd recomputes the tagged ops in the compiled backward. Where checkpointing runs
  eagerly around compiled code (regional scope), the variant matters: *reentrant* runs the
  forward under ``no_grad`` and the recompute under grad, so every layer graph compiles twice
  (a ``grad_mode`` guard) and it needs an input that requires grad; *non-reentrant* compiles
  once and needs nothing. ``grad_ckpt`` sets the variant reversibly, or leaves it alone.
* **Scope.** ``"whole"`` compiles the model's forward as one graph (the loss included).
  ``"regional"`` compiles each decoder layer with ``Module.compile`` instead: the layers share
  one code object, so one layer's compile serves them all (compile time ~ one layer instead
  of the whole stack), and the checkpointing around each layer stays eager, so the backward
  recomputes exactly one layer at a time, as in eager. What the shorter compile is worth against
  the whole graph's faster step over a job is :func:`regional_pays_until` (``optimize()``'s scope
  choice weighs it).
* **What the compiled backward keeps.** Plain checkpointing tags its region
  ``PREFER_RECOMPUTE``, which the compiler may override. In exploratory GPU runs (torch 2.11,
  1B-shape NF4 QLoRA) it did: the whole-model graph kept several MLP- and attention-width
  activations per layer and peaked above eager with checkpointing. With ``grad_ckpt=True`` in
  ``"whole"`` scope the checkpoint carries a selective-checkpointing policy of
  ``MUST_RECOMPUTE`` for every op (:func:`must_recompute_context`), which the compiler must
  obey, and the compiled peak came down to eager's. Those runs kept no results file, so no
  figure is quoted here; the compile matrix (``qlora_nb_utils.bench.matrix``) records peak memory
  per cell. The CPU partitioner makes the lean choice either way, so only a GPU shows it.
* **Optimizer.** ``compile_optimizer`` adds a :class:`~qlora_nb_utils.compile.CompiledOptimizer`,
  compiled the way PyTorch's recipe asks (:mod:`.optimizer` says why).
* **Low-precision numerics.** Inductor fuses bf16/fp16 pointwise ops into one kernel and
  keeps the intermediates in fp32, where eager rounds every op's output to bf16, so compiled
  losses drift from eager's by rounding. ``eager_numerics=True`` turns on Inductor's
  ``emulate_precision_casts`` (those roundings kept) for the life of the :class:`Prepared`.
* **One configuration per kernel.** In its default mode Inductor still gives a reduction (and a
  two-dimensional pointwise kernel) several candidate launch configurations, compiles each and
  benchmarks them on real buffers at the first call: first-step time (and a first-step copy of
  each buffer the benchmark writes) spent on choices among kernels that are small in a LoRA step.
  ``one_config=True`` has Inductor pick one configuration per kernel by its own heuristics (the
  filter its deterministic mode uses for reductions; no pointwise autotuning), for the life of
  the :class:`Prepared` (:func:`one_config_available` says whether this torch has the filter).

Every compile goes through a :class:`~qlora_nb_utils.compile.CompileCounter`, so the
number of compilations is a fact on the returned :class:`Prepared` rather than a guess.
This module validates the options and makes the changes in order, each reversibly; the
checkpointing choices live in :mod:`.checkpointing`, the optimizer in :mod:`.optimizer`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import torch

from ..ops.static_floats import with_static_floats
from ..reversible import PatchHandle, set_attribute
from .checkpointing import configure_checkpointing, decoder_layers, has_traceable_hook
from .counting import CompileCounter
from .optimizer import CompiledOptimizer, compiled_optimizer
from .options import AUTOTUNE_MODES
from .patches import PATCHES, input_require_grads, use_cache_warning

__all__ = [
    "SCOPES",
    "GRAD_CKPT_CHOICES",
    "Prepared",
    "prepare_for_compile",
    "valid_modes",
    "valid_backends",
    "regional_pays_until",
    "one_config_available",
    "WHOLE_COMPILE_S_PER_LAYER",
    "REGIONAL_STEP_S_PER_LAYER",
]

SCOPES = ("whole", "regional")
#: None keeps the model's setting; True means "non_reentrant".
GRAD_CKPT_CHOICES = (None, False, True, "non_reentrant", "reentrant")
_FALLBACK_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")

#: A whole-model graph's cold compile, per decoder layer, in seconds on a GPU: Dynamo traces, and
#: Inductor compiles, every layer of the unrolled stack again, so its compile grows with the depth,
#: where a regional compile traces one layer that every layer then reuses.
WHOLE_COMPILE_S_PER_LAYER = 5.0
#: What each decoder layer adds to a regional step on a GPU, in seconds, against a whole graph under
#: CUDA graphs: the layer's kernels are launched one by one instead of replayed as one graph.
REGIONAL_STEP_S_PER_LAYER = 1.5e-3


def regional_pays_until(layers: int) -> int:
    """The steps up to which a regional compile finishes a GPU job first: the whole graph's longer
    compile (:data:`WHOLE_COMPILE_S_PER_LAYER` for each layer beyond the one compiled regionally) over
    its faster step (:data:`REGIONAL_STEP_S_PER_LAYER` for every layer). Both grow with the depth, so
    this hardly depends on the model's size."""
    return int(WHOLE_COMPILE_S_PER_LAYER * (layers - 1) / (REGIONAL_STEP_S_PER_LAYER * layers))


# ----------------------------------------------------------------------------- validation
def valid_modes() -> list[str]:
    """Inductor modes this torch accepts: ``"default"`` plus ``torch._inductor.list_mode_options()``."""
    try:
        from torch._inductor import list_mode_options

        modes = list(list_mode_options())
    except Exception:  # private helper moved: the modes every torch >= 2.2 has
        modes = list(_FALLBACK_MODES)
    return ["default"] + [m for m in modes if m != "default"]


def valid_backends() -> list[str]:
    """Every registered Dynamo backend name, debug ones (``eager``, ``aot_eager``) included."""
    try:
        return sorted(torch._dynamo.list_backends(exclude_tags=()))
    except TypeError:  # older signature without exclude_tags
        return sorted(set(torch._dynamo.list_backends()) | {"eager", "aot_eager", "inductor"})


def _validate(model, grad_ckpt, scope, mode, backend, fullgraph, dynamic, compile_optimizer, patches,
              eager_numerics=False, one_config=False):
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(grad_ckpt is c for c in GRAD_CKPT_CHOICES) and grad_ckpt not in ("non_reentrant", "reentrant"):
        raise ValueError(f"grad_ckpt must be one of {list(GRAD_CKPT_CHOICES)}, got {grad_ckpt!r}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {list(SCOPES)}, got {scope!r}")
    if isinstance(backend, str):
        if backend not in valid_backends():
            raise ValueError(f"backend must be a callable or one of {valid_backends()}, got {backend!r}")
    elif not callable(backend):
        raise ValueError(f"backend must be a name or a callable, got {type(backend).__name__}")
    if mode is not None:
        if backend != "inductor":
            raise ValueError(f"mode is an inductor option; with backend={backend!r} pass mode=None")
        if mode not in valid_modes():
            raise ValueError(f"mode must be None or one of {valid_modes()}, got {mode!r}")
    if not isinstance(fullgraph, bool):
        raise ValueError(f"fullgraph must be True or False, got {fullgraph!r}")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ValueError(f"dynamic must be None, True or False, got {dynamic!r}")
    if not isinstance(compile_optimizer, (bool, dict)):
        raise ValueError("compile_optimizer must be True, False or a dict of AdamW options "
                         f"(e.g. {{'lr': 2e-4}}), got {compile_optimizer!r}")
    if not isinstance(eager_numerics, bool):
        raise ValueError(f"eager_numerics must be True or False, got {eager_numerics!r}")
    if not isinstance(one_config, bool):
        raise ValueError(f"one_config must be True or False, got {one_config!r}")
    if one_config and mode in AUTOTUNE_MODES:
        raise ValueError(f"one_config=True contradicts mode {mode!r}, which benchmarks kernel variants")
    return _patch_names(patches)


def _patch_names(patches) -> Sequence[str] | str:
    if patches == "auto":
        return "auto"
    if patches is None:
        return ()
    if isinstance(patches, str) or not isinstance(patches, Iterable):
        raise ValueError(f"patches must be 'auto', None or a list of names from {list(PATCHES)}, "
                         f"got {patches!r}")
    names = list(patches)
    unknown = [n for n in names if n not in PATCHES]
    if unknown:
        raise ValueError(f"unknown patches {unknown}; valid: {list(PATCHES)}")
    return names


# ----------------------------------------------------------------------------- model surgery
def _emulate_precision_casts() -> PatchHandle:
    """Turn on ``torch._inductor.config.emulate_precision_casts``; undo puts back the value before.

    The flag is read while compiling (AOTAutograd's tracer marks the ops whose results eager
    rounds, Inductor's code generation keeps those roundings), which happens at the first call
    of the compiled forward (and the first backward), after ``prepare_for_compile`` has
    returned: so it is set for the life of the :class:`Prepared`, not around one call. Undo leaves the flag
    alone if someone else changed it meanwhile (as :func:`set_attribute` does).
    """
    from torch._inductor import config

    handle = PatchHandle("eager_numerics", {"emulate_precision_casts": True})
    _set_config(handle, config, "emulate_precision_casts", True)
    return handle


def _set_config(handle: PatchHandle, section: Any, name: str, value: Any) -> None:
    """Set an entry of Inductor's config (``section``: the module or a section of it) with an undo step
    on ``handle`` that puts back the value before, unless someone changed it meanwhile.

    Not :func:`set_attribute`: a config entry is no instance attribute, so that would delete it on
    undo, and a deleted entry of torch's config reads as missing from then on."""
    old = getattr(section, name)
    setattr(section, name, value)

    def restore() -> None:
        if getattr(section, name) == value:  # else changed since: not ours to revert
            setattr(section, name, old)

    handle.add_undo(restore)


#: Where Inductor keeps the reduction filter of its deterministic mode (one configuration chosen by
#: heuristics, none benchmarked), outside that mode's other changes: ``(section, name)`` of its config.
_REDUCTION_FILTER = ("test_configs", "force_filter_reduction_configs")


def one_config_available() -> bool:
    """Whether this torch's Inductor can filter a reduction's candidates to one (:data:`_REDUCTION_FILTER`);
    without it ``one_config`` still turns pointwise autotuning off."""
    try:
        from torch._inductor import config
    except ImportError:
        return False
    return hasattr(getattr(config, _REDUCTION_FILTER[0], None), _REDUCTION_FILTER[1])


#: What ``one_config`` sets in Inductor's config: ``(section, name, value)``, each only where this torch has it.
_ONE_CONFIG = (("triton", "autotune_pointwise", False), (*_REDUCTION_FILTER, True))


def _one_config(config: Any = None) -> PatchHandle:
    """Inductor's kernels in one configuration each: no pointwise autotuning, reductions filtered to one
    (each where this torch has the setting: ``config``, Inductor's own when None); undo puts back each
    value it changed, unless changed since.

    Like ``emulate_precision_casts`` the settings are read while compiling (code generation writes
    each kernel's candidates), which happens at the first step after ``prepare_for_compile`` has
    returned, so they hold for the life of the :class:`Prepared`."""
    if config is None:
        from torch._inductor import config
    targets = [(getattr(config, section), name, value) for section, name, value in _ONE_CONFIG
               if hasattr(getattr(config, section, None), name)]
    handle = PatchHandle("one_config", {name: value for _, name, value in targets})
    for section, name, value in targets:
        _set_config(handle, section, name, value)
    return handle


def _apply_patches(model: torch.nn.Module, names) -> list[PatchHandle]:
    if names == "auto":
        names = []
        if input_require_grads.find_hooks(model):
            names.append("input_require_grads")
        if use_cache_warning.find_configs(model):
            names.append("use_cache_warning")
    handles = []
    try:
        for name in names:
            handles.append(PATCHES[name].apply(model))
    except BaseException:
        for h in reversed(handles):
            h.undo()
        raise
    return handles


def _compile_regional(model, backend_fn, fullgraph, dynamic) -> PatchHandle:
    if "_compiled_call_impl" not in vars(torch.nn.Module):
        raise RuntimeError(f"regional compilation needs Module._compiled_call_impl (torch >= 2.2); "
                           f"torch {torch.__version__} lacks it")
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"scope='regional' found no decoder layer in {type(model).__name__}; "
                         "use scope='whole'")
    handle = PatchHandle("regional_compile", {"layers": len(layers)})
    # The first layer's input is the frozen embedding's output, which does not require grad; every
    # other layer's does (the previous layer's LoRA output), so the first layer would compile a
    # second graph on a requires_grad guard. The traceable hook makes them alike: one compilation.
    embeddings = next((m.get_input_embeddings() for m in model.modules() if hasattr(m, "get_input_embeddings")), None)
    if embeddings is not None and not input_require_grads.find_hooks(model) and not has_traceable_hook(model):
        hook = embeddings.register_forward_hook(input_require_grads.requires_grad_unless_compiling)
        handle.add_undo(hook.remove)
    for layer in layers:  # what Module.compile() does, recorded for undo
        compiled = torch.compile(layer._call_impl, backend=backend_fn, fullgraph=fullgraph, dynamic=dynamic)
        if dynamic is True:
            compiled = with_static_floats(compiled)
        set_attribute(handle, layer, "_compiled_call_impl", compiled)
    return handle


# ----------------------------------------------------------------------------- the entry point
@dataclasses.dataclass
class Prepared:
    """A model made ready for compiled training.

    Attributes:
        model: The model, patched in place (its layers compiled in place for ``"regional"``).
        forward: What to call instead of ``model``: ``forward(**batch)`` (the compiled module
            for ``"whole"``, the model itself for ``"regional"``).
        scope: ``"whole"`` or ``"regional"``.
        handles: Every reversible change, in the order made.
        counter: Counts the model's compilations (forward graphs, backward graphs, time).
        optimizer: A :class:`CompiledOptimizer` when ``compile_optimizer`` was asked for.
        options: The options it was prepared with.
    """

    model: torch.nn.Module
    forward: Callable[..., Any]
    scope: str
    handles: list[PatchHandle]
    counter: CompileCounter
    optimizer: CompiledOptimizer | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @property
    def patches(self) -> list[str]:
        """Names of the upstream patches applied."""
        return [h.name for h in self.handles if h.name in PATCHES]

    def compile_stats(self) -> dict[str, Any]:
        """The counter's numbers (model, and optimizer step when compiled)."""
        stats = {"model": self.counter.to_dict()}
        if self.optimizer is not None:
            stats["optimizer"] = self.optimizer.counter.to_dict()
        return stats

    def undo(self) -> None:
        """Revert every change (newest first): the model is as it was. Safe to call twice."""
        first_error: BaseException | None = None
        for handle in reversed(self.handles):
            try:
                handle.undo()
            except BaseException as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error


def prepare_for_compile(
    model: torch.nn.Module,
    *,
    grad_ckpt: bool | str | None = None,
    scope: str = "whole",
    mode: str | None = None,
    backend: Any = "inductor",
    fullgraph: bool = True,
    dynamic: bool | None = None,
    compile_optimizer: bool | dict = False,
    patches: str | Sequence[str] | None = "auto",
    eager_numerics: bool = False,
    one_config: bool = False,
) -> Prepared:
    """Patch, configure and compile ``model`` for training; everything is reversible.

    Args:
        model: A transformers causal LM, PEFT-wrapped or not (QLoRA included).
        grad_ckpt: ``None`` keeps the model's checkpointing exactly as it is; ``False``
            turns it off; ``True``/``"non_reentrant"`` turns it on, non-reentrant, and in
            ``"whole"`` scope with the :func:`must_recompute_context` policy, so that the
            compiled step keeps no more activations than eager checkpointing (``None`` on a
            checkpointing model lets the compiler save more; see the module docstring);
            ``"reentrant"`` turns on reentrant checkpointing (regional scope then compiles
            each layer graph twice, under no_grad and under grad).
        scope: ``"whole"`` (one graph for the forward and loss) or ``"regional"`` (each
            decoder layer compiled, the rest eager; see the module docstring).
        mode: An inductor mode (``valid_modes()``) or None; only with ``backend="inductor"``.
        backend: A Dynamo backend name (``valid_backends()``) or a backend callable.
        fullgraph: Fail at the first graph break instead of splitting the graph.
        dynamic: ``torch.compile``'s ``dynamic`` (None: specialise first, then go dynamic
            on the first shape change). In ``"regional"`` scope ``True`` (variable lengths:
            the layers' inputs cannot be marked dynamic from outside) keeps Python floats
            constant, which saves a restarted trace of the layer (see :func:`~qlora_nb_utils.ops.static_floats.with_static_floats`).
        compile_optimizer: True builds a compiled ``AdamW`` over the trainable parameters
            (lr 2e-4); a dict gives its ``AdamW`` options, e.g. ``{"lr": 1e-4}``.
        patches: ``"auto"`` (the patches whose targets the model has), None/``[]`` (none), or
            names from ``qlora_nb_utils.compile.patches.PATCHES``.
        eager_numerics: True sets Inductor's ``emulate_precision_casts`` until ``undo()``.
            Inductor fuses bf16/fp16 pointwise ops and keeps the intermediates in fp32, while
            eager rounds each op's result to bf16; with this, the fused kernels round where
            eager does, so the compiled losses follow eager's. The cost: a little speed (extra
            casts; Triton's floating-point fusion is turned off). Only Inductor reads it; it is
            meant for bf16/fp16 training.
        one_config: True has Inductor compile each kernel in one configuration and benchmark none on
            the first step, until ``undo()`` (see the module docstring); not with a max-autotune mode.

    Returns:
        A :class:`Prepared`: call ``prepared.forward(**batch)``; ``prepared.undo()`` reverts.

    Raises:
        ValueError: An option is invalid (the message lists the valid values) or the model
            cannot do what was asked (no checkpointing support, no decoder layers).
        RuntimeError: A patch refuses (unsupported versions or a changed upstream target).
    """
    names = _validate(model, grad_ckpt, scope, mode, backend, fullgraph, dynamic, compile_optimizer, patches,
                      eager_numerics, one_config)
    options = {"grad_ckpt": grad_ckpt, "scope": scope, "mode": mode, "backend": backend,
               "fullgraph": fullgraph, "dynamic": dynamic, "compile_optimizer": compile_optimizer,
               "patches": patches, "eager_numerics": eager_numerics, "one_config": one_config}
    handles: list[PatchHandle] = []
    try:
        if eager_numerics:
            handles.append(_emulate_precision_casts())
        if one_config:
            handles.append(_one_config())
        handles.append(configure_checkpointing(model, grad_ckpt, scope))
        handles.extend(_apply_patches(model, names))
        counter = CompileCounter(backend=backend)
        backend_fn = counter.as_backend(mode=mode, dynamic=dynamic)
        if scope == "whole":
            forward = torch.compile(model, backend=backend_fn, fullgraph=fullgraph, dynamic=dynamic)
        else:
            handles.append(_compile_regional(model, backend_fn, fullgraph, dynamic))
            forward = model
        optimizer = None
        if compile_optimizer is not False:
            kwargs = compile_optimizer if isinstance(compile_optimizer, dict) else {}
            optimizer = compiled_optimizer(model, backend=backend, mode=mode, **kwargs)
    except BaseException:
        for h in reversed(handles):
            h.undo()
        raise
    return Prepared(model=model, forward=forward, scope=scope, handles=handles, counter=counter,
                    optimizer=optimizer, options=options)
