"""The manager server: managed objects, their reference counts, and how calls run.

One :class:`ManagerService` per server, hosted under the object id
``"manager"`` by a hub whose secret is the manager's authkey (so a wrong
authkey fails the handshake and nothing is unpickled). It keeps the
``multiprocessing.managers`` semantics: a typeid registry, objects created by
``create``, ``exposed`` methods, ``method_to_typeid`` results returned as
new proxies, reference counts, ``#GETVALUE`` and the ``__str__``/``__repr__``
fallbacks.

How a call runs depends on how it came::

    dedicated line (one client thread)       shared hub connection (async calls)
    peer thread -> op_call                   peer thread -> op_spawn
      runs the method right here:               -> lane of that object (FIFO)
      it may block, as a stdlib server             -> worker thread runs it, replies
      thread per connection does                  objects run in parallel, calls to
                                                  one object in order, one at a time
                                             a call alone in its frame, to an idle
                                             lane, runs in the peer thread; after
                                             INLINE_S a new thread reads instead

    an object's own line (its async proxies in one client process)
    peer thread -> op_acall: runs the method right here, holding the object's
      ``exclusive`` lock, which lane calls to it hold too: a call that blocks holds
      up only the calls sent after it to that same object

Arguments travel pickled inside the call and are unpickled by the op, in
the server's context (so a proxy to one of this server's objects becomes a
manager-owned proxy that keeps the object alive, as in the stdlib); results
are pickled by the op, so an unpicklable result is an error for its caller.
This module does not own the client side (``lines``, ``proxies``) nor the
process that runs it (``manager``).
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import process
from typing import Any, Callable, Optional

from ..wire import serialization
from ..wire.serialization import Encoded
from ..errors import RemoteObjectError
from ..hosting.hub import FrameReplies, Hub, ReplySink, Service
from ..hosting.runtime import current_config
from ..hosting.hosted import answer
from .lines import MANAGER_OID

__all__ = ["Server", "ManagerService", "Token", "ProxyRef", "Created", "Registration",
           "public_methods", "listen_address"]

log = logging.getLogger(__name__)

_DEDICATED = "fibrl.manager.line"
_VIEWS = tuple(type(getattr({}, name)()) for name in ("items", "keys", "values"))


@dataclass(frozen=True, slots=True)
class Token:
    """Identifies one managed object: its typeid, its server's address and its id."""

    typeid: str
    address: str
    id: str


@dataclass(frozen=True, slots=True)
class ProxyRef:
    """A method result that is itself a managed object (``method_to_typeid``)."""

    token: Token
    exposed: tuple
    proxytype: Any


@dataclass(frozen=True, slots=True)
class Created:
    """The answer to ``create``: the new object's id and exposed methods."""

    id: str
    exposed: tuple


@dataclass(frozen=True)
class Registration:
    """What ``BaseManager.register`` recorded for one typeid."""

    callable: Optional[Callable[..., Any]]
    exposed: Optional[tuple]
    method_to_typeid: Optional[dict]
    proxytype: Any


@dataclass
class _Entry:
    obj: Any
    exposed: frozenset
    method_to_typeid: dict
    # held while an asynchronous call runs on the object (from a lane or an object's
    # own line): calls of async proxies run one at a time, whichever way they came
    exclusive: threading.Lock = field(default_factory=threading.Lock)


def public_methods(obj: Any) -> list:
    """Names of the public callable attributes of ``obj`` (the default ``exposed``)."""
    return [name for name in dir(obj) if name[0] != "_" and callable(getattr(obj, name, None))]


def listen_address(address: Any, default_host: str) -> tuple:
    """``(host, port)`` to listen on for an address given as a tuple, ``host:port`` or URL."""
    if address is None:
        return default_host, 0
    if isinstance(address, str):
        text = address[len("tcp://"):] if address.startswith("tcp://") else address
        host, _, port = text.rpartition(":")
        address = (host, port)
    host, port = address
    return (host or "0.0.0.0"), int(port or 0)


