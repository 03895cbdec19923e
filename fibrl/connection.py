"""``Pipe()``, ``Connection`` and ``wait()`` that work between any processes.

A pipe is two :class:`~fibrl.hosting.mailbox.PipeBox` objects hosted by the process
that called ``Pipe()``: one per direction. A :class:`Connection` is a handle
on them (address, the direction it reads, the one it writes) and pickles to any
process of the run. Each process holding the write side of a direction counts
as one open writer (a pickled handle counts from the moment it is pickled);
when the last one closes or its process dies, a reader gets ``EOFError`` once
the buffered messages are read, as with an OS pipe. Readers are counted the
same way: once none is left, ``send()`` raises ``BrokenPipeError`` (after a
reader's process dies, as soon as the owner has seen its connection drop).

An end read in another process than the owner's gets its messages *pushed*:
its first ``recv``/``poll`` subscribes that process's :class:`_Inbox`, and
from then on each ``send`` is one frame to the owner, which forwards it at
once (one frame; none when the sender is the owner). ``recv`` and ``poll``
then wait on local state, and a waiting ``recv`` reads the owner's connection
itself while no other thread of its process does: no hand-over between
threads. Messages pushed to a process that dies unread are lost with it, like
the data in a dead reader's OS pipe; a process that closes its end, or whose
subscription another reader takes over, gives them back.

::

    process A               owner of the pipe (hub)                 process B
    a.send(obj) ==put==>    PipeBox a->b  ==push (subscribed)==>    _Inbox -> b.recv()
    a.recv()    <=========  PipeBox b->a  <==========put=========   b.send(obj)
    (A is the owner here: its recv() reads the PipeBox in-process, and while it
    waits, reads B's connection itself and runs what B sent)

``wait()`` mixes connections, process sentinels and any object with
``fileno()``: connections are watched with parked ``poll`` requests that
write to a self-pipe, and everything is waited on with one ``select``.
"""
from __future__ import annotations

import itertools
import os
import selectors
import threading
import time
import weakref
from collections import deque
from multiprocessing import BufferTooShort
from typing import Any, Callable, Iterable, Optional

from .wire import serialization
from .hosting.hub import QuietCondition, drop_owner, get_hub, mark_pickled
from .janitor import Finalizer
from .hosting.mailbox import PipeBox, merge_puts, take
from .wire.messages import blob, one_way_head, payload_reply_head
from .wire.serialization import Encoded

__all__ = ["Connection", "Pipe", "wait"]

_tokens = itertools.count(1)


