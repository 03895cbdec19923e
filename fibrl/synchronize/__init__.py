"""``Lock``, ``RLock``, ``Semaphore``, ``BoundedSemaphore``, ``Condition``, ``Event``
and ``Barrier`` that work between any processes of a run, on any backend.

Each primitive is a service hosted by the hub of the process that created it
(as a ``Queue`` is a hosted ``Mailbox``, see ``services``); the object users
hold is a small handle (address + object id) that pickles to any process, on
any machine, at any time (not only when a process starts).

Data flow::

    any process (any thread)              owner process (hub)
    lock.acquire(timeout=t)
      hub.call_async(acquire, tid, t) ---> LockService.op_acquire
      hub.wait(handle)                       free?  yes -> reply(True)
        | waits in slices; between slices          no  -> park a waiter (FIFO)
        | pings the owner, so a lost owner            timer thread: deadline -> reply(False)
        v raises instead of hanging           release / holder's process lost -> grant next
    True / False   <------------------------- reply

    Condition.wait: one op on the lock's owner releases the lock, parks the
    waiter, and on notify or timeout moves it to the lock's queue; the reply
    comes when the lock is held again.

An interrupted wait (Ctrl-C) withdraws its parked request and gives back
what it obtained meanwhile, so nothing stays granted to nobody. Differences
from ``multiprocessing``: a primitive lives while its creating process runs
(and, once pickled, while processes use it); a Lock or RLock held by a process
that dies is released (a Semaphore has no owner, so it is not); a Barrier
party that dies breaks the barrier.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from ..hosting.hosted import HostedHandle, call_owner
from ..hosting.hub import get_hub
from .services import (SEM_VALUE_MAX, BarrierService, ConditionService, EventService, LockService,
                       LockState)

__all__ = ["Lock", "RLock", "Semaphore", "BoundedSemaphore", "Condition", "Event", "Barrier",
           "LockHandle", "wait_for"]


# -- handles ---------------------------------------------------------------------------------
def wait_for(wait: Callable[[Optional[float]], Any], predicate: Callable[[], Any],
             timeout: Optional[float]) -> Any:
    """``Condition.wait_for`` over any ``wait(timeout)``: the stdlib's loop."""
    result = predicate()
    endtime = None if timeout is None else time.monotonic() + timeout
    waittime = None
    while not result:
        if endtime is not None:
            waittime = endtime - time.monotonic()
            if waittime <= 0:
                break
        wait(waittime)
        result = predicate()
    return result


def _timeout_of(block: bool, timeout: Optional[float]) -> Optional[float]:
    if not block:
        return 0.0
    if timeout is None:
        return None
    seconds = float(timeout)
    if seconds != seconds:
        raise ValueError("timeout must be a number of seconds or None, not NaN")
    return max(seconds, 0.0)


class LockHandle(HostedHandle):
    """What Lock, RLock and Semaphore handles share (``sharedctypes`` takes any as a lock)."""

    _kind = "lock"

    def _undo(self, result: Any) -> None:
        if result is True:
            self.release()

    def acquire(self, block: bool = True, timeout: Optional[float] = None) -> bool:
        """Acquire; with ``block`` False or a ``timeout``, return whether it was acquired."""
        return self._parked("acquire", threading.get_ident(), _timeout_of(block, timeout))

    def release(self) -> None:
        self._call("release", threading.get_ident())

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *args: Any) -> None:
        self.release()

    def _lock_state(self) -> LockState:
        return self._call("state", threading.get_ident())

    def _owner_name(self, state: LockState) -> str:
        if state.mine:
            from ..process import current_process

            name = current_process().name
            if threading.current_thread().name != "MainThread":
                name += "|" + threading.current_thread().name
            return name
        if state.value == 1:
            return "None"
        return "SomeOtherThread" if state.same_process else "SomeOtherProcess"


class Lock(LockHandle):
    """A non-recursive lock shared by any processes of the run.

    Same semantics as ``multiprocessing.Lock``: any thread may release it;
    releasing an unlocked lock raises ``ValueError``. If the process holding
    it dies, it is released.

    Example:
        >>> lock = Lock()
        >>> with lock:
        ...     pass
        >>> lock.acquire(timeout=1)
        True
    """

    def __init__(self, *, ctx: Any = None) -> None:
        self._host(LockService("lock", 1, 1))

    def __repr__(self) -> str:
        try:
            name = self._owner_name(self._lock_state())
        except Exception:
            name = "unknown"
        return f"<Lock(owner={name})>"


class RLock(LockHandle):
    """A recursive lock: the thread that holds it may acquire it again.

    Example:
        >>> lock = RLock()
        >>> with lock, lock:
        ...     pass
    """

    def __init__(self, *, ctx: Any = None) -> None:
        self._host(LockService("rlock", 1, 1))

    def __repr__(self) -> str:
        try:
            state = self._lock_state()
            name = self._owner_name(state)
            count = state.count if state.mine else (0 if state.value == 1 else "nonzero")
        except Exception:
            name, count = "unknown", "unknown"
        return f"<RLock({name}, {count})>"


class Semaphore(LockHandle):
    """A counter of permits: ``acquire`` takes one (waiting for it), ``release`` gives one.

    Example:
        >>> sem = Semaphore(2)
        >>> sem.acquire(); sem.get_value()
        True
        1
    """

    _bounded = False

    def __init__(self, value: int = 1, *, ctx: Any = None) -> None:
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        self._host(LockService("semaphore", value, value if self._bounded else None))

    def get_value(self) -> int:
        return self._call("get_value")

    def __repr__(self) -> str:
        value: int | str
        try:
            value = self.get_value()
        except Exception:
            value = "unknown"
        return f"<{type(self).__name__}(value={value})>"


