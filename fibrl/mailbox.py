"""The hosted FIFO behind queues and pipe ends.

A :class:`Mailbox` lives in the hub of the process that created it and holds
serialized items (never unpickled here). ``get`` requests that cannot be
answered are parked in arrival order, so an item goes to whichever consumer
asked first and no consumer prefetches more than it asked for. Deadlines are
the mailbox's: when a parked ``get`` times out the mailbox answers ``Empty``
itself, so an item is never handed to a getter that stopped waiting.

An item handed to another process stays *unacknowledged* until that process
confirms it received it (:func:`take` sends the acknowledgement right after the
reply arrives). When the process's connection drops first (it died, or the
answer could not be delivered), its unacknowledged items go back to the front
of the queue, in order. So no item is ever lost, and an item is returned by
more than one ``get()`` only when the process whose ``get()`` returned it died
between receiving it and its acknowledgement reaching this owner.

    consumer                       owner (Mailbox)
    take(): get(timeout) -------->  op_get: item -> reply; unacked[peer][rid] = item
            <------- item --------
            ack(rid) ------------>  op_ack: forget it
                                    drop_peer: unacked items -> front of the queue

Besides the queue operations it counts the open *writer* handles of a pipe
end (per peer, so a dead process's handles close with it) to raise
``EOFError`` like a closed pipe.
"""
from __future__ import annotations

import queue
import time
from collections import deque
from typing import Any, Optional

from .hub import ReplySink, SharedService

__all__ = ["Mailbox", "PipeBox", "EMPTY", "take"]

EMPTY = object()


class _Parked:
    __slots__ = ("reply", "payload", "timer", "token")

    def __init__(self, reply: ReplySink, payload: Any = None, token: Any = None) -> None:
        self.reply = reply
        self.payload = payload
        self.timer = None
        self.token = token


