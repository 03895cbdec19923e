"""``BaseManager``, ``SyncManager`` and ``AsyncManager``: starting, reaching and stopping servers.

``start()`` runs the server as a fibrl Process on the context's backend (a
local process, a docker container or a kubernetes pod, labelled
``fibrl.role=manager``); the server reports its address back through a
one-shot service in this process's hub. ``connect()`` reaches a server
started elsewhere (``get_server().serve_forever()``) by address and authkey.
``shutdown()`` (also run by ``with``, by garbage collection of the manager and
at interpreter exit, before the hub closes) asks the server to stop, then
terminates and finally kills it if it does not exit in time.

Data flow of ``start()``::

    this process                                   manager process (fibrl worker)
    _StartReport service <-- ready(address) ------  Server(registry, address, authkey)
    wait: report pipe or process sentinel            serve_forever() until shutdown
    Finalize(shutdown, exitpriority=0)  -- shutdown -->  stop, close hub, exit

The registry semantics are ``multiprocessing.managers``' (``register`` with
``callable``, ``proxytype``, ``exposed``, ``method_to_typeid``,
``create_method``); the objects live in ``server``; proxies in ``proxies``.
"""
from __future__ import annotations

import array
import os
import queue
import signal
import threading
from dataclasses import dataclass
from multiprocessing import ProcessError, process, util
from multiprocessing.connection import wait as wait_fds
from typing import Any, Callable, Optional

from ..wire import serialization
from ..errors import BackendError, describe_exitcode
from ..hosting.hub import ReplySink, Service, get_hub
from ..janitor import Finalizer
from ..wire.messages import RemoteError
from .lines import MANAGER_OID, close_lines, hub_for, line_for, take_decrefs
from .proxies import (AcquirerProxy, ArrayProxy, AsyncAutoProxy, AutoProxy, BarrierProxy,
                      ConditionProxy, DictProxy, EventProxy, IteratorProxy, ListProxy,
                      NamespaceProxy, PoolProxy, ValueProxy)
from .server import Registration, Server, Token, connect_address

__all__ = ["BaseManager", "SyncManager", "AsyncManager", "State", "Namespace", "Value",
           "Array"]


class State:
    """The life of a manager: ``INITIAL`` -> ``STARTED`` -> ``SHUTDOWN``."""

    __slots__ = ["value"]
    INITIAL = 0
    STARTED = 1
    SHUTDOWN = 2

    def __init__(self) -> None:
        self.value = State.INITIAL


# -- start-up report ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StartReport:
    """Where the manager process reports: this process's hub address and the service id."""

    address: str
    oid: str


class _StartReportService(Service):
    """Receives the server's address (or its start-up error) once, then wakes the starter."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        self.ok: Optional[bool] = None
        self.value: Any = None

    def _done(self, ok: bool, value: Any) -> None:
        if self.ok is None:
            self.ok, self.value = ok, value
            os.write(self._write_fd, b"x")

    def op_ready(self, reply: ReplySink, address: str) -> None:
        self._done(True, address)
        reply(None)

    def op_failed(self, reply: ReplySink, error: BaseException) -> None:
        self._done(False, error)  # unpickled with the server's traceback as __cause__
        reply(None)

    def closed(self) -> None:
        os.close(self.read_fd)
        os.close(self._write_fd)


def _run_server(registry: dict, address: Any, authkey: Any, serializer: str,
                report: StartReport, initializer: Optional[Callable[..., Any]],
                initargs: tuple) -> None:
    """The manager process's target: build the server, report its address, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, as in the stdlib
    hub = get_hub()
    try:
        if initializer is not None:
            initializer(*initargs)
        server = Server(registry, address, authkey, serializer)
    except BaseException as exc:
        hub.call(report.address, report.oid, "failed", RemoteError.capture(exc), timeout=30)
        raise
    # (the stdlib's own mark of a manager process; typeshed does not declare it)
    process.current_process()._manager_server = server  # type: ignore[attr-defined]
    hub.call(report.address, report.oid, "ready", server.address, timeout=30)
    server.serve_forever()


