"""The messages processes exchange: small frozen dataclasses, never tuples.

Owns the vocabulary of the runtime protocol. Encoding is ``serialization``;
moving bytes is ``transport``; acting on messages is ``hub``.
"""
from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import Any

from .config import Config
from .errors import RemoteObjectError, chain_remote
from .serialization import OOB_THRESHOLD, Encoded, dumps

__all__ = ["Call", "Reply", "RemoteError", "WorkerStart", "MAIN_SOURCE", "blob", "wrap_raw",
           "wrap_args", "RAW_TYPES"]


@dataclass(frozen=True, slots=True)
class Call:
    """Invoke ``method`` of the hosted object ``oid``. ``rid`` 0 means no reply is wanted."""

    rid: int
    oid: str
    method: str
    args: tuple = ()

    def __reduce__(self):  # 7x faster than the default for slotted dataclasses
        return (Call, (self.rid, self.oid, self.method, self.args))


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to the :class:`Call` with the same ``rid``.

    ``encoded`` values are a frame of their own (see ``serialization``), decoded
    by the receiver for this reply alone: a value that cannot be unpickled
    there fails its own call instead of the connection.
    """

    rid: int
    ok: bool
    value: Any = None
    encoded: bool = False

    def __reduce__(self):
        return (Reply, (self.rid, self.ok, self.value, self.encoded))


@dataclass(frozen=True, slots=True)
class RemoteError:
    """An exception raised in this process, captured to travel to another one.

    The one place for remote errors: the raising side captures an exception
    once (:meth:`capture`); the receiving side never sees a ``RemoteError``,
    because unpickling one gives back the exception itself, with its own type
    and the remote traceback chained as ``__cause__`` (as loky does). Anything
    that reaches a receiver as an exception is raised as it is.
    """

    exc: BaseException
    tb: str

    @classmethod
    def capture(cls, exc: BaseException) -> "RemoteError":
        """Format ``exc``'s traceback now; an exception that cannot be pickled travels as
        a :class:`~fibrl.errors.RemoteObjectError` with its type and message."""
        tb = ""
        if exc.__traceback__ is not None:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            tb = f'\n"""\n{text}"""'
        try:
            dumps(exc)
        except Exception:
            exc = RemoteObjectError(f"{type(exc).__name__}: {exc}")
        exc.__traceback__ = None
        exc.__context__ = exc.__cause__ = None
        return cls(exc, tb)

    def rebuilt(self) -> BaseException:
        """The exception with the remote traceback as ``__cause__`` (what unpickling gives)."""
        return chain_remote(self.exc, self.tb)

    def __reduce__(self):
        return (_rebuilt, (self.exc, self.tb))


def _rebuilt(exc: BaseException, tb: str) -> BaseException:
    return chain_remote(exc, tb)


@dataclass(frozen=True)
class WorkerStart:
    """What a worker needs to become the process object: sent after authentication.

    Defined here, not by the parent's ``popen``, so that a worker unpickles it
    without importing popen and the backends.
    """

    process: bytes
    config: Config
    preparation: dict
    parent_address: str


# The key, in ``WorkerStart.preparation``, of the main script's source for a worker that
# cannot see the script (see ``popen._preparation`` and ``bootstrap._visible_main``).
MAIN_SOURCE = "fibrl_main_source"

RAW_TYPES = (bytes, bytearray, memoryview)


def blob(data: "bytes | bytearray | memoryview | Encoded") -> Any:
    """Wrap an already serialized payload so a large one travels out of band (an
    :class:`~fibrl.serialization.Encoded` does so by itself)."""
    if type(data) is Encoded:
        return data
    if memoryview(data).nbytes >= OOB_THRESHOLD:
        return pickle.PickleBuffer(data)
    # a small memoryview (a slice of a received frame) cannot be pickled as it is
    return data if type(data) is bytes else bytes(data)


def wrap_raw(value: Any) -> Any:
    """``blob(value)`` for raw payloads, ``value`` itself for anything else.

    A payload that arrived out of band is stored as a ``memoryview`` of its
    frame: when it is forwarded (a queue item handed to a getter in a third
    process) it must travel as a buffer again, since a memoryview is not
    picklable.
    """
    return blob(value) if type(value) in RAW_TYPES else value


def wrap_args(args: tuple) -> tuple:
    """A call's arguments with raw payloads wrapped (:func:`wrap_raw`); ``args`` itself
    when none is raw, the commonest case (no new tuple)."""
    for arg in args:
        if type(arg) in RAW_TYPES:
            return tuple(wrap_raw(a) for a in args)
    return args if type(args) is tuple else tuple(args)


# The ``kind`` a worker gives when it reports that it could not load its process
# because the main script starts processes at import (no ``if __name__ ==
# "__main__":`` guard); the parent says so once (see ``bootstrap`` and ``popen``).
MISSING_MAIN_GUARD = "missing-main-guard"
