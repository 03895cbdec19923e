"""Deadlines: one thread that runs callbacks at given times.

Owns only that. Used by the hub (deadlines of parked replies) and by backends
(deadlines of pending jobs); it depends on nothing else in fibrl, so any layer
may use it.
"""
from __future__ import annotations

import functools
import heapq
import itertools
import logging
import threading
import time
from typing import Callable, Optional

__all__ = ["Timers"]

log = logging.getLogger(__name__)

# The longest single wait of the timer thread; the heap is checked again after it. A
# deadline further away is reached in steps (a timeout of 1e12 s is more than a
# condition can wait for in one call), and a clock that was replaced for a while (a
# test's fake clock, freezegun) cannot leave the thread asleep for hours past the
# deadlines that came after: it is late by this much at most. One wake-up a second.
_LONGEST_WAIT_S = 1.0


class Timers:
    """One thread that runs callbacks at deadlines (for parked replies)."""

    def __init__(self) -> None:
        self._heap: list = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._thread: Optional[threading.Thread] = None

    def call_at(self, deadline: float, fn: Callable[[], None], *,
                blocking: bool = False) -> list:
        """Run ``fn`` at ``time.monotonic() >= deadline``; returns a cancellable entry.

        ``blocking``: ``fn`` may wait (a backend call: logs, kill), so it runs in a
        thread of its own; the timer thread must stay free for every other deadline.
        """
        if deadline != deadline:   # NaN: it would break the heap's order for every entry
            raise ValueError("a deadline must be a number of seconds, not NaN")
        if blocking:
            fn = functools.partial(_in_thread, fn)
        entry = [deadline, next(self._seq), fn]
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                 name="fibrl-timers")
                self._thread.start()
            if self._heap[0] is entry:
                self._cond.notify()
        return entry

    @staticmethod
    def cancel(entry: list) -> None:
        entry[2] = None

    def close(self, timeout: float = 5.0) -> None:
        """Drop every pending deadline and end the thread (waits up to ``timeout`` s for a
        callback it is running). A later :meth:`call_at` starts a new thread."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._heap.clear()
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        me = threading.current_thread()
        try:
            self._serve(me)
        except BaseException:
            # never left for dead while still named as the thread: every later deadline
            # of the process (timed waits, heartbeats) would silently never fire
            log.exception("the timer thread failed; the next deadline starts a new one")
            with self._cond:
                if self._thread is me:
                    self._thread = None

    def _serve(self, me: threading.Thread) -> None:
        while True:
            with self._cond:
                while self._thread is me and (not self._heap
                                              or self._heap[0][0] > time.monotonic()):
                    if self._heap:
                        delay = min(self._heap[0][0] - time.monotonic(), _LONGEST_WAIT_S)
                        self._cond.wait(delay)
                    else:
                        self._cond.wait()
                if self._thread is not me:
                    return   # closed
                fn = heapq.heappop(self._heap)[2]
            if fn is not None:
                try:
                    fn()
                except Exception:
                    log.exception("timer callback failed")
            # not kept while waiting for the next deadline: what the callback refers to
            # (a parked reply, its caller's objects) is freed now
            fn = None


def _in_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, daemon=True, name="fibrl-deadline").start()
