"""The first step of a run, as the user sees it: its wait announced, its rate kept out of the speed.

Why a module of its own: the first step of a process compiles, which can take from seconds to
minutes, and two things follow from that for everything a run reports. While it compiles, the
run says so at intervals (:class:`Ticker`), since a bar that does not move looks like a hang;
and the rate a run states never counts that step (:func:`median_tokens_per_s`). How long the
user waited is measured from the process's own start (:func:`since_launch`), imports included.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["Ticker", "median_tokens_per_s", "since_launch"]


def median_tokens_per_s(rows: list[dict], skip: int = 3) -> float | None:
    """Median real tokens/s over the steps after the first ``skip`` of each session, or, in a session
    that short, after its first; None when only first steps ran.

    A session's first step compiles (each process compiles anew, a resumed one too), and a rate
    with the compile in it says nothing of the training's speed: it never counts. The next few
    steps still settle (allocator, caches), so they count only where there is nothing else.
    """
    by_session: dict[Any, list[float]] = {}
    for row in rows:
        by_session.setdefault(row["session"], []).append(row["tokens_per_s"])
    steady = [v for values in by_session.values() for v in values[skip:]]
    values = steady or [v for values in by_session.values() for v in values[1:]]
    return float(statistics.median(values)) if values else None


def since_launch() -> float | None:
    """Seconds since this process started (None where the start cannot be read)."""
    try:
        import psutil

        return round(time.time() - psutil.Process().create_time(), 3)
    except Exception:  # psutil missing, or no such process information here
        return None


class Ticker:
    """Say every ``every`` seconds, until stopped, how long the first step has run: a compile can
    take minutes, and a bar that does not move looks like a hang."""

    def __init__(self, say: Callable[[str], None], message: str, every: float = 15.0) -> None:
        import threading

        self._done = threading.Event()
        self._t0 = time.perf_counter()

        def tick() -> None:
            while not self._done.wait(every):
                say(message.format(time.perf_counter() - self._t0))

        self._thread = threading.Thread(target=tick, name="qlora-nb-first-step", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
