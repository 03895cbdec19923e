"""Proxies: the client side of managed objects, with ``multiprocessing.managers`` semantics.

A proxy holds a :class:`~fibrl.managers.server.Token` (typeid, server
address, object id) and the manager's authkey. ``_callmethod`` sends one call
on the calling thread's dedicated line (``lines``); ``_call_async`` sends it
through the hub and returns a :class:`ProxyHandle` at once. A proxy pickles
as its token (``RebuildProxy``), so it works in any process; unpickled inside
its own server it becomes a manager-owned proxy that keeps the object alive,
which is what makes nested proxies (a managed list inside a managed dict)
behave as in the stdlib. Reference counting is the stdlib's, except that a
decref is not a message of its own: it rides on the next call to that
server (finalizers must never block or do I/O).

Data flow of a call::

    proxy.append(x) -> _callmethod("append", (x,))
        pickles (args, kwds) -> line.call("call", id, "append", payload, decrefs)
        <- pickled result: a value, or a ProxyRef -> a new proxy (method_to_typeid)
    async_proxy.step(a) -> the object's own line (one per object and process):
        line.submit("acall", id, "step", payload, decrefs) -> PipelinedHandle at once
        handle.get(timeout) -> reads the line in the caller's thread, unpickles
    proxy._call_async(...) -> hub.call_async(..., "spawn", ...) -> ProxyHandle
        (also an async proxy's calls once OBJECT_LINES objects of that server have lines)
"""
from __future__ import annotations

import functools
import multiprocessing
import threading
import time
import weakref
from multiprocessing import process
from multiprocessing.context import get_spawning_popen
from typing import Any, Callable, ClassVar, Optional, cast

from ..wire import serialization
from ..errors import RemoteObjectError, TransportError
from ..hosting.hub import Handle
from ..janitor import Finalizer
from .lines import (MANAGER_OID, PipelinedLine, ReplyTimeout, _value, decref_queue, hub_for,
                    line_for, lost_error, note_decref, take_decrefs)
from .server import ProxyRef, Token

__all__ = [
    "BaseProxy", "AsyncProxy", "AutoProxy", "AsyncAutoProxy", "MakeProxyType", "RebuildProxy",
    "ProxyHandle", "PipelinedHandle", "HandleTimeout", "IteratorProxy", "AcquirerProxy",
    "ConditionProxy", "EventProxy", "BarrierProxy", "NamespaceProxy", "ValueProxy", "BaseListProxy",
    "ListProxy", "DictProxy", "ArrayProxy", "BasePoolProxy", "PoolProxy",
]


_NO_ARGS = serialization.encode(((), {}))   # (already an Encoded: sent as it is)


def _payload(args: tuple, kwds: Optional[dict]) -> Any:
    if not args and not kwds:
        return _NO_ARGS
    return serialization.encode((args, kwds or {}))


