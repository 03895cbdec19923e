"""Finalizers that never run their work on the collecting thread.

Owns only that. A ``weakref.finalize`` callback runs wherever the garbage
collector happens to run: on any thread, at any allocation, possibly while that
thread holds one of fibrl's locks (a handle being resolved, a mailbox, the hub's
table). A callback that then calls into fibrl takes the same lock again and the
thread deadlocks with itself. So a collected object's cleanup is only queued
here (``queue.SimpleQueue.put`` is reentrant, safe inside a collection) and one
daemon thread runs it. Two cases run inline instead:

- an explicit call of the :class:`Finalizer` (``close()``, ``terminate()``):
  the caller is in ordinary code and expects the work done when it returns;
- interpreter exit (``atexit`` finalizers): the janitor thread may never get
  another turn. At exit the process's hub calls :func:`flush` (bounded) and
  :func:`stop` before it closes, and :func:`join` after: what is queued later
  is dropped (the hub's close ends every connection anyway), and no cleanup is
  left running inside nng when nng's own exit handler tears it down.

It depends on nothing else in fibrl, so any layer may use it.

Example:
    >>> class Res: pass
    >>> r = Res(); done = []
    >>> f = Finalizer(r, done.append, 1)
    >>> f(); done          # explicit: at once, on this thread
    [1]
    >>> f(); done          # and only once
    [1]
"""
from __future__ import annotations

import gc
import logging
import os
import queue
import sys
import threading
import weakref
from typing import Any, Callable, Optional

__all__ = ["Finalizer", "flush", "join", "stop"]

log = logging.getLogger(__name__)

# (None, ()) is the stop sentinel
_pending: "queue.SimpleQueue[tuple[Optional[Callable[..., Any]], tuple]]" = queue.SimpleQueue()
_start_lock = threading.Lock()
_thread: Optional[threading.Thread] = None
_thread_pid = 0
_stopped = False
_STOP = (None, ())


class Finalizer:
    """Run ``fn(*args)`` once: when ``obj`` is collected (on the janitor thread),
    when called (inline), or at interpreter exit if ``atexit`` (inline)."""

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, obj: Any, fn: Callable[..., Any], *args: Any,
                 atexit: bool = False) -> None:
        _ensure_thread()  # here, in ordinary code: never start a thread inside a collection
        self._ref = weakref.finalize(obj, _collected, fn, args)
        self._ref.atexit = atexit

    def __call__(self) -> None:
        """Run now on this thread, unless it already ran or was detached."""
        info = self._ref.detach()
        if info is not None:
            fn, args = info[2]
            fn(*args)

    def detach(self) -> bool:
        """Never run it; True if it was still pending."""
        return self._ref.detach() is not None

    @property
    def alive(self) -> bool:
        return self._ref.alive


def flush(timeout: Optional[float] = None) -> bool:
    """Wait until every cleanup queued so far has run; False on timeout."""
    if _thread is None or not _thread.is_alive() or _stopped:
        return True
    done = threading.Event()
    _pending.put((_mark, (done,)))
    return done.wait(timeout)


def _mark(done: threading.Event) -> None:
    done.set()


def stop() -> None:
    """Run nothing more that is queued (interpreter exit); :func:`join` waits for the
    cleanup that is running now, if any."""
    global _stopped
    _stopped = True
    _pending.put(_STOP)


def join(timeout: Optional[float] = None) -> None:
    """Wait up to ``timeout`` s for the janitor to finish after :func:`stop`."""
    thread = _thread
    if thread is not None and thread.is_alive() and _thread_pid == os.getpid():
        thread.join(timeout)


def _collected(fn: Callable[..., Any], args: tuple) -> None:
    if _exiting():
        _run(fn, args)
    else:
        _pending.put((fn, args))


def _exiting() -> bool:
    # weakref's exit pass calls each atexit finalizer in turn, from ordinary code on the
    # main thread with the collector switched off: no collection can be under way, and
    # the janitor may not get another turn. Any other call (a daemon thread late in
    # exit included) may come from a collection and is queued.
    return (not gc.isenabled() and threading.current_thread() is threading.main_thread()) \
        or sys.is_finalizing()


def _run(fn: Callable[..., Any], args: tuple) -> None:
    try:
        fn(*args)
    except Exception:  # a cleanup that fails must not stop the others
        log.debug("cleanup %r failed", fn, exc_info=True)


def _work() -> None:
    while True:
        fn, args = _pending.get()
        if fn is None:
            return
        if not _stopped or fn is _mark:  # after stop() only flush() markers run
            _run(fn, args)
        del fn, args  # drop references now, not at the next item


def _ensure_thread() -> None:
    global _thread, _thread_pid
    if _thread is not None and _thread_pid == os.getpid():
        return
    with _start_lock:
        if _thread is None or _thread_pid != os.getpid():  # none yet, or a forked child
            _thread = threading.Thread(target=_work, daemon=True, name="fibrl-janitor")
            _thread.start()
            _thread_pid = os.getpid()