# -- managers -------------------------------------------------------------------------------------
class BaseManager:
    """Starts or connects to a manager server and creates shared objects in it.

    Same signature as ``multiprocessing.managers.BaseManager``. ``address`` is
    ``(host, port)``, ``"host:port"`` or ``"tcp://host:port"``; when it is None
    the server listens on the config's ``listen_host`` and a free port, and
    :attr:`address` tells where (as a ``tcp://`` URL). ``authkey`` defaults
    to this process's authkey; the server's listener accepts only it.

    Example:
        >>> class Calc:
        ...     def add(self, a, b): return a + b
        >>> class MyManager(BaseManager): pass
        >>> MyManager.register("Calc", Calc)
        >>> with MyManager() as m:          # doctest: +SKIP
        ...     m.Calc().add(1, 2)
        3
    """

    _registry: dict = {}
    _default_proxytype: Callable[..., Any] = AutoProxy

    def __init__(self, address: Any = None, authkey: Optional[bytes] = None,
                 serializer: str = "pickle", ctx: Any = None, *,
                 shutdown_timeout: float = 1.0) -> None:
        if serializer != "pickle":
            raise ValueError(f"serializer {serializer!r} is not supported: fibrl managers "
                             f"use pickle (with cloudpickle for lambdas and closures).")
        if authkey is None:
            authkey = process.current_process().authkey
        self._address = address
        # (AuthenticationString is not in typeshed)
        self._authkey = process.AuthenticationString(authkey)  # type: ignore[attr-defined]
        self._state = State()
        self._state.value = State.INITIAL
        self._serializer = serializer
        self._ctx = ctx
        self._shutdown_timeout = shutdown_timeout
        self._process: Any = None

    @property
    def address(self) -> Any:
        """The server's address (a ``tcp://host:port`` URL once started)."""
        return self._address

    def get_server(self) -> Server:
        """A server for this manager's registry in this process (``serve_forever()`` it)."""
        if self._state.value != State.INITIAL:
            raise ProcessError(f"Already started server (state {self._state.value})"
                               if self._state.value == State.STARTED else
                               "Manager has shut down")
        return Server(self._registry, self._address, bytes(self._authkey), self._serializer)

    def connect(self) -> None:
        """Connect to a server already running at ``address`` (a wrong authkey raises
        :class:`fibrl.AuthenticationError`)."""
        self._address = connect_address(self._address)
        line_for(self._address, bytes(self._authkey)).call("dummy")
        self._state.value = State.STARTED

    def start(self, initializer: Optional[Callable[..., Any]] = None, initargs: tuple = (), *,
              timeout: Optional[float] = None) -> None:
        """Start the server as a fibrl Process on the backend and wait until it listens.

        Args:
            initializer: called as ``initializer(*initargs)`` in the server first.
            timeout: keyword extra: seconds to wait for the server (None: until it
                reports or its process ends; the backend's start_timeout bounds it).
        """
        self._check_startable(initializer)
        hub = get_hub()
        report = _StartReportService()
        oid = hub.register(report)
        try:
            self._process = self._make_process(StartReport(hub.address, oid), initializer,
                                               initargs)
            self._process.start()
            self._address = self._await_report(report, timeout)
        finally:
            hub.unregister(oid)
        self._state.value = State.STARTED
        # At exit and when called: inline. When the manager is collected: on the janitor's
        # thread (a collection can run on a thread that holds one of fibrl's locks).
        self.shutdown = util.Finalize(  # type: ignore[method-assign]
            None, type(self)._finalize_manager,
            args=(self._process, self._address, bytes(self._authkey), self._state,
                  self._shutdown_timeout),
            exitpriority=0)
        Finalizer(self, self.shutdown)

    def _check_startable(self, initializer: Any) -> None:
        if self._state.value != State.INITIAL:
            if self._state.value == State.STARTED:
                raise ProcessError("Already started server")
            raise ProcessError("Manager has shut down")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")

    def _make_process(self, report: StartReport, initializer: Any, initargs: tuple) -> Any:
        from ..context import default_context

        ctx = self._ctx or default_context
        proc = ctx.Process(target=_run_server,
                           args=(self._registry, self._address, self._authkey,
                                 self._serializer, report, initializer, initargs))
        proc._fibrl_role = "manager"
        ident = ":".join(str(i) for i in proc._identity)
        proc.name = f"{type(self).__name__}-{ident}"
        return proc

    def _await_report(self, report: _StartReportService, timeout: Optional[float]) -> str:
        ready = wait_fds([report.read_fd, self._process.sentinel], timeout)
        if report.ok:
            return report.value
        if report.ok is False:
            self._process.join(self._shutdown_timeout)
            raise report.value  # its __cause__ is the server's traceback
        if not ready:
            self._process.kill()
            self._process.join()
            raise TimeoutError(f"the manager server did not start within {timeout} s; "
                               f"see its output above, or raise the timeout.")
        self._process.join()
        raise BackendError(
            f"the manager server process {self._process.name} ended before it listened "
            f"({describe_exitcode(self._process.exitcode)}). Its output (or the backend's "
            f"logs) says why; a registered callable that cannot be imported by the server "
            f"is a common cause.")

    def _create(self, typeid: str, /, *args: Any, **kwds: Any) -> tuple:
        """Create a managed object; returns its token and exposed methods."""
        address = self._address
        created = line_for(address, bytes(self._authkey)).call(
            "create", typeid, serialization.dumps((args, kwds)), take_decrefs(address))
        return Token(typeid, address, created.id), created.exposed

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the server process to exit."""
        if self._process is not None:
            self._process.join(timeout)
            if not self._process.is_alive():
                self._process = None

    def _debug_info(self) -> str:
        return line_for(self._address, bytes(self._authkey)).call("debug_info")

    def _number_of_objects(self) -> int:
        return line_for(self._address, bytes(self._authkey)).call(
            "number_of_objects", take_decrefs(self._address))

    def __enter__(self) -> "BaseManager":
        if self._state.value == State.INITIAL:
            self.start()
        if self._state.value != State.STARTED:
            raise ProcessError(f"Unable to enter manager (state {self._state.value!r})")
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the server this manager started (replaced by a finalizer by ``start``)."""
        self._state.value = State.SHUTDOWN

    @staticmethod
    def _finalize_manager(proc: Any, address: str, authkey: bytes, state: State,
                          shutdown_timeout: float) -> None:
        if proc.is_alive():
            try:
                hub_for(authkey).call(address, MANAGER_OID, "shutdown",
                                      timeout=shutdown_timeout)
            except Exception:
                pass  # already gone, or not answering: terminate below
            proc.join(timeout=shutdown_timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=shutdown_timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=shutdown_timeout)
        state.value = State.SHUTDOWN
        close_lines(address)

    @classmethod
    def register(cls, typeid: str, callable: Optional[Callable[..., Any]] = None,
                 proxytype: Any = None, exposed: Optional[Any] = None,
                 method_to_typeid: Optional[dict] = None, create_method: bool = True) -> None:
        """Register ``typeid``: the server makes objects with ``callable``, clients get
        ``proxytype`` proxies; ``create_method`` adds a ``manager.<typeid>(...)`` method."""
        if "_registry" not in cls.__dict__:
            cls._registry = cls._registry.copy()
        if proxytype is None:
            proxytype = cls._default_proxytype
        exposed = exposed or getattr(proxytype, "_exposed_", None)
        method_to_typeid = method_to_typeid or getattr(proxytype, "_method_to_typeid_", None)
        for key, value in (method_to_typeid or {}).items():
            if type(key) is not str or type(value) is not str:
                raise TypeError(f"method_to_typeid must map str to str, got {key!r}: {value!r}")
        cls._registry[typeid] = Registration(callable, tuple(exposed) if exposed else None,
                                             method_to_typeid, proxytype)
        if create_method:
            setattr(cls, typeid, _creator(typeid, proxytype))


