"""Which pool workers went silent: the parent's side of the workers' heartbeats.

A worker whose process is frozen, or whose machine or network vanished, closes
no socket and exits with no status: its sentinel and its connection say nothing.
Every pool worker therefore sends the service a one-way ``alive`` every
``heartbeat_interval`` (besides its results and requests); :class:`Liveness`
remembers when each connected worker was last heard from and reports one that
stayed silent for ``parent_timeout`` (the same limit a worker gives its parent).

Owns only the bookkeeping and the periodic check, on the hub's timer thread.
What a silent worker costs (its tasks are requeued, it is killed later) is the
service's decision. The check is not fooled by this process's own stalls (the
parent stopped, swapped out, starved of CPU): when it runs much later than
planned, nobody could be heard meanwhile, so every worker gets a fresh start.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Protocol

__all__ = ["Liveness", "Timings"]


class Timings(Protocol):
    """Where the heartbeat timings in force are read (the hub: they follow the config)."""

    heartbeat_interval: float
    parent_timeout: float


class Liveness:
    """When each worker was last heard from; reports the silent ones.

    Args:
        on_silent: ``on_silent(wid, seconds)``, called once for a worker silent for
            longer than ``parent_timeout``, in a thread of its own (it may block).
    """

    def __init__(self, on_silent: Callable[[int, float], None]) -> None:
        self._on_silent = on_silent
        self._lock = threading.Lock()
        self._heard: dict[int, float] = {}
        self._timers: Any = None
        self._timings: Optional[Timings] = None
        self._entry: Optional[list] = None   # the scheduled check
        self._checked = 0.0                  # when the last check ran

    def start(self, timers: Any, timings: Timings) -> None:
        """Check every ``heartbeat_interval`` on ``timers`` (a :class:`fibrl.timers.Timers`)
        while some worker is watched. Before this, workers are only recorded."""
        with self._lock:
            self._timers, self._timings = timers, timings
            self._schedule()

    def watch(self, wid: int) -> None:
        """Worker ``wid`` connected: from now on it must be heard from."""
        with self._lock:
            self._heard[wid] = time.monotonic()
            self._schedule()

    def heard(self, wid: int) -> None:
        """Something arrived from worker ``wid``."""
        with self._lock:
            if wid in self._heard:
                self._heard[wid] = time.monotonic()

    def forget(self, wid: int) -> None:
        """Worker ``wid`` ended (or was given up): stop watching it."""
        with self._lock:
            self._heard.pop(wid, None)

    def stop(self) -> None:
        """Watch nobody any more (the pool ended)."""
        with self._lock:
            self._heard.clear()
            if self._entry is not None:
                self._timers.cancel(self._entry)
                self._entry = None

    def _schedule(self) -> None:
        if self._entry is not None or self._timings is None or not self._heard:
            return
        now = time.monotonic()
        self._checked = now
        self._entry = self._timers.call_at(now + self._timings.heartbeat_interval, self._check)

    def _check(self) -> None:
        """On the timer thread: report the workers silent past the limit; never blocks."""
        now = time.monotonic()
        with self._lock:
            self._entry = None
            timings = self._timings
            assert timings is not None
            if now - self._checked > 2 * timings.heartbeat_interval + 1.0:
                # this process did not run for a while: nothing could be heard meanwhile
                self._heard = dict.fromkeys(self._heard, now)
            self._checked = now
            silent = [(wid, now - last) for wid, last in self._heard.items()
                      if now - last > timings.parent_timeout]
            for wid, _ in silent:
                del self._heard[wid]
            self._schedule()
        for wid, seconds in silent:
            self._timers.call_at(now, lambda w=wid, s=seconds: self._on_silent(w, s),
                                 blocking=True)