class Connection:
    """One end of a :func:`Pipe`, usable from any process of the run."""

    def __init__(self, address: str, inbox: Optional[str], outbox: Optional[str]) -> None:
        self._address = address
        self._inbox = inbox      # mailbox this end reads (None: write-only)
        self._outbox = outbox    # mailbox this end writes (None: read-only)
        self._closed = False
        self._finalizer: Optional[Finalizer] = None
        self._watch: Any = None  # a Handle answered when no reader is left: BrokenPipeError
        self._pushed: Optional[_Inbox] = None  # this process's inbox (reader elsewhere)
        self._put_head: Optional[bytes] = None   # how each of its puts' frame begins
        # where its messages go, found once: (the PipeBox written, when this process owns
        # it, else the connection to its owner), and the PipeBox read (owner only)
        self._out: tuple[Optional[PipeBox], Any] = (None, None)
        self._box_in: Optional[PipeBox] = None

    # -- lifetime ----------------------------------------------------------------
    def _attach(self, adopt: bool = False) -> None:
        hub = get_hub()
        if self._inbox is not None:
            hub.call(self._address, self._inbox, "adopt_reader" if adopt else "attach_reader")
            if not hub.is_local(self._address):
                self._pushed = _Inbox.use(self._address, self._inbox)
        if self._outbox is not None:
            hub.call(self._address, self._outbox, "adopt" if adopt else "attach")
            self._watch = _watch_for(hub, self._address, self._outbox)
            if not hub.is_local(self._address):   # sends that queue up travel as one call
                hub.merge_calls("put", merge_puts)
        self._finalizer = Finalizer(self, _detach, self._address, self._inbox, self._outbox,
                                    atexit=True)

    def __reduce__(self):
        self._check_closed()
        hub = get_hub()
        for oid in (self._inbox, self._outbox):
            if oid is not None:
                mark_pickled(self._address, oid)
        if self._inbox is not None:
            hub.call(self._address, self._inbox, "attach_reader", "inflight")
        if self._outbox is not None:
            hub.call(self._address, self._outbox, "attach", "inflight")
        return (_rebuild, (self._address, self._inbox, self._outbox))

    def close(self) -> None:
        """Close this handle; the other end sees EOF once every writer handle is closed."""
        if not self._closed:
            self._closed = True
            if self._finalizer is not None:
                self._finalizer()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def readable(self) -> bool:
        return self._inbox is not None

    @property
    def writable(self) -> bool:
        return self._outbox is not None

    def fileno(self) -> int:
        raise OSError("a fibrl Connection has no file descriptor (it may live on another "
                      "machine); wait on it with fibrl.connection.wait()")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._inbox}<->{self._outbox}"
        return f"<fibrl.connection.Connection {state} at {self._address}>"

    def _check_closed(self) -> None:
        if self._closed:
            raise OSError("handle is closed")

    def _check_readable(self) -> str:
        """The mailbox this end reads, if it may."""
        self._check_closed()
        inbox = self._inbox
        if inbox is None:
            raise OSError("connection is write-only")
        return inbox

    def _check_writable(self) -> str:
        """The mailbox this end writes, if it may."""
        self._check_closed()
        outbox = self._outbox
        if outbox is None:
            raise OSError("connection is read-only")
        return outbox

    # -- sending -------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        """Send a picklable object to the other end."""
        outbox = self._outbox
        if self._closed or outbox is None:
            outbox = self._check_writable()   # (raises)
        self._put(outbox, serialization.encode(obj))

    def send_bytes(self, buf: Any, offset: int = 0, size: Optional[int] = None) -> None:
        """Send bytes from a bytes-like object (``offset``/``size`` in items of ``buf``)."""
        outbox = self._check_writable()
        view = memoryview(buf).cast("B") if memoryview(buf).ndim else memoryview(buf)
        itemsize = memoryview(buf).itemsize
        start, length = offset * itemsize, len(view)
        if offset < 0 or start > length:
            raise ValueError("offset is negative or too large")
        if size is None:
            size = (length - start) // itemsize
        if size < 0 or start + size * itemsize > length:
            raise ValueError("size is negative or too large")
        self._put(outbox, bytes(view[start:start + size * itemsize]))

    def _put(self, outbox: str, payload: bytes | Encoded) -> None:
        watch = self._watch
        if watch is not None and watch.ready() and watch.successful() and watch.get(0):
            raise BrokenPipeError(
                f"[Errno 32] Broken pipe: every reader of {self!r} was closed or its process "
                f"died; nothing can read what is sent. Keep a reader open (do not close the "
                f"other end, or end the process holding it) while sending.")
        box, client = self._out
        if (box is None or box.retired) and (client is None or client.lost):
            box, client = self._out = _route(self._address, outbox)
            _routed.add(self)
        if box is not None:   # this process owns the pipe: no call, no reply
            if type(payload) is Encoded:
                payload.own()  # the pipe may keep it: the caller may change the original
            box.give(payload)
            return
        # inline: a pipe is used for request/response, where latency matters most
        assert client is not None   # (see _route)
        if type(payload) is Encoded:
            head = self._put_head
            if head is None:
                head = self._put_head = one_way_head(outbox, "put")
            if client.send_lone(head, payload):
                return
        client.send(outbox, "put", (payload,), inline=True)

    # -- receiving -----------------------------------------------------------------
    def _get(self, inbox: str) -> Any:
        if self._pushed is not None:
            return self._pushed.take()
        box = self._box_in
        if box is None or box.retired:
            hub = get_hub()
            # (a PipeBox, as Pipe() made it; a cast would cost a call)
            box = self._box_in = hub.local_service(self._address, inbox)  # type: ignore
            if box is None:
                return take(hub, self._address, inbox, None)
            _routed.add(self)
        return box.take_here()

    def recv(self) -> Any:
        """Receive an object sent with :meth:`send`; ``EOFError`` when the other end closed."""
        inbox = self._inbox
        if self._closed or inbox is None:
            inbox = self._check_readable()   # (raises)
        payload = self._get(inbox)
        return payload.load() if type(payload) is Encoded else serialization.loads(payload)

    def recv_bytes(self, maxlength: Optional[int] = None) -> bytes:
        """Receive one message as bytes; ``OSError`` if it is longer than ``maxlength``."""
        inbox = self._check_readable()
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        data = bytes(serialization.as_bytes(self._get(inbox)))
        if maxlength is not None and len(data) > maxlength:
            self.close()
            raise OSError("bad message length")
        return data

    def recv_bytes_into(self, buf: Any, offset: int = 0) -> int:
        """Receive into a writable buffer; ``BufferTooShort`` (holding the message) if it
        does not fit."""
        inbox = self._check_readable()
        view = memoryview(buf).cast("B")
        if offset < 0 or offset > len(view):
            raise ValueError("offset out of bounds")
        data = memoryview(serialization.as_bytes(self._get(inbox))).cast("B")
        if len(data) > len(view) - offset:
            raise BufferTooShort(bytes(data))
        view[offset:offset + len(data)] = data
        return len(data)

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        """Whether there is data to read (or EOF), waiting up to ``timeout`` seconds."""
        inbox = self._check_readable()
        if self._pushed is not None:
            return self._pushed.poll(timeout)
        return get_hub().call(self._address, inbox, "poll", timeout)