class _InFlight:
    """Async calls awaiting replies, per server: a burst is batched, a lone call is not.

    The first call to an idle server is sent at once (lowest latency); calls
    made while others are in flight go to the hub's feeder thread, which packs
    them into one frame (highest rate).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[str, int] = {}

    def start(self, address: str) -> bool:
        """Count a new call; True when it should be sent inline."""
        with self._lock:
            count = self._count.get(address, 0)
            self._count[address] = count + 1
        return count == 0

    def done(self, address: str) -> None:
        with self._lock:
            self._count[address] = max(self._count.get(address, 1) - 1, 0)


_in_flight = _InFlight()


class HandleTimeout(multiprocessing.TimeoutError, TimeoutError):
    """``ProxyHandle.get(timeout)`` ran out of time (both the stdlib and builtin kind)."""


_decoding = threading.local()  # (address, authkey) of the server whose reply is being unpickled


def _local_server(token: Token) -> Any:
    server = getattr(process.current_process(), "_manager_server", None)
    if server is not None and server.owns(token):
        return server
    return None


class BaseProxy:
    """Base class of proxies: ``_callmethod``, ``_call_async``, ``_getvalue``, pickling.

    Same constructor as ``multiprocessing.managers.BaseProxy``.
    """

    _exposed_: tuple = ()
    _decref_finalizer: Any = None   # sends this proxy's decref (a finalizer)
    # set on some proxy types and on AutoProxy instances only (read with getattr)
    _method_to_typeid_: ClassVar[dict[str, str]]
    _isauto: bool

    def __init__(self, token: Token, serializer: str = "pickle", manager: Any = None,
                 authkey: Optional[bytes] = None, exposed: Optional[tuple] = None,
                 incref: bool = True, manager_owned: bool = False) -> None:
        self._token = token
        self._id = token.id
        self._serializer = serializer
        self._manager = manager
        if authkey is None:
            authkey = manager._authkey if manager is not None else \
                process.current_process().authkey
        # (AuthenticationString is not in typeshed)
        self._authkey = process.AuthenticationString(authkey)  # type: ignore[attr-defined]
        self._owned_by_manager = manager_owned
        self._server = _local_server(token)
        if incref:
            self._incref()

    # -- calls ---------------------------------------------------------------------------
    def _callmethod(self, methodname: str, args: tuple = (), kwds: Optional[dict] = None) -> Any:
        """Call ``methodname`` of the managed object and return its result."""
        address = self._address()
        if self._server is not None:
            data = self._server.hub.call(address, MANAGER_OID, "call", self._id, methodname,
                                         _payload(args, kwds), take_decrefs(address))
        else:
            # one pickle for the whole call: a lone call's frame is then the plainest kind
            request = serialization.encode((self._id, methodname, args, kwds))
            line = line_for(address, bytes(self._authkey))
            decrefs = take_decrefs(address)
            data = (line.call("scall", request, decrefs) if decrefs
                    else line.call("scall", request))
        return self._decode(data)

    def _call_async(self, methodname: str, args: tuple = (),
                    kwds: Optional[dict] = None) -> "ProxyHandle":
        """Start ``methodname`` on the server and return a :class:`ProxyHandle` at once.

        Calls to one object run in the order they arrive, one at a time;
        calls to different objects run in parallel.
        """
        payload = _payload(args, kwds)
        address = self._address()
        hub = self._hub()
        try:
            handle = hub.call_async(address, MANAGER_OID, "spawn", self._id, methodname,
                                    payload, take_decrefs(address),
                                    inline=_in_flight.start(address))
        except TransportError as exc:
            _in_flight.done(address)
            raise lost_error(address, exc) from exc
        handle.add_done_callback(lambda _h: _in_flight.done(address))
        return ProxyHandle(handle, self, methodname)

    _line: Optional[PipelinedLine] = None   # made by the first _call_pipelined

    def _call_pipelined(self, methodname: str, args: tuple = (),
                        kwds: Optional[dict] = None) -> Any:
        """Send ``methodname`` on this proxy's own pipelined line; a handle at once.

        For a client that asks for its next result before it needs it. Unlike
        :meth:`_call_async` no thread of the hub is on the way: the reply is read
        by the thread that waits for it, which saves about a thread hand-over's
        CPU per call. The calls sent this way run one at a time in the order
        sent, in the server thread of this proxy's line: one that blocks holds up
        the ones sent after it this way, and nothing else.
        """
        if self._server is not None:   # inside the object's own server: no line to it
            return self._call_async(methodname, args, kwds)
        payload = _payload(args, kwds)
        address = self._token.address
        line = self._line
        if line is None or line.broken or line.closed:
            # connected outside the lock: a server slow to accept holds up no other
            # proxy; of two threads that connect at once, the second's line is closed
            fresh = PipelinedLine(address, bytes(self._authkey))
            with _line_lock:
                line = self._line
                if line is None or line.broken or line.closed:
                    line = self._line = fresh
            if line is not fresh:
                fresh.close()
        rid = line.submit("call", self._id, methodname, payload, take_decrefs(address))
        return PipelinedHandle(line, rid, self, methodname)

    def _address(self) -> str:
        """Where calls go: the token's address, or our own server's inside it."""
        return self._server.address if self._server is not None else self._token.address

    def _hub(self) -> Any:
        """The hub this proxy's async calls and liveness pings go through."""
        return self._server.hub if self._server is not None else hub_for(bytes(self._authkey))

    def _decode(self, data: bytes) -> Any:
        outer = getattr(_decoding, "context", None)
        _decoding.context = (self._token.address, bytes(self._authkey))
        try:
            result = serialization.loads(data)
        finally:
            _decoding.context = outer
        if isinstance(result, ProxyRef):
            return self._adopt(result)
        return result

    def _adopt(self, ref: ProxyRef) -> "BaseProxy":
        """A proxy for an object the server created for us (it already counts our reference)."""
        proxy = ref.proxytype(ref.token, self._serializer, manager=self._manager,
                              authkey=bytes(self._authkey), exposed=ref.exposed, incref=False)
        proxy._track()
        return proxy

    def _getvalue(self) -> Any:
        """A copy of the managed object."""
        return self._callmethod("#GETVALUE")

    # -- reference counting ------------------------------------------------------------------
    def _incref(self) -> None:
        if self._owned_by_manager:
            return
        line_for(self._token.address, bytes(self._authkey)).call("incref", self._id)
        self._track()

    def _track(self) -> None:
        if self._owned_by_manager:
            return
        decref_queue(self._address())
        # (inline, in the collecting thread: noting a decref only appends to a deque)
        finalizer = weakref.finalize(self, note_decref, self._address(), self._id)
        finalizer.atexit = False
        self._decref_finalizer = finalizer

    # -- pickling and display ---------------------------------------------------------------
    def __reduce__(self) -> tuple:
        kwds: dict = {}
        if get_spawning_popen() is not None:
            kwds["authkey"] = self._authkey   # the run's secret is not written (serialization)
        if getattr(self, "_isauto", False):
            kwds["exposed"] = self._exposed_
            return (RebuildProxy, (_auto_factory(type(self)), self._token, self._serializer,
                                   kwds))
        return (RebuildProxy, (type(self), self._token, self._serializer, kwds))

    def __deepcopy__(self, memo: dict) -> Any:
        return self._getvalue()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} object, typeid {self._token.typeid!r} at {id(self):#x}>"

    def __str__(self) -> str:
        try:
            return BaseProxy._callmethod(self, "__repr__")
        except Exception:
            return repr(self)[:-1] + "; '__str__()' failed>"


def RebuildProxy(func: Callable[..., BaseProxy], token: Token, serializer: str,
                 kwds: dict) -> BaseProxy:
    """Rebuild a pickled proxy; inside its own server it keeps the object alive."""
    server = _local_server(token)
    if server is not None:
        kwds["manager_owned"] = True
        server.service.pin(token.id)
    context = getattr(_decoding, "context", None)
    if "authkey" not in kwds and context is not None and context[0] == token.address:
        kwds["authkey"] = context[1]  # a proxy its own server returned: same key
    incref = kwds.pop("incref", True) and not getattr(process.current_process(),
                                                      "_inheriting", False)
    return func(token, serializer, incref=incref, **kwds)


class ProxyHandle:
    """The pending result of an asynchronous proxy call.

    Example:
        >>> h = calc.add(1, 2)          # doctest: +SKIP
        >>> h.ready(), h.get(timeout=5)  # doctest: +SKIP
        (True, 3)
    """

    __slots__ = ("_handle", "_proxy", "_method", "_value", "_decoded")

    def __init__(self, handle: Handle, proxy: BaseProxy, method: str) -> None:
        self._handle = handle
        self._proxy = proxy
        self._method = method
        self._decoded = False
        self._value: Any = None

    def ready(self) -> bool:
        return self._handle.ready()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the result is in; returns whether it is."""
        return self._handle.wait(timeout)

    def successful(self) -> bool:
        return self._handle.successful()

    def get(self, timeout: Optional[float] = None) -> Any:
        """The result; re-raises the remote exception (traceback as ``__cause__``).

        Raises:
            HandleTimeout: no result within ``timeout`` seconds.
            RemoteObjectError: the manager server is gone.
        """
        if self._decoded:
            return self._value
        if timeout is None:
            data = self._proxy._hub().wait(self._handle, self._proxy._address())
        elif not self._handle.wait(timeout):
            raise HandleTimeout(f"{self._method}() of {self._proxy._token.typeid} "
                                f"{self._proxy._id} gave no result within {timeout} s")
        else:
            data = self._handle.get(0)
        self._value, self._decoded = self._proxy._decode(data), True
        return self._value

    def add_done_callback(self, fn: Callable[["ProxyHandle"], None]) -> None:
        """Run ``fn(handle)`` when the result arrives (in the thread that receives it)."""
        self._handle.add_done_callback(lambda _h: fn(self))

    def __repr__(self) -> str:
        state = "ready" if self.ready() else "pending"
        return f"<ProxyHandle {self._method}() of {self._proxy._token.typeid} {state}>"


class PipelinedHandle(ProxyHandle):
    """The pending result of a call on a line (an :class:`AsyncProxy`'s call, or
    :meth:`BaseProxy._call_pipelined`): a :class:`ProxyHandle`. The reply is read by
    whichever thread asks for it (``get``, ``wait``, ``ready``). A handle dropped
    unread lets its reply be discarded when it comes."""

    __slots__ = ("_line", "_rid", "_done", "_ok", "_reply", "_waiting")

    def __init__(self, line: PipelinedLine, rid: int, proxy: BaseProxy, method: str) -> None:
        self._line = line
        self._rid = rid
        self._proxy = proxy
        self._method = method
        self._value: Any = None
        self._done = False
        self._ok = True
        self._reply: Any = None   # the reply taken from the line, until decoded
        self._waiting = threading.Lock()   # held by the thread that takes the reply

    def ready(self) -> bool:
        return self._done or self._reply is not None or self._line.ready(self._rid)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the result is in; returns whether it is. Several threads may wait."""
        if self._done:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._waiting.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return self._done
        try:
            if not self._done:
                self._take(None if deadline is None
                           else max(0.0, deadline - time.monotonic()))
        finally:
            self._waiting.release()
        return self._done

    def _take(self, timeout: Optional[float]) -> None:
        if self._reply is None:
            try:
                self._reply = self._line.reply(self._rid, timeout)
            except ReplyTimeout:
                return
            except RemoteObjectError as exc:
                self._value, self._ok, self._done = exc, False, True
                return
        try:
            self._value = self._proxy._decode(_value(self._reply))
        except Exception as exc:   # what the call raised, or an unpicklable result
            self._value, self._ok = exc, False
        self._done = True
        self._reply = None

    def successful(self) -> bool:
        if not self.wait(0):
            raise ValueError(f"{self!r} not ready")
        return self._ok

    def get(self, timeout: Optional[float] = None) -> Any:
        """The result; re-raises the remote exception (traceback as ``__cause__``).

        Raises:
            HandleTimeout: no result within ``timeout`` seconds; call again to keep waiting.
            RemoteObjectError: the manager server is gone.
        """
        if not self.wait(timeout):
            raise HandleTimeout(f"{self._method}() of {self._proxy._token.typeid} "
                                f"{self._proxy._id} gave no result within {timeout} s")
        if not self._ok:
            raise self._value
        return self._value

    def add_done_callback(self, fn: Callable[["ProxyHandle"], None]) -> None:
        """Run ``fn(handle)`` once the result is in: now if it is, else in a thread
        that waits for it."""
        if self.ready():
            fn(self)
            return

        def wait_then_call() -> None:
            self.wait()
            fn(self)

        threading.Thread(target=wait_then_call, daemon=True,
                         name=f"fibrl-callback-{self._method}").start()

    def __del__(self) -> None:
        if not self._done:
            self._line.forget(self._rid)


_line_lock = threading.Lock()

OBJECT_LINES = 32   # objects of one server with a line of their own, per client process


class OnHub:
    """Held by every proxy of an object whose asynchronous calls go through the hub
    (past the line limit): while one such proxy lives, the object's other proxies in
    this process go that way too, so that all their calls stay in one order."""

    __slots__ = ("__weakref__",)


class _ObjectLines:
    """The lines of managed objects, one per (server, object, authkey) in this process,
    alive while a proxy holds it (closed with the last one). At most ``OBJECT_LINES``
    per server (each costs a connection and a thread in the server): further objects'
    calls go through the hub, each object's all one way."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: "weakref.WeakValueDictionary[tuple, PipelinedLine]" = \
            weakref.WeakValueDictionary()
        self._on_hub: "weakref.WeakValueDictionary[tuple, OnHub]" = \
            weakref.WeakValueDictionary()
        self._connecting: dict[tuple, int] = {}   # key -> its lines being connected

    def line(self, address: str, ident: str, authkey: bytes) -> PipelinedLine | OnHub:
        """The object's line, counting one more proxy that uses it (connected now if
        it has none); past the limit, or while another proxy of the object uses the
        hub, the object's :class:`OnHub` mark instead, for the proxy to keep."""
        key = (address, ident, authkey)
        with self._lock:
            mark = self._on_hub.get(key)
            if mark is not None:
                return mark
            line = self._lines.get(key)
            if line is not None and line.adopt():
                return line
            # other objects of this server with a line, or with one being connected
            # (two proxies of this object connecting at once share the one that wins)
            others = {k for k, v in list(self._lines.items())
                      if k[0] == address and k != key and v.usable}
            others.update(k for k in self._connecting if k[0] == address and k != key)
            if len(others) >= OBJECT_LINES:
                mark = self._on_hub[key] = OnHub()
                return mark
            self._connecting[key] = self._connecting.get(key, 0) + 1
        try:
            new = PipelinedLine(address, authkey)   # (connects: not under the lock)
        except BaseException:
            with self._lock:
                self._connected(key)
            raise
        with self._lock:   # (counted as connecting until it is in the table)
            self._connected(key)
            line = self._lines.get(key)
            if line is None or not line.adopt():
                self._lines[key] = line = new
                new.adopt()
        if line is not new:
            new.close()
        return line

    def _connected(self, key: tuple) -> None:
        left = self._connecting[key] - 1
        if left:
            self._connecting[key] = left
        else:
            del self._connecting[key]


