"""What a pool caller waits on: ``AsyncResult``, ``MapResult``, ``IMapIterator``.

Owns result delivery to the caller, with the surface of the running Python's
``multiprocessing.pool`` result objects (``get(timeout)``, ``wait``,
``ready``, ``successful``; ``next(timeout)`` for iterators). The service
(``service``) decides *what* is delivered, exactly once per item; these
objects only store it, wake waiters and run callbacks.

Every result object is a :class:`~fibrl.pool.protocol.ResultSink`: the
service and the feeder hand it outcomes through ``sink_claim``,
``sink_deliver``, ``sink_abort`` (and ``sink_set_length`` for streams), from
the threads that receive results.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from multiprocessing import TimeoutError as MpTimeoutError
from typing import Any, Callable, Optional

from .protocol import Raised, ResultSink

__all__ = ["ApplyResult", "AsyncResult", "MapResult", "IMapIterator",
           "IMapUnorderedIterator", "Failure", "outcome"]

log = logging.getLogger(__name__)


class Failure:
    """An item's outcome when it failed in the parent (lost worker, unpicklable input)."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def outcome(item: Any) -> tuple[bool, Any]:
    """``(True, value)`` or ``(False, exception)`` with the remote traceback as ``__cause__``."""
    kind = type(item)
    if kind is Raised:
        return False, item.error  # unpickled with the worker's traceback as __cause__
    if kind is Failure:
        return False, item.exc
    return True, item


def _run_callback(fn: Optional[Callable[[Any], Any]], value: Any) -> None:
    if fn is None:
        return
    try:
        fn(value)
    except Exception:  # a raising callback must not stop result delivery
        log.exception("pool result callback %r raised", fn)


class ApplyResult(ResultSink):
    """The result of ``apply_async``.

    Example:
        >>> r = pool.apply_async(pow, (2, 10))  # doctest: +SKIP
        >>> r.get(timeout=30)                    # doctest: +SKIP
        1024
    """

    def __init__(self, pool: Any, callback: Optional[Callable] = None,
                 error_callback: Optional[Callable] = None) -> None:
        self._pool = pool  # keeps the pool alive until the result is ready
        self._event = threading.Event()
        self._callback = callback
        self._error_callback = error_callback
        self._success = False
        self._value: Any = None
        self._once = threading.Lock()

    def ready(self) -> bool:
        return self._event.is_set()

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._success

    def wait(self, timeout: Optional[float] = None) -> None:
        self._event.wait(timeout)

    def get(self, timeout: Optional[float] = None) -> Any:
        """The value, or raise the task's exception; ``multiprocessing.TimeoutError`` if late."""
        self.wait(timeout)
        if not self.ready():
            raise MpTimeoutError
        if self._success:
            return self._value
        raise self._value

    # -- sink ---------------------------------------------------------------------------
    def sink_deliver(self, index: int, outcomes: list, clean: bool = False) -> None:
        self._set(*outcome(outcomes[0]))

    def sink_abort(self, exc: BaseException) -> None:
        self._set(False, exc)

    def _set(self, success: bool, value: Any) -> None:
        if not self._once.acquire(blocking=False):
            return  # already set (an abort racing a late result)
        self._success, self._value = success, value
        _run_callback(self._callback if success else self._error_callback, value)
        self._event.set()
        self._pool = None


AsyncResult = ApplyResult


class MapResult(ApplyResult):
    """The result of ``map_async`` / ``starmap_async``: a list in input order.

    When items fail, ``get()`` raises the exception of the failed item with
    the lowest index, once every item has finished (as the stdlib waits for
    every chunk).
    """

    def __init__(self, pool: Any, length: int, callback: Optional[Callable] = None,
                 error_callback: Optional[Callable] = None) -> None:
        super().__init__(pool, callback, error_callback)
        self._values: list = [None] * length
        self._left = length
        self._error: Optional[tuple[int, BaseException]] = None
        self._lock = threading.Lock()
        if length == 0:  # as the stdlib: ready at once, no callback
            self._once.acquire()
            self._success, self._value = True, []
            self._event.set()
            self._pool = None

    def sink_deliver(self, index: int, outcomes: list, clean: bool = False) -> None:
        values = self._values
        with self._lock:
            if clean:
                values[index:index + len(outcomes)] = outcomes
            else:
                self._store_checked(index, outcomes)
            self._left -= len(outcomes)
            done = self._left == 0
        if done:
            self._finish()

    def _store_checked(self, index: int, outcomes: list) -> None:
        values = self._values
        for i, item in enumerate(outcomes, index):
            ok, value = outcome(item)
            if ok:
                values[i] = value
            elif self._error is None or i < self._error[0]:
                self._error = (i, value)

    def _finish(self) -> None:
        if self._error is None:
            self._set(True, self._values)
        else:
            self._set(False, self._error[1])


class IMapIterator(ResultSink):
    """The iterator returned by ``imap``: results in input order, as they complete.

    ``next(timeout)`` raises ``multiprocessing.TimeoutError`` when nothing
    arrives in time; an item that failed raises its exception at its position
    and iteration goes on with the next item.
    """

    _ordered = True

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._cond = threading.Condition(threading.Lock())
        self._ready: Any = {} if self._ordered else deque()
        self._index = 0          # items handed to the caller so far
        self._length: Optional[int] = None
        self._aborted: Optional[BaseException] = None
        self._hook: Optional[Callable[[], None]] = None
        self._hook_every = 0

    def __iter__(self) -> "IMapIterator":
        return self

    def next(self, timeout: Optional[float] = None) -> Any:
        with self._cond:
            item = self._take(timeout)
            self._index += 1
            hook = self._hook
            if hook is not None and self._index % self._hook_every:
                hook = None  # not its turn
        if hook is not None:
            hook()
        ok, value = outcome(item)
        if ok:
            return value
        raise value

    __next__ = next

    def _take(self, timeout: Optional[float]) -> Any:
        while True:
            item = self._pop()
            if item is not _NOTHING:
                return item
            if self._length is not None and self._index >= self._length:
                self._pool = None
                raise StopIteration
            if self._aborted is not None:
                self._length = self._index
                raise self._aborted
            if not self._cond.wait(timeout):
                raise MpTimeoutError

    def _pop(self) -> Any:
        return self._ready.pop(self._index, _NOTHING)

    def _store(self, index: int, outcomes: list) -> None:
        self._ready.update(zip(range(index, index + len(outcomes)), outcomes))

    # -- sink ---------------------------------------------------------------------------
    def sink_deliver(self, index: int, outcomes: list, clean: bool = False) -> None:
        with self._cond:
            self._store(index, outcomes)
            self._cond.notify_all()

    def sink_abort(self, exc: BaseException) -> None:
        with self._cond:
            if self._aborted is None:
                self._aborted = exc
            self._cond.notify_all()

    def sink_set_length(self, length: int) -> None:
        with self._cond:
            self._length = length
            self._cond.notify_all()

    def _watch(self, every: int, hook: Callable[[], None]) -> None:
        """Call ``hook`` (outside any lock) each time ``every`` more items were taken."""
        with self._cond:
            self._hook_every = max(1, every)
            self._hook = hook

    def _taken(self) -> int:
        return self._index


class IMapUnorderedIterator(IMapIterator):
    """The iterator returned by ``imap_unordered``: results in completion order."""

    _ordered = False

    def _pop(self) -> Any:
        return self._ready.popleft() if self._ready else _NOTHING

    def _store(self, index: int, outcomes: list) -> None:
        self._ready.extend(outcomes)


_NOTHING = object()