class Mailbox(SharedService):
    """A FIFO of serialized items with parked getters, putters, joiners and pollers."""

    def __init__(self, maxsize: int = 0, joinable: bool = False, pipe_end: bool = False) -> None:
        import threading

        self.maxsize = maxsize if maxsize > 0 else 0
        self._items: deque = deque()
        self._getters: deque[_Parked] = deque()
        self._putters: deque[_Parked] = deque()
        self._pollers: list[_Parked] = []
        self._joiners: list[ReplySink] = []
        self._unfinished = 0 if joinable else None
        self._lock = threading.RLock()
        self._writers: Optional[dict] = {} if pipe_end else None  # peer key -> count
        self._eof = False
        self._unacked: dict[int, dict[int, Any]] = {}  # peer id -> {rid: item}, in order

    # -- helpers ---------------------------------------------------------------
    def _park(self, where, parked: _Parked, timeout: Optional[float], on_timeout) -> None:
        where.append(parked)
        if timeout is not None:
            parked.timer = self.hub.timers.call_at(
                time.monotonic() + max(timeout, 0.0), lambda: self._expire(where, parked,
                                                                            on_timeout))

    def _expire(self, where, parked: _Parked, on_timeout) -> None:
        with self._lock:
            try:
                where.remove(parked)
            except ValueError:
                return  # answered meanwhile
        on_timeout(parked.reply)

    def _unpark(self, parked: _Parked) -> None:
        if parked.timer is not None:
            self.hub.timers.cancel(parked.timer)

    def _full(self) -> bool:
        return self.maxsize > 0 and len(self._items) >= self.maxsize

    def _hand(self, reply: ReplySink, payload: Any) -> bool:
        """Answer a getter with ``payload``; a remote one holds it unacknowledged (lock held)."""
        if not reply(payload):
            return False
        if reply.peer is not None and reply.wanted:
            self._unacked.setdefault(reply.peer.id, {})[reply.rid] = payload
        return True

    def _deliver(self, payload: Any) -> None:
        """Give ``payload`` to the oldest live getter, or store it (lock held)."""
        while self._getters:
            parked = self._getters.popleft()
            self._unpark(parked)
            if self._hand(parked.reply, payload):
                return
        self._items.append(payload)
        self._wake_pollers(True)

    def _requeue(self, payloads: list) -> None:
        """Put items a dead consumer never acknowledged back in front, in order (lock held)."""
        rest = deque()
        for payload in payloads:
            while self._getters and not rest:
                parked = self._getters.popleft()
                self._unpark(parked)
                if self._hand(parked.reply, payload):
                    break
            else:
                rest.append(payload)
        if rest:
            self._items.extendleft(reversed(rest))
            self._wake_pollers(True)

    def _wake_pollers(self, value: bool) -> None:
        pollers, self._pollers = self._pollers, []
        for parked in pollers:
            self._unpark(parked)
            parked.reply(value)

    def _admit_putters(self) -> None:
        while self._putters and not self._full():
            parked = self._putters.popleft()
            self._unpark(parked)
            self._accept(parked.payload)
            parked.reply(None)

    def _accept(self, payload: Any) -> None:
        if self._unfinished is not None:
            self._unfinished += 1
        self._deliver(payload)

    # -- fast paths for the owner process (no handle, no event) ------------------------
    def take_nowait(self) -> Any:
        """Pop an item if one is there, else return :data:`EMPTY` (owner process only)."""
        with self._lock:
            if not self._items:
                return EMPTY
            payload = self._items.popleft()
            if self._putters:
                self._admit_putters()
            return payload

    # -- queue operations ----------------------------------------------------------
    def op_put(self, reply: ReplySink, payload: Any, timeout: Optional[float] = None) -> None:
        with self._lock:
            if not self._full():
                self._accept(payload)
                reply(None)
            elif timeout is not None and timeout <= 0:
                raise queue.Full
            else:
                self._park(self._putters, _Parked(reply, payload), timeout,
                           lambda r: r.fail(queue.Full()))

    def op_get(self, reply: ReplySink, timeout: Optional[float] = None) -> None:
        with self._lock:
            if self._items:
                payload = self._items.popleft()
                if not self._hand(reply, payload):
                    self._items.appendleft(payload)
                    return
                self._admit_putters()
            elif self._eof:
                raise EOFError("the other end of the pipe was closed")
            elif timeout is not None and timeout <= 0:
                raise queue.Empty
            else:
                self._park(self._getters, _Parked(reply), timeout,
                           lambda r: r.fail(queue.Empty()))

    def op_ack(self, reply: ReplySink, rid: int) -> None:
        """The calling process received the item it asked for with call ``rid``."""
        with self._lock:
            held = self._unacked.get(reply.peer.id) if reply.peer is not None else None
            if held is not None:
                held.pop(rid, None)
                if not held:
                    del self._unacked[reply.peer.id]
        reply(None)

    def op_poll(self, reply: ReplySink, timeout: Optional[float] = 0.0, token: Any = None) -> None:
        with self._lock:
            if self._items or self._eof:
                reply(True)
            elif timeout is not None and timeout <= 0:
                reply(False)
            else:
                self._park(self._pollers, _Parked(reply, token=token), timeout,
                           lambda r: r(False))

    def op_unpoll(self, reply: ReplySink, token: Any) -> None:
        with self._lock:
            keep = [p for p in self._pollers if p.token != token or p.reply.peer != reply.peer]
            dropped = [p for p in self._pollers if p not in keep]
            self._pollers = keep
        for parked in dropped:
            self._unpark(parked)
            parked.reply(False)
        reply(None)

    def op_qsize(self, reply: ReplySink) -> None:
        reply(len(self._items))

    def op_empty(self, reply: ReplySink) -> None:
        reply(not self._items)

    def op_full(self, reply: ReplySink) -> None:
        reply(self._full())

    def op_task_done(self, reply: ReplySink) -> None:
        with self._lock:
            if not self._unfinished:
                raise ValueError("task_done() called too many times")
            self._unfinished -= 1
            if self._unfinished == 0:
                joiners, self._joiners = self._joiners, []
                for joiner in joiners:
                    joiner(None)
        reply(None)

    def op_join(self, reply: ReplySink) -> None:
        with self._lock:
            if not self._unfinished:
                reply(None)
            else:
                self._joiners.append(reply)

    # -- pipe end bookkeeping ------------------------------------------------------
    def op_attach(self, reply: ReplySink, key: Any = None) -> None:
        """Count one more open writer handle, owned by ``key`` or the calling peer."""
        with self._lock:
            owner = _owner(reply, key)
            self._writers[owner] = self._writers.get(owner, 0) + 1
        reply(None)

    def op_adopt(self, reply: ReplySink) -> None:
        """Move one in-flight handle (pickled, now unpickled) to the calling peer."""
        with self._lock:
            self._take("inflight")
            owner = _owner(reply, None)
            self._writers[owner] = self._writers.get(owner, 0) + 1
        reply(None)

    def op_detach(self, reply: ReplySink) -> None:
        with self._lock:
            self._take(_owner(reply, None))
            self._check_eof()
        reply(None)

    def _take(self, owner: Any) -> None:
        count = self._writers.get(owner, 0)
        if count <= 1:
            self._writers.pop(owner, None)
        else:
            self._writers[owner] = count - 1

    def _check_eof(self) -> None:
        if self._writers or self._eof:
            return
        self._eof = True
        getters, self._getters = self._getters, deque()
        for parked in getters:
            self._unpark(parked)
            parked.reply.fail(EOFError("the other end of the pipe was closed"))
        self._wake_pollers(True)

    # -- lifecycle -------------------------------------------------------------------
    def drop_peer(self, peer) -> None:
        with self._lock:
            held = self._unacked.pop(peer.id, None)
            for where in (self._getters, self._putters, self._pollers):
                for parked in [p for p in where if p.reply.peer is peer]:
                    where.remove(parked)
                    self._unpark(parked)
            self._joiners = [j for j in self._joiners if j.peer is not peer]
            if held:
                self._requeue(list(held.values()))
            if self._writers is not None and self._writers.pop(("peer", peer.id), None):
                self._check_eof()

    def closed(self) -> None:
        from .errors import object_gone

        err = object_gone(self.oid, "its process", "closed")
        with self._lock:
            parked = list(self._getters) + list(self._putters) + self._pollers
            self._getters.clear(), self._putters.clear(), self._pollers.clear()
        for p in parked:
            self._unpark(p)
            p.reply.fail(err)


