"""The messages between a pool's service (parent) and its workers.

Owns the vocabulary only: small frozen dataclasses that pickle compactly
(``__reduce__`` to the constructor, which is several times faster than the
default for frozen slotted dataclasses: thousands of them cross per second).
Acting on them is ``service`` (parent side) and ``worker`` (worker side).

One worker's conversation::

    worker                                       PoolService (parent hub)
    next(wid, [Report...])  ------------------>  records results, then answers at once
                            <------------------  Batch(tasks, funcs, refill, hold) or parks
    report(wid, [Report...])  (one-way) ------>  results while a next() is pending
    report(wid, [Report], (tid, lo))  (waits)    careful tasks: acknowledge the last
                                                 item, announce the one starting now
                                                 (lo = LOADING: unpickling the task)
    func(fid)               ------------------>  a callable the worker no longer caches
    func_by_value(fid)      ------------------>  a callable of the main script that the
                                                 worker cannot find by name (cloudpickle)
    alive(wid)  (one-way, every heartbeat) --->  it runs (``liveness``: a silent one is lost)
    init_failed(wid, RemoteError) ------------>  the initializer raised: the pool breaks
                            <------------------  Batch(stop=True): exit now

It also declares the two seams the pool's modules share: the pool's states
(:data:`INIT`, :data:`RUN`, :data:`CLOSE`, :data:`TERMINATE`, the stdlib's
names), and :class:`ResultSink`, what the service and the feeder hand results
to (``results``' objects and the executor's futures implement it).
"""
from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Optional, TypeVar, cast

from ..wire import serialization
from ..wire.messages import RemoteError

if TYPE_CHECKING:  # (typing has it from 3.11 on; fibrl needs no typing_extensions to run)
    from _typeshed import DataclassInstance
    from typing_extensions import dataclass_transform
else:
    def dataclass_transform(**kwargs: Any) -> Any:
        return lambda decorator: decorator

__all__ = ["Kind", "TaskSpec", "Batch", "Report", "Raised", "WorkerArgs", "LOADING", "message",
           "pack", "unpack", "ResultSink", "INIT", "RUN", "CLOSE", "TERMINATE"]

# A pool's states, as the stdlib names them (a Pool's repr shows them). The Pool
# object goes INIT -> RUN -> CLOSE or TERMINATE; its service RUN -> CLOSE / TERMINATE.
INIT, RUN, CLOSE, TERMINATE = "INIT", "RUN", "CLOSE", "TERMINATE"


class ResultSink:
    """Where the pool delivers the outcomes of one submission (``apply``, ``map``...).

    Called from the threads that receive results (a worker's connection
    thread, a submitting thread, the pool's feeder), never under the service's
    lock, so an implementation may take its own lock and run callbacks.
    Outcomes are values, :class:`~fibrl.pool.results.Failure` or
    :class:`Raised` entries (see :func:`fibrl.pool.results.outcome`).
    """

    def sink_claim(self) -> bool:
        """One of its tasks is handed to a worker for the first time; False: it was
        cancelled (an executor future), so the task is dropped."""
        return True

    def sink_deliver(self, index: int, outcomes: list, clean: bool = False) -> None:
        """Outcomes of items ``index, index + 1, ...``; ``clean``: none is a failure."""
        raise NotImplementedError

    def sink_abort(self, exc: BaseException) -> None:
        """The pool was terminated or broke: fail whatever was not delivered."""
        raise NotImplementedError

    def sink_set_length(self, length: int) -> None:
        """The number of items, once a lazily fed submission knows it (streams only)."""
        raise TypeError(f"{type(self).__name__} has a fixed length")


def pack(obj: Any) -> bytes:
    """Pickle a task's arguments or results: plain pickle when it can, else fibrl's.

    Thousands of these are made per second, and a plain pickle is several
    times cheaper than a fibrl frame; what plain pickle refuses (lambdas,
    closures, an interactive ``__main__``) takes :func:`fibrl.wire.serialization.dumps`,
    whose :class:`~fibrl.errors.SerializationError` names the culprit.
    """
    if not serialization.main_is_interactive():
        try:
            return pickle.dumps(obj, protocol=5)
        except Exception:
            pass  # retried below, which says what cannot be pickled
    return serialization.dumps(obj)


