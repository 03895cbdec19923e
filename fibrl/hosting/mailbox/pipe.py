"""One direction of a pipe: :class:`PipeBox`, a mailbox that pushes to the process
reading it and counts the open writer handles of its end (per peer, so a dead
process's handles close with it) to raise ``EOFError`` like a closed pipe.
"""
from __future__ import annotations

import logging
import queue
from threading import get_ident
from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Callable, Optional

from ...wire.messages import one_way_head
from ...wire.serialization import Encoded
from ..hub import Handle, LocalReply, ReplySink
from .consumer import take
from .owner import Mailbox, _owner, _Parked

if TYPE_CHECKING:
    from ...wire.transport import Frame, Peer

__all__ = ["PipeBox"]

log = logging.getLogger(__name__)


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

    _ordered = False  # one reader at a time: a giveback goes in front as it is
    # (peer, take_here's frame handler for it)
    _reader_of: Optional[tuple[Peer, Callable[[Frame], None]]] = None

    def __init__(self) -> None:
        super().__init__(pipe_end=True)
        self._sub: Optional[ReplySink] = None     # the subscribed reader's stream
        self._revoking: set[int] = set()          # peer ids whose giveback is due
        self._readers: dict[Hashable, int] = {}   # owner -> open reader handles
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
                peer = sub.peer
                assert peer is not None   # (only another process subscribes)
                self._revoking.add(peer.id)

    def op_subscribe(self, reply: ReplySink) -> None:
        if reply.peer is None:
            raise RuntimeError("the process that owns a pipe reads it without subscribing")
        with self._lock:
            self._revoke_other(reply)
            self._sub = reply
            self._flush()
            reply("ready")

    def op_release(self, reply: ReplySink) -> None:
        """The subscribed reader closes its end: take the subscription back as another
        reader's request would (``revoke``, sent after every message pushed to it), so
        that it gives back all it holds, the messages still on their way included;
        nothing is handed out meanwhile."""
        with self._lock:
            sub = self._sub
            if sub is not None and reply.peer is not None and sub.peer is reply.peer:
                self._sub = None
                if sub("revoke"):
                    self._revoking.add(reply.peer.id)
        reply(None)

    def op_giveback(self, reply: ReplySink, items: list[Any]) -> None:
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

    def give(self, payload: Any) -> None:
        if not self._broken:   # (see _put)
            super().give(payload)

    def take_here(self) -> Any:
        """``recv()`` in the owner process: what is stored, else wait for the next
        message while reading the connection of the process that sent last (it likely
        sends the next one too); no call and no dispatch. A reader elsewhere that holds
        the subscription, or a giveback that is due, takes the general way."""
        with self._lock:
            if self._sub is not None or self._revoking or self._eof and not self._items:
                handle = None
            elif self._items:
                return self._popleft()[0]
            else:
                handle, feeder = Handle(), self.feeder
                if feeder is None:
                    self._getters.append(_Parked(LocalReply(handle)))
                else:
                    self._getters.append(_Parked(_Woken(handle, feeder, get_ident())))
        if handle is None:
            return take(self.hub, None, self.oid, None)
        if feeder is not None:   # (the answer wakes this reader: see _Woken)
            self.hub.wait_reading(handle, feeder, self._reading(feeder), woken=True)
        return handle.get()

    def _reading(self, peer: Peer) -> Callable[[Frame], None]:
        """How :meth:`take_here` handles a frame it reads from ``peer``: a ``send`` of
        the writer in that process (a one-way ``put`` to this box, alone in its frame)
        is stored as ``op_put`` would store it, without unpacking the frame and
        dispatching the call (half the owner's Python per message received, 6.4 -> 3.3
        us warm); any other frame, or a put that ``op_put`` would not simply store (no
        reader left, a tally asked for), goes through the hub's dispatch. An error in
        storing it is logged, as the dispatch of a one-way call logs it."""
        made = self._reader_of
        if made is not None and made[0] is peer:
            return made[1]   # (the same writer as last time: made once for it)
        head = one_way_head(self.oid, "put")
        size = len(head)
        dispatch = self.hub.dispatch_frame

        def on_frame(frame: Frame) -> None:
            if type(frame) is bytes and frame.startswith(head):
                try:
                    with self._lock:
                        plain = not self._broken and not self._tallies
                        if plain:
                            self.feeder = peer
                            getters = self._getters
                            if (getters and not self._revoking and getters[0].timer is None
                                    and getters[0].reply.peer is None):
                                # a recv() of this process waits first in line: what
                                # _accept would do, without its four calls
                                getters.popleft().reply(Encoded(frame[size:]))
                            else:
                                self._accept(Encoded(frame[size:]))
                except Exception:
                    log.exception("a message to %s could not be stored", self.oid)
                    return
                if plain:
                    if self._outgoing:   # (as Mailbox.dispatch, after any operation)
                        self._kick()
                    return
            dispatch(peer, frame)

        self._reader_of = (peer, on_frame)
        return on_frame

    def _put(self, reply: ReplySink, payload: Any, timeout: Optional[float]) -> None:
        if self._broken:
            # no reader is left: the sender raises BrokenPipeError once its watch is
            # answered; what it sent meanwhile goes nowhere, as into a widowed OS pipe
            reply(None)
            return
        super()._put(reply, payload, timeout)

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
        self._redo.clear()
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            watcher(True)

    def drop_peer(self, peer: Peer) -> None:
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
        self.retired = True   # (first: a Connection that kept this box finds it retired)
        with self._lock:
            watchers, self._watchers = self._watchers, []
            sub, self._sub = self._sub, None
        for watcher in watchers:
            watcher(False)  # retired, not broken: a later send reports the owner's answer
        if sub is not None:
            from ...errors import object_gone

            sub.fail(object_gone(self.oid, "its process", "closed"))
        super().closed()


class _Woken(LocalReply):
    """The answer to :meth:`PipeBox.take_here`'s get, which also ends the wait of the
    thread reading ``peer``'s frames meanwhile (``reader``) when another thread
    answers it."""

    __slots__ = ("reader", "waker")

    def __init__(self, handle: Handle, peer: Peer, reader: int) -> None:
        super().__init__(handle)
        self.reader = reader
        self.waker = peer.wake

    def __call__(self, value: Any = None) -> bool:
        self.handle._resolve(True, value)
        self.waker(self.reader)   # (nothing to do when the reader itself answers)
        return True

    def fail(self, exc: BaseException) -> bool:
        super().fail(exc)
        self.waker(self.reader)
        return True


def _take_one(counts: dict[Hashable, int], owner: Hashable) -> None:
    count = counts.get(owner, 0)
    if count <= 1:
        counts.pop(owner, None)
    else:
        counts[owner] = count - 1

