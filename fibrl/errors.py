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
     |         |    +-- BackendUnavailableError  no engine or cluster: no job can start
     |         +-- WorkerLostError               a worker died while holding tasks
     |         |    +-- TaskFailedError          a task killed its worker too many times
     |         +-- RemoteObjectError             a hosted object vanished (owner exited)
     |         +-- SerializationError            an object cannot be pickled (also a TypeError)
     +-- multiprocessing.pool.RemoteTraceback     (stdlib; also fibrl.errors.RemoteTraceback)
                                                  carries a worker's formatted traceback,
                                                  chained as ``__cause__`` of a remote error
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.pool  # for RemoteTraceback (about 3 ms more on import)
import signal

__all__ = [
    "AuthenticationError", "BackendError", "BackendUnavailableError", "ChannelClosed",
    "ConfigError", "FibrlError", "FrameError", "RemoteObjectError", "RemoteTraceback",
    "SerializationError", "TaskFailedError", "TransportError", "WorkerLostError",
    "chain_remote", "describe_exitcode", "object_gone", "owner_gone",
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


class BackendUnavailableError(BackendError):
    """The backend can start no job at all: its engine or cluster is not configured,
    not installed or not reachable. A pool stops at the first one instead of retrying."""


class WorkerLostError(FibrlError):
    """A worker died (killed, OOM, container or pod gone) while it held work."""


class TaskFailedError(WorkerLostError):
    """A task killed its worker on every attempt it was given."""


class RemoteObjectError(FibrlError):
    """A hosted object (queue, lock, pipe...) no longer exists or its owner is gone."""


class SerializationError(FibrlError, TypeError):
    """An object could not be pickled or unpickled."""


#: The formatted traceback of an exception raised in another process: the stdlib's
#: class itself, so code written for the stdlib's pool that checks an error's
#: ``__cause__`` (its type included) keeps working.
RemoteTraceback: type[Exception] = \
    multiprocessing.pool.RemoteTraceback  # type: ignore[attr-defined]  # not in typeshed


def chain_remote(exc: BaseException, tb: str) -> BaseException:
    """``exc`` with the remote traceback ``tb`` chained as its ``__cause__`` (as
    ``raise exc from RemoteTraceback(tb)`` would); returns ``exc``."""
    if tb:
        cause = RemoteTraceback(tb)
        cause.args = (tb,)  # the stdlib's leaves them empty: it would not unpickle
        exc.__cause__ = cause
        exc.__suppress_context__ = True
    return exc


def owner_gone(address: object, detail: object = "", *, owner: str = "fibrl process",
               hosted: str = "queues, locks, values or managers",
               in_flight: bool = False) -> RemoteObjectError:
    """The one wording for "the process that hosts this object is gone".

    ``owner`` names that process (``"manager server"``), ``hosted`` what it
    hosted, ``detail`` the evidence (the transport's error); ``in_flight``: the
    call that gets this error had been sent and was waiting for its answer, so it
    may or may not have taken effect.

    Example:
        >>> str(owner_gone("tcp://10.0.0.7:4100", owner="manager server"))[:56]
        'lost the manager server at tcp://10.0.0.7:4100 that host'
    """
    extra = f" ({detail})" if detail else ""
    flight = (" while this call was in flight (sent, its answer not yet back: it may or "
              "may not have taken effect)") if in_flight else ""
    return RemoteObjectError(
        f"lost the {owner} at {address} that hosts this object{extra}{flight}: it exited, "
        f"was shut down or killed, or its machine is gone, so the {hosted} it hosted are "
        f"gone. Create them again (check that process's output if it should still be "
        f"running).")


def object_gone(oid: str, where: object, how: str = "closed or garbage-collected") -> \
        RemoteObjectError:
    """The one wording for "this hosted object no longer exists" (its process lives on)."""
    return RemoteObjectError(
        f"object {oid!r} no longer exists in {where}: it was {how} by its owner. Keep the "
        f"object (and a reference to its creating handle) alive while others use it.")


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