_object_lines = _ObjectLines()


def _keep(mark: OnHub, _done: Handle) -> None:
    """A call's done-callback that holds ``mark`` (bound to it) until the call is answered."""


class AsyncProxy(BaseProxy):
    """A proxy whose method calls return a :class:`ProxyHandle` at once.

    A process's calls to one managed object go on a connection of that object's own
    (shared by its proxies in this process), read back by the thread that waits for
    a result: no reader thread is on the way. They run one at a time, in the order
    sent, with every other asynchronous call to that object; calls to different
    objects run in parallel. Past ``OBJECT_LINES`` objects of one server, a
    process's calls to further objects share its hub connection instead (same
    guarantees, a thread hand-over more per call).
    """

    _on_hub: Optional[OnHub] = None   # its object's calls go through the hub (held)
    _object_line: Optional[PipelinedLine] = None

    def __init__(self, *args: Any, **kwds: Any) -> None:
        # held while this proxy adopts a line (a connect): its own, so a server that is
        # slow to answer holds up no other proxy's first call
        self._adopting = threading.Lock()
        super().__init__(*args, **kwds)

    def _callmethod(self, methodname: str, args: tuple = (),
                    kwds: Optional[dict] = None) -> ProxyHandle:
        line = self._object_line
        if line is None or line.broken or line.closed:
            # (a proxy on the hub stays there: no lock to take for every call)
            line = None if self._on_hub is not None else self._adopt_line()
            if line is None:
                handle = self._call_async(methodname, args, kwds)
                mark = self._on_hub
                if mark is not None:
                    # the object stays on the hub until this call is answered, even if
                    # this proxy and the handle are dropped: a twin's call cannot overtake
                    handle._handle.add_done_callback(functools.partial(_keep, mark))
                return handle
        # one pickle for the whole call: a lone call's frame is then the plainest kind
        request = serialization.encode((self._id, methodname, args, kwds))
        decrefs = take_decrefs(self._token.address)
        rid = (line.submit("acall", request, decrefs, batch=True) if decrefs
               else line.submit("acall", request, batch=True))
        return PipelinedHandle(line, rid, self, methodname)

    def _adopt_line(self) -> Optional[PipelinedLine]:
        """This proxy's object line from now on (its first call, or its line was lost);
        None: its calls go through the hub (inside the server, past ``OBJECT_LINES``,
        or a proxy that sends no decref of its own)."""
        with self._adopting:   # (one adoption per proxy, whichever threads call at once)
            old = self._object_line
            if old is not None and not old.broken and not old.closed:
                return old
            if (self._server is not None or self._on_hub is not None
                    or self._decref_finalizer is None):
                return None
            line = _object_lines.line(self._token.address, self._id, bytes(self._authkey))
            if type(line) is OnHub:
                self._on_hub = line   # (a lost line's release sends the decref as usual)
                return None
            assert isinstance(line, PipelinedLine)
            if old is not None:   # lost: this proxy goes on with the new one
                old.drop()
            # its decref goes on that line when it is collected, after its calls there
            # (a proxy adopting a line again after losing one had moved it already)
            self._decref_finalizer.detach()
            self._decref_finalizer = Finalizer(self, line.release, self._id)
            self._object_line = line
            return line

    def _getvalue(self) -> Any:
        """A copy of the managed object (synchronously)."""
        return BaseProxy._callmethod(self, "#GETVALUE")