# Connections that keep where their messages go (see _put, _get): a forked child
# forgets that, as it forgets the parent's hub (the boxes and connections it found were
# the parent's)
_routed: "weakref.WeakSet[Connection]" = weakref.WeakSet()


def _forget_routes_in_child() -> None:
    for conn in list(_routed):
        conn._out, conn._box_in = (None, None), None
    _routed.clear()


os.register_at_fork(after_in_child=_forget_routes_in_child)


def _route(address: str, oid: str) -> tuple[Optional[PipeBox], Any]:
    """``(box, None)`` when this process hosts the pipe direction ``oid`` (its PipeBox),
    else ``(None, client)``: the connection to its owner at ``address``."""
    hub = get_hub()
    box = hub.local_service(address, oid)
    if box is not None:
        # (a PipeBox, as Pipe() made it)
        return box, None   # type: ignore[return-value]
    return None, hub.client(address)


def _detach(address: str, inbox: Optional[str], outbox: Optional[str]) -> None:
    hub = get_hub()
    if inbox is not None and not hub.is_local(address):
        _Inbox.release(address, inbox)
    for oid, method in ((inbox, "detach_reader"), (outbox, "detach")):
        if oid is not None:
            try:
                hub.call(address, oid, method, timeout=5.0)
            except Exception:
                pass  # the owner is gone: so is the pipe


_watches: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_watches_lock = threading.Lock()


def _watch_for(hub: Any, address: str, oid: str) -> Any:
    """The parked ``watch`` of this process on a pipe direction, shared by its handles,
    so that passing ends around does not park one more reply at the owner each time."""
    with _watches_lock:
        handle = _watches.get((address, oid))
        if handle is None or (handle.ready() and not handle.successful()):
            handle = _watches[(address, oid)] = hub.call_async(address, oid, "watch")
        return handle


def _rebuild(address: str, inbox: Optional[str], outbox: Optional[str]) -> Connection:
    conn = Connection(address, inbox, outbox)
    conn._attach(adopt=True)
    return conn


_RELEASE_S = 5.0   # how long a closing reader waits for its subscription's release


