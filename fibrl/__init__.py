"""fibrl: ``multiprocessing`` code, with workers on local processes, docker or kubernetes.

Change ``import multiprocessing as mp`` to ``import fibrl as mp``. This module
only re-exports the default context's methods (as the stdlib does); each
factory imports its implementation when first called, so importing fibrl opens
no socket, starts no thread, reads no file and imports no backend.

Example:
    >>> import fibrl as mp
    >>> q = mp.Queue()
    >>> p = mp.Process(target=q.put, args=(42,)); p.start()
    >>> q.get(timeout=30)
    42
    >>> p.join()
"""
from __future__ import annotations

from .context import default_context, init
from .errors import AuthenticationError
from .meta import meta
from .process import Process

from ._version import __version__  # noqa: E402

from multiprocessing import BufferTooShort, ProcessError, TimeoutError  # noqa: E402

_METHODS = (
    "Array", "Barrier", "BoundedSemaphore", "Condition", "Event", "JoinableQueue", "Lock",
    "Manager", "Pipe", "Pool", "Queue", "RLock", "RawArray", "RawValue", "Semaphore",
    "SimpleQueue", "Value", "active_children", "allow_connection_pickling", "cpu_count",
    "current_process", "freeze_support", "get_all_start_methods", "get_context",
    "get_logger", "get_start_method", "log_to_stderr", "parent_process", "set_executable",
    "set_forkserver_preload", "set_start_method",
)
globals().update({name: getattr(default_context, name) for name in _METHODS})
reducer = default_context.reducer

__all__ = sorted(_METHODS + (
    "AuthenticationError", "BufferTooShort", "Process", "ProcessError", "TimeoutError",
    "init", "meta", "reducer",
))