def connect_address(address: Any) -> str:
    """The URL of a server address given as a tuple, ``"host:port"`` or a URL: a URL
    (``tcp://`` or ``tls+tcp://``) as it is, else ``tls+tcp://`` when the config says
    ``tls``, ``tcp://`` otherwise."""
    if isinstance(address, str):
        if "://" in address:
            return address
        hostport = address
    else:
        host, port = address
        hostport = f"{host or '127.0.0.1'}:{port}"
    return ("tls+tcp://" if current_config().tls else "tcp://") + hostport


class _Workers:
    """An elastic set of daemon threads: one more whenever none is idle, idle ones retire."""

    def __init__(self, idle_timeout: float = 30.0) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._idle_timeout = idle_timeout

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._tasks.put(fn)
                return
        threading.Thread(target=self._run, args=(fn,), daemon=True,
                         name="fibrl-manager-worker").start()

    def _run(self, fn: Optional[Callable[[], None]]) -> None:
        while fn is not None:
            fn()
            fn = self._next()

    def _next(self) -> Optional[Callable[[], None]]:
        with self._lock:
            self._idle += 1
        try:
            return self._tasks.get(timeout=self._idle_timeout)
        except queue.Empty:
            with self._lock:
                try:  # a submit may have reserved us just now
                    return self._tasks.get_nowait()
                except queue.Empty:  # (or another idle thread took that task)
                    self._idle -= 1
                    return None


# A lone asynchronous call to an idle object runs in the thread that read it: handing it
# to a worker thread costs a thread wake-up, a large part of a quick call (~60 us of
# server CPU per call on a 2-core VM). A call found still running by the
# check every INLINE_S hands the reading of its connection to a new thread, so one that
# blocks holds up the calls behind it on that connection for 1 to 2 INLINE_S at most.
INLINE_S = 0.005


