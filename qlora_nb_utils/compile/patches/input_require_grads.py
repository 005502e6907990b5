"""Make the "input embeddings require grad" hook of transformers traceable by Dynamo.

The break. ``PreTrainedModel.enable_input_require_grads`` registers a forward hook on the
input embeddings whose body is ``output.requires_grad_(True)``. transformers calls it from
``gradient_checkpointing_enable()`` (for every model whose main input is ``input_ids``), peft
from ``prepare_model_for_kbit_training(..., use_gradient_checkpointing=True)`` and from
``get_peft_model`` on a checkpointing model. Dynamo inlines module hooks, and it cannot trace
``requires_grad_`` on an intermediate whose result reaches the output (torch 2.13: "returning
intermediate with requires_grad_()" / "Unsupported Tensor.requires_grad_() call"; torch 2.11:
"Unsupported Tensor.requires_grad_() call"). The break lands inside peft's forward-hook
context manager, where Dynamo cannot resume, so ``fullgraph=True`` fails and without it the
whole forward falls back to eager frame by frame. Upstream: pytorch/pytorch#170487 (support
``requires_grad_`` under compile; open), unslothai/unsloth-zoo#1000 (the same skip-while-
tracing workaround for their own hooks).

Why skipping the hook while tracing is correct. The hook exists for *reentrant* checkpointing
run eagerly: ``CheckpointFunction`` only propagates gradients when one of its tensor inputs
requires grad, and the embedding output of a frozen model does not. Inside a region that
Dynamo traces, ``torch.utils.checkpoint.checkpoint`` is never run as Python: Dynamo captures it
as the ``tag_activation_checkpoint`` higher-order op whatever ``use_reentrant`` says, and
AOTAutograd differentiates the captured graph with respect to the trainable (LoRA) parameters
directly, recomputing the tagged region in the backward. Nothing there needs the embedding
output to require grad; making it require grad would only add a useless gradient of the
embedding output. So the replacement hook does exactly what the original does when it runs
eagerly (eager runs, regional compilation, where the embedding stays eager) and nothing while
Dynamo traces it (``torch.compiler.is_compiling()`` is a constant there, so no break and no
guard). Gradients of the LoRA weights are bit-identical to eager (see the tests).

Alternatives considered: a ``torch.library.custom_op`` returning ``x.detach().requires_grad_()``
(the 2025 write-up's fix) detaches, so a trainable embedding (``modules_to_save``) would
silently get no gradient, and it puts an opaque op in every compiled step for an effect only
eager needs; removing the hook breaks reentrant checkpointing in eager (LoRA gradients
vanish: "element 0 of tensors does not require grad"); switching everyone to
non-reentrant checkpointing is a behaviour change that belongs to the caller
(``compile.prepare_for_compile(grad_ckpt=...)`` offers it), not to a patch.

Smallest reproduction (``tests/test_patches.py::test_upstream_hook_breaks_fullgraph``)::

    model = get_peft_model(tiny_llama, LoraConfig(...))   # after gradient_checkpointing_enable()
    torch.compile(lambda **b: model(**b).loss, fullgraph=True, backend="eager")(**batch)
    # torch._dynamo.exc.Unsupported: returning intermediate with requires_grad_()

``apply(model)`` swaps the hook functions registered on that model (same hook ids and order,
so ``disable_input_require_grads()`` still removes them) and ``undo()`` puts the original
function objects back. ``apply()`` without a model wraps
``PreTrainedModel.enable_input_require_grads`` so that models set up while it is active get
the traceable hook; undo restores the class attribute (hooks registered meanwhile keep the
replacement, which behaves like the original in eager).
"""

from __future__ import annotations

from typing import Any

import torch

from ...reversible import PatchHandle, check_signature, check_versions, set_attribute

__all__ = ["VERIFIED_ON", "SUPPORTED", "apply", "patched", "find_hooks", "requires_grad_unless_compiling"]

NAME = "input_require_grads"

#: Versions this patch was verified on (CPU; the lead's GPU box runs torch 2.11 + the same rest).
VERIFIED_ON = {"torch": "2.13.0", "transformers": "5.17.0", "peft": "0.21.2", "bitsandbytes": "0.50.2"}

