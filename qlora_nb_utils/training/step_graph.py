"""A whole optimizer step captured once as a CUDA graph, then replayed: the host's launches paid once.

Why this module exists: at a small model's shapes a step is a few milliseconds of GPU work behind
a host that launches thousands of kernels (each compiled decoder layer's, the LoRA matmuls', the
loss's, the optimizer's). A CUDA graph of the whole step, forward, backward, gradient clipping and
the optimizer's update, replays all of them with one launch. This is PyTorch's own whole-network
capture (``torch.cuda.graph``), applied to the loop's step; Inductor's CUDA graphs
(``mode="reduce-overhead"``) graph each compiled region apart instead, which in regional scope
means one graph per layer call and a cost at recording that grows with their number.

What a capture needs, and how :class:`StepGraphs` meets it:

* **Inputs at fixed addresses.** Each batch signature (its tensors' names, shapes and dtypes) gets
  static buffers; a step copies its batch into them and replays. A signature is captured the
  second time it is seen: its first step runs as code (it compiles what is new, and a capture
  must not record first-call work), and at most ``max_graphs`` signatures are captured, all in
  one memory pool (steps replay one at a time, and every graph's outputs stay referenced, so no
  graph's memory is handed to another while it is needed).
* **Nothing in the step waits for the device.** The batch is prepared outside the graph (the
  labelled rows are read from the labels' values: ``prepare``), the loss and the gradient norm are
  read after the replay.
* **Gradients written, not accumulated.** A capture starts with every gradient ``None``, so the
  backward it records writes fresh gradients; a replay writes the same buffers again. A step run
  as code after a capture starts from ``None`` too.
* **A capturable optimizer and a learning rate on the device** (:func:`make_capturable`): the
  update reads the step count and the learning rate from device tensors, which the scheduler
  fills between steps; a float would be frozen into the graph.

It is off on a CPU, where there is no graph to capture.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch

__all__ = ["StepGraphs", "make_capturable", "batch_signature"]


def batch_signature(batch: dict) -> tuple:
    """What fixes a captured graph's inputs: each tensor's name, shape and dtype, and every other
    value as it is (a graph replays only for batches that match it)."""
    return tuple(sorted((k, (tuple(v.shape), v.dtype) if torch.is_tensor(v) else ("value", repr(v)))
                        for k, v in batch.items()))


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make ``optimizer`` replayable inside a CUDA graph: every group ``capturable`` with its
    learning rate a 0-d tensor on ``device`` (an LR scheduler then fills it), and any step count
    already in its state moved there (a resumed run's). Idempotent.

    Raises:
        ValueError: an optimizer without a ``capturable`` option (only those with one update from
            device-side state).
    """
    for group in optimizer.param_groups:
        if "capturable" not in group:
            raise ValueError(f"{type(optimizer).__name__} has no 'capturable' option: its step cannot be "
                             "replayed in a CUDA graph")
        group["capturable"] = True
        lr = group["lr"]
        if not torch.is_tensor(lr) or lr.device != device:
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
    for state in optimizer.state.values():
        step = state.get("step")
        if torch.is_tensor(step) and step.device != device:
            state["step"] = step.to(device=device, dtype=torch.float32)