class _Overtime:
    """Watches the calls running inline in peer threads, and hands a connection to a
    new reader thread when its call outlasts ``INLINE_S`` (see
    :meth:`fibrl.wire.transport.Peer.offload`). One timer for all of them: it fires every
    ``INLINE_S`` while calls come (arming it per call would wake the timer thread per
    call) and stops ``IDLE_S`` after the last one."""

    IDLE_S = 0.1

    def __init__(self, timers: Any) -> None:
        self._timers = timers
        self._lock = threading.Lock()
        self._running: dict = {}   # thread ident -> (started, hand_off)
        self._armed = False
        self._last = 0.0           # when the last inline call started

    def run(self, hand_off: Callable[[], bool], fn: Callable[[], None]) -> None:
        me = threading.get_ident()
        now = time.monotonic()
        with self._lock:
            self._running[me] = (now, hand_off)
            self._last = now
            if not self._armed:
                self._armed = True
                self._timers.call_at(now + INLINE_S, self._check)
        try:
            fn()
        finally:
            with self._lock:
                self._running.pop(me, None)   # (gone already if it was handed off)

    def _check(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [me for me, (started, _) in self._running.items()
                    if now - started >= INLINE_S]
            hand_offs = [self._running.pop(me)[1] for me in late]
            if self._running or now - self._last < self.IDLE_S:
                self._timers.call_at(now + INLINE_S, self._check)
            else:
                self._armed = False
        for hand_off in hand_offs:
            hand_off()


class _Lane:
    """Calls to one object from async proxies: run in arrival order, one at a time.

    While more calls wait behind the one running, its reply is held to share a frame
    with theirs (:class:`~fibrl.hosting.hub.HeldReplies`, at most ``hub.HOLD_S``): a pipelined
    burst costs a few frames, a lone call is answered at once.
    """

    def __init__(self, workers: _Workers, timers: Any, overtime: _Overtime) -> None:
        self._workers = workers
        self._timers = timers
        self._overtime = overtime
        self._calls: deque = deque()
        self._lock = threading.Lock()
        self._running = False

    def submit(self, reply: ReplySink, fn: Callable[[ReplySink], None]) -> None:
        with self._lock:
            self._calls.append((reply, fn))
            if self._running:
                return
            self._running = True
        # lone: not one of a burst (a burst's replies share frames: see _drain); only a
        # peer's reply is lone
        if reply.lone and (peer := reply.peer) is not None:
            self._overtime.run(peer.offload(), self._drain)
        else:
            self._workers.submit(self._drain)

    def _drain(self) -> None:
        held: set = set()
        try:
            while True:
                with self._lock:
                    if not self._calls:
                        self._running = False
                        return
                    reply, fn = self._calls.popleft()
                    more = bool(self._calls)
                if more:
                    holder = reply.hold(self._timers)
                    if holder is not None:
                        held.add(holder)
                fn(reply)
        finally:
            for holder in held:
                holder.flush()


class ManagerService(Service):
    """The managed objects of one server and the operations on them."""

    def __init__(self, server: "Server") -> None:
        self.server = server
        self.registry: dict = server.registry
        self.objects: dict[str, _Entry] = {}
        self.refcounts: dict[str, int] = {}
        self.pinned: set[str] = set()
        self.mutex = threading.Lock()
        self.workers = _Workers()
        self.lanes: dict[str, _Lane] = {}
        self.overtime: Optional[_Overtime] = None   # made with the first lane

    # -- how calls run -------------------------------------------------------------------
    @staticmethod
    def _inline(reply: ReplySink) -> bool:
        return reply.peer is None or reply.peer.context.get(_DEDICATED, False)

    def _run(self, reply: ReplySink, fn: Callable[[], Any]) -> None:
        if self._inline(reply):
            answer(reply, fn)
        else:
            self.workers.submit(lambda: answer(reply, fn))

    def op_hello(self, reply: ReplySink) -> None:
        """Mark this connection as one client thread's own line."""
        if reply.peer is not None:
            reply.peer.context[_DEDICATED] = True
        reply(os.getpid())

    def op_ping(self, reply: ReplySink) -> None:
        reply(os.getpid())

    def op_dummy(self, reply: ReplySink) -> None:
        reply(None)

    # -- objects -----------------------------------------------------------------------------
    def op_create(self, reply: ReplySink, typeid: str, payload: bytes,
                  decrefs: tuple = ()) -> None:
        self._decref_all(decrefs)
        self._run(reply, lambda: self._create_from(typeid, payload))

    def _create_from(self, typeid: str, payload: bytes) -> Created:
        args, kwds = serialization.loads(payload)
        return self.create(typeid, args, kwds)

    def create(self, typeid: str, args: tuple, kwds: dict) -> Created:
        """Make a new managed object of ``typeid`` with one reference (its first proxy's)."""
        reg = self.registry.get(typeid)
        if reg is None:
            raise KeyError(f"typeid {typeid!r} is not registered with this manager "
                           f"(known: {sorted(self.registry)}); call register() before start().")
        if reg.callable is None:
            if kwds or len(args) != 1:
                raise ValueError(f"typeid {typeid!r} has no callable: create it from one object")
            obj = args[0]
        else:
            obj = reg.callable(*args, **kwds)
        exposed = list(reg.exposed) if reg.exposed is not None else public_methods(obj)
        if reg.method_to_typeid:
            exposed += list(reg.method_to_typeid)
        ident = f"{self.server.nonce}.{id(obj):x}"  # the nonce tells our own tokens apart
        with self.mutex:
            self.objects[ident] = _Entry(obj, frozenset(exposed), dict(reg.method_to_typeid or {}))
            self.refcounts[ident] = self.refcounts.get(ident, 0) + 1
        return Created(ident, tuple(exposed))

    def op_incref(self, reply: ReplySink, ident: str) -> None:
        with self.mutex:
            if ident not in self.objects:
                raise RemoteObjectError(
                    f"managed object {ident} no longer exists: every proxy to it was "
                    f"garbage-collected before this one arrived. Keep a reference to the "
                    f"proxy until the receiver has it.")
            self.refcounts[ident] = self.refcounts.get(ident, 0) + 1
        reply(None)

    def op_decref(self, reply: ReplySink, idents: tuple) -> None:
        self._decref_all(idents)
        reply(None)

    def _decref_all(self, idents: tuple) -> None:
        if not idents:
            return
        dead = []
        with self.mutex:
            for ident in idents:
                count = self.refcounts.get(ident, 0) - 1
                if count > 0 or ident in self.pinned:
                    self.refcounts[ident] = max(count, 0)
                    continue
                self.refcounts.pop(ident, None)
                dead.append(self.objects.pop(ident, None))
                self.lanes.pop(ident, None)
        del dead  # dropped outside the mutex: they may hold proxies of ours

    def pin(self, ident: str) -> None:
        """Keep ``ident`` alive for good: a proxy to it is stored inside this server."""
        self.pinned.add(ident)

    def op_get_methods(self, reply: ReplySink, ident: str) -> None:
        reply(tuple(self._entry(ident).exposed))

    def op_number_of_objects(self, reply: ReplySink, decrefs: tuple = ()) -> None:
        self._decref_all(decrefs)
        reply(len(self.refcounts))

    def op_debug_info(self, reply: ReplySink) -> None:
        with self.mutex:
            reply("\n".join(f"  {ident}:       refcount={self.refcounts.get(ident, 0)}\n"
                            f"    {str(entry.obj)[:75]}"
                            for ident, entry in self.objects.items()))

    def op_shutdown(self, reply: ReplySink) -> None:
        reply(None)
        self.server.stop_event.set()

    # -- method calls ------------------------------------------------------------------------
    def _entry(self, ident: str) -> _Entry:
        entry = self.objects.get(ident)
        if entry is None:
            raise RemoteObjectError(
                f"managed object {ident} no longer exists in the manager at "
                f"{self.server.address}: its last proxy was garbage-collected.")
        return entry

    def op_call(self, reply: ReplySink, ident: str, method: str, payload: Any,
                decrefs: tuple = ()) -> None:
        """A synchronous proxy call (runs here on a dedicated line); ``payload``: the
        pickled ``(args, kwds)``, or the tuple itself."""
        if decrefs:
            self._decref_all(decrefs)
        if not self._inline(reply):
            self.workers.submit(lambda: answer(reply, lambda: self.invoke(ident, method, payload)))
            return
        try:
            value = self.invoke(ident, method, payload)
        except Exception as exc:
            reply.fail(exc)
        else:
            reply(value)

    def op_spawn(self, reply: ReplySink, ident: str, method: str, payload: bytes,
                 decrefs: tuple = ()) -> None:
        """An asynchronous proxy call: queued on the object's lane."""
        self._decref_all(decrefs)
        with self.mutex:
            lane = self.lanes.get(ident)
            if lane is None:
                if self.overtime is None:
                    self.overtime = _Overtime(self.hub.timers)
                lane = self.lanes[ident] = _Lane(self.workers, self.hub.timers,
                                                 self.overtime)
        lane.submit(reply, lambda r: self._exclusive(r, ident, method, payload))

    def op_scall(self, reply: ReplySink, request: Any, decrefs: tuple = ()) -> None:
        """A synchronous proxy call (:meth:`op_call`) whose ``request`` is the pickled
        ``(ident, method, args, kwds)``: one pickle, and a frame of the plainest kind."""
        if decrefs:
            self._decref_all(decrefs)
        call = _request(reply, request)
        if call is not None:
            self.op_call(reply, *call)

    def op_acall(self, reply: ReplySink, request: Any, decrefs: tuple = ()) -> None:
        """An asynchronous proxy call on its object's own line, ``request`` the pickled
        ``(ident, method, args, kwds)`` (one pickle, and a frame of the plainest kind):
        runs here, one at a time with the object's other asynchronous calls (its
        ``exclusive`` lock)."""
        if decrefs:
            self._decref_all(decrefs)
        call = _request(reply, request)
        if call is None:
            return
        if not reply.lone:   # one of a burst: its reply goes in one frame with theirs
            reply.hold(self.hub.timers, FrameReplies)
        self._exclusive(reply, *call)

    def _exclusive(self, reply: ReplySink, ident: str, method: str, payload: Any) -> None:
        """Run an asynchronous call holding the object's lock, then send its reply after
        the lock (a caller slow to read its replies holds up no other caller of the
        object; buffers the result borrows from the object are copied first)."""
        try:
            entry = self._entry(ident)
            with entry.exclusive:
                value = self._invoke(entry, method, payload)
                if type(value) is Encoded:
                    value.own()
        except Exception as exc:
            reply.fail(exc)
            return
        reply(value)

    def invoke(self, ident: str, method: str, payload: Any) -> Any:
        """Run ``method`` of object ``ident``; returns the pickled result or ProxyRef."""
        return self._invoke(self._entry(ident), method, payload)

    def _invoke(self, entry: _Entry, method: str, payload: Any) -> Any:
        """``payload``: the pickled ``(args, kwds)``, or the tuple itself."""
        args, kwds = payload if type(payload) is tuple else serialization.loads(payload)
        if method not in entry.exposed:
            fallback = _FALLBACKS.get(method)
            if fallback is None:
                raise AttributeError(
                    f"method {method!r} of {type(entry.obj)!r} object is not in "
                    f"exposed={sorted(entry.exposed)!r}")
            return serialization.encode(fallback(entry.obj))
        result = getattr(entry.obj, method)(*args, **kwds)
        typeid = entry.method_to_typeid.get(method)
        if typeid:
            created = self.create(typeid, (result,), {})
            result = ProxyRef(Token(typeid, self.server.address, created.id), created.exposed,
                              self.registry[typeid].proxytype)
        elif isinstance(result, _VIEWS):
            result = list(result)
        return serialization.encode(result)  # sent before the reply returns: no copy


def _request(reply: ReplySink, request: Any) -> Optional[tuple[str, str, tuple]]:
    """``(ident, method, (args, kwds))`` of a call that came as one pickle of ``(ident,
    method, args, kwds)``; None when it cannot be unpickled (``reply`` says why)."""
    try:
        ident, method, args, kwds = serialization.loads(request)
    except Exception as exc:
        reply.fail(exc)
        return None
    return ident, method, (args, kwds or {})


_FALLBACKS: dict[str, Callable[[Any], Any]] = {
    "__str__": str, "__repr__": repr, "#GETVALUE": lambda obj: obj,
}


class Server:
    """Serves the objects of one manager on an address guarded by its authkey.

    ``BaseManager.get_server()`` returns one; ``serve_forever()`` blocks until
    ``shutdown`` is called by a client (or Ctrl-C).
    """

    def __init__(self, registry: dict, address: Any, authkey: bytes,
                 serializer: str = "pickle") -> None:
        config = current_config()
        host, port = listen_address(address, config.listen_host)
        self.registry = registry
        self.authkey = bytes(authkey)
        self.nonce = secrets.token_hex(4)
        self.hub = Hub.from_config(config, self.authkey, host=host, port=port)
        self.hub.shared_peers = False   # only the manager service here: none waits reading
        self.service = ManagerService(self)
        self.hub.register(self.service, MANAGER_OID)
        self.address = self.hub.address
        self.stop_event = threading.Event()

    def owns(self, token: Token) -> bool:
        """Whether ``token`` names one of this server's objects (whatever address it uses)."""
        return token.address == self.address or token.id.split(".", 1)[0] == self.nonce

    def serve_forever(self) -> None:
        """Serve until a client calls ``shutdown`` (or the process is interrupted)."""
        # (the stdlib's own mark of a manager process; typeshed does not declare it)
        process.current_process()._manager_server = self  # type: ignore[attr-defined]
        try:
            self.stop_event.wait()
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def close(self) -> None:
        self.stop_event.set()
        if getattr(process.current_process(), "_manager_server", None) is self:
            process.current_process()._manager_server = None  # type: ignore[attr-defined]
        self.hub.close()