def _method(name: str) -> Callable[..., Any]:
    def call(self: BaseProxy, /, *args: Any, **kwds: Any) -> Any:
        return self._callmethod(name, args, kwds)

    call.__name__ = name
    return call


# (the stdlib's signature: ``_cache`` is the shared cache on purpose)
def MakeProxyType(name: str, exposed: Any, _cache: dict = {}, *,  # noqa: B006
                  base: type[BaseProxy] = BaseProxy) -> type[BaseProxy]:
    """A proxy class with one method per name in ``exposed`` (cached per name+exposed)."""
    exposed = tuple(exposed)
    key = (name, exposed, base)
    proxytype: Optional[type[BaseProxy]] = _cache.get(key)
    if proxytype is None:
        namespace = {meth: _method(meth) for meth in exposed}
        proxytype = cast("type[BaseProxy]", type(name, (base,), namespace))
        proxytype._exposed_ = exposed
        _cache[key] = proxytype
    return proxytype


def _auto(token: Token, serializer: str, manager: Any, authkey: Optional[bytes],
          exposed: Optional[tuple], incref: bool, manager_owned: bool, base: type) -> BaseProxy:
    if authkey is None:
        authkey = manager._authkey if manager is not None else \
            process.current_process().authkey
    if exposed is None:
        exposed = line_for(token.address, bytes(authkey)).call("get_methods", token.id)
    if base is AsyncProxy:
        exposed = tuple(name for name in exposed if not name.startswith("__"))
    kind = "AsyncAutoProxy" if base is AsyncProxy else "AutoProxy"
    proxytype = MakeProxyType(f"{kind}[{token.typeid}]", exposed, base=base)
    proxy = proxytype(token, serializer, manager=manager, authkey=authkey, incref=incref,
                      manager_owned=manager_owned)
    proxy._isauto = True
    return proxy


