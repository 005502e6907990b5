"""Checkpointing whose saved layer inputs live in CPU memory: the last GiBs of a QLoRA step.

Why this module exists: with every decoder layer checkpointed, what a step still keeps on the
GPU per layer is that layer's input (the hidden state, ``batch * seq * hidden`` elements per
layer, summed over every layer). Unsloth brings its checkpointed peak below ours partly by
keeping those inputs in pinned CPU memory: ``unsloth_zoo/gradient_checkpointing.py`` (unslothai/unsloth-zoo,
commit ce232d6, ``UnslothCheckpointFunction``) is a reentrant ``torch.autograd.Function`` run
with Dynamo disabled that copies the first input to a pinned buffer on a side stream during the
layer's forward, and copies it back into one reused GPU buffer before the recompute.

What was tried (torch 2.13 on this CPU, 2.11 on the GPU), and why this design:

* **torch's partitioner offload** (``torch._functorch.config.enable_activation_offloading`` and
  its ``activation_offload_*`` stream options, ``CheckpointPolicy.MUST_CPU_OFFLOAD``): marked
  "testing purpose" in the config; in 2.13 the pass offloads only forward nodes whose
  ``meta["should_offload"]`` is set, and nothing in torch sets it (the ``*_CPU_OFFLOAD``
  policies are defined in ``torch.utils.checkpoint`` and read nowhere else). Using it means a
  custom joint-graph pass over private metadata, Inductor only, in a module that changed
  between releases. Not taken.
* **A custom ``autograd.Function`` per layer** (Unsloth's way): its backward must rerun the
  layer and call ``torch.autograd.backward``, which Dynamo cannot trace, so it runs outside
  any graph; and a reentrant-style rerun under grad after a ``no_grad`` forward compiles each
  compiled layer twice (a ``grad_mode`` guard, see :mod:`.prepare`). Not taken.
* **``torch.autograd.graph.save_on_cpu``**: saved-tensor hooks. Put around torch's
  *non-reentrant* checkpoint, they see exactly what the checkpoint saves, the layer's inputs
  (``checkpoint`` saves its inputs before it pushes its own hooks), and nothing inside the
  layer. But its copy out runs on the compute stream (the layer's compute waits for it), and
  the copy back happens when the backward asks, with nothing in flight (the recompute waits).
* **This module**: the same place (saved-tensor hooks around the non-reentrant checkpoint),
  with the copies on a side CUDA stream: out into pinned memory while the next layer computes
  (the GPU tensor is kept from reuse by ``record_stream`` until its copy is done), and back one
  layer ahead: unpacking layer *i*'s input starts layer *i-1*'s copy in (the next one the
  backward needs), so it overlaps layer *i*'s recompute and backward. At most two layer inputs
  are back on the GPU at once. On a CPU (tests) the "offloaded" input is a separate copy, so
  the GPU-side behaviour (the original freed, a copy kept) is what the tests check.

How it composes with ``torch.compile``: in ``regional`` scope the checkpoint runs eagerly around
each compiled layer, so the hooks are plain eager code and the layer graph is untouched (one
compilation, ``fullgraph=True``). In ``whole`` scope Dynamo would have to trace the hooks inside
the graph: with ``fullgraph=True`` it refuses them (a graph break, ``tests/test_offload.py``);
hooks around the *compiled* call instead see the whole graph's saved tensors, and AOTAutograd's
backward unpacks all of them when it starts, so the inputs would all come back at once (no
saving at the backward's peak). Offloading therefore means regional scope; :func:`optimize`
switches to it and says so. :func:`apply` swaps each checkpointed layer's checkpoint function
(recorded on a :class:`~qlora_nb_utils.reversible.PatchHandle`; ``undo()`` restores it).
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Any, Callable

import torch

from ..reversible import PatchHandle, set_attribute
from .checkpointing import decoder_layers

__all__ = ["CpuOffloader", "OffloadStats", "CheckpointPlan", "HostPool", "apply", "offloaded", "offload_supported",
           "plan", "host_bytes", "check_host_memory", "MIN_OFFLOAD_BYTES", "EXACT_HOST_BUFFERS"]

#: Saved tensors smaller than this stay where they are. 0: the hooks only see what the checkpoint
#: saves, a decoder layer's positional tensor arguments (transformers passes the hidden state
#: positionally, the rest bound as keywords), so all of it moves.
MIN_OFFLOAD_BYTES = 0


#: :func:`apply`'s default for ``exact_host_buffers`` (:class:`HostPool`): on, since torch's pinned
#: allocator rounds each input up to a power of two (up to twice the host memory) and the copies
#: are as fast either way; False gives the allocator's rounded blocks back.
EXACT_HOST_BUFFERS = True


class HostPool:
    """Host buffers of the exact sizes asked for, page-locked once and reused step after step.

    Why: ``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which
    rounds each request up to a power of two, so a layer input just over a power of two takes
    almost twice its size in page-locked host memory, for every layer, and host memory is what
    runs out first at long sequences on the machines users have. Here each buffer is an ordinary
    CPU tensor of exactly the bytes asked for, page-locked with ``cudaHostRegister`` (as torch's
    own distributed checkpoint stager pins its buffers), so copies to and from it are still
    asynchronous; a layer input hands its buffer back when autograd lets the input go, and the
    next step's input of the same size takes it again. :meth:`release` unregisters and frees them.
    On a CPU (tests) nothing is registered.
    """

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._pinned: list[int] = []  # addresses registered with CUDA
        self.buffers = 0  # buffers made
        self.bytes = 0  # their bytes, all together

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` buffer of ``nbytes`` bytes: a free one of that size, or a new one."""
        if self._free[nbytes]:
            return self._free[nbytes].pop()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin and nbytes:
            err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
            if err != 0:
                raise RuntimeError(f"page-locking {nbytes} bytes of host memory failed (cudaError {err})")
            self._pinned.append(buf.data_ptr())
        self.buffers += 1
        self.bytes += nbytes
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """``buf`` free again (taken by the next request of its size)."""
        self._free[buf.numel()].append(buf)

    def release(self) -> None:
        """Unregister and drop the free buffers (those still held are dropped by their holders)."""
        for address in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(address)
        self._pinned.clear()
        self._free.clear()