def _creator(typeid: str, proxytype: Any) -> Callable[..., Any]:
    def create(self: BaseManager, /, *args: Any, **kwds: Any) -> Any:
        token, exposed = self._create(typeid, *args, **kwds)
        proxy = proxytype(token, self._serializer, manager=self, authkey=self._authkey,
                          exposed=exposed, incref=False)
        proxy._track()  # the server counted this proxy's reference when it created the object
        return proxy

    create.__name__ = typeid
    create.__qualname__ = f"BaseManager.{typeid}"
    return create


# -- the types SyncManager serves ------------------------------------------------------------------
class Namespace:
    """A plain attribute bag (``manager.Namespace(x=1)``)."""

    def __init__(self, /, **kwds: Any) -> None:
        self.__dict__.update(kwds)

    def __repr__(self) -> str:
        items = [f"{name}={value!r}" for name, value in self.__dict__.items()
                 if not name.startswith("_")]
        return f"{type(self).__name__}({', '.join(sorted(items))})"


class Value:
    """A value with ``get``/``set`` (``manager.Value(typecode, value)``)."""

    def __init__(self, typecode: Any, value: Any, lock: bool = True) -> None:
        self._typecode = typecode
        self._value = value

    def get(self) -> Any:
        return self._value

    def set(self, value: Any) -> None:
        self._value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._typecode!r}, {self._value!r})"

    value = property(get, set)


