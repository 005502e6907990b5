"""Compiled functions whose Python floats are constants, not graph inputs.

Why a module of its own: both the decoder layers compiled regionally (``compile.prepare``) and the
chunked loss's compiled arithmetic (``ops.losses``) are compiled with ``dynamic=True`` and take
Python floats; each needs the same switch, and the loss sits below the compile layer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def with_static_floats(compiled: Callable) -> Callable:
    """Run ``compiled`` with Dynamo's ``specialize_float`` on: Python floats are constants.

    Why (a function compiled with ``dynamic=True``, i.e. variable lengths): ``dynamic=True`` makes Dynamo
    assume *everything* dynamic, Python floats included, so a decoder layer's float attributes
    (the attention's ``scaling`` and ``attention_dropout``, RMSNorm's ``variance_epsilon``, the
    LoRA ``scaling``) become graph inputs (``SymFloat``s, turned into 0-d tensors by AOTAutograd's
    tensorify pass). ``scaled_dot_product_attention`` takes ``scale`` and ``dropout_p`` as plain
    floats, so the pass cannot turn those two into tensors: it raises
    ``TensorifyScalarRestartAnalysis`` and Dynamo traces the layer a second time with them
    specialized. The restart is one more full Dynamo + AOTAutograd trace and one more graph
    handed to the backend under the same compile id (``0/0`` twice): one more counted
    compilation, on a CPU as on a GPU (where the compile matrix's regional variable-length cells
    showed more compilations than recompilations: two graphs with frame compile id 0). The
    chunked loss's arithmetic restarts the same way on its ``scale`` (a cold compile only: a
    cached graph skips the pass that raises).

    Specializing floats up front (what ``dynamic=None`` does on a first compile, where
    ``assume_static_by_default`` keeps floats constant) avoids the restart; shapes stay dynamic,
    so the sequence dimension is still symbolic from the first compile. The values are the
    same constants either way, so results do not change. The cost: a float that differs
    between calls (e.g. a per-layer LoRA ``scaling`` with ``rank_pattern``/``alpha_pattern``)
    now recompiles once per distinct value (a ``CONSTANT_MATCH`` guard) instead of being a
    graph input. The switch is set per call (Dynamo reads its config while it compiles, inside
    the call) with the low-overhead patcher ``torch.compile`` itself uses for ``dynamic``.
    """
    config = torch._dynamo.config
    if not hasattr(config, "specialize_float"):  # older torch: floats were always specialized
        return compiled
    make_patcher = getattr(config, "_make_closure_patcher", None)
    if make_patcher is None:  # private helper gone: the public (slower) context manager
        def call(*args: Any, **kwargs: Any) -> Any:
            with config.patch(specialize_float=True):
                return compiled(*args, **kwargs)
    else:
        patch = make_patcher(specialize_float=True)

        def call(*args: Any, **kwargs: Any) -> Any:
            revert = patch()
            try:
                return compiled(*args, **kwargs)
            finally:
                revert()

    call.__wrapped__ = compiled  # type: ignore[attr-defined]
    return call