@dataclasses.dataclass
class OffloadStats:
    """What an offloader did: packs and unpacks, bytes moved out, where the copies live."""

    packed: int = 0
    unpacked: int = 0
    bytes_out: int = 0
    prefetched: int = 0
    stored_on: set[str] = dataclasses.field(default_factory=set)
    #: The last unpacks: (the copy's device type, whether the tensor it was made from is freed).
    unpacks: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=256))


class _Stash:
    """One saved layer input: its CPU copy, the event that ends the copy out, its way back."""

    __slots__ = ("cpu", "device", "source", "reloaded", "ready", "prev", "__weakref__")

    def __init__(self, cpu: torch.Tensor, device: torch.device, source: Any, prev: Any) -> None:
        self.cpu, self.device, self.source, self.prev = cpu, device, source, prev
        self.reloaded: torch.Tensor | None = None
        self.ready: Any = None  # the CUDA event after which ``reloaded`` holds the data


class CpuOffloader:
    """Saved-tensor hooks that keep each saved tensor (>= ``min_bytes``) in CPU memory.

    Args:
        min_bytes: tensors smaller than this are saved as they are.
        prefetch: when the backward unpacks a layer's input, start copying back the input saved
            before it (the next one the backward needs) on the side stream.
        exact_host_buffers: keep the copies in a :class:`HostPool` (exact sizes, reused) instead
            of torch's pinned allocator (sizes rounded up to a power of two).
    """

    def __init__(self, min_bytes: int = MIN_OFFLOAD_BYTES, prefetch: bool = True,
                 exact_host_buffers: bool = False) -> None:
        self.min_bytes, self.prefetch = min_bytes, prefetch
        self.pool = HostPool(pin=torch.cuda.is_available()) if exact_host_buffers else None
        self.stats = OffloadStats()
        self._stream: Any = None
        self._last: Any = None  # weakref to the last stash packed

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def pack(self, tensor: torch.Tensor) -> Any:
        """The pack hook: a :class:`_Stash` for a large tensor, the tensor itself otherwise."""
        if tensor.numel() * tensor.element_size() < self.min_bytes or tensor.layout != torch.strided:
            return tensor
        from torch.multiprocessing.reductions import StorageWeakRef

        source = StorageWeakRef(tensor.untyped_storage())
        buf = None if self.pool is None else self.pool.take(tensor.numel() * tensor.element_size())
        cpu = None if buf is None else buf.view(tensor.dtype).view(tensor.shape)
        if tensor.is_cuda:
            main = torch.cuda.current_stream(tensor.device)
            side = self._side_stream(tensor.device)
            if cpu is None:
                cpu = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            side.wait_stream(main)  # the tensor is written on the compute stream
            with torch.cuda.stream(side):
                cpu.copy_(tensor, non_blocking=True)
            tensor.record_stream(side)  # its memory is not reused before the copy is done
        elif cpu is not None:
            cpu.copy_(tensor.detach())
        else:
            cpu = tensor.detach().to("cpu", copy=True)
        stash = _Stash(cpu, tensor.device, source, self._last)
        if buf is not None:
            # back to the pool when autograd lets the saved input go; the copies in and out share
            # the side stream, so the next step's copy into it waits for this one's copy back
            weakref.finalize(stash, self.pool.give, buf)
        self._last = weakref.ref(stash)
        self.stats.packed += 1
        self.stats.bytes_out += tensor.numel() * tensor.element_size()
        self.stats.stored_on.add(cpu.device.type)
        return stash

    def _start_reload(self, stash: _Stash) -> None:
        if stash.reloaded is not None:
            return
        if stash.device.type != "cuda":
            stash.reloaded = stash.cpu
            return
        main = torch.cuda.current_stream(stash.device)
        side = self._side_stream(stash.device)
        gpu = torch.empty(stash.cpu.shape, dtype=stash.cpu.dtype, device=stash.device)
        side.wait_stream(main)  # the block may be one the compute stream still reads
        with torch.cuda.stream(side):
            gpu.copy_(stash.cpu, non_blocking=True)
            stash.ready = torch.cuda.Event()
            stash.ready.record(side)
        gpu.record_stream(side)  # freed unused (an aborted backward): not reused before the copy ends
        stash.reloaded = gpu

    def unpack(self, packed: Any) -> torch.Tensor:
        """The unpack hook: the tensor back on its device (the one saved before it on its way)."""
        if not isinstance(packed, _Stash):
            return packed
        self._start_reload(packed)
        tensor = packed.reloaded
        packed.reloaded = None  # the caller's reference is the only one left
        if packed.ready is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.ready)
            packed.ready = None
        prev = packed.prev() if packed.prev is not None else None
        if self.prefetch and prev is not None and prev.reloaded is None:
            self._start_reload(prev)
            self.stats.prefetched += 1
        self.stats.unpacked += 1
        self.stats.unpacks.append((packed.cpu.device.type, packed.source.expired()))
        if tensor is packed.cpu:  # a CPU run: hand out a fresh tensor, as a copy back would
            tensor = tensor.clone()
        return tensor