def AutoProxy(token: Token, serializer: str = "pickle", manager: Any = None,
              authkey: Optional[bytes] = None, exposed: Optional[tuple] = None,
              incref: bool = True, manager_owned: bool = False) -> BaseProxy:
    """A proxy exposing the object's public methods (or ``exposed``), built on the fly."""
    return _auto(token, serializer, manager, authkey, exposed, incref, manager_owned, BaseProxy)


def AsyncAutoProxy(token: Token, serializer: str = "pickle", manager: Any = None,
                   authkey: Optional[bytes] = None, exposed: Optional[tuple] = None,
                   incref: bool = True, manager_owned: bool = False) -> BaseProxy:
    """Like :func:`AutoProxy`, but every method returns a :class:`ProxyHandle`."""
    return _auto(token, serializer, manager, authkey, exposed, incref, manager_owned,
                 AsyncProxy)


def _auto_factory(cls: type) -> Callable[..., BaseProxy]:
    return AsyncAutoProxy if issubclass(cls, AsyncProxy) else AutoProxy


# -- the proxy types of SyncManager (same names and methods as the stdlib's) ---------------------
class IteratorProxy(BaseProxy):
    _exposed_ = ("__next__", "send", "throw", "close")

    def __iter__(self) -> "IteratorProxy":
        return self

    def __next__(self, *args: Any) -> Any:
        return self._callmethod("__next__", args)

    def send(self, *args: Any) -> Any:
        return self._callmethod("send", args)

    def throw(self, *args: Any) -> Any:
        return self._callmethod("throw", args)

    def close(self, *args: Any) -> Any:
        return self._callmethod("close", args)