def Array(typecode: str, sequence: Any, lock: bool = True) -> array.array:
    """An ``array.array`` (``manager.Array(typecode, sequence)``)."""
    return array.array(typecode, sequence)


def _pool(*args: Any, **kwds: Any) -> Any:
    from ..pool import Pool

    return Pool(*args, **kwds)


class SyncManager(BaseManager):
    """The manager behind ``fibrl.Manager()``: queues, containers and locks in one server.

    Example:
        >>> with SyncManager() as m:        # doctest: +SKIP
        ...     d = m.dict(); d["x"] = m.list([1]); d["x"].append(2); d["x"][:]
        [1, 2]
    """


SyncManager.register("Queue", queue.Queue)
SyncManager.register("JoinableQueue", queue.Queue)
SyncManager.register("Event", threading.Event, EventProxy)
SyncManager.register("Lock", threading.Lock, AcquirerProxy)
SyncManager.register("RLock", threading.RLock, AcquirerProxy)
SyncManager.register("Semaphore", threading.Semaphore, AcquirerProxy)
SyncManager.register("BoundedSemaphore", threading.BoundedSemaphore, AcquirerProxy)
SyncManager.register("Condition", threading.Condition, ConditionProxy)
SyncManager.register("Barrier", threading.Barrier, BarrierProxy)
SyncManager.register("Pool", _pool, PoolProxy)
SyncManager.register("list", list, ListProxy)
SyncManager.register("dict", dict, DictProxy)
SyncManager.register("Value", Value, ValueProxy)
SyncManager.register("Array", Array, ArrayProxy)
SyncManager.register("Namespace", Namespace, NamespaceProxy)
SyncManager.register("Iterator", proxytype=IteratorProxy, create_method=False)
SyncManager.register("AsyncResult", create_method=False)


class AsyncManager(BaseManager):
    """A manager whose proxies return a :class:`~fibrl.managers.ProxyHandle` from every call.

    Calls to different objects (in one or many servers) run in parallel; calls
    to one object run one at a time in arrival order, so an object needs no
    locking of its own. ``handle.get(timeout)`` returns the result or
    re-raises the remote exception with its traceback.

    Example:
        >>> class Mgr(AsyncManager): pass
        >>> Mgr.register("Calc", Calc)      # doctest: +SKIP
        >>> m = Mgr(); m.start(); c = m.Calc()  # doctest: +SKIP
        >>> c.add(1, 2).get()               # doctest: +SKIP
        3
    """

    _registry: dict = {}
    _default_proxytype = AsyncAutoProxy