def offloaded(checkpoint: Callable[..., Any], offloader: CpuOffloader) -> Callable[..., Any]:
    """``checkpoint(function, *args, **kwargs)`` with what it saves (the inputs) kept by ``offloader``.

    ``checkpoint`` must be torch's non-reentrant checkpoint (it saves its inputs under the
    caller's saved-tensor hooks, then pushes its own for the region).
    """

    def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return checkpoint(function, *args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
            return checkpoint(function, *args, **kwargs)

    run.offloader = offloader  # type: ignore[attr-defined]
    run.inner = checkpoint  # type: ignore[attr-defined]
    return run


def offload_supported(model: torch.nn.Module) -> str | None:
    """None when :func:`apply` can offload ``model``'s checkpointed layers, else why not."""
    layers = [m for m in decoder_layers(model) if getattr(m, "gradient_checkpointing", False)]
    if not layers:
        return "no decoder layer checkpoints"
    for layer in layers:
        func = getattr(layer, "_gradient_checkpointing_func", None)
        func = getattr(func, "inner", func)  # torch's checkpoint under a wrapper of ours
        keywords = getattr(func, "keywords", None) or {}
        if keywords.get("use_reentrant", True) is not False:
            return "the checkpoint is not torch's non-reentrant checkpoint"
    return None


def apply(model: torch.nn.Module, *, min_bytes: int = MIN_OFFLOAD_BYTES, prefetch: bool = True,
          exact_host_buffers: bool | None = None) -> PatchHandle:
    """Offload the saved inputs of ``model``'s checkpointed decoder layers to CPU memory.

    Call it after checkpointing is configured (``prepare_for_compile(..., grad_ckpt=True,
    scope="regional")`` or :func:`~qlora_nb_utils.compile.recipe.prepare_fast`); undo it before
    the prepared model's own ``undo()``.

    ``exact_host_buffers``: :class:`CpuOffloader`'s (None: :data:`EXACT_HOST_BUFFERS`); the
    pool's buffers are released on ``undo()``.

    Returns:
        A :class:`~qlora_nb_utils.reversible.PatchHandle`; ``handle.offloader`` counts what moved.

    Raises:
        ValueError: no checkpointed decoder layer, or one whose checkpoint is not torch's
            non-reentrant one (a reentrant checkpoint saves nothing the hooks could see).
    """
    why = offload_supported(model)
    if why is not None:
        raise ValueError(f"cannot offload checkpointed inputs: {why}")
    exact = EXACT_HOST_BUFFERS if exact_host_buffers is None else exact_host_buffers
    offloader = CpuOffloader(min_bytes=min_bytes, prefetch=prefetch, exact_host_buffers=exact)
    layers = [m for m in decoder_layers(model) if m.gradient_checkpointing]
    handle = PatchHandle("cpu_offload", {"layers": len(layers), "min_bytes": min_bytes, "exact_host_buffers": exact})
    if offloader.pool is not None:
        handle.add_undo(offloader.pool.release)
    for layer in layers:
        set_attribute(handle, layer, "_gradient_checkpointing_func",
                      offloaded(layer._gradient_checkpointing_func, offloader))
    handle.offloader = offloader  # type: ignore[attr-defined]
    return handle


def host_bytes(layers: int, input_bytes: int, exact: bool | None = None) -> int:
    """The host memory ``layers`` offloaded inputs of ``input_bytes`` each take: as asked with
    exact buffers (:class:`HostPool`), else each rounded up to a power of two, as torch's pinned
    allocator rounds it (None: :data:`EXACT_HOST_BUFFERS`)."""
    exact = EXACT_HOST_BUFFERS if exact is None else exact
    each = input_bytes if exact or input_bytes <= 1 else 1 << (input_bytes - 1).bit_length()
    return layers * each


def available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(layers: int, input_bytes: int, shape: str = "") -> None:
    """Refuse, before any step, an offload whose inputs cannot fit in the host memory available.

    Why: page-locked memory cannot be swapped out, so a run whose offloaded inputs do not fit
    is stopped by the system part-way through its first step (or its pinned allocation fails),
    after the model was loaded and compiled; said here, the user can shorten the sequence first.

    Raises:
        ValueError: the inputs need more than the memory available (the message says how much).
    """
    need, have = host_bytes(layers, input_bytes), available_host_bytes()
    if have is not None and need > have:
        gib = 2**30
        raise ValueError(
            f"offloading the inputs of {layers} checkpointed layers{f' at {shape}' if shape else ''} needs about "
            f"{need / gib:.1f} GiB of CPU memory, and {have / gib:.1f} GiB is available: use a shorter sequence "
            f"or fewer rows, a machine with more memory, or a larger memory target (fewer layers offloaded)")


@dataclasses.dataclass
class CheckpointPlan:
    """What :func:`plan` decided: layers to checkpoint, whether to offload them, the scope; why."""

    ckpt_layers: int
    ckpt_why: str
    offload: bool
    offload_why: str
    scope: str
    scope_why: str | None = None  # None: the scope as asked


def _check_options(grad_ckpt: Any, ckpt_layers: int | None, offload: Any) -> None:
    if not (offload == "auto" or isinstance(offload, bool)):
        raise ValueError(f"offload must be one of ['auto', True, False], got {offload!r}")
    if offload is True and (grad_ckpt is False or ckpt_layers == 0):
        raise ValueError("offload=True keeps checkpointed layers' inputs in CPU memory; it needs checkpointing "
                         "(grad_ckpt=True or 'auto', ckpt_layers > 0)")


def plan(n_layers: int, *, grad_ckpt: Any, ckpt_layers: int | None, max_memory_gib: float | None,
         offload: Any, scope: str, estimate: Callable[[int, bool], float] | None, shape: str = "",
         target_label: str | None = None) -> CheckpointPlan:
    """Decide checkpointing and offload for ``optimize()`` (each choice with its reason).

    Args:
        n_layers: the model's decoder layers.
        grad_ckpt: ``"auto"``, True or False (``optimize``'s option).
        ckpt_layers: checkpoint the first N layers (None: decided).
        max_memory_gib: the peak target (None: none).
        offload: ``"auto"`` (on only when checkpointing every layer is estimated above the
            target), True or False.
        scope: the scope asked for; offloading needs ``"regional"`` (see the module docstring).
        estimate: ``estimate(ckpt_layers, offload) -> GiB`` (needed with ``max_memory_gib``).
        shape: the batch shape, for the reasons.
        target_label: how the reasons name ``max_memory_gib`` (default: ``"<value> GiB"``).

    Raises:
        ValueError: a bad ``offload``, or ``offload=True`` without checkpointing.
    """
    _check_options(grad_ckpt, ckpt_layers, offload)
    target = target_label or (f"{max_memory_gib:.4g} GiB" if max_memory_gib is not None else "")
    off, off_why = False, ("asked for" if offload != "auto" else "no memory target" if max_memory_gib is None
                           else "not needed: the estimate fits the target without it")
    if grad_ckpt is True or ckpt_layers is not None:
        ckpt = n_layers if ckpt_layers is None else min(ckpt_layers, n_layers)
        why = "asked for"
        if offload is True:
            off = True
        elif offload == "auto" and max_memory_gib is not None and ckpt:
            est = estimate(ckpt, False)
            off = est > max_memory_gib
            off_why = (f"estimated peak {est:.2f} GiB > {target} without it" if off
                       else f"estimated peak {est:.2f} GiB fits {target} without it")
    elif grad_ckpt is False:
        ckpt, why = 0, "asked for"
    elif max_memory_gib is None:
        ckpt, why = (n_layers, "offload asked for: every layer") if offload is True else (0, "no memory target")
        off = offload is True
    else:
        fits = [(n, o) for o in ((False, True) if offload == "auto" else (offload is True,))
                for n in range(0 if o is False else 1, n_layers + 1) if estimate(n, o) <= max_memory_gib]
        if fits:
            ckpt, off = fits[0]
            why = f"estimated peak {estimate(ckpt, off):.2f} GiB <= {target} at {shape}"
            if off and offload == "auto":
                off_why = (f"checkpointing every layer is estimated at {estimate(n_layers, False):.2f} GiB "
                           f"> {target}")
        else:
            ckpt, off = n_layers, offload is not False
            why = (f"estimated peak above {target} even with every layer checkpointed"
                   + (" and offloaded" if off else ""))
            if off and offload == "auto":
                off_why = "the target is not met without it either"
    scope_why = None
    if off and scope != "regional":
        scope, scope_why = "regional", ("offload needs the checkpoint eager around each compiled layer: "
                                        "Dynamo refuses saved-tensor hooks in a graph")
    if off:
        off_why = f"the inputs of {ckpt} checkpointed layers in CPU memory, copied on a side stream; {off_why}"
    return CheckpointPlan(ckpt, why, off, off_why, scope, scope_why)