class BoundedSemaphore(Semaphore):
    """A Semaphore whose ``release`` raises ``ValueError`` above its initial value."""

    _bounded = True

    def __repr__(self) -> str:
        value: int | str
        maxvalue: int | str | None
        try:
            state = self._lock_state()
            value, maxvalue = state.value, state.maxvalue
        except Exception:
            value = maxvalue = "unknown"
        return f"<BoundedSemaphore(value={value}, maxvalue={maxvalue})>"


class Condition(HostedHandle):
    """A condition variable over a fibrl ``Lock`` or ``RLock`` (a new RLock by default).

    ``wait`` releases the lock, waits for ``notify`` or its timeout, and holds
    the lock again before it returns, as in ``multiprocessing``.

    Example:
        >>> cond = Condition()
        >>> with cond:
        ...     cond.wait(0.01)
        False
    """

    def __init__(self, lock: Optional[LockHandle] = None, *, ctx: Any = None) -> None:
        if lock is None:
            lock = RLock(ctx=ctx)
        if not isinstance(lock, (Lock, RLock)):
            raise TypeError(
                f"fibrl.Condition needs a fibrl Lock or RLock, got {type(lock).__name__}: a "
                f"threading or multiprocessing lock cannot be shared across machines. Create "
                f"it with fibrl.Lock()/fibrl.RLock() or leave the argument out.")
        self._lock = lock
        hub = get_hub()
        service = hub.service(lock._oid) if hub.is_local(lock._address) else None
        if isinstance(service, LockService):
            self._host(ConditionService(service))
        else:
            self._address = lock._address
            self._oid = call_owner(lock._address, lock._oid, "new_condition")

    def _state(self) -> dict:
        return {"_lock": self._lock}

    def acquire(self, block: bool = True, timeout: Optional[float] = None) -> bool:
        return self._lock.acquire(block, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *args: Any) -> None:
        self._lock.__exit__(*args)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for a notify; False when ``timeout`` passed first. Holds the lock on return."""
        return self._parked("wait", threading.get_ident(), _timeout_of(True, timeout))

    def wait_for(self, predicate: Callable[[], Any], timeout: Optional[float] = None) -> Any:
        """Wait until ``predicate()`` is true (checked after each wake-up) or ``timeout``."""
        return wait_for(self.wait, predicate, timeout)

    def notify(self, n: int = 1) -> None:
        self._call("notify", threading.get_ident(), n)

    def notify_all(self) -> None:
        self._call("notify", threading.get_ident(), SEM_VALUE_MAX)

    def __repr__(self) -> str:
        try:
            waiters = self._call("waiters")
        except Exception:
            waiters = "unknown"
        return f"<Condition({self._lock!r}, {waiters})>"


class Event(HostedHandle):
    """A flag processes can wait for.

    Example:
        >>> ev = Event(); ev.set(); ev.wait(1)
        True
    """

    def __init__(self, *, ctx: Any = None) -> None:
        self._host(EventService())

    def is_set(self) -> bool:
        return self._call("is_set")

    def set(self) -> None:
        self._call("set")

    def clear(self) -> None:
        self._call("clear")

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the flag is set; returns the flag (False after ``timeout``)."""
        return self._call("wait", _timeout_of(True, timeout))

    def __repr__(self) -> str:
        try:
            state = "set" if self.is_set() else "unset"
        except Exception:
            state = "unknown"
        return f"<Event at {id(self):#x} {state}>"


class Barrier(HostedHandle):
    """``parties`` processes wait until all have arrived; the last runs ``action``.

    Same semantics as ``threading.Barrier`` (which ``multiprocessing.Barrier``
    is): ``wait`` returns an index in ``range(parties)``; a timeout, ``abort``,
    ``reset`` or a failing action raise ``threading.BrokenBarrierError`` in
    every waiter. A party whose process dies while waiting breaks the barrier.
    ``action`` travels with the barrier, so it must be picklable.

    Example:
        >>> b = Barrier(1); b.wait(5)
        0
    """

    def __init__(self, parties: int, action: Optional[Callable[[], Any]] = None,
                 timeout: Optional[float] = None, *, ctx: Any = None) -> None:
        if parties < 1:
            raise ValueError("parties must be > 0")
        self._parties = parties
        self._action = action
        self._timeout = timeout
        self._host(BarrierService(parties, action is not None))

    def _state(self) -> dict:
        return {"_parties": self._parties, "_action": self._action, "_timeout": self._timeout}

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the other parties; returns this party's arrival index."""
        if timeout is None:
            timeout = self._timeout
        turn = self._parked("wait", threading.get_ident(), _timeout_of(True, timeout))
        if turn.run_action:
            self._run_action()
        return turn.index

    def _run_action(self) -> None:
        action = self._action
        assert action is not None  # the service asks only a barrier with an action to run it
        try:
            action()
        except BaseException:
            self._call("action_done", False)
            raise
        self._call("action_done", True)

    def reset(self) -> None:
        self._call("reset")

    def abort(self) -> None:
        self._call("abort")

    @property
    def parties(self) -> int:
        return self._parties

    @property
    def n_waiting(self) -> int:
        return self._call("n_waiting")

    @property
    def broken(self) -> bool:
        return self._call("broken")

    def __repr__(self) -> str:
        return f"<Barrier(parties={self._parties}) {self._oid} at {self._address}>"