class StepGraphs:
    """The loop's step, each batch signature captured once and replayed after.

    Args:
        forward: ``forward(**batch).loss`` on a batch from ``prepare`` (the optimized step).
        params: the parameters the optimizer updates (their gradients are the graph's).
        optimizer: the run's optimizer (made capturable here: :func:`make_capturable`).
        max_grad_norm: the gradient clipping's norm (None: no clipping).
        prepare: the batch as ``forward`` takes it, computed outside any graph (on the device, padded,
            with its labelled rows); None: the batch as it is.
        max_graphs: the most signatures captured; batches of any other run as code.
        capture: how a step is captured (tests pass a stand-in): ``capture(fn, pool)`` runs nothing,
            records ``fn`` and returns ``(replay, pool)``; the default records a ``torch.cuda.CUDAGraph``.

    Attributes:
        plain_steps: steps run as code (a signature's first, and any past ``max_graphs``).
        failed: why a capture failed (None: none did); after one, every step runs as code.
        replayed_peak_gib: the last step's peak where it was a replay (0.0 where it ran as code): its
            capture's, since a replay allocates nothing, yet runs in the memory the capture took.
    """

    def __init__(self, forward: Callable[..., Any], params: Iterable[torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None,
                 prepare: Callable[..., dict] | None = None, max_graphs: int = 2,
                 capture: Callable[..., tuple[Callable[[], None], Any]] | None = None) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("no parameters to update")
        device = self.params[0].device
        if capture is None and device.type != "cuda":
            raise ValueError(f"a step can be captured as a CUDA graph on a CUDA device only, not {device.type}")
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.forward, self.optimizer, self.max_grad_norm = forward, optimizer, max_grad_norm
        self.prepare = prepare or (lambda **batch: batch)
        self.max_graphs, self._capture = max_graphs, capture or _cuda_capture
        if device.type == "cuda":  # a stand-in capture elsewhere (tests) keeps the optimizer as it is
            make_capturable(optimizer, device)
        self._seen: dict[tuple, int] = {}
        self._graphs: dict[tuple, _Captured] = {}
        self._pool: Any = None
        self.plain_steps = 0
        self.failed: str | None = None
        self.replayed_peak_gib = 0.0

    @property
    def captured(self) -> list[tuple]:
        """The signatures captured so far, in order."""
        return list(self._graphs)

    def step(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step on ``batch`` (not yet prepared): ``(loss, grad_norm)`` as device
        tensors, read by the caller after the step (the scheduler steps apart, after it)."""
        batch = self.prepare(**batch)
        sig = batch_signature(batch)
        graph = self._graphs.get(sig)
        if graph is None and self._seen.get(sig, 0) >= 1 and len(self._graphs) < self.max_graphs and not self.failed:
            try:
                graph = self._graphs[sig] = self._record(batch)
            except Exception as err:  # an op the capture cannot hold: the run goes on, every step as code
                self.failed = f"{type(err).__name__}: {err}"
                warnings.warn(f"the step could not be captured as a CUDA graph ({self.failed}); every step runs as "
                              "code from here on (step_graph=False says so from the start)", stacklevel=2)
        self.replayed_peak_gib = 0.0
        if graph is None:
            self._seen[sig] = self._seen.get(sig, 0) + 1
            self.plain_steps += 1
            self._clear_grads()
            loss, norm = self._body(batch)
            return loss.detach(), norm
        graph.load(batch)
        graph.replay()
        self.replayed_peak_gib = graph.peak_gib
        return graph.loss, graph.norm

    def _body(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        loss = self.forward(**batch).loss
        loss.backward()
        norm = (torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
                if self.max_grad_norm is not None else None)
        self.optimizer.step()
        return loss, norm

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _record(self, batch: dict) -> "_Captured":
        static = {k: _static_copy(v) if torch.is_tensor(v) else v for k, v in batch.items()}
        graph = _Captured(static)
        self._clear_grads()

        def body() -> None:
            loss, norm = self._body(static)
            graph.loss, graph.norm = loss.detach(), norm

        graph.replay, self._pool = self._capture(body, self._pool)
        graph.grads = [p.grad for p in self.params]  # the buffers the graph writes: kept allocated
        if self.params[0].device.type == "cuda":
            # a replay allocates nothing: the step's peak is the capture's (the loop resets it at each step)
            graph.peak_gib = torch.cuda.max_memory_allocated(self.params[0].device) / 2**30
            torch.cuda.empty_cache()  # the blocks the steps before it cached, now unused: back to the device
        return graph


class _Captured:
    """One captured signature: its static inputs, its outputs and how to replay it."""

    def __init__(self, static: dict) -> None:
        self.static = static
        self.replay: Callable[[], None] = lambda: None
        self.loss: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.grads: list = []
        self.peak_gib = 0.0

    def load(self, batch: dict) -> None:
        for k, v in batch.items():
            if torch.is_tensor(v):
                self.static[k].copy_(v, non_blocking=True)


def _static_copy(t: torch.Tensor) -> torch.Tensor:
    """A buffer holding ``t``, with the marks Dynamo reads from it (a dimension marked static or
    dynamic): the compiled step sees the buffer as it saw the batch, and compiles nothing new."""
    out = t.clone()
    for name, value in vars(t).items():
        if name.startswith("_dynamo"):
            setattr(out, name, value.copy() if hasattr(value, "copy") else value)
    return out


def _cuda_capture(fn: Callable[[], None], pool: Any) -> tuple[Callable[[], None], Any]:
    """Record ``fn`` into a ``torch.cuda.CUDAGraph`` in memory pool ``pool`` (None: a new one); the
    capture runs nothing, so the step it stands for is the first replay's."""
    graph = torch.cuda.CUDAGraph()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    # cuBLAS keeps a workspace per stream, and the capture's stream gets its own, in the graph's
    # pool: the one the steps before it used is released first (the next step run as code takes a
    # new one), and the capture's after it (the graph goes on using that memory as scratch, which no
    # step reads across replays), so the capture holds no second workspace.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)
    clear()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    clear()
    return graph.replay, pool
