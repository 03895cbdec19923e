"""Contexts: the factories behind ``fibrl.Process``, ``fibrl.Queue``, ...

As in ``multiprocessing.context``, every factory imports its implementation
when called, so ``import fibrl`` stays cheap and imports no backend. A context
is bound to a backend; the default context follows the config in force, which
``fibrl.init(**kw)`` (or ``set_start_method``) sets. The config in force is
owned by ``runtime`` (the bottom layer, so the hosting core never asks this
module for it); the default context reads and sets it there.

Start methods map to backends: ``"local"`` (and the stdlib names ``"spawn"``,
``"fork"``, ``"forkserver"``, which all start fresh local interpreters:
nng cannot survive a fork), ``"docker"`` and ``"kubernetes"``.
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Any, Optional

from . import process
from .hosting import runtime
from .config import BACKENDS, Config, resolve
from .errors import AuthenticationError
from .hosting.runtime import current_config, install_config

__all__ = ["BaseContext", "DefaultContext", "default_context", "current_config", "install_config",
           "init"]

_ALIASES = {"spawn": "local", "fork": "local", "forkserver": "local"}


def _backend_of(method: Optional[str]) -> str:
    name = None if method is None else _ALIASES.get(method, method)
    if name is None or name not in BACKENDS:
        raise ValueError(
            f"cannot find context for {method!r}: fibrl start methods are "
            f"{', '.join(BACKENDS)} (and spawn/fork/forkserver, which mean local)")
    return name


class BaseContext:
    """The factories of one backend. Method names and signatures follow ``multiprocessing``."""

    ProcessError = multiprocessing.ProcessError
    BufferTooShort = multiprocessing.BufferTooShort
    TimeoutError = multiprocessing.TimeoutError
    AuthenticationError = AuthenticationError

    current_process = staticmethod(process.current_process)
    parent_process = staticmethod(process.parent_process)
    active_children = staticmethod(process.active_children)

    _backend: Optional[str] = None

    @property
    def config(self) -> Config:
        """The config this context starts workers with."""
        base = current_config()
        if self._backend and base.backend != self._backend:
            return base.replace(backend=self._backend)
        return base

    @property
    def Process(self) -> type:
        if self._backend is None:
            return process.Process
        return _process_class(self._backend)

    def cpu_count(self) -> int:
        """Number of CPUs of the backend's view (this machine for local and docker)."""
        return runtime.backend(self.config).cpu_count()

    def Manager(self):
        """A started :class:`fibrl.managers.SyncManager`."""
        from .managers import SyncManager

        manager = SyncManager(ctx=self.get_context())
        manager.start()
        return manager

    def Pipe(self, duplex: bool = True):
        """Two connected :class:`fibrl.connection.Connection` objects."""
        from .connection import Pipe

        return Pipe(duplex)

    def Lock(self):
        from .synchronize import Lock

        return Lock(ctx=self.get_context())

    def RLock(self):
        from .synchronize import RLock

        return RLock(ctx=self.get_context())

    def Condition(self, lock=None):
        from .synchronize import Condition

        return Condition(lock, ctx=self.get_context())

    def Semaphore(self, value: int = 1):
        from .synchronize import Semaphore

        return Semaphore(value, ctx=self.get_context())

    def BoundedSemaphore(self, value: int = 1):
        from .synchronize import BoundedSemaphore

        return BoundedSemaphore(value, ctx=self.get_context())

    def Event(self):
        from .synchronize import Event

        return Event(ctx=self.get_context())

    def Barrier(self, parties: int, action=None, timeout: Optional[float] = None):
        from .synchronize import Barrier

        return Barrier(parties, action, timeout, ctx=self.get_context())

    def Queue(self, maxsize: int = 0):
        from .queues import Queue

        return Queue(maxsize, ctx=self.get_context())

    def JoinableQueue(self, maxsize: int = 0):
        from .queues import JoinableQueue

        return JoinableQueue(maxsize, ctx=self.get_context())

    def SimpleQueue(self):
        from .queues import SimpleQueue

        return SimpleQueue(ctx=self.get_context())

    def Pool(self, processes: Optional[int] = None, initializer=None, initargs: tuple = (),
             maxtasksperchild: Optional[int] = None, **kwargs: Any):
        from .pool import Pool

        return Pool(processes, initializer, initargs, maxtasksperchild,
                    context=self.get_context(), **kwargs)

    def RawValue(self, typecode_or_type, *args):
        from .sharedctypes import RawValue

        return RawValue(typecode_or_type, *args)

    def RawArray(self, typecode_or_type, size_or_initializer):
        from .sharedctypes import RawArray

        return RawArray(typecode_or_type, size_or_initializer)

    def Value(self, typecode_or_type, *args, lock=True):
        from .sharedctypes import Value

        return Value(typecode_or_type, *args, lock=lock, ctx=self.get_context())

    def Array(self, typecode_or_type, size_or_initializer, *, lock=True):
        from .sharedctypes import Array

        return Array(typecode_or_type, size_or_initializer, lock=lock, ctx=self.get_context())

    def freeze_support(self) -> None:
        """Nothing to do: fibrl workers are started with ``python -m fibrl.bootstrap``."""

    def get_logger(self):
        from multiprocessing.util import get_logger

        return get_logger()

    def log_to_stderr(self, level=None):
        from multiprocessing.util import log_to_stderr

        return log_to_stderr(level)

    def allow_connection_pickling(self) -> None:
        """Nothing to do: fibrl connections are always picklable."""

    def set_executable(self, executable: str) -> None:
        """Choose the interpreter of local workers, as ``multiprocessing.set_executable``
        does for spawn (it sets the same value). Containers and pods run their
        image's python: there it raises NotImplementedError."""
        backend = self.get_start_method()
        if backend != "local":
            raise NotImplementedError(
                f"set_executable() chooses the interpreter of local workers; {backend} "
                f"workers run the python of their image ({self.config.image}). Fix: build "
                f"an image with the interpreter you need and pass it as "
                f"fibrl.init(image=...), or use the local backend.")
        from multiprocessing import spawn

        spawn.set_executable(executable)

    def set_forkserver_preload(self, module_names) -> None:
        """Accepted for compatibility, and ignored: the local backend's fork server
        preloads fibrl's own modules (a worker imports the rest itself, as a spawned
        one does)."""

    def get_context(self, method: Optional[str] = None) -> "BaseContext":
        if method is None:
            return self
        return _contexts[_backend_of(method)]

    def get_start_method(self, allow_none: bool = False) -> str:
        return self._backend or default_context.get_start_method(allow_none)

    def set_start_method(self, method: Optional[str], force: bool = False) -> None:
        raise ValueError("cannot set start method of concrete context")

    def get_all_start_methods(self) -> list:
        return list(BACKENDS)

    @property
    def reducer(self):
        from multiprocessing import reduction

        return reduction.ForkingPickler