def take(hub: Any, address: str, oid: str, timeout: Optional[float]) -> Any:
    """``get`` from the mailbox ``oid`` at ``address`` and acknowledge what arrived.

    The acknowledgement is a one-way message sent before this returns, so the
    owner re-queues the item only if this process dies in between.
    """
    handle = hub.call_async(address, oid, "get", timeout)
    payload = hub.wait(handle, address, None)
    if handle.rid:
        hub.send(address, oid, "ack", handle.rid, inline=True)
    return payload


def _owner(reply: ReplySink, key: Any) -> Any:
    if key is not None and key != "peer":
        return key
    return ("peer", reply.peer.id) if reply.peer is not None else "local"


class PipeBox(Mailbox):
    """One direction of a pipe: a mailbox that pushes to the process reading it.

    The first ``recv``/``poll`` of a reader in another process *subscribes*:
    from then on every message is pushed to that process as it arrives (one
    frame per ``send``, no request per ``recv``), after whatever was stored.
    A reader elsewhere that asks (a ``get``, ``poll`` or its own subscription)
    *revokes* the subscriber, which gives back what it holds unread; until it
    has, nothing is handed out, so messages keep their order. Messages pushed
    to a reader that dies before reading them die with it, as data in a dead
    reader's OS pipe does.

    It also counts open *reader* handles (like writers): once none is left,
    ``watch`` answers its writers and their ``send`` raises ``BrokenPipeError``.

    ::

        writer  --put-->  PipeBox  --Reply(rid of subscribe)-->  reader's inbox
                          revoke  --------------------------->   giveback(items)
    """

    def __init__(self) -> None:
        super().__init__(pipe_end=True)
        self._sub: Optional[ReplySink] = None     # the subscribed reader's stream
        self._revoking: set = set()               # peer ids whose giveback is due
        self._readers: dict = {}
        self._broken = False
        self._watchers: list[ReplySink] = []

    # -- pushing ----------------------------------------------------------------------
    def _deliver(self, payload: Any) -> None:
        if self._revoking:
            self._items.append(payload)  # after what the revoked reader gives back
        elif not self._getters and self._sub is not None:
            if not self._sub(payload):
                self._sub = None  # its connection dropped: keep it for another reader
                super()._deliver(payload)
        else:
            super()._deliver(payload)

    def _flush(self) -> None:
        """Hand stored messages out, in order, once no giveback is due (lock held)."""
        if self._revoking:
            return
        while self._items and self._getters:
            parked = self._getters.popleft()
            self._unpark(parked)
            payload = self._items.popleft()
            if not self._hand(parked.reply, payload):
                self._items.appendleft(payload)
        while self._items and self._sub is not None:
            if not self._sub(self._items[0]):
                self._sub = None
                break
            self._items.popleft()
        if self._items:
            self._wake_pollers(True)
        if self._eof:
            self._finish_eof()

    def _finish_eof(self) -> None:
        if self._sub is not None:
            self._sub("eof")
        if not self._items:
            self._check_eof_now()

    def _revoke_other(self, reply: ReplySink) -> None:
        """A reader other than the subscriber asks: take the subscription back."""
        sub = self._sub
        if sub is not None and (reply.peer is None or sub.peer is not reply.peer):
            self._sub = None
            if sub("revoke"):
                self._revoking.add(sub.peer.id)

    def op_subscribe(self, reply: ReplySink) -> None:
        if reply.peer is None:
            raise RuntimeError("the process that owns a pipe reads it without subscribing")
        with self._lock:
            self._revoke_other(reply)
            self._sub = reply
            self._flush()
            reply("ready")

    def op_giveback(self, reply: ReplySink, items: list) -> None:
        """A revoked or closing subscriber returns the messages it did not read."""
        with self._lock:
            if reply.peer is not None:
                self._revoking.discard(reply.peer.id)
                if self._sub is not None and self._sub.peer is reply.peer:
                    self._sub = None
            self._items.extendleft(reversed(items))
            self._flush()
        reply(None)

    def op_get(self, reply: ReplySink, timeout: Optional[float] = None) -> None:
        with self._lock:
            self._revoke_other(reply)
            if self._revoking:
                self._park(self._getters, _Parked(reply), timeout,
                           lambda r: r.fail(queue.Empty()))
            else:
                super().op_get(reply, timeout)

    def op_poll(self, reply: ReplySink, timeout: Optional[float] = 0.0, token: Any = None) -> None:
        with self._lock:
            self._revoke_other(reply)
            if self._revoking and (timeout is None or timeout > 0):
                self._park(self._pollers, _Parked(reply, token=token), timeout,
                           lambda r: r(False))
            else:
                super().op_poll(reply, 0.0 if self._revoking else timeout, token)

    def op_put(self, reply: ReplySink, payload: Any, timeout: Optional[float] = None) -> None:
        if self._broken:
            # no reader is left: the sender raises BrokenPipeError once its watch is
            # answered; what it sent meanwhile goes nowhere, as into a widowed OS pipe
            reply(None)
            return
        super().op_put(reply, payload, timeout)

    def _check_eof(self) -> None:
        if self._writers or self._eof:
            return
        self._eof = True
        if not self._revoking:
            self._finish_eof()

    def _check_eof_now(self) -> None:
        """Fail parked getters with EOFError, wake pollers (nothing is left to read)."""
        getters, self._getters = self._getters, deque()
        for parked in getters:
            self._unpark(parked)
            parked.reply.fail(EOFError("the other end of the pipe was closed"))
        self._wake_pollers(True)

    # -- readers, and the writers' watch --------------------------------------------------
    def op_attach_reader(self, reply: ReplySink, key: Any = None) -> None:
        with self._lock:
            owner = _owner(reply, key)
            self._readers[owner] = self._readers.get(owner, 0) + 1
        reply(None)

    def op_adopt_reader(self, reply: ReplySink) -> None:
        with self._lock:
            _take_one(self._readers, "inflight")
            owner = _owner(reply, None)
            self._readers[owner] = self._readers.get(owner, 0) + 1
        reply(None)

    def op_detach_reader(self, reply: ReplySink) -> None:
        with self._lock:
            _take_one(self._readers, _owner(reply, None))
            self._check_broken()
        reply(None)

    def op_watch(self, reply: ReplySink) -> None:
        """Answer True once no reader handle is left (the pipe is broken)."""
        with self._lock:
            if self._broken:
                reply(True)
            else:
                self._watchers.append(reply)

    def _check_broken(self) -> None:
        if self._readers or self._broken:
            return
        self._broken = True
        self._items.clear()
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            watcher(True)

    def drop_peer(self, peer) -> None:
        with self._lock:
            self._revoking.discard(peer.id)  # what it held died with it
            if self._sub is not None and self._sub.peer is peer:
                self._sub = None
            self._watchers = [w for w in self._watchers if w.peer is not peer]
            if self._readers.pop(("peer", peer.id), None):
                self._check_broken()
            super().drop_peer(peer)
            self._flush()

    def closed(self) -> None:
        with self._lock:
            watchers, self._watchers = self._watchers, []
            sub, self._sub = self._sub, None
        for watcher in watchers:
            watcher(False)  # retired, not broken: a later send reports the owner's answer
        if sub is not None:
            from .errors import object_gone

            sub.fail(object_gone(self.oid, "its process", "closed"))
        super().closed()


def _take_one(counts: dict, owner: Any) -> None:
    count = counts.get(owner, 0)
    if count <= 1:
        counts.pop(owner, None)
    else:
        counts[owner] = count - 1