class _Inbox:
    """This process's end of a pipe direction whose owner (another process) pushes
    each message here: ``recv`` and ``poll`` wait on local state, not on the network.

    Shared by every handle of this process on that direction; it subscribes on
    the first ``recv``/``poll`` and gives back what it holds unread when its
    last handle closes or the owner revokes it (a reader elsewhere asked).
    """

    _registry: dict = {}
    _registry_lock = threading.Lock()

    def __init__(self, address: str, oid: str) -> None:
        self.address, self.oid = address, oid
        self.items: deque = deque()
        self.lock = threading.RLock()   # (``with`` on it: a Condition's is a Python call)
        self.cond = QuietCondition(self.lock)
        self.users = 0
        self.rid = 0            # the subscription's call id; 0: not subscribed
        self.client: Any = None  # the connection the subscription is on
        self.ready = False      # the owner pushed what it stored (answered "ready")
        self.revokes = 0        # how many times the owner took the subscription back
        self.eof = False
        self.error: Optional[BaseException] = None
        self.listeners: set = set()
        self._reader_of: Optional[tuple] = None   # (client, rid, _reading's pair for them)

    @classmethod
    def use(cls, address: str, oid: str) -> "_Inbox":
        with cls._registry_lock:
            inbox = cls._registry.get((address, oid))
            if inbox is None:
                inbox = cls._registry[(address, oid)] = cls(address, oid)
            inbox.users += 1
            return inbox

    @classmethod
    def release(cls, address: str, oid: str) -> None:
        with cls._registry_lock:
            inbox = cls._registry.get((address, oid))
            if inbox is None:
                return
            inbox.users -= 1
            if inbox.users > 0:
                return
            del cls._registry[(address, oid)]
        inbox.unsubscribe()

    # -- the subscription ----------------------------------------------------------------
    def _subscribe(self) -> None:
        """Ask the owner to push (cond held); replies arrive on the client's reader."""
        self.ready, self.eof, self.error = False, False, None
        self.rid = -1  # subscribing: the owner's replies may arrive before stream() returns
        self.client = get_hub().client(self.address)
        rid = self.client.stream(self.oid, "subscribe", (), self._on_reply)
        if self.rid == -1:
            self.rid = rid

    def _on_reply(self, ok: bool, value: Any) -> None:
        with self.lock:
            if not ok:
                self.error, self.rid = value, 0
            elif value == "ready":
                self.ready = True
            elif value == "eof":
                self.eof = True
            elif value == "revoke":
                self._give_back()
                self.revokes += 1
            else:
                self.items.append(value)
            listeners = self._news()
        for poke in listeners:
            poke()

    def _news(self) -> tuple:
        """Wake this inbox's waiters (cond held); the ``wait()`` listeners to poke once
        the lock is let go."""
        self.cond.notify_all()
        return tuple(self.listeners) if self.listeners else ()

    def _give_back(self) -> None:
        """End the subscription and return what was not read, in order (cond held)."""
        hub = get_hub()
        client = hub.client(self.address)
        if self.rid > 0:
            client.end_stream(self.rid)
        self.rid, self.ready, self.eof = 0, False, False
        items = [blob(item) for item in self.items]
        self.items.clear()
        try:
            hub.send(self.address, self.oid, "giveback", items)
        except Exception:
            pass  # the owner is gone, and the pipe with it

    def unsubscribe(self) -> None:
        """End the subscription (the last handle of this process closed), giving back
        what was not read. A subscription in place is released by the owner (it sends
        ``revoke`` after the messages already pushed here), so that those still on their
        way when this runs come back too; waits up to ``_RELEASE_S`` for that."""
        with self.lock:
            rid = self.rid
            if rid > 0 and self.client is not None and not self.client.lost:
                try:
                    self.client.send(self.oid, "release", ())
                except Exception:
                    pass   # the owner is gone, and the pipe with it
                else:
                    self.cond.wait_for(lambda: self.rid != rid, _RELEASE_S)
                    if self.rid != rid:
                        return   # given back on the owner's revoke (see _on_reply)
            if self.rid != 0:
                self._give_back()

    # -- reading ---------------------------------------------------------------------
    def _state(self) -> Optional[bool]:
        """True: a message or EOF is here; None: not subscribed (cond held)."""
        if self.items or self.eof or self.error is not None:
            return True
        if self.rid == 0:
            return None
        return False

    def take(self) -> Any:
        with self.lock:
            if self.items:
                return self.items.popleft()
            hub = get_hub()
            revokes = self.revokes
            while True:
                if self.items or self.eof or self.error is not None:
                    return self._pop()
                if self.rid == 0:
                    if self.revokes != revokes:
                        break  # another reader took it meanwhile: queue up with a get
                    self._subscribe()
                elif not self._wait(hub):
                    self.cond.release()
                    try:  # a vanished owner closes no socket: ping it
                        hub.ensure_alive(self.address, hub.parent_timeout)
                    finally:
                        self.cond.acquire()
        return take(hub, self.address, self.oid, None)

    def _wait(self, hub: Any) -> bool:
        """Wait up to ``heartbeat_interval`` for news (cond held); False when none came.
        This thread reads the owner's connection itself while no other thread does, so
        a pushed message reaches it with no hand-over between threads."""
        interval, start = hub.heartbeat_interval, time.monotonic()
        rid, client = self.rid, self.client
        if rid > 0 and client is not None:
            ready, on_frame = self._reading(client, rid)
            self.cond.release()
            try:
                client.read_until(ready, interval, on_frame)
            finally:
                self.cond.acquire()
            if ready():
                return True
        return self.cond.wait(max(0.0, interval - (time.monotonic() - start)))

    def _reading(self, client: Any, rid: int) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        """``(ready, on_frame)`` for :meth:`_wait` on subscription ``rid``: whether news
        came (a message, EOF, an error, the subscription ended), and how a frame read is
        handled: a message the owner pushed on ``rid`` (a lone reply with a payload) goes
        straight into :attr:`items`, as :meth:`_on_reply` would put it, without unpacking
        the frame and looking up its stream; anything else, or a subscription that ended
        meanwhile, goes through the client."""
        made = self._reader_of
        if made is not None and made[0] is client and made[1] == rid:
            return made[2]   # (the same subscription as last time: made once for it)
        head = payload_reply_head(rid)
        size = len(head)
        received = client.received
        items = self.items

        def ready() -> Any:
            return items or self.eof or self.error is not None or self.rid != rid

        cond = self.cond

        def on_frame(frame: Any) -> None:
            if type(frame) is bytes and frame.startswith(head):
                listeners: tuple = ()
                with self.lock:
                    current = self.rid == rid and self.client is client
                    if current:
                        items.append(Encoded(frame[size:]))
                        if cond.sleepers or self.listeners:   # (else _news has nothing to do)
                            listeners = self._news()
                if current:
                    for poke in listeners:
                        poke()
                    return
            received(frame)

        self._reader_of = (client, rid, (ready, on_frame))
        return ready, on_frame

    def _pop(self) -> Any:
        if self.items:
            return self.items.popleft()
        if self.error is not None:
            raise self.error
        raise EOFError("the other end of the pipe was closed")

    def poll(self, timeout: Optional[float]) -> bool:
        hub = get_hub()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            if self._state() is None:
                self._subscribe()
            while self.rid != 0 and not self.ready and self.error is None:
                if not self.cond.wait(hub.parent_timeout):
                    break  # the owner stays silent: the next recv() reports it
            while True:
                state = self._state()
                if state is not False:
                    return bool(state) if state is not None else False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left if left is not None else hub.heartbeat_interval)


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
    """Return two connected ends ``(conn1, conn2)``.

    With ``duplex=False`` ``conn1`` can only receive and ``conn2`` only send.

    Example:
        >>> a, b = Pipe()
        >>> a.send([1, 2]); b.recv()
        [1, 2]
    """
    hub = get_hub()
    to_1 = hub.register(PipeBox())
    to_2 = hub.register(PipeBox()) if duplex else None
    address = hub.address
    conn1 = Connection(address, to_1, to_2)
    conn2 = Connection(address, to_2, to_1)
    for conn in (conn1, conn2):
        conn._attach()
    for oid in (to_1, to_2):
        if oid is not None:
            # the creator's handle is the pair: the pipe retires (see SharedService)
            # once both ends are collected here and nobody else uses it
            Finalizer(conn1, _drop_when_both_gone, weakref.ref(hub), oid, weakref.ref(conn2))
    return conn1, conn2