_process_classes: dict = {}


def _process_class(backend: str) -> type:
    cls = _process_classes.get(backend)
    if cls is None:
        cls = type(f"{backend.capitalize()}Process", (process.Process,),
                   {"_context_backend": backend, "__module__": __name__})
        _process_classes[backend] = cls
    return cls


class BackendContext(BaseContext):
    """A context that always uses one backend: ``fibrl.get_context("docker")``."""

    def __init__(self, backend: str) -> None:
        self._backend = backend


class DefaultContext(BaseContext):
    """The context behind the module-level functions; sets the config in force
    (kept by ``runtime``)."""

    @property
    def config(self) -> Config:
        return current_config()

    def init(self, **settings: Any) -> Config:
        """Set the config in force: ``settings`` > FIBRL_* env > .fibrlconfig > defaults."""
        return install_config(resolve(settings))

    def get_start_method(self, allow_none: bool = False) -> str:
        resolved, _ = runtime.config_is_set()
        if not resolved and allow_none and not _env_sets_backend():
            return None  # type: ignore[return-value]
        return self.config.backend

    def set_start_method(self, method: Optional[str], force: bool = False) -> None:
        if runtime.config_is_set()[1] and not force:
            raise RuntimeError("context has already been set")
        if method is None and force:
            runtime.reset_config()
            return
        self.init(backend=_backend_of(method))

    def get_context(self, method: Optional[str] = None) -> BaseContext:
        if method is None:
            return self
        return _contexts[_backend_of(method)]


def _env_sets_backend() -> bool:
    return "FIBRL_BACKEND" in os.environ


default_context = DefaultContext()
_contexts: dict = {name: BackendContext(name) for name in BACKENDS}


def init(**settings: Any) -> Config:
    """Choose the backend and options for this program.

    Precedence: these keyword arguments > ``FIBRL_*`` environment variables >
    a ``.fibrlconfig`` file > defaults. Unknown keys raise
    :class:`fibrl.errors.ConfigError` listing the valid ones.

    Example:
        >>> import fibrl
        >>> fibrl.init(backend="local").backend
        'local'
    """
    return default_context.init(**settings)