#: Versions the patch accepts; outside them it refuses.
SUPPORTED = {"torch": ">=2.6", "transformers": ">=5.0,<6"}

#: Names of the upstream hooks: transformers' and peft's fallback.
HOOK_NAMES = frozenset({"make_inputs_require_grads", "make_inputs_require_grad"})


def requires_grad_unless_compiling(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook: ``output.requires_grad_(True)`` in eager, nothing while Dynamo traces."""
    if torch.compiler.is_compiling():
        return None
    output.requires_grad_(True)
    return None


def _check_hook(hook: Any) -> None:
    """Refuse when an upstream hook no longer looks like ``output.requires_grad_(True)``."""
    check_signature(NAME, hook, ("module", "input", "output"))
    code = getattr(hook, "__code__", None)
    if code is None or "requires_grad_" not in code.co_names:
        raise RuntimeError(
            f"patch {NAME!r}: hook {getattr(hook, '__qualname__', hook)!r} no longer calls "
            "requires_grad_; the upstream target changed, so the patch refuses to apply"
        )


def find_hooks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int, Any]]:
    """The upstream require-grad forward hooks registered anywhere in ``model``.

    Returns:
        ``(module, hook_id, hook)`` for each hook whose function is named like transformers'
        or peft's ``make_inputs_require_grad(s)``. Usually one, on the input embeddings; two
        when both transformers and peft registered theirs.
    """
    found = []
    for module in model.modules():
        for hook_id, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__name__", None) in HOOK_NAMES:
                found.append((module, hook_id, hook))
    return found


def _swap(handle: PatchHandle | None, model: torch.nn.Module) -> int:
    """Replace each upstream hook of ``model`` in place; register undo steps on ``handle``."""
    hooks = find_hooks(model)
    for _, _, hook in hooks:
        _check_hook(hook)
    for module, hook_id, hook in hooks:
        module._forward_hooks[hook_id] = requires_grad_unless_compiling
        if handle is not None:
            handle.add_undo(_restorer(module, hook_id, hook))
    return len(hooks)


def _restorer(module: torch.nn.Module, hook_id: int, original: Any):
    def restore() -> None:
        # Only if our hook is still there: one removed meanwhile must not come back.
        if module._forward_hooks.get(hook_id) is requires_grad_unless_compiling:
            module._forward_hooks[hook_id] = original

    return restore


def _check_target() -> type:
    check_versions(NAME, SUPPORTED, VERIFIED_ON)
    from transformers.modeling_utils import PreTrainedModel

    target = getattr(PreTrainedModel, "enable_input_require_grads", None)
    if target is None:
        raise RuntimeError(f"patch {NAME!r}: PreTrainedModel.enable_input_require_grads is gone")
    check_signature(NAME, target, ("self",))
    return PreTrainedModel


def apply(model: torch.nn.Module | None = None) -> PatchHandle:
    """Make the require-grad hook traceable, on one model or for models set up from now on.

    Args:
        model: The model (PEFT-wrapped or not) whose hooks to replace. None patches
            ``PreTrainedModel.enable_input_require_grads`` instead.

    Returns:
        A :class:`PatchHandle`; ``details["hooks"]`` is the number of hooks replaced (0 when
        the model has none, e.g. no gradient checkpointing: then the patch is a no-op).

    Raises:
        RuntimeError: Unsupported versions, or the upstream hook/method changed.
    """
    cls = _check_target()
    handle = PatchHandle(NAME)
    if model is not None:
        handle.details["hooks"] = _swap(handle, model)
        return handle
    original = cls.__dict__["enable_input_require_grads"]

    def enable_input_require_grads(self):
        original(self)
        _swap(None, self)

    enable_input_require_grads.__doc__ = original.__doc__
    enable_input_require_grads.__wrapped__ = original
    set_attribute(handle, cls, "enable_input_require_grads", enable_input_require_grads)
    handle.details["scope"] = "PreTrainedModel.enable_input_require_grads"
    return handle


def patched(model: torch.nn.Module | None = None) -> PatchHandle:
    """``with patched(model): ...`` applies the patch and undoes it on exit (even on error).

    The handle is itself the context manager: ``PatchHandle.__exit__`` calls ``undo()``.
    """
    return apply(model)
