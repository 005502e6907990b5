"""Keep transformers' "use_cache is incompatible with gradient checkpointing" warning out of the graph.

The break. ``transformers.utils.generic.merge_with_config_defaults`` (the decorator on
``LlamaModel.forward`` and most decoder models in transformers 5) fills ``use_cache`` from
``config.use_cache``; when the module is checkpointing and training and the value is True, it
calls ``logger.warning_once(...)`` and forces ``use_cache=False``. Dynamo does not trace
``logging.Logger`` methods ("logging.Logger method not supported for non-export cases", at
``transformers/utils/generic.py:1030`` in 5.17), and the call sits inside peft's forward-hook
context manager, so Dynamo cannot resume after it: ``fullgraph=True`` fails and without it the
forward runs as several frames. Upstream: the same break fixed downstream by setting
``use_cache=False`` (foundation-model-stack/fms-hf-tuning#516, huggingface/trl#3891).

The fix: set ``use_cache = False`` on every config object the model's modules carry. With
checkpointing in training the value is forced to False anyway, so the loss and gradients do
not change; without checkpointing, training with ``use_cache=True`` only builds a KV cache
nobody reads (memory for nothing). Alternatives: ``torch._dynamo.config.ignore_logger_methods``
would silence every ``warning_once`` process-wide and is a private knob that moves between
torch releases; passing ``use_cache=False`` in every batch is the caller's choice, not ours.
``undo()`` puts the original values back (``generate()`` wants ``use_cache=True``).

Smallest reproduction (``tests/test_patches.py::test_upstream_use_cache_warning_breaks``)::

    base.config.use_cache = True; base.gradient_checkpointing_enable()
    model = get_peft_model(base, LoraConfig(...)); model.train()
    torch.compile(lambda **b: model(**b).loss, fullgraph=True, backend="eager")(**batch)
    # torch._dynamo.exc.Unsupported: logging.Logger method not supported for non-export cases
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ...reversible import PatchHandle, check_versions, set_attribute

__all__ = ["VERIFIED_ON", "SUPPORTED", "apply", "patched", "find_configs"]

NAME = "use_cache_warning"

#: Versions this patch was verified on.
VERIFIED_ON = {"torch": "2.13.0", "transformers": "5.17.0", "peft": "0.21.2"}

#: Versions the patch accepts; outside them it refuses.
SUPPORTED = {"transformers": ">=5.0,<6"}

#: The message the upstream warning prints: the fingerprint of the target.
WARNING_TEXT = "`use_cache=True` is incompatible with gradient checkpointing"


def _code_constants(code: Any) -> Iterator[Any]:
    for const in code.co_consts:
        if hasattr(const, "co_consts"):
            yield from _code_constants(const)
        else:
            yield const


def _check_target() -> None:
    check_versions(NAME, SUPPORTED, VERIFIED_ON)
    from transformers.utils import generic

    target = getattr(generic, "merge_with_config_defaults", None)
    if target is None or not any(
            isinstance(c, str) and WARNING_TEXT in c for c in _code_constants(target.__code__)):
        raise RuntimeError(
            f"patch {NAME!r}: transformers.utils.generic.merge_with_config_defaults no longer "
            f"warns {WARNING_TEXT!r}; the upstream target changed, so the patch refuses to apply"
        )


def find_configs(model: torch.nn.Module) -> list[Any]:
    """The distinct config objects of ``model``'s modules that have ``use_cache`` True."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", None) is True:
            seen.setdefault(id(config), config)
    return list(seen.values())


def apply(model: torch.nn.Module | None = None) -> PatchHandle:
    """Set ``use_cache = False`` on every config of ``model`` that has it True.

    Args:
        model: The model (PEFT-wrapped or not). Required: the fix is per config object.

    Returns:
        A :class:`PatchHandle`; ``details["configs"]`` counts the configs changed.

    Raises:
        ValueError: ``model`` is None.
        RuntimeError: Unsupported versions, or the upstream warning is gone.
    """
    if model is None:
        raise ValueError(f"patch {NAME!r} needs a model: it sets use_cache=False on its configs")
    _check_target()
    handle = PatchHandle(NAME)
    configs = find_configs(model)
    for config in configs:
        set_attribute(handle, config, "use_cache", False)
    handle.details["configs"] = len(configs)
    return handle


def patched(model: torch.nn.Module | None = None) -> PatchHandle:
    """``with patched(model): ...`` applies the patch and undoes it on exit (even on error).

    The handle is itself the context manager: ``PatchHandle.__exit__`` calls ``undo()``.
    """
    return apply(model)