def _drop_when_both_gone(hub_ref, oid: str, other: "weakref.ref") -> None:
    conn = other()
    if conn is None:
        drop_owner(hub_ref, oid)
    else:
        Finalizer(conn, drop_owner, hub_ref, oid)


# -- wait ---------------------------------------------------------------------------------
def wait(object_list: Iterable[Any], timeout: Optional[float] = None) -> list:
    """Wait until one or more objects are ready; return the ready ones.

    Objects may be :class:`Connection` objects (ready when readable or at
    EOF), integer file descriptors such as ``Process.sentinel``, or objects
    with a ``fileno()`` method.

    Example:
        >>> a, b = Pipe(); b.send(1)
        >>> wait([a], timeout=5) == [a]
        True
    """
    objects = list(object_list)
    conns = [o for o in objects if isinstance(o, Connection)]
    others = [o for o in objects if not isinstance(o, Connection)]
    ready = [c for c in conns if c.poll(0)]
    if ready or timeout is not None and timeout <= 0:
        return ready + _ready_fds(others, 0)
    return _wait_blocking(conns, others, timeout)


def _ready_fds(objects: list, timeout: Optional[float]) -> list:
    if not objects:
        return []
    with selectors.DefaultSelector() as sel:
        for obj in objects:
            sel.register(obj, selectors.EVENT_READ)
        return [key.fileobj for key, _ in sel.select(timeout)]