class AcquirerProxy(BaseProxy):
    _exposed_: tuple = ("acquire", "release")

    def acquire(self, blocking: bool = True, timeout: Optional[float] = None) -> bool:
        args = (blocking,) if timeout is None else (blocking, timeout)
        return self._callmethod("acquire", args)

    def release(self) -> None:
        return self._callmethod("release")

    def __enter__(self) -> bool:
        return self._callmethod("acquire")

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        return self._callmethod("release")


class ConditionProxy(AcquirerProxy):
    _exposed_ = ("acquire", "release", "wait", "notify", "notify_all")

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._callmethod("wait", (timeout,))

    def notify(self, n: int = 1) -> None:
        return self._callmethod("notify", (n,))

    def notify_all(self) -> None:
        return self._callmethod("notify_all")

    def wait_for(self, predicate: Callable[[], Any], timeout: Optional[float] = None) -> Any:
        from ..synchronize import wait_for

        return wait_for(self.wait, predicate, timeout)


class EventProxy(BaseProxy):
    _exposed_ = ("is_set", "set", "clear", "wait")

    def is_set(self) -> bool:
        return self._callmethod("is_set")

    def set(self) -> None:
        return self._callmethod("set")

    def clear(self) -> None:
        return self._callmethod("clear")

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._callmethod("wait", (timeout,))


