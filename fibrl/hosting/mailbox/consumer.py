"""The consumer's side of a mailbox owned by another process: :class:`Window`, the
items its owner pushed ahead for this process and what ``get()`` returned of them,
and :func:`take`, a request/reply get acknowledged the same way.

A window's first ``get()`` opens a stream on which the owner pushes; each
``get()`` counts what it returned and that count (the acknowledgement) rides
ahead of this process's next request to the owner, or goes within
:data:`ACK_DELAY` seconds.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Optional

from ..hub import Hub, get_hub
from .protocol import ASKING, IDLE, WAITING, WINDOW_ITEMS, Run

__all__ = ["Window", "take"]

log = logging.getLogger(__name__)

#: A consumer acknowledges what its get() returned at the latest this late.
ACK_DELAY = 0.002


def take(hub: Hub, address: Optional[str], oid: str, timeout: Optional[float]) -> Any:
    """``get`` from the mailbox ``oid`` at ``address`` and acknowledge what arrived.

    The acknowledgement is a one-way message sent before this returns, so the
    owner re-queues the item only if this process dies in between.
    """
    handle = hub.call_async(address, oid, "get", timeout)
    if not handle.ready() and hub.is_local(address):
        feeder = getattr(hub.service(oid), "feeder", None)
        if feeder is not None:   # another process put last: read its frames here
            hub.wait_reading(handle, feeder)
    payload = hub.wait(handle, address, None)
    if handle.rid:
        hub.send(address, oid, "ack", handle.rid, inline=True)
    return payload


class Window:
    """This process's window on a queue that another process owns: the items its
    owner pushed ahead, and what ``get()`` returned of them (see the package doc).

    One per process and queue, shared by the process's handles and threads. The
    stream that carries the items is opened by the first ``get()``; the owner
    pushes only while the window has room, and room comes from what ``get()``
    returned, so a process that stops calling ``get()`` receives at most one
    window more, which is recalled as soon as another consumer waits for it.
    """

    _registry: dict[tuple[str, str], Window] = {}   # (address, oid) -> its window
    _registry_lock = threading.Lock()
    _hooked = False   # close_all runs at this process's exit
    epoch = 0         # one more in each forked child: windows found before are not its own
    #: windows whose owner was not yet told all that get() returned
    unreported: set[Window] = set()

    def __init__(self, address: str, oid: str) -> None:
        self.address, self.oid = address, oid
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)   # (get() takes the lock itself: faster)
        self.items: deque[Any] = deque()   # pushed items that get() has not returned
        self.stream: Optional[object] = None   # the open stream's token; None: closed
        self.rid = 0
        self.client: Any = None  # the connection the stream is on (never a new one)
        self.conn: Any = None    # its channel (closed: see _servable)
        self.size = 1          # items this process asks the owner to hold for it
        self.returned = 0      # items get() returned from this stream
        self.reported = 0      # the count the owner was last told
        self.waiters = 0       # threads of this process waiting in get()
        self.error: Optional[BaseException] = None
        self.timer: Optional[list[Any]] = None   # the timers' entry that acknowledges
        # "resume" markers still due: the owner pushed before it saw this process
        # give its items back, so what arrives until then went back too and is dropped
        self.stale = 0

    @classmethod
    def of(cls, address: str, oid: str) -> "Window":
        """This process's window on the queue ``oid`` at ``address`` (made on first use)."""
        key = (address, oid)
        win = cls._registry.get(key)
        if win is None:
            with cls._registry_lock:
                if not cls._hooked:
                    from .. import runtime

                    runtime.at_exit(runtime.CONNECTIONS, cls.close_all)
                    cls._hooked = True
                win = cls._registry.get(key)
                if win is None:
                    win = cls._registry[key] = cls(address, oid)
                    # what get() returned is acknowledged ahead of this process's other
                    # requests, so the owner's empty() and qsize() count it as taken
                    get_hub().before_send(_acks_ahead)
        return win

    @classmethod
    def find(cls, address: str, oid: str) -> Optional["Window"]:
        return cls._registry.get((address, oid))

    @classmethod
    def _forget_in_child(cls) -> None:
        """A forked child starts with no window (its parent's streams are not its own)."""
        cls._registry, cls.unreported, cls._hooked = {}, set(), False
        cls.epoch += 1
        cls._registry_lock = threading.Lock()

    @classmethod
    def sync_to(cls, address: str) -> None:
        """Acknowledge to the process at ``address`` what get() returned of its queues,
        ahead of another message to it (so the owner's counts follow what it is told)."""
        for win in list(cls.unreported):
            if win.address == address:
                win.sync()

    @classmethod
    def close_all(cls) -> None:
        """At exit: tell each owner what get() returned; the rest goes back."""
        for win in list(cls._registry.values()):
            win.close()

    # -- talking to the owner (cond held) ---------------------------------------------
    def _open(self, hub: Hub) -> None:
        token = object()
        self.stream, self.returned, self.reported, self.error = token, 0, 0, None
        self.items.clear()
        self.stale = 0
        self.client = hub.client(self.address)
        self.conn = self.client.channel
        rid = self.client.stream(
            self.oid, "window", (self.size,), lambda ok, value: self._on_reply(token, ok, value))
        if self.stream is token:
            self.rid = rid

    def _send(self, method: str, *args: Any) -> None:
        """A one-way message to the owner on the stream's connection (cond held).

        Sent from this thread when nothing waits to go (else by the connection's
        feeder, behind what waits): an acknowledgement that ``_pop`` sends leaves
        before ``get()`` returns, so the item is not delivered again when this
        process dies right after."""
        try:
            self.client.send(self.oid, method, args, inline=True)
        except Exception as exc:
            self._lost(exc)

    def _want(self, hub: Hub, waiting: int) -> None:
        self.reported = self.returned
        Window.unreported.discard(self)
        if self.stream is None:
            return
        if waiting != ASKING:
            self._send("want", self.returned, self.size, waiting)
            return
        handle = self.client.call(self.oid, "want", (self.returned, self.size, ASKING))
        self.cond.release()
        try:
            hub.wait(handle, self.address, None)
        except Exception as exc:
            self.cond.acquire()
            self._lost(exc)
        else:
            self.cond.acquire()

    def _lost(self, exc: BaseException, closed_by_owner: bool = False) -> None:
        """The stream ended (cond held). What the window holds stays for ``get()`` only
        when the owner ended it itself (``closed_by_owner``: it closed the queue, and
        put nothing back). Otherwise the owner takes those items back: when it sees the
        connection drop, or when this process opens a new window on it; serving them
        too would return them twice, so they are dropped here."""
        if self.rid and self.client is not None:
            self.client.end_stream(self.rid)
        self.stream, self.rid = None, 0
        if self.items and not closed_by_owner:
            log.debug("window on %s at %s: dropped %d item(s) pushed ahead; the owner "
                      "puts them back (%s)", self.oid, self.address, len(self.items), exc)
            self.items.clear()
        self.error = exc
        self.cond.notify_all()

    def _servable(self) -> bool:
        """Whether get() may return what the window holds (cond held, items held): not
        once the stream's connection was closed on this side (a frame it could not
        decode, a test's fault seam cut it: in any thread), though the reader thread
        may not have handled that yet. The owner puts those items back when it sees the drop,
        so they are dropped here, as :meth:`_lost` does: only what get() returned
        before the close can come twice."""
        if self.stream is None or not self.conn.closed:
            return True
        self.client.lost_now()   # (fails the stream here, unless another thread does now)
        if self.stream is not None:
            log.debug("window on %s at %s: dropped %d item(s) pushed ahead; its connection "
                      "closed", self.oid, self.address, len(self.items))
            self.items.clear()
        return False

    def _on_reply(self, token: object, ok: bool, value: Any) -> None:
        with self.cond:
            if token is not self.stream:
                return  # a stream closed meanwhile
            if not ok:   # over a live connection: the owner closed the queue
                self._lost(value, closed_by_owner=not self.client.lost)
            elif type(value) is not str:   # an item, or items pushed in a row
                if not self.stale:
                    kind = type(value)
                    batch = (value.items() if kind is Run else value if kind is list
                             else (value,))
                    self.items.extend(batch)
                    self.cond.notify(len(batch))
            elif value == "resume":   # what comes from here on is this process's again
                self.stale = max(0, self.stale - 1)
            else:   # "recall": others wait for what this one holds
                self.size = max(1, self.size // 2)  # it did not drain: shrink
                # a get() that waits stays in line, with a window of one
                if self.waiters:
                    self._give_back(1, WAITING)
                else:
                    self._give_back(0, IDLE)

    def _flush_acks(self) -> None:
        with self.cond:
            self.timer = None
            self.sync()

    def sync(self) -> None:
        """Acknowledge what get() returned, ahead of another request to the owner."""
        with self.cond:   # (reentrant: _flush_acks holds it)
            if self.stream is not None and self.returned != self.reported:
                self._want(get_hub(), WAITING if self.waiters and not self.items else IDLE)

    def close(self) -> None:
        """Give back what get() has not returned (this process closes its handle, or exits)."""
        with self.cond:
            if self.stream is None:
                return
            self.size = 1
            self._give_back(0, IDLE)

    def _give_back(self, size: int, waiting: int) -> None:
        """Drop what get() has not returned; the owner puts it back (cond held)."""
        self.items.clear()
        self.stale += 1
        self.reported = self.returned
        Window.unreported.discard(self)
        self._send("returned", self.returned, size, waiting)

    # -- get -----------------------------------------------------------------------------
    def _pop(self) -> Any:
        payload = self.items.popleft()
        self.returned += 1
        Window.unreported.add(self)
        if self.returned - self.reported >= max(1, self.size // 4):
            self._want(get_hub(), IDLE)  # a quarter of the window was returned: room for more
        elif self.timer is None:
            hub = get_hub()
            self.timer = hub.timers.call_at(time.monotonic() + ACK_DELAY, self._flush_acks)
        return payload

    def get(self, timeout: Optional[float]) -> Any:
        """Return the next item pushed here; ``queue.Empty`` after ``timeout`` seconds."""
        with self.lock:
            if self.items and (self.stream is None or not self.conn.closed):
                return self._pop()   # (the usual case; the rest as in _servable)
            if self.items:
                self._servable()
            hub = get_hub()
            if self.error is not None and self.stream is None:
                self.error = None  # a new stream: the owner may be back (a reconnect)
            if self.stream is None:
                self._open(hub)
            elif self.size < WINDOW_ITEMS:
                self.size *= 2  # it ran dry: ask for more ahead
            if timeout is not None and timeout <= 0:
                self._want(hub, ASKING)  # the owner pushes an item stored, then answers
                if self.items and self._servable():
                    payload = self._pop()
                    if self.returned != self.reported:
                        self._want(hub, IDLE)  # a request went to the owner anyway: ack now
                    return payload
                self._raise_error()
                raise queue.Empty
            self._want(hub, WAITING)
            deadline = None if timeout is None else time.monotonic() + timeout
            self.waiters += 1
            try:
                while not (self.items and self._servable()):
                    self._raise_error()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        if self.waiters == 1:
                            self._want(hub, IDLE)  # stopped waiting: what comes stays here
                        raise queue.Empty
                    step = hub.heartbeat_interval if left is None else min(
                        left, hub.heartbeat_interval)
                    if not self.cond.wait(step) and not self.items and (
                            left is None or left > step):
                        self.cond.release()
                        try:  # a vanished owner closes no socket: ping it
                            hub.ensure_alive(self.address, hub.parent_timeout)
                        finally:
                            self.cond.acquire()
            finally:
                self.waiters -= 1
            return self._pop()

    def _raise_error(self) -> None:
        if self.error is not None and not self.items:
            raise self.error


def _acks_ahead(address: str) -> None:
    if Window.unreported:
        Window.sync_to(address)

