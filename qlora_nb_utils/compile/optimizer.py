"""A compiled optimizer step that survives LR schedulers without recompiling.

Why this module exists: compiling ``opt.step`` naively either recompiles at every scheduler
change or is not compiled at all. It follows PyTorch's compiled-optimizer recipe: the
learning rate must be a tensor (else every scheduler change recompiles), and the compiled
function must call the optimizer's own ``step``, because an LR scheduler wraps ``opt.step`` in
a function Dynamo skips. :class:`CompiledOptimizer` does both and still works with any
``LRScheduler`` and with :func:`qlora_nb_utils.training.train` (``optimizer=``). Its
compilations are counted by a :class:`~qlora_nb_utils.compile.CompileCounter` of its own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .counting import CompileCounter

__all__ = ["CompiledOptimizer", "compiled_optimizer"]


# ----------------------------------------------------------------------------- optimizer
class CompiledOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer so that ``step()`` runs a ``torch.compile``'d step.

    It shares the wrapped optimizer's ``param_groups`` and ``state`` (same objects), so an
    ``LRScheduler`` built on it drives the wrapped optimizer, and ``train(optimizer=...)``
    uses it like any optimizer. Float learning rates are turned into 0-d tensors once, so the
    scheduler's changes are ``fill_`` into the tensor rather than new constants Dynamo would
    recompile for. The step is compiled with ``fullgraph=False`` on purpose: ``Optimizer.step``
    graph-breaks around its body by design (torch/optim/optimizer.py, ``_use_grad``).

    Attributes:
        optimizer: The wrapped optimizer.
        counter: The :class:`CompileCounter` that counts the step's compilations.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, backend: Any = "inductor",
                 mode: str | None = None, counter: CompileCounter | None = None) -> None:
        # Deliberately no super().__init__(): the state lives in the wrapped optimizer.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, CompiledOptimizer):
            raise ValueError("optimizer is already a CompiledOptimizer")
        self.optimizer = optimizer
        self.counter = counter or CompileCounter(backend=backend)
        for group in optimizer.param_groups:
            if not torch.is_tensor(group["lr"]):
                group["lr"] = torch.tensor(float(group["lr"]))
        inner_step = type(optimizer).step  # not opt.step: a scheduler may have wrapped that

        def step() -> None:
            inner_step(optimizer)

        self._compiled_step = torch.compile(step, backend=self.counter.as_backend(mode=mode), fullgraph=False)

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        """One compiled optimizer step (closures are not supported)."""
        if closure is not None:
            raise ValueError("CompiledOptimizer.step does not take a closure")
        self._compiled_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients, eagerly."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer (learning rates stay tensors)."""
        self.optimizer.load_state_dict(state_dict)
        for group in self.optimizer.param_groups:
            if not torch.is_tensor(group["lr"]):
                group["lr"] = torch.tensor(float(group["lr"]))

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"CompiledOptimizer({self.optimizer!r})"


def compiled_optimizer(params_or_optimizer: Any, *, backend: Any = "inductor", mode: str | None = None,
                       **adamw_kwargs: Any) -> CompiledOptimizer:
    """An optimizer whose step is compiled, ready for ``train(..., optimizer=...)``.

    Args:
        params_or_optimizer: An optimizer to wrap, or the parameters for a new ``AdamW``
            (a module's trainable parameters are taken when given a module).
        backend: The compile backend (name or callable).
        mode: An inductor mode, or None.
        **adamw_kwargs: ``AdamW`` options when building one (``lr`` defaults to 2e-4, as in
            :class:`~qlora_nb_utils.training.TrainConfig`).

    Returns:
        A :class:`CompiledOptimizer`; its ``counter`` counts the step's compilations.
    """
    if isinstance(params_or_optimizer, torch.optim.Optimizer):
        if adamw_kwargs:
            raise ValueError("AdamW options only apply when building a new optimizer")
        return CompiledOptimizer(params_or_optimizer, backend=backend, mode=mode)
    params = params_or_optimizer
    if isinstance(params, torch.nn.Module):
        params = [p for p in params.parameters() if p.requires_grad]
    kwargs = {"lr": 2e-4, **adamw_kwargs}
    kwargs["lr"] = torch.tensor(float(kwargs["lr"]))
    return CompiledOptimizer(torch.optim.AdamW(params, **kwargs), backend=backend, mode=mode)