class BarrierProxy(BaseProxy):
    _exposed_ = ("__getattribute__", "wait", "abort", "reset")

    def wait(self, timeout: Optional[float] = None) -> int:
        return self._callmethod("wait", (timeout,))

    def abort(self) -> None:
        return self._callmethod("abort")

    def reset(self) -> None:
        return self._callmethod("reset")

    @property
    def parties(self) -> int:
        return self._callmethod("__getattribute__", ("parties",))

    @property
    def n_waiting(self) -> int:
        return self._callmethod("__getattribute__", ("n_waiting",))

    @property
    def broken(self) -> bool:
        return self._callmethod("__getattribute__", ("broken",))


class NamespaceProxy(BaseProxy):
    _exposed_ = ("__getattribute__", "__setattr__", "__delattr__")

    def __getattr__(self, key: str) -> Any:
        if key[0] == "_":
            return object.__getattribute__(self, key)
        return object.__getattribute__(self, "_callmethod")("__getattribute__", (key,))

    def __setattr__(self, key: str, value: Any) -> None:
        if key[0] == "_":
            object.__setattr__(self, key, value)
            return
        object.__getattribute__(self, "_callmethod")("__setattr__", (key, value))

    def __delattr__(self, key: str) -> None:
        if key[0] == "_":
            object.__delattr__(self, key)
            return
        object.__getattribute__(self, "_callmethod")("__delattr__", (key,))


class ValueProxy(BaseProxy):
    _exposed_ = ("get", "set")

    def get(self) -> Any:
        return self._callmethod("get")

    def set(self, value: Any) -> None:
        return self._callmethod("set", (value,))

    value = property(get, set)


BaseListProxy = MakeProxyType("BaseListProxy", (
    "__add__", "__contains__", "__delitem__", "__getitem__", "__len__", "__mul__",
    "__reversed__", "__rmul__", "__setitem__", "append", "count", "extend", "index",
    "insert", "pop", "remove", "reverse", "sort", "__imul__"))


class ListProxy(BaseListProxy):  # type: ignore[misc, valid-type]
    def __iadd__(self, value: Any) -> "ListProxy":
        self._callmethod("extend", (value,))
        return self

    def __imul__(self, value: Any) -> "ListProxy":
        self._callmethod("__imul__", (value,))
        return self


DictProxy = MakeProxyType("DictProxy", (
    "__contains__", "__delitem__", "__getitem__", "__iter__", "__len__", "__setitem__",
    "clear", "copy", "get", "items", "keys", "pop", "popitem", "setdefault", "update",
    "values"))
DictProxy._method_to_typeid_ = {"__iter__": "Iterator"}

ArrayProxy = MakeProxyType("ArrayProxy", ("__len__", "__getitem__", "__setitem__"))

BasePoolProxy = MakeProxyType("PoolProxy", (
    "apply", "apply_async", "close", "imap", "imap_unordered", "join", "map", "map_async",
    "starmap", "starmap_async", "terminate"))
BasePoolProxy._method_to_typeid_ = {
    "apply_async": "AsyncResult", "map_async": "AsyncResult", "starmap_async": "AsyncResult",
    "imap": "Iterator", "imap_unordered": "Iterator",
}


class PoolProxy(BasePoolProxy):  # type: ignore[misc, valid-type]
    def __enter__(self) -> "PoolProxy":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.terminate()

