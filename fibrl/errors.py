"""The exceptions fibrl raises, in one place.

Every library error maps an underlying one with ``raise X(...) from exc``, and
its message says what happened, the likely cause, the evidence and the fix.

Hierarchy::

    Exception
     +-- multiprocessing.ProcessError            (stdlib)
     |    +-- multiprocessing.BufferTooShort
     |    +-- multiprocessing.TimeoutError
     |    +-- multiprocessing.AuthenticationError
     |    |    +-- fibrl.errors.AuthenticationError   handshake failed
     |    +-- fibrl.errors.FibrlError            base of the library's own errors
     |         +-- ConfigError                   unknown key, bad value
     |         +-- TransportError                connection lost, bad frame
     |         |    +-- FrameError               bytes that are not a fibrl frame
     |         |    +-- ChannelClosed            the peer went away
     |         +-- BackendError                  engine/cluster unreachable, job failed to start
     |         +-- WorkerLostError               a worker died while holding tasks
     |         |    +-- TaskFailedError          a task killed its worker too many times
     |         +-- RemoteObjectError             a hosted object vanished (owner exited)
     |         +-- SerializationError            an object cannot be pickled (also a TypeError)
     +-- multiprocessing.pool.RemoteTraceback     (stdlib)
          +-- fibrl.errors.RemoteTraceback        carries a worker's formatted traceback,
                                                  chained as ``__cause__`` of a remote error
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.pool  # for RemoteTraceback's base (about 3 ms more on import)
import signal

__all__ = [
    "AuthenticationError", "BackendError", "ChannelClosed", "ConfigError", "FibrlError",
    "FrameError", "RemoteObjectError", "RemoteTraceback", "SerializationError",
    "TaskFailedError", "TransportError", "WorkerLostError", "describe_exitcode",
]


class FibrlError(multiprocessing.ProcessError):
    """Base class of the errors raised by fibrl itself."""


class AuthenticationError(multiprocessing.AuthenticationError):
    """A peer did not prove it knows the run's secret (or we could not prove it)."""


class ConfigError(FibrlError, ValueError):
    """A configuration key or value is invalid."""


class TransportError(FibrlError, OSError):
    """Sending or receiving a message failed."""


class FrameError(TransportError):
    """Received bytes are not a valid fibrl frame."""


class ChannelClosed(TransportError, EOFError):
    """The other end of a channel went away."""


class BackendError(FibrlError):
    """A backend could not start, watch or stop a job."""


class WorkerLostError(FibrlError):
    """A worker died (killed, OOM, container or pod gone) while it held work."""


class TaskFailedError(WorkerLostError):
    """A task killed its worker on every attempt it was given."""


class RemoteObjectError(FibrlError):
    """A hosted object (queue, lock, pipe...) no longer exists or its owner is gone."""


class SerializationError(FibrlError, TypeError):
    """An object could not be pickled or unpickled."""


class RemoteTraceback(multiprocessing.pool.RemoteTraceback):
    """The formatted traceback of an exception raised in another process.

    A ``multiprocessing.pool.RemoteTraceback``, so code written for the stdlib's
    pool that checks an error's ``__cause__`` keeps working.
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def describe_exitcode(code: int | None) -> str:
    """Render an exit code the way a person reads it: ``-9`` becomes ``SIGKILL``.

    Example:
        >>> describe_exitcode(-11)
        'killed by SIGSEGV (exit code -11)'
    """
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exit code {code}"
