"""Hosting objects for other processes, and calling objects they host.

Every fibrl process owns at most one :class:`Hub`. It hosts *services*
(queues, pipe ends, locks, a job's hand-over, a pool's dispatcher...) under an
object id, and reaches services hosted by other processes through one
:class:`Client` per remote hub. A service's methods never block the thread that
calls them: an operation that must wait (``get`` on an empty queue) *parks*
its reply and answers later, from whichever thread makes it possible, or from
the timer thread when its deadline passes. The service, not the caller, owns
every deadline, so an item is handed out exactly once.

Data flow::

    caller thread                  remote hub process
    hub.call(addr, oid, m, args)
      |  local oid? --> service.dispatch(m, args, LocalReply) --> Handle
      v
    Client ---- feeder thread batches one-way Calls ----> Listener peer thread
      ^         (a synchronous call is sent inline)         | unpack(frame)
      |                                                     v
    reader <------------ Reply(rid) ---------------- service.dispatch(m, args, _PeerReply)
      | resolves the Handle with that rid                   | parks or answers now
      v                                                     v
    Handle.get(timeout)                             Timers: deadlines of parked replies

The *reader* of a connection is whichever thread waits on it: a caller in
``hub.wait`` (or a pipe end's ``recv``) reads and handles the frames itself while
no other thread does, so its reply reaches it with no hand-over between threads;
the connection's reader thread reads only while nobody waits (it sleeps until
the socket is readable, which nng does not signal for a frame a waiting thread
takes). The owner of a pipe or queue reads the frames of the process that put
last the same way while it waits in ``recv`` or ``get`` (:meth:`Hub.wait_reading`;
a pipe's owner parks its getter on the pipe itself, with no call).

This module owns the dispatching and waiting. It does not own the meaning of
any service (``queues``, ``connection``, ``synchronize``, ``pool``,
``managers``) nor the wire (``transport``, ``serialization``, and ``messages``,
which packs calls and replies into frames), nor which hub is
this process's and when it closes (``runtime``: this module only builds the hub
the first time one is asked for).
"""
from __future__ import annotations

import functools
import itertools
import logging
from _thread import allocate_lock as _allocate_lock
from threading import TIMEOUT_MAX
import os
import struct
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional

from multiprocessing.process import current_process

from . import runtime
from ..wire import serialization
from ..config import Config
from ..errors import ChannelClosed, RemoteObjectError, TransportError, object_gone, owner_gone
from ..janitor import Finalizer
from ..wire.messages import (RAW_TYPES, Call, RemoteError, Reply, blob, inline_payload, pack,
                             payload_reply_head, unpack, wrap_args)
from ..wire.serialization import Encoded, FramePart
from ..timers import Timers

if TYPE_CHECKING:   # (imported when the hub is built: transport loads pynng)
    from ..wire.transport import Channel, Frame, FrameHandler, Listener, LossHandler, Peer

__all__ = ["Hub", "Handle", "Service", "SharedService", "Client", "HeldReplies", "FrameReplies",
           "get_hub", "drop_owner", "mark_pickled", "own", "QuietCondition"]

log = logging.getLogger(__name__)

_ids = itertools.count(1)


def new_oid(kind: str) -> str:
    """A process-unique object id such as ``queue-7``."""
    return f"{kind}-{next(_ids)}"


# Resolving and adding callbacks: brief, rare contention. Reentrant: a collection on this
# thread may run code that resolves another handle while this one is being resolved.
_callback_lock = threading.RLock()


def silence_left(channel: Any, limit: float) -> float:
    """Seconds until ``channel`` (a :class:`~fibrl.wire.transport.Channel`) will have
    received no bytes for ``limit`` seconds; 0 once it has, or where that is unknown.
    What a liveness limit counts from: an answer or a heartbeat waits behind the frames
    sent before it, and while a large one is still arriving, the peer is there."""
    silence = channel.silence()
    return 0.0 if silence is None else max(0.0, limit - silence)


