"""``Queue``, ``JoinableQueue`` and ``SimpleQueue`` that work between any processes.

A queue is a :class:`~fibrl.hosting.mailbox.Mailbox` hosted by the hub of the process
that created it; the queue object is a small handle (a
:class:`~fibrl.hosting.hosted.HostedHandle`: address + object id) that pickles to any
process of the run, including processes on other machines.

Data flow::

    producer process                    owner process (hub)             consumer process
    put(obj) -> dumps(obj) -> feeder ==> Mailbox.op_put -> deque          get(): the next item
             (unbounded: one-way,               |                         of this process's
              batched; bounded: waits           +-> pushed ahead  =====>  Window (the owner's
              for room)                             into windows          own get(): the deque)

Semantics follow ``multiprocessing.Queue``: ``put``/``get`` with ``block`` and
``timeout``, ``*_nowait``, ``qsize``, ``empty``, ``full``, ``close``,
``join_thread``, ``cancel_join_thread``; ``JoinableQueue`` adds ``task_done``
and ``join``. Differences: ``qsize`` is exact (it asks the owner); a queue
lives in its owner process: until that process drops its handle, or, once the
queue was sent to other processes, until they are done with it too.
"""
from __future__ import annotations

import queue
from typing import Any, Optional

from .wire import serialization
from .hosting.hosted import HostedHandle
from .hosting.hub import get_hub
from .hosting.mailbox import EMPTY, Ledger, Mailbox, Window, merge_puts, take

__all__ = ["Queue", "JoinableQueue", "SimpleQueue"]


def _timeout(block: bool, timeout: Optional[float]) -> Optional[float]:
    if not block:
        return 0.0
    if timeout is not None and not timeout >= 0:   # (NaN too)
        raise ValueError("'timeout' must be a non-negative number")
    return timeout


class Queue(HostedHandle):
    """A FIFO queue shared by any number of producers and consumers.

    Example:
        >>> q = Queue()
        >>> q.put("x"); q.get(timeout=5)
        'x'
    """

    _joinable = False
    # Where this process reaches the queue, found once (again in a forked child, whose
    # Window.epoch differs): the Mailbox itself in the owner process, else the window
    # its first get() opens.
    _box: Any = None
    _window: Optional[Window] = None
    _ledger: Optional[Ledger] = None   # what this process put, per connection to the owner
    _epoch = -1

    def __init__(self, maxsize: int = 0, *, ctx: Any = None) -> None:
        if maxsize <= 0:
            maxsize = 0
        self._maxsize = maxsize
        self._closed = False
        self._host(Mailbox(maxsize, joinable=self._joinable))

    def _state(self) -> dict:
        return {"_maxsize": self._maxsize, "_closed": False}

    def __repr__(self) -> str:
        return f"<fibrl.{type(self).__name__} {self._oid} at {self._address}>"

    def _call(self, method: str, *args: Any) -> Any:
        self._sync()
        return get_hub().call(self._address, self._oid, method, *args)

    def _sync(self) -> None:
        """Acknowledgements ride ahead of this process's next request to the owner."""
        if Window.unreported:
            Window.sync_to(self._address)

    def _check_closed(self) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        """Put ``obj`` on the queue; waits for room when the queue has a ``maxsize``."""
        self._check_closed()
        payload = serialization.encode(obj)
        if self._epoch != Window.epoch:
            self._locate()
        local = self._box
        if local is not None:
            payload.own()  # the queue keeps it: the caller may change the original
            if self._maxsize == 0:
                local.give(payload)
                return
        elif Window.unreported:
            Window.sync_to(self._address)
        if self._maxsize == 0:
            # one-way, counted per connection, so an item lost with one is reported (a
            # large item is sent from this thread, copied once, into the connection)
            self._ledger.put(payload)  # type: ignore[union-attr]  # (_locate made it)
            return
        try:
            self._call("put", payload, _timeout(block, timeout))
        except queue.Full:
            raise queue.Full from None

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """Remove and return an item; raises ``queue.Empty`` after ``timeout`` seconds."""
        self._check_closed()
        if self._epoch != Window.epoch:
            self._locate()
        local = self._box
        try:
            if local is not None:  # the owner process: no handle when an item is there
                payload = local.take_nowait()
                if payload is EMPTY:
                    payload = take(get_hub(), self._address, self._oid,
                                   _timeout(block, timeout))
            else:
                if self._window is None:
                    self._window = Window.of(self._address, self._oid)
                payload = self._window.get(_timeout(block, timeout))
        except queue.Empty:
            raise queue.Empty from None
        return serialization.loads(payload)

    def _locate(self) -> None:
        hub = get_hub()
        self._box = hub.local_service(self._address, self._oid)
        if self._box is None:   # puts travel to the owner: runs of small ones as one call
            hub.merge_calls("put", merge_puts)
            self._ledger = Ledger.of(self._address, self._oid)
        self._window, self._epoch = None, Window.epoch

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        return self._call("qsize")

    def empty(self) -> bool:
        return self._call("empty")

    def full(self) -> bool:
        return self._call("full")

    def close(self) -> None:
        """This process will put no more; pending puts are still delivered. Items pushed
        ahead to this process and not returned by ``get()`` go back to the queue.

        Raises:
            RemoteObjectError: items this process put were lost with a connection to
                the queue's owner that dropped (it says how many).
        """
        self._closed = True
        window = Window.find(self._address, self._oid)
        if window is not None:
            window.close()
        if self._ledger is not None:
            self._ledger.settle()

    def join_thread(self) -> None:
        """Wait until every item this process put has reached the queue.

        Raises:
            RemoteObjectError: items this process put were lost with a connection to
                the queue's owner that dropped (it says how many).
        """
        if not self._closed:
            raise AssertionError("Queue.join_thread() requires close() first")
        if self._ledger is not None:
            self._ledger.confirm()
        else:
            get_hub().flush(None)

    def cancel_join_thread(self) -> None:
        """Accepted for compatibility: puts are delivered before the process exits."""


class JoinableQueue(Queue):
    """A :class:`Queue` with ``task_done()`` and ``join()``."""

    _joinable = True

    def task_done(self) -> None:
        """Mark one item taken with ``get()`` as processed."""
        self._call("task_done")

    def join(self, *, timeout: Optional[float] = None) -> None:
        """Block until every item put has been marked done.

        Args:
            timeout: keyword extra (seconds); raises ``TimeoutError`` when it passes.
        """
        self._sync()
        get_hub().call(self._address, self._oid, "join", timeout=timeout)


class SimpleQueue:
    """A minimal queue: ``put``, ``get``, ``empty``, ``close``."""

    def __init__(self, *, ctx: Any = None) -> None:
        self._queue = Queue(ctx=ctx)

    def put(self, obj: Any) -> None:
        self._queue.put(obj)

    def get(self) -> Any:
        return self._queue.get()

    def empty(self) -> bool:
        return self._queue.empty()

    def close(self) -> None:
        self._queue.close()

    def __repr__(self) -> str:
        return f"<fibrl.SimpleQueue {self._queue._oid}>"
