"""Share one GPU between concurrent benchmark processes without sharing its clock.

Why: compiling the 1B shape takes one to five minutes of CPU per configuration, and the GPU
sits idle meanwhile. A 16-core GPU host can compile a dozen configurations at once, but if
their training steps overlap on the GPU, every step time is wrong. The fix is a lock around
each training step (an exclusive `fcntl.flock` on a file every process opens), released while
Dynamo/Inductor compile inside the step, so compilation runs in parallel and timed GPU work
never does.

How: `train.train` wraps each optimizer step in `step_lock()`. When `$QLORA_NB_GPU_LOCK` names a
file, that takes the lock; otherwise it is a no-op (the default: one process, nothing to share).
The release during compilation uses `torch._dynamo.callback`'s compile start/end callbacks,
which fire around every Dynamo frame compile and every lazily compiled backward. A step that
compiled is not a steady-state step anyway: benchmarks leave it out of their medians.

What it does not do: work outside `train.train` (building a model, a graph-break check) runs
unlocked, and the processes still share the host's CPU cores. Runs that used the lock record it
(`bench`/`matrix` write `gpu_lock` into their options), so a reader knows how they were made.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from typing import Iterator

__all__ = ["LOCK_ENV", "StepLock", "step_lock", "lock_path"]

LOCK_ENV = "QLORA_NB_GPU_LOCK"


def lock_path() -> str | None:
    """The lock file named by `$QLORA_NB_GPU_LOCK`, or None when steps need no lock."""
    return os.environ.get(LOCK_ENV) or None


class StepLock:
    """An exclusive file lock held across training steps, let go while torch compiles.

    Args:
        path: the lock file (created if missing); every cooperating process uses the same one.
    """

    def __init__(self, path: str):
        if not path:
            raise ValueError("StepLock needs a lock file path")
        self.path = path
        self._fd: int | None = None
        self._in_step = False
        self._held = False
        self._mutex = threading.Lock()
        self._callbacks = None

    # -- the lock itself
    def _acquire(self) -> None:
        if not self._held:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._held = True

    def _release(self) -> None:
        if self._held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._held = False

    # -- compile callbacks: let go while compiling inside a step, take it back after
    def _on_start(self, _args) -> None:
        with self._mutex:
            if self._in_step:
                self._release()

    def _on_end(self, _args) -> None:
        with self._mutex:
            if self._in_step:
                self._acquire()

    def _register(self) -> None:
        # Checked before every step: `torch.compiler.reset()` clears all compile callbacks, and a
        # benchmark resets between runs. Unregistered, a compile would hold the lock throughout.
        from torch._dynamo.callback import callback_handler

        if self._on_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._on_start)
        if self._on_end not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(self._on_end)
        self._callbacks = callback_handler

    def close(self) -> None:
        """Release the lock, remove the compile callbacks and close the file."""
        with self._mutex:
            self._in_step = False
            if self._fd is not None:
                self._release()
                os.close(self._fd)
                self._fd = None
        if self._callbacks is not None:
            if self._on_start in self._callbacks.start_callbacks:
                self._callbacks.remove_start_callback(self._on_start)
            if self._on_end in self._callbacks.end_callbacks:
                self._callbacks.remove_end_callback(self._on_end)
            self._callbacks = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Hold the lock for one training step (minus the time spent compiling in it)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        self._register()
        with self._mutex:
            self._acquire()
            self._in_step = True
        try:
            yield
        finally:
            with self._mutex:
                self._in_step = False
                self._release()

    @property
    def held(self) -> bool:
        """Whether this process holds the lock now."""
        return self._held


_shared: dict[str, StepLock] = {}


@contextlib.contextmanager
def step_lock() -> Iterator[None]:
    """The lock for one step when `$QLORA_NB_GPU_LOCK` is set, else nothing."""
    path = lock_path()
    if path is None:
        yield
        return
    lock = _shared.get(path)
    if lock is None:
        lock = _shared[path] = StepLock(path)
    with lock.step():
        yield