def unpack(data: bytes) -> Any:
    """Rebuild what :func:`pack` made (a plain pickle or a fibrl frame)."""
    if data[:3] == serialization.MAGIC:
        return serialization.loads(data)
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise serialization.unpickle_error(exc) from exc


_M = TypeVar("_M")


@dataclass_transform(frozen_default=True)
def message(cls: type[_M]) -> type[_M]:
    """Make ``cls`` a frozen slotted dataclass that pickles as a constructor call."""
    cls = dataclass(frozen=True, slots=True)(cls)
    names = [f.name for f in fields(cast("type[DataclassInstance]", cls))]
    getter = attrgetter(*names)
    if len(names) == 1:
        def reduce(self: object) -> tuple[Any, ...]:
            return (cls, (getter(self),))
    else:
        def reduce(self: object) -> tuple[Any, ...]:
            return (cls, getter(self))
    cls.__reduce__ = reduce  # type: ignore[method-assign]  # set once, as the class is made
    return cls


class Kind(enum.IntEnum):
    """How a task's payload is applied to its function."""

    APPLY = 0    # payload: (args, kwds), one item
    MAP = 1      # payload: [x, ...], func(x) per item
    STARMAP = 2  # payload: [args, ...], func(*args) per item


@message
class TaskSpec:
    """One chunk of work as a worker sees it: run items ``lo`` .. ``n`` of ``payload``.

    ``careful``: the chunk was held by a lost worker; run it alone and report
    each item before starting the next, so the item that kills a worker is known.
    """

    tid: int
    fid: int
    kind: int
    payload: bytes
    lo: int
    n: int
    careful: bool


@message
class Batch:
    """The answer to ``next``: tasks to run, callables not yet sent, when to ask again.

    ``refill``: ask for more once this many tasks are left locally (as the last one
    starts, at the latest); -1: only once all of them are done (work is scarce: an
    early request would wait, and the last results would travel on their own).
    ``stop``: no more work for this worker; it exits.
    ``hold``: seconds a finished result may wait in the worker for its next request
    before it is sent on its own (longer in a large pool: see the service's pace).
    """

    tasks: tuple
    funcs: dict
    refill: int
    stop: bool
    hold: float = 0.0


STOP = Batch((), {}, 0, True)

# What a careful worker announces as "starting" while it unpickles a task's
# function and arguments, before any item runs: a crash then is the payload's.
LOADING = -1


@message
class Report:
    """Outcomes of items ``lo`` .. ``lo + count`` of task ``tid``.

    ``payload`` pickles a list with one entry per item: the return value, or
    a :class:`Raised`. ``seconds``: time the worker spent running them.
    ``clean``: no entry is a :class:`Raised` (the parent may skip checking).
    """

    tid: int
    lo: int
    count: int
    payload: bytes
    seconds: float
    clean: bool


@message
class Raised:
    """An item's outcome when the call raised (or its result could not be pickled).

    The worker builds it with a :class:`~fibrl.wire.messages.RemoteError`; the parent
    unpickles the exception itself, its traceback chained as ``__cause__``.
    """

    error: "RemoteError | BaseException"


@message
class WorkerArgs:
    """What a pool worker process is started with."""

    address: str
    oid: str
    wid: int
    init: Optional[bytes]  # pickled (initializer, initargs), or None


def describe(value: Any, limit: int = 120) -> str:
    """A short ``repr`` for error messages."""
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not hide the real error
        text = f"<unprintable {type(value).__name__}: {exc}>"
    return shorten(text, limit)


def shorten(text: str, limit: int = 120) -> str:
    """``text``, cut to ``limit`` characters with an ellipsis if it is longer."""
    return text if len(text) <= limit else text[:limit - 3] + "..."
