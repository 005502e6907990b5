"""Keep bitsandbytes' NF4 weights in their training layout on a CPU, so an eval pass cannot break training.

The bug (a wrong gradient, not a graph break). bitsandbytes 0.50's ``Linear4bit.forward``, on a
CPU with AVX512-BF16, in eval mode and given an input that does not require grad (any
``torch.no_grad()`` evaluation, any ``generate``), repacks the layer's NF4 weight into a CPU
inference layout (``_convert_weight_packed_for_cpu``; ``quant_state.packing_format_for_cpu``)
and keeps it so. From then on the layer computes through ``bitsandbytes::gemv_4bit``, which has
no autograd kernel: backward through it warns ("an autograd kernel was not registered to the
Autograd key(s) ...") and the gradient that flows through the frozen base weight to the layers
below is lost, and the repacked kernel computes differently too. The loss barely moves, so
nothing looks wrong, while the LoRA gradients of the first layers are far from the right ones. So a
run that evaluates before it trains (a held-out loss at step 0, a "before" sample) trains on
wrong gradients, and a resumed run, which does not evaluate first, follows another curve.
(``from_pretrained`` hands a model back in eval mode: a first forward before ``.train()``
repacks the layers whose input does not require grad.)

The repack is lossy, too: it casts the block scales (absmax) to bf16, and bitsandbytes' own
inverse (``_convert_weight_packed_for_cpu_inverse``, which ``state_dict()`` and ``.cuda()``
call) re-quantizes those rounded scales ("best-effort inverse"), so a model evaluated once is
changed for good (its LoRA gradients stay slightly off once converted back).

The fix: ``Linear4bit.__init__`` stores ``support_avx512bf16_for_cpu = has_avx512bf16()`` and the
repack runs only when it is True. :func:`apply` sets it False on each ``Linear4bit`` of the model
(``undo()`` restores it), so eval passes use the layout and kernels training uses; apply it
before the first forward. A weight already repacked is converted back with bitsandbytes' inverse
(gradients flow again; the scales keep their rounding). Only the CPU inference fast path is
given up. It is not in :data:`~.PATCHES`: those are what
``prepare_for_compile`` picks against graph breaks; this one is applied by ``optimize()`` on a CPU
and by whoever evaluates a
model it goes on training (``training.finetuning``).

Smallest reproduction (``tests/test_finetune.py::test_an_eval_pass_keeps_bnb_gradients``)::

    model.eval(); torch.no_grad()(model)(**batch); model.train()
    model(**batch).loss.backward()  # LoRA grads of layer 0 differ from those before the eval pass
"""

from __future__ import annotations

import torch

from ...reversible import PatchHandle, check_versions, set_attribute

__all__ = ["VERIFIED_ON", "SUPPORTED", "apply", "patched", "find_layers"]

NAME = "bnb_cpu_packing"

#: Versions this patch was verified on.
VERIFIED_ON = {"torch": "2.13.0", "bitsandbytes": "0.50.2"}

#: Versions the patch accepts; outside them it refuses.
SUPPORTED = {"bitsandbytes": ">=0.50,<0.51"}

_FLAG = "support_avx512bf16_for_cpu"


def find_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The bitsandbytes ``Linear4bit`` modules of ``model``."""
    return [m for m in model.modules()
            if type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")]


def _check_target(layers: list[torch.nn.Module]) -> None:
    check_versions(NAME, SUPPORTED, VERIFIED_ON)
    forward = type(layers[0]).forward
    if _FLAG not in forward.__code__.co_names or not all(hasattr(m, _FLAG) for m in layers):
        raise RuntimeError(f"patch {NAME!r}: bitsandbytes' Linear4bit.forward no longer reads {_FLAG!r}; the "
                           "upstream target changed, so the patch refuses to apply")


def apply(model: torch.nn.Module | None = None) -> PatchHandle:
    """Keep every ``Linear4bit`` of ``model`` in the training layout (module docstring).

    Args:
        model: The model (PEFT-wrapped or not). A model without ``Linear4bit`` is left alone.

    Returns:
        A :class:`PatchHandle`; ``details["layers"]`` counts the layers changed and
        ``details["unpacked"]`` the weights converted back.

    Raises:
        ValueError: ``model`` is None.
        RuntimeError: Unsupported versions, or ``Linear4bit`` no longer has the flag.
    """
    if model is None:
        raise ValueError(f"patch {NAME!r} needs a model: it changes its Linear4bit layers")
    layers = find_layers(model)
    handle = PatchHandle(NAME, {"layers": len(layers), "unpacked": 0})
    if not layers:
        return handle
    _check_target(layers)
    for layer in layers:
        set_attribute(handle, layer, _FLAG, False)
        weight = layer.weight
        if getattr(weight.quant_state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
            handle.details["unpacked"] += 1
    return handle


def patched(model: torch.nn.Module | None = None) -> PatchHandle:
    """``with patched(model): ...`` applies the patch and undoes it on exit (even on error)."""
    return apply(model)