class Handle:
    """The pending result of a call: ``get(timeout)``, ``ready()``, ``wait(timeout)``.

    Waiting uses one bare lock, held from creation until the result arrives (a
    ``threading.Event`` costs a condition, a lock per wait and a list of waiters:
    measurable on every call).

    Example:
        >>> h = Handle(); h._resolve(True, 3); h.get(1)
        3
    """

    __slots__ = ("_gate", "_done", "_ok", "_value", "_callbacks", "rid", "__weakref__")

    def __init__(self, rid: int = 0) -> None:
        self.rid = rid  # the call's id on its connection (0: a local call)
        self._gate = _allocate_lock()
        self._gate.acquire()  # released once, when the result arrives
        self._done = False
        self._ok = True
        self._value: Any = None
        self._callbacks: Optional[list[Callable[[Handle], None]]] = None

    def _resolve(self, ok: bool, value: Any) -> None:
        with _callback_lock:
            if self._done:
                return
            self._ok, self._value = ok, value
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
        self._gate.release()  # outside the lock: waking a waiter must not wait for it
        if callbacks:
            for cb in callbacks:
                cb(self)

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Run ``fn(handle)`` once, when the result arrives (at once if it has)."""
        with _callback_lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def ready(self) -> bool:
        return self._done

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._done:
            return True
        gate = self._gate
        # (a timeout past what a lock can wait for at once is no limit, not an error)
        if gate.acquire(True, -1 if timeout is None or timeout >= TIMEOUT_MAX
                        else max(0.0, timeout)):
            gate.release()  # let any other waiter through too
        return self._done

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._ok

    def get(self, timeout: Optional[float] = None) -> Any:
        """Return the result, raise the remote error, or raise ``TimeoutError``."""
        if not self._done and not self.wait(timeout):
            raise TimeoutError(f"no result within {timeout} s")
        if not self._ok:
            raise self._value  # a remote one has its traceback as __cause__ already
        return self._value


class QuietCondition(threading.Condition):
    """A condition whose ``notify_all`` costs nothing while no thread waits on it (a
    plain one checks that the caller holds its lock, a lock round trip, every time):
    for a hot path that notifies far more often than anyone waits."""

    def __init__(self, lock: Any = None) -> None:
        super().__init__(lock)
        self.sleepers = 0   # threads in wait() (changed with the lock held)

    def wait(self, timeout: Optional[float] = None) -> bool:
        self.sleepers += 1
        try:
            return super().wait(timeout)
        finally:
            self.sleepers -= 1

    def notify_all(self) -> None:
        if self.sleepers:
            super().notify_all()


class ReplySink:
    """Where a service sends the answer to one call (the caller's handle, or a peer)."""

    __slots__ = ("peer",)
    peer: Optional[Peer]   # the caller's connection; None: a caller in this process
    wanted = True
    lone = False   # a peer's call that came alone in its frame (see _PeerReply)
    rid = 0        # the call's id on the peer's connection (0: a local or one-way call)

    def __call__(self, value: Any = None) -> bool:
        """Answer with ``value``; False when the caller is gone (re-queue what you gave)."""
        raise NotImplementedError

    def fail(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def hold(self, timers: Timers, kind: Optional[type["HeldReplies"]] = None
             ) -> Optional["HeldReplies"]:
        """Let this reply wait to share a frame with the next ones to the same peer
        (see :class:`HeldReplies`; ``kind``: :class:`FrameReplies` for a burst its
        reader thread runs); returns the holder to flush, or None when this reply
        goes nowhere a frame could be shared (a local caller, a one-way call)."""
        return None


class LocalReply(ReplySink):
    """The answer to a call made in the service's own process: resolves its handle."""

    __slots__ = ("handle",)

    def __init__(self, handle: Handle) -> None:
        self.peer = None
        self.handle = handle

    def __call__(self, value: Any = None) -> bool:
        self.handle._resolve(True, value)
        return True

    def fail(self, exc: BaseException) -> bool:
        # what a remote caller would get: the service's frames as __cause__, not live ones
        self.handle._resolve(False, RemoteError.capture(exc).rebuilt() if exc.__traceback__
                             else exc)
        return True


# How long a reply may be held back to share a frame with the next ones (see HeldReplies).
HOLD_S = 0.001


class HeldReplies:
    """Replies to one peer gathered into one frame: a service that runs a burst of
    pipelined calls holds their replies while more of them wait, so a thousand quick
    calls cost a few frames instead of a thousand. Nothing is held longer than
    ``HOLD_S``: the hub's timer thread sends what is still held then, even while a
    slow call runs.
    """

    __slots__ = ("peer", "_timers", "_lock", "_replies", "_timer")

    def __init__(self, peer: Peer, timers: Timers) -> None:
        self.peer = peer
        self._timers = timers
        self._lock = threading.Lock()
        self._replies: list[Reply] = []
        self._timer: Optional[list[Any]] = None   # the timers' entry that sends what is held

    @classmethod
    def of(cls, peer: Peer, timers: Timers) -> "HeldReplies":
        """The one holder of ``peer`` (made on first use)."""
        held: Optional[HeldReplies] = peer.context.get(cls)
        if held is None:
            held = peer.context.setdefault(cls, cls(peer, timers))
        return held

    def add(self, reply: Reply) -> None:
        with self._lock:
            self._replies.append(reply)
            if self._timer is None:
                self._timer = self._timers.call_at(time.monotonic() + HOLD_S, self.flush)

    def flush(self) -> None:
        """Send what is held now, as one frame."""
        with self._lock:
            replies, self._replies = self._replies, []
            timer, self._timer = self._timer, None
        if timer is not None:
            self._timers.cancel(timer)
        if replies and not self.peer.closed:
            try:
                self.peer.send(_frame(replies))
            except ChannelClosed:
                pass  # the caller is gone: its calls fail on its side


class FrameReplies(HeldReplies):
    """Replies to the calls of one frame that the peer's reader thread runs one after
    the other (a burst on a connection of one caller): sent as one frame once the
    frame's calls are done (:meth:`Hub.dispatch_frame`). A call that outlasts ``HOLD_S``
    has the replies before it sent by a thread of their own: the timer thread never
    waits for a peer to read."""

    __slots__ = ()

    def add(self, reply: Reply) -> None:
        with self._lock:
            self._replies.append(reply)
            if self._timer is None:
                self._timer = self._timers.call_at(time.monotonic() + HOLD_S,
                                                   self._flush_apart)

    def _flush_apart(self) -> None:
        threading.Thread(target=self.flush, daemon=True, name="fibrl-held-replies").start()


def _frame(messages: list[Call] | list[Reply]) -> list[FramePart]:
    """One frame for a batch of messages (a lone one travels unwrapped)."""
    return pack(messages[0] if len(messages) == 1 else messages)


def _lone_reply_head(rid: int) -> bytes:
    """``payload_reply_head(rid)``; empty for a call id that a lone frame cannot carry."""
    try:
        return payload_reply_head(rid)
    except struct.error:
        return b""


class _PeerReply(ReplySink):
    __slots__ = ("rid", "holder", "lone", "head")
    peer: Peer

    def __init__(self, peer: Peer, rid: int, lone: bool) -> None:
        self.peer = peer
        self.rid = rid
        self.holder: Optional[HeldReplies] = None  # set: the reply waits there (see above)
        self.lone = lone   # its call came alone in its frame, not in a burst
        self.head: Optional[bytes] = None   # how its lone payload replies begin (made once)

    @property
    def wanted(self) -> bool:  # type: ignore[override]
        return self.rid != 0

    def hold(self, timers: Timers, kind: Optional[type[HeldReplies]] = None
             ) -> Optional[HeldReplies]:
        if self.rid == 0:
            return None
        self.holder = (kind or HeldReplies).of(self.peer, timers)
        return self.holder

    def _send(self, reply: Reply) -> bool:
        if self.rid == 0 or self.peer.closed:
            return self.rid == 0
        if self.holder is not None:
            if type(reply.value) is Encoded:
                reply.value.own()  # sent later: the service may change the objects it views
            self.holder.add(reply)
            return True
        return self._send_frame(pack(reply))

    def _send_frame(self, frame: Any) -> bool:
        if self.peer.closed:
            return False
        try:
            self.peer.send(frame)
            return True
        except ChannelClosed:
            return False

    def __call__(self, value: Any = None) -> bool:
        if self.rid == 0:
            return True
        kind = type(value)
        if kind is Encoded and self.holder is None:
            # the commonest on a stream (a pushed message or queue item): its lone frame,
            # built here without the Reply that pack() would make of it
            head = self.head
            if head is None:
                head = self.head = _lone_reply_head(self.rid)
            data = inline_payload(value) if head else None
            if data is not None:
                return self._send_frame(head + data)
        if kind is Encoded or kind in RAW_TYPES:
            return self._send(Reply(self.rid, True, blob(value)))
        if value is None or kind in _PLAIN:
            return self._send(Reply(self.rid, True, value))
        try:
            encoded = serialization.encode(value)
        except Exception as exc:
            return self.fail(exc)
        # sent before this returns: the value's own buffers may be borrowed
        return self._send(Reply(self.rid, True, encoded, encoded=True))

    def fail(self, exc: BaseException) -> bool:
        if self.rid == 0:
            log.error("one-way call failed: %r", exc, exc_info=exc)
            return True
        return self._send(Reply(self.rid, False, RemoteError.capture(exc)))


# (service class, method name) -> its op_ function, or None
_operations: dict[tuple[type, str], Optional[Callable[..., None]]] = {}


def _operation(cls: type, method: str) -> Optional[Callable[..., None]]:
    """The ``op_<method>`` function of the service class ``cls`` (found once per pair:
    a name built and looked up through the class's bases on every call is measurable)."""
    try:
        return _operations[cls, method]
    except KeyError:
        pass
    op: Optional[Callable[..., None]] = (getattr(cls, "op_" + method, None)
                                         if type(method) is str else None)
    if len(_operations) < 10_000:   # (method names come from peers: keep the cache bounded)
        _operations[cls, method] = op
    return op


class Service:
    """An object hosted by a hub. Subclasses define ``op_<name>(reply, *args)``.

    An ``op_`` method either answers at once (``reply(value)``), raises (the
    caller gets the exception), or keeps ``reply`` to answer later. It must not
    block. ``peer_lost`` lets a service drop what it parked for a dead peer.
    """

    oid: str = ""
    hub: "Hub"

    def dispatch(self, method: str, args: tuple[Any, ...], reply: ReplySink) -> None:
        op = _operation(type(self), method)
        if op is None:
            reply.fail(RemoteObjectError(
                f"{type(self).__name__} {self.oid!r} has no operation {method!r}"))
            return
        try:
            op(self, reply, *args)
        except BaseException as exc:  # the caller gets it, with its traceback
            reply.fail(exc)

    def peer_lost(self, peer: Peer) -> None:
        """A connected process went away; drop replies parked for it."""

    def closed(self) -> None:
        """The service was unregistered; fail whatever is still parked."""


class SharedService(Service):
    """A service that outlives its creator's handle while pickled copies are in use.

    It is unregistered when the handle in the creating process is collected
    (:func:`drop_owner`), unless the handle was pickled (``pickled``): then
    once every process that used it has disconnected too. A handle pickled but
    never used keeps the service until this process exits, as a file
    descriptor inherited by a child keeps an OS pipe open.
    """

    pickled = False
    _orphan = False
    _had_users = False
    _users: Optional[set[int]] = None   # ids of the peers that used it

    def dispatch(self, method: str, args: tuple[Any, ...], reply: ReplySink) -> None:
        peer = reply.peer
        if peer is not None:
            if self._users is None:
                self._users = set()
            if peer.id not in self._users:
                self._users.add(peer.id)
                self._had_users = True
        super().dispatch(method, args, reply)

    def peer_lost(self, peer: Peer) -> None:
        if self._users is not None:
            self._users.discard(peer.id)
        self.drop_peer(peer)
        self._maybe_retire()

    def drop_peer(self, peer: Peer) -> None:
        """Forget what ``peer`` parked or held."""

    def owner_dropped(self) -> None:
        """The creating process no longer holds a handle."""
        self._orphan = True
        self._maybe_retire()

    def _maybe_retire(self) -> None:
        if self._orphan and not self._users and (self._had_users or not self.pickled):
            hub = getattr(self, "hub", None)
            if hub is not None:
                hub.unregister(self.oid)


def drop_owner(hub_ref: "weakref.ref[Hub]", oid: str) -> None:
    """Finalizer of a creating handle: let its :class:`SharedService` retire when unused."""
    hub = hub_ref()
    service = hub.service(oid) if hub is not None else None
    if isinstance(service, SharedService):
        service.owner_dropped()


def mark_pickled(address: Optional[str], oid: str) -> None:
    """Called when a handle is pickled: its service must outlive the creating handle."""
    hub = get_hub()
    if hub.is_local(address):
        service = hub.service(oid)
        if isinstance(service, SharedService):
            service.pickled = True


def own(handle: Any, oid: str) -> None:
    """Tie the lifetime of the hosted ``oid`` to the creating ``handle`` (see SharedService)."""
    # not at exit: the hub closes every service itself then
    Finalizer(handle, drop_owner, weakref.ref(get_hub()), oid)


class Client:
    """A connection to another process's hub, shared by all threads of this process."""

    def __init__(self, hub: "Hub", address: str, timeout: float) -> None:
        self.address = address
        self._hub = hub
        self._channel = hub.settings.connect(address, hub.secret, timeout)
        try:
            self._channel.watch()
        except TransportError:
            self._channel.close()
            raise
        self._pending: dict[int, Handle] = {}
        self._streams: dict[int, Callable[[bool, Any], None]] = {}
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._outbox: deque[Call] = deque()
        self._sending = False
        self._idle = QuietCondition(self._lock)
        self._feeder: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self.lost = False
        # one-way calls sent, and how many of them the other hub confirmed it processed
        # (:meth:`Hub.flush`): an exit waits only for connections with unconfirmed ones
        self.one_way_sent = 0
        self.one_way_confirmed = 0
        self._lost_callbacks: list[Callable[[], None]] = []
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"fibrl-client-{address}")
        self._reader.start()
        self._channel.on_lost(self._on_lost)

    # -- sending -------------------------------------------------------------
    def call(self, oid: str, method: str, args: tuple[Any, ...], inline: bool = True) -> Handle:
        """Send a call whose reply resolves the returned :class:`Handle`.

        ``inline=False`` queues it for the feeder thread like a one-way call,
        so a caller with other work to do does not wait for the send.
        """
        with self._lock:
            if self.lost:
                handle = Handle()
                handle._resolve(False, self._lost_error())
                return handle
            rid = next(self._rids)
            self._pending[rid] = handle = Handle(rid)
        self._submit(Call(rid, oid, method, wrap_args(args)), inline=inline)
        return handle

    def stream(self, oid: str, method: str, args: tuple[Any, ...],
               on_reply: Callable[[bool, Any], None]) -> int:
        """Send a call whose service answers many times: each reply runs
        ``on_reply(ok, value)`` on the reader thread (keep it short) until
        :meth:`end_stream`; a lost connection runs it once with ``ok`` False.

        This is how a pipe's owner pushes messages to the process that reads
        them: one frame per message, on the connection already open.
        """
        with self._lock:
            lost = self.lost
            if not lost:
                rid = next(self._rids)
                self._streams[rid] = on_reply
        if lost:
            on_reply(False, self._lost_error())
            return 0
        self._submit(Call(rid, oid, method, wrap_args(args)), inline=True)
        return rid

    def end_stream(self, rid: int) -> None:
        """Stop delivering the replies of stream ``rid`` (late ones are dropped)."""
        with self._lock:
            self._streams.pop(rid, None)

    def send(self, oid: str, method: str, args: tuple[Any, ...], inline: bool = False) -> None:
        """Send a one-way call (no reply).

        By default it is queued for the feeder thread, which batches calls
        (throughput); ``inline`` sends it from this thread when nothing is
        queued (latency).
        """
        if self.lost:
            raise self._lost_error()
        self._submit(Call(0, oid, method, wrap_args(args)), inline=inline)

    def send_lone(self, head: bytes, payload: Encoded) -> bool:
        """Send the one-way call whose lone frame begins with ``head`` (see
        :func:`~fibrl.wire.messages.one_way_head`) and carries ``payload``, from this
        thread, as ``send(..., inline=True)`` would: the same frame, without building
        the message. False when it must take :meth:`send` (something is queued or being
        sent, the payload travels out of band, the connection is lost)."""
        data = inline_payload(payload)
        if data is None:
            return False
        with self._lock:
            if self._outbox or self._sending or self.lost:
                return False
            self._sending = True
            self.one_way_sent += 1
        try:
            self._transmit_frame(head + data)
        finally:
            self._done_sending()
        return True

    def _submit(self, call: Call, inline: bool) -> None:
        borrowed = False
        if inline:
            for arg in call.args:
                if type(arg) is Encoded and arg.borrowed:
                    borrowed = True
                    break
        with self._lock:
            if not call.rid:
                self.one_way_sent += 1
            while borrowed and (self._outbox or self._sending) and not self.lost:
                # a large payload that views the caller's objects: send it from this
                # thread once earlier calls are out, rather than copy it for the feeder
                self._idle.wait()
            if inline and not self._outbox and not self._sending:
                self._sending = True
            else:
                for arg in call.args:
                    if type(arg) is Encoded:
                        arg.own()  # sent later: the caller may change the original meanwhile
                self._outbox.append(call)
                self._start_feeder()
                return
        try:
            self._transmit([call])
        finally:
            self._done_sending()

    def _done_sending(self) -> None:
        with self._lock:
            self._sending = False
            if self._outbox:
                self._wake.set()
            else:
                self._idle.notify_all()

    def _start_feeder(self) -> None:
        if self._feeder is None:
            self._feeder = threading.Thread(target=self._feed, daemon=True,
                                            name=f"fibrl-feeder-{self.address}")
            self._feeder.start()
        if not self._wake.is_set():   # (lock held: the feeder clears it under the lock)
            self._wake.set()

    def _feed(self) -> None:
        while not self.lost:
            self._wake.wait()
            with self._lock:
                self._wake.clear()
                if self._sending or not self._outbox:
                    continue
                batch = list(self._outbox)
                self._outbox.clear()
                self._sending = True
            try:
                self._transmit(_merged(batch, self._hub.mergers) if len(batch) > 1
                               else batch)
            finally:
                self._done_sending()

    def _transmit(self, calls: list[Call]) -> None:
        self._transmit_frame(_frame(calls))

    def _transmit_frame(self, frame: Any) -> None:
        try:
            self._channel.send(frame)
        except ChannelClosed:
            self._on_lost()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued one-way call was handed to the connection."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while (self._outbox or self._sending) and not self.lost:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    # -- receiving -----------------------------------------------------------
    # A thread that waits for a reply reads the connection itself while no other thread
    # does (:meth:`read_until`), and handles what it reads as the reader thread would:
    # its own reply reaches it with no hand-over between threads. The reader thread
    # reads only while nobody waits: it sleeps until the connection is readable, which
    # nng does not signal for a frame that a waiting thread takes.
    def _read(self) -> None:
        channel = self._channel
        try:
            while not self.lost and channel.wait_readable():
                with channel.lead:
                    while not self.lost:
                        data = channel.recv_nowait()
                        if data is None:
                            break
                        self.received(data)
        except (ChannelClosed, TransportError):
            pass
        except MemoryError:  # a frame larger than this process can hold
            log.error("a message from %s is larger than this process can allocate; "
                      "closing that connection (calls waiting on it fail)", self.address)
            channel.close()
        finally:
            self._on_lost()

    def read_until(self, ready: Callable[[], bool], timeout: float,
                   on_frame: Optional[Callable[[Frame], None]] = None) -> None:
        """Read the connection in this thread until ``ready()`` or ``timeout`` seconds,
        if no other thread reads it now; returns at once when one does (the caller
        then waits as usual: that thread handles what arrives). Whatever is read is
        handled here, callbacks included (the caller must hold no lock they take), by
        ``on_frame`` if given (which hands what it does not handle to :meth:`received`)."""
        if not self.lost:
            self._channel.read_here(ready, timeout, on_frame or self.received)

    def wait(self, handle: Handle, timeout: float) -> bool:
        """``handle.wait(timeout)`` for a call on this connection, reading its reply in
        this thread when no other thread reads (:meth:`read_until`)."""
        start = time.monotonic()
        self.read_until(handle.ready, timeout)
        return handle.wait(max(0.0, timeout - (time.monotonic() - start)))

    def received(self, data: Frame) -> None:
        """Handle a frame of this connection: resolve the calls and run the streams it
        answers (the reader thread does, or a thread in :meth:`read_until`)."""
        try:
            msg = unpack(data)
        except Exception:
            log.exception("undecodable frame from %s; closing the connection", self.address)
            self._channel.close()
            return
        # (no lock: a dict's pop and get are atomic, and _on_lost swaps the dicts for
        # empty ones before it fails what they held; a handle resolves only once)
        # (the other hub sends replies only; mypy does not narrow msg when it is not a list)
        replies: list[Reply] | tuple[Reply]
        replies = msg if type(msg) is list else (msg,)  # type: ignore[assignment]
        for reply in replies:
            handle = self._pending.pop(reply.rid, None)
            if handle is not None:
                handle._resolve(*_decode(reply))
            else:
                stream = self._streams.get(reply.rid)
                if stream is not None:
                    stream(*_decode(reply))

    def _lost_error(self, in_flight: bool = False) -> RemoteObjectError:
        return owner_gone(self.address, "its connection dropped", in_flight=in_flight)

    def _on_lost(self) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost = True
            pending, self._pending = self._pending, {}
            streams, self._streams = self._streams, {}
            self._outbox.clear()
            self._idle.notify_all()
        self._wake.set()
        err = self._lost_error(in_flight=True)
        for handle in list(pending.values()):   # (a last reply may still pop one)
            handle._resolve(False, err)
        for on_reply in list(streams.values()):
            on_reply(False, err)
        self._hub._client_lost(self)
        for cb in self._lost_callbacks:
            cb()

    @property
    def channel(self) -> Channel:
        """The connection itself: its ``closed`` turns True the moment this side closes
        it, before the reader thread fails this client's calls and streams."""
        return self._channel

    def lost_now(self) -> bool:
        """Whether the connection dropped. One that this side closed a moment ago (its
        reader found a frame it could not decode, a test's fault seam cut it) and whose
        loss the reader thread has not handled yet is handled here first: its calls and
        streams fail now, so a caller never goes on as if what came on it still held."""
        if not self.lost and self._channel.closed:
            self._on_lost()
        return self.lost

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once when the connection drops."""
        self._lost_callbacks.append(callback)
        if self.lost:
            callback()

    def close(self) -> None:
        self.flush(5.0)
        self._channel.close()


_PLAIN = frozenset({bool, int, float, str})


Merger = Callable[[str, list[Call]], Optional[Call]]


def _merged(calls: list[Call], mergers: dict[str, Merger]) -> list[Call]:
    """``calls`` with each run that a merger takes replaced by its one call."""
    out: list[Call] = []
    i, n = 0, len(calls)
    while i < n:
        call = calls[i]
        j = i + 1
        merge = mergers.get(call.method) if call.rid == 0 else None
        one = None
        if merge is not None:
            while (j < n and calls[j].rid == 0 and calls[j].method == call.method
                   and calls[j].oid == call.oid):
                j += 1
            if j - i > 1:
                one = merge(call.oid, calls[i:j])
        if one is not None:
            out.append(one)
        else:
            out.extend(calls[i:j])
        i = j
    return out


def _decode(reply: Reply) -> tuple[bool, Any]:
    if not reply.encoded:
        return reply.ok, reply.value
    try:
        return reply.ok, serialization.loads(reply.value)
    except Exception as exc:
        return False, exc


class Hub:
    """This process's host of services and its connections to other hubs.

    Why one class of this size: it is the one place where a process's objects and its
    connections meet; a frame from a peer is dispatched to a hosted service, a call to
    an address goes to a local service or a connection, and a lost peer or connection
    reaches every service, all through the two maps (services, connections) that it
    changes under one lock. A connection to another hub is a :class:`Client`, a
    pending result a :class:`Handle`, an answer a :class:`ReplySink`."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", auth_timeout: float = 10.0,
                 connect_timeout: float = 30.0, port: int = 0, *,
                 heartbeat_interval: float = Config.heartbeat_interval,
                 parent_timeout: float = Config.parent_timeout, tls: bool = False) -> None:
        from ..wire.transport import Settings

        self.secret = secret
        self.settings = Settings(host, tls, auth_timeout, connect_timeout)
        self.port = port
        # whether threads other than a connection's reader may read its frames
        # (:meth:`wait_reading`); False: each is read in its reader thread only, which
        # waits inside the receive (set before the hub first listens)
        self.shared_peers = True
        self.heartbeat_interval = heartbeat_interval
        self.parent_timeout = parent_timeout
        self.timers = Timers()
        self._services: dict[str, Service] = {}
        self._clients: dict[str, Client] = {}
        self._lock = threading.RLock()
        self._listening = threading.Lock()   # held only while the listener is made
        self._listener: Optional[Listener] = None
        self.pid = os.getpid()
        # How one-way calls to remote objects of some kinds travel: set by those kinds'
        # handles when they are first used in this process (see merge_calls, before_send).
        self.mergers: dict[str, Merger] = {}
        self._before_send: tuple[Callable[[str], None], ...] = ()
        self.register(_HubService(), "hub")

    def merge_calls(self, method: str, merger: Merger) -> None:
        """Consecutive one-way calls named ``method`` to one object, sent together on a
        connection, travel as the one call ``merger(oid, calls)`` returns (None: as they
        are). A queue's handle declares it for its puts."""
        self.mergers[method] = merger

    def before_send(self, hook: Callable[[str], None]) -> None:
        """Run ``hook(address)`` before each call or one-way call to another hub (once
        per hook). A consumer's queue window declares one: what ``get()`` returned is
        acknowledged ahead of any other request to that queue's owner."""
        if hook not in self._before_send:
            self._before_send += (hook,)

    @classmethod
    def from_config(cls, config: Config, secret: bytes, *, host: Optional[str] = None,
                    port: int = 0) -> "Hub":
        """The hub of a process whose config is ``config`` (the process hub, a manager
        server's, a worker's): it listens on ``host`` (default ``config.listen_host``)."""
        hub = cls(bytes(secret), port=port, heartbeat_interval=config.heartbeat_interval,
                  parent_timeout=config.parent_timeout)
        hub.use_settings(config, host)
        return hub

    def use_settings(self, config: Config, host: Optional[str] = None) -> None:
        """Take the transport settings of ``config`` (listening on ``host``, default
        ``config.listen_host``) for every listener and channel this hub opens from now on
        (a worker adopts its parent's before it listens)."""
        from ..wire.transport import Settings

        self.settings = Settings.from_config(config, host)

    # the settings' fields, as this hub's (read-only: change them with use_settings)
    host = property(lambda self: self.settings.host)
    tls = property(lambda self: self.settings.tls)
    auth_timeout = property(lambda self: self.settings.auth_timeout)
    connect_timeout = property(lambda self: self.settings.connect_timeout)

    def open_listener(self, on_frame: FrameHandler,
                      on_lost: Optional[LossHandler] = None) -> Listener:
        """A listener of its own (not the hub's: its frames go to ``on_frame``, in its
        peers' reader threads, and only there), with this hub's secret and transport
        settings."""
        return self.settings.listener(self.secret, on_frame=on_frame, on_lost=on_lost,
                                      shared=False)

    def open_channel(self, address: str, timeout: Optional[float] = None) -> Channel:
        """A dedicated channel to ``address`` (not the shared :meth:`client`), with this
        hub's secret and transport settings."""
        return self.settings.connect(address, self.secret, timeout)

    def use_config(self, config: Config) -> None:
        """Adopt a config put in force after this hub was built: its liveness timings
        (read while it waits) and its transport settings (for what it opens from now on;
        a listener already open stays as it is, so a change of ``tls`` is reported)."""
        self.heartbeat_interval = config.heartbeat_interval
        self.parent_timeout = config.parent_timeout
        was, listener = self.settings.tls, self._listener
        self.use_settings(config)
        if listener is not None and was != config.tls:
            log.warning("tls=%s was set after this process started listening with tls=%s; "
                        "its listener at %s stays as it is. Set tls in fibrl.init before "
                        "the first Process, Pool, Queue or Manager.", config.tls, was,
                        listener.address)

    # -- hosting -------------------------------------------------------------
    @property
    def address(self) -> str:
        """The address other processes connect to (starts listening on first use)."""
        if self._listener is None:
            # (its own lock, which no pipe callback or pipe-event thread takes: the
            # hub's lock is never held while nng listens or closes)
            with self._listening:
                if self._listener is None:
                    self._listener = self.settings.listener(
                        self.secret, on_frame=self.dispatch_frame,
                        on_lost=self._on_peer_lost, port=self.port,
                        shared=self.shared_peers)
        return self._listener.address

    def register(self, service: Service, oid: Optional[str] = None) -> str:
        """Host ``service``; returns its object id."""
        service.oid = oid or service.oid or new_oid(type(service).__name__.lower())
        service.hub = self
        with self._lock:
            self._services[service.oid] = service
        return service.oid

    def unregister(self, oid: str) -> None:
        with self._lock:
            service = self._services.pop(oid, None)
        if service is not None:
            service.closed()

    def service(self, oid: str) -> Optional[Service]:
        return self._services.get(oid)

    def local_service(self, address: Optional[str], oid: str) -> Optional[Service]:
        """The service itself when it is hosted by this process, else None."""
        if self.is_local(address):
            return self._services.get(oid)
        return None

    def dispatch_frame(self, peer: Peer, data: Frame) -> None:
        """Run the calls of one frame that ``peer`` sent (its reader thread does, or a
        thread that waits while reading it: :meth:`wait_reading`)."""
        try:
            msg = unpack(data)
        except Exception as exc:  # an authenticated peer that sends garbage is broken
            log.error("dropping peer %s of process %s: %s", peer.id, self.pid, exc)
            peer.close()
            return
        lone = type(msg) is not list
        services = self._services
        calls: tuple[Call] | list[Call]   # (a peer sends calls only; mypy cannot tell)
        calls = (msg,) if lone else msg  # type: ignore[assignment]
        for call in calls:
            reply = _PeerReply(peer, call.rid, lone)
            service = services.get(call.oid)
            if service is None:
                if call.rid:
                    reply.fail(object_gone(call.oid, f"process {self.pid}"))
                else:   # a one-way call that came after its object closed: nobody waits
                    log.debug("one-way %s() to %r, which no longer exists here: dropped",
                              call.method, call.oid)
            else:
                service.dispatch(call.method, call.args, reply)
        if not lone:
            held = peer.context.get(FrameReplies)
            if held is not None:
                held.flush()

    def wait_reading(self, handle: Handle, peer: Peer,
                     on_frame: Optional[Callable[[Frame], None]] = None,
                     woken: bool = False) -> None:
        """Wait for a local call's ``handle`` while reading ``peer``'s frames in this
        thread, when no other thread reads them (``transport._Reading``): the
        message that answers it then reaches this thread with no hand-over. Returns
        when it is answered, or as soon as this thread cannot read them (the caller
        then waits as usual). ``on_frame``: what handles each frame read (default: the
        hub's dispatch, as the peer's reader thread would); ``woken``: what answers the
        handle wakes this thread itself (``peer.wake``), so no callback is added."""
        if not woken:
            me = threading.get_ident()
            handle.add_done_callback(lambda _h: peer.wake(me))   # answered elsewhere
        if on_frame is None:
            on_frame = functools.partial(self.dispatch_frame, peer)
        while not handle.ready():
            if not peer.read_here(handle.ready, self.heartbeat_interval, on_frame):
                return

    def _on_peer_lost(self, peer: Peer) -> None:
        for service in list(self._services.values()):
            try:
                service.peer_lost(peer)
            except Exception:
                log.exception("peer_lost of %s failed", service.oid)

    # -- calling -------------------------------------------------------------
    def is_local(self, address: Optional[str]) -> bool:
        return address is None or (self._listener is not None
                                   and address == self._listener.address)

    def client(self, address: str) -> Client:
        """The shared connection to the hub at ``address`` (connects on first use)."""
        client = self._clients.get(address)   # (a dict read needs no lock)
        if client is None or client.lost:
            new = Client(self, address, self.connect_timeout)
            with self._lock:
                client = self._clients.get(address)
                if client is None or client.lost:
                    self._clients[address] = client = new
            if client is not new:
                new.close()   # (after the lock: the close waits for nng's reaper)
        return client

    def _client_lost(self, client: Client) -> None:
        with self._lock:
            if self._clients.get(client.address) is client:
                del self._clients[client.address]

    def call_async(self, address: Optional[str], oid: str, method: str, *args: Any,
                   inline: bool = True) -> Handle:
        """Call ``method`` of object ``oid`` hosted at ``address``; returns a :class:`Handle`.

        ``inline=False`` hands the send to the connection's feeder thread (see
        :meth:`Client.call`); it makes no difference for a local object.
        """
        if address is None or self.is_local(address):   # (so address is a str below)
            handle = Handle()
            service = self._services.get(oid)
            if service is None:
                handle._resolve(False, object_gone(oid, "this process"))
            else:
                service.dispatch(method, args, LocalReply(handle))
            return handle
        for hook in self._before_send:
            hook(address)
        return self.client(address).call(oid, method, args, inline)

    def call(self, address: Optional[str], oid: str, method: str, *args: Any,
             timeout: Optional[float] = None) -> Any:
        """Call and wait for the result (``timeout``: seconds, None for no limit)."""
        return self.wait(self.call_async(address, oid, method, *args), address, timeout)

    def wait(self, handle: Handle, address: Optional[str],
             timeout: Optional[float] = None) -> Any:
        """``handle.get(timeout)`` for a call to the hub at ``address``, never hanging.

        A remote owner whose machine or network vanished closes no socket, so
        its connection is not seen to drop: while waiting, ping it every
        ``heartbeat_interval`` and raise :class:`RemoteObjectError` when it
        stays silent for ``parent_timeout``.
        """
        if handle.ready() or address is None or self.is_local(address):
            return handle.get(timeout)
        interval = self.heartbeat_interval
        deadline = None if timeout is None else time.monotonic() + timeout
        client = self._clients.get(address)
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            step = interval if left is None else min(left, interval)
            if client.wait(handle, step) if client is not None else handle.wait(step):
                return handle.get(0)
            if left is not None and left <= interval:
                raise TimeoutError(f"no result within {timeout} s")
            self.ensure_alive(address, self.parent_timeout)

    def ensure_alive(self, address: str, limit: float) -> None:
        """Raise :class:`RemoteObjectError` when the hub at ``address`` does not answer a
        ping within ``limit`` seconds (its process, machine or network is gone).

        The one liveness ping: every hub hosts ``_HubService`` as ``"hub"``.
        """
        try:
            ping = self.call_async(address, "hub", "ping")
        except TransportError as exc:
            raise owner_gone(address, exc) from exc
        if not self._answered(ping, address, limit):
            raise RemoteObjectError(
                f"the process at {address} that hosts this object did not answer a liveness "
                f"ping within {limit:.0f} s (parent_timeout): its machine or network is gone. "
                f"Objects it hosted are lost; restart the work, or raise parent_timeout if the "
                f"network is only slow.")
        ping.get(0)

    def _answered(self, ping: Handle, address: str, limit: float) -> bool:
        """Whether ``ping`` is answered before the connection to ``address`` has received
        nothing for ``limit`` seconds. An answer waits behind the frames sent before it:
        while a large one is still arriving, its bytes show the peer is there."""
        wait = limit
        while not ping.wait(wait):
            client = self._clients.get(address)
            wait = 0.0 if client is None else silence_left(client.channel, limit)
            if wait <= 0:
                return False
        return True

    def send(self, address: Optional[str], oid: str, method: str, *args: Any,
             inline: bool = False) -> None:
        """One-way call: no reply, errors are only logged by the receiver.

        ``inline`` trades batching for latency (see :meth:`Client.send`).
        """
        if address is None or self.is_local(address):
            service = self._services.get(oid)
            if service is None:
                raise object_gone(oid, "this process")
            service.dispatch(method, args, _NO_REPLY)
            return
        for hook in self._before_send:
            hook(address)
        self.client(address).send(oid, method, args, inline)

    def flush(self, timeout: Optional[float] = 10.0) -> bool:
        """Make sure every one-way call sent so far was processed by its receiver: a
        ping behind them, answered once they were (connections with nothing
        unconfirmed are skipped). The wait lasts while the receiver answers liveness
        pings (a frozen one ends it after ``parent_timeout``). What stays unconfirmed is
        logged; returns whether everything was confirmed."""
        with self._lock:
            clients = list(self._clients.values())
        confirmed = True
        for client in clients:
            sent = client.one_way_sent
            if sent == client.one_way_confirmed or client.lost:
                continue
            try:
                if not client.flush(timeout):
                    raise TimeoutError(f"not sent within {timeout} s")
                self.wait(client.call("hub", "ping", ()), client.address, timeout)
                client.one_way_confirmed = max(client.one_way_confirmed, sent)
            except Exception as exc:
                if client.lost:   # (its loss is reported where the calls came from)
                    continue
                confirmed = False
                log.warning("%d one-way message(s) to %s (queue puts, pipe sends, "
                            "events) may not have been processed there: it did not "
                            "confirm them (%s)", sent - client.one_way_confirmed,
                            client.address, exc)
        return confirmed

    def close(self) -> None:
        """Flush, close every connection, the listener and the timers, and wait for their
        threads.

        Runs at interpreter exit (before pynng's own exit handler, which must
        not find a thread still inside nng).
        """
        self.flush(5.0)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            services, self._services = list(self._services.values()), {}
            listener, self._listener = self._listener, None
        for service in services:
            service.closed()
        for client in clients:
            client._channel.close()
        if listener is not None:
            listener.close(join=1.0)
        for client in clients:
            client._reader.join(1.0)
        self.timers.close(1.0)


class _NoReply(ReplySink):
    __slots__ = ()
    wanted = False

    def __init__(self) -> None:
        self.peer = None

    def __call__(self, value: Any = None) -> bool:
        return True

    def fail(self, exc: BaseException) -> bool:
        log.error("one-way call failed: %r", exc, exc_info=exc)
        return True


_NO_REPLY = _NoReply()


class _HubService(Service):
    """Operations on the hub itself (liveness ping)."""

    def op_ping(self, reply: ReplySink) -> None:
        reply(os.getpid())


def get_hub() -> Hub:
    """This process's hub (see ``runtime``), built on first use from the config in force,
    with the process's authkey as secret."""
    hub: Optional[Hub] = runtime.installed_hub()   # (the runtime layer keeps it untyped)
    if hub is None:
        with runtime.hub_lock:
            hub = runtime.installed_hub()
            if hub is None:
                hub = Hub.from_config(runtime.current_config(),
                                      bytes(current_process().authkey))
                runtime.install_hub(hub)
    return hub