def _wait_blocking(conns: list, others: list, timeout: Optional[float]) -> list:
    hub = get_hub()
    waker = _Waker()
    token = (os.getpid(), next(_tokens))
    pushed = [c for c in conns if c._pushed is not None]
    polled = [c for c in conns if c._pushed is None]
    handles = []
    try:
        for conn in pushed:  # the message itself arrives here: watch the local inbox
            with conn._pushed.lock:
                conn._pushed.listeners.add(waker.poke)
        for conn in polled:
            handle = hub.call_async(conn._address, conn._inbox, "poll", timeout, token)
            handle.add_done_callback(waker.poke)
            handles.append(handle)
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(waker.read_fd, selectors.EVENT_READ)
            for obj in others:
                sel.register(obj, selectors.EVENT_READ)
            left: Optional[float]
            while True:
                if any(c._pushed.poll(0) for c in pushed):
                    left = 0.0
                else:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                keys = [k.fileobj for k, _ in sel.select(left)]
                fds = [o for o in keys if o is not waker.read_fd]
                conns_ready = [c for c, h in zip(polled, handles) if h.ready() and _true(h)]
                conns_ready += [c for c in pushed if c._pushed.poll(0)]
                if fds or conns_ready or left == 0:
                    return conns_ready + fds
                if (not pushed and all(h.ready() for h in handles) and not others
                        and waker.read_fd in keys):
                    return []
                if waker.read_fd in keys:
                    os.read(waker.read_fd, 4096)
    finally:
        for conn in pushed:
            with conn._pushed.lock:
                conn._pushed.listeners.discard(waker.poke)
        for conn, handle in zip(polled, handles):
            if not handle.ready():
                hub.call_async(conn._address, conn._inbox, "unpoll", token)
        waker.close()


class _Waker:
    """The self-pipe of one wait(): poll replies poke it, until wait() closes it.

    A reply may still arrive after wait() returned (the answer to an unpoll
    that crossed it); it must not write into a descriptor number that was
    closed and handed out again.
    """

    __slots__ = ("read_fd", "_write_fd", "_lock")

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # a full pipe means the reader is awake
        self._lock = threading.Lock()

    def poke(self, _handle: Any = None) -> None:
        with self._lock:
            if self._write_fd >= 0:
                try:
                    os.write(self._write_fd, b"x")
                except OSError:
                    pass  # full: a wake-up is pending already

    def close(self) -> None:
        with self._lock:
            write_fd, self._write_fd = self._write_fd, -1
        os.close(write_fd)
        os.close(self.read_fd)


def _true(handle) -> bool:
    try:
        return bool(handle.get(0))
    except Exception:
        return True  # an error (owner gone) is "ready": the next recv() reports it
