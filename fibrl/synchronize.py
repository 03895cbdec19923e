"""``Lock``, ``RLock``, ``Semaphore``, ``BoundedSemaphore``, ``Condition``, ``Event``
and ``Barrier`` that work between any processes of a run, on any backend.

Each primitive is a service hosted by the hub of the process that created it
(as a ``Queue`` is a hosted ``Mailbox``); the object users hold is a small
handle (address + object id) that pickles to any process, on any machine.
The service owns all state and every deadline: a blocking ``acquire`` or
``wait`` *parks* its reply until it can be granted or its timeout passes, so a
grant can never race a client-side timeout.

Data flow::

    any process (any thread)              owner process (hub)
    lock.acquire(timeout=t)
      hub.call_async(acquire, tid, t) ---> _LockService.op_acquire
      wait_reply(handle)                     free?  yes -> reply(True)
        | waits in slices; between slices          no  -> park _Waiter (FIFO)
        | pings the owner, so a lost owner            timer thread: deadline -> reply(False)
        v raises instead of hanging           release / holder's process lost -> grant next
    True / False   <------------------------- reply

    Condition.wait: one op on the lock's owner releases the lock, parks the
    waiter, and on notify or timeout moves it to the lock's queue; the reply
    comes when the lock is held again.

A holder is ``(connection, thread id)``: RLock ownership and Condition checks
work per thread, and when a process disconnects (killed, lost node) the Lock or
RLock it held is released and everything it had parked is dropped. This
module owns these semantics; ``hub`` owns dispatching and waiting,
``sharedctypes`` builds ``Value``/``Array`` on :class:`LockService`.
Differences from ``multiprocessing``: a primitive lives while its creating
process runs (see docs/managers.md); a Semaphore is not released when a
process that acquired it dies (it has no owner).
"""
from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .errors import RemoteObjectError, TransportError
from .hub import Handle, Hub, ReplySink, Service, get_hub

__all__ = ["Lock", "RLock", "Semaphore", "BoundedSemaphore", "Condition", "Event", "Barrier",
           "HostedService", "LockService", "Owner", "owner_of", "wait_reply"]

_tokens = itertools.count(1)
_SEM_VALUE_MAX = 2 ** 31 - 1


# -- identity and waiting --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Owner:
    """Who holds or waits: one thread (``tid``) behind one connection (``peer``, 0: local)."""

    peer: int
    tid: int


def owner_of(reply: ReplySink, tid: int) -> Owner:
    return Owner(reply.peer.id if reply.peer is not None else 0, tid)


def wait_reply(handle: Handle, address: Optional[str], hub: Hub) -> Any:
    """``handle.get()`` for a call whose deadline its owner enforces.

    Waits in slices of ``heartbeat_interval`` and pings the owner between
    them, so a lost owner (even a vanished node, which closes no socket)
    raises :class:`RemoteObjectError` within ``parent_timeout`` instead of
    hanging.
    """
    if not handle.ready() and not hub.is_local(address):
        from .context import current_config

        config = current_config()
        while not handle.wait(config.heartbeat_interval):
            ensure_alive(hub, address, config.parent_timeout)
    return handle.get()


def ensure_alive(hub: Hub, address: str, limit: float, oid: str = "hub") -> None:
    """Raise :class:`RemoteObjectError` when the hub at ``address`` does not answer a ping."""
    try:
        ping = hub.call_async(address, oid, "ping")
    except TransportError as exc:
        raise _gone(address, exc) from exc
    if not ping.wait(limit):
        raise RemoteObjectError(
            f"the process at {address} that hosts this object did not answer a liveness "
            f"ping within {limit:.0f} s (parent_timeout): its machine or network is gone. "
            f"Objects it hosted are lost; restart the work, or raise parent_timeout if the "
            f"network is only slow.")
    ping.get(0)


def _gone(address: Optional[str], exc: BaseException) -> RemoteObjectError:
    return RemoteObjectError(
        f"cannot reach the process at {address} that hosts this object ({exc}); it exited "
        f"or was killed, so the lock/event/value it hosted is gone.")


def call_owner(address: Optional[str], oid: str, method: str, *args: Any) -> Any:
    """Call a hosted primitive and wait for its reply (owner-side deadlines)."""
    hub = get_hub()
    try:
        handle = hub.call_async(address, oid, method, *args)
    except TransportError as exc:
        raise _gone(address, exc) from exc
    return wait_reply(handle, address, hub)


# -- hosting ---------------------------------------------------------------------------------
class HostedService(Service):
    """A service that outlives its creator's handle while pickled copies are in use.

    It is unregistered when the handle in the creating process is collected,
    unless the handle was pickled: then when every process that used it has
    disconnected too. (A handle pickled but never used stays until exit.)
    """

    def __init__(self) -> None:
        self.mutex = threading.RLock()
        self._users: set[int] = set()
        self._had_users = False
        self.pickled = False
        self._orphan = False

    def dispatch(self, method: str, args: tuple, reply: ReplySink) -> None:
        peer = reply.peer
        if peer is not None and peer.id not in self._users:
            self._users.add(peer.id)
            self._had_users = True
        super().dispatch(method, args, reply)

    def peer_lost(self, peer) -> None:
        self._users.discard(peer.id)
        with self.mutex:
            self.drop_peer(peer)
        self._maybe_retire()

    def drop_peer(self, peer) -> None:
        """Forget what ``peer`` parked or held (mutex held)."""

    def owner_dropped(self) -> None:
        """The creating process no longer holds a handle."""
        self._orphan = True
        self._maybe_retire()

    def _maybe_retire(self) -> None:
        if self._orphan and not self._users and (self._had_users or not self.pickled):
            hub = getattr(self, "hub", None)
            if hub is not None:
                hub.unregister(self.oid)

    def op_ping(self, reply: ReplySink) -> None:
        reply(os.getpid())


def _drop_owner(hub_ref: "weakref.ref[Hub]", oid: str) -> None:
    hub = hub_ref()
    service = hub.service(oid) if hub is not None else None
    if isinstance(service, HostedService):
        service.owner_dropped()


class _Waiter:
    """A parked request: an acquire, a condition wait, or an operation waiting for a lock."""

    __slots__ = ("reply", "who", "count", "token", "timer", "result", "run")

    def __init__(self, reply: ReplySink, who: Owner, count: int = 1, token: int = 0,
                 run: Optional[Callable[[], Any]] = None) -> None:
        self.reply = reply
        self.who = who
        self.count = count
        self.token = token
        self.timer = None
        self.result = True
        self.run = run


def answer(reply: ReplySink, fn: Callable[[], Any]) -> None:
    """Reply with ``fn()``, or with the exception it raised."""
    try:
        value = fn()
    except Exception as exc:
        reply.fail(exc)
    else:
        reply(value)


@dataclass(frozen=True, slots=True)
class LockState:
    """What ``repr`` of a lock shows, seen from the asking thread."""

    mine: bool
    same_process: bool
    count: int
    value: int
    maxvalue: Optional[int]


class LockService(HostedService):
    """Lock, RLock, Semaphore and BoundedSemaphore: permits, an owner and a FIFO of waiters.

    ``kind`` is ``"lock"``, ``"rlock"`` or ``"semaphore"``; ``maxvalue`` bounds a
    semaphore's releases (None: unbounded).
    """

    def __init__(self, kind: str, value: int = 1, maxvalue: Optional[int] = None) -> None:
        super().__init__()
        self.kind = kind
        self.value = value
        self.maxvalue = maxvalue
        self.owner: Optional[Owner] = None
        self.count = 0
        self.waiters: deque[_Waiter] = deque()
        self.conditions: list[str] = []

    # -- state ------------------------------------------------------------------------------
    def free_for(self, who: Owner) -> bool:
        if self.kind == "semaphore":
            return self.value > 0
        return self.owner is None or (self.kind == "rlock" and self.owner == who)

    def owns(self, who: Owner) -> bool:
        return self.kind != "semaphore" and self.owner == who and self.count > 0

    def _take(self, who: Owner, count: int) -> None:
        if self.kind == "semaphore":
            self.value -= 1
        else:
            self.owner = who
            self.count += count

    def _untake(self, who: Owner, count: int) -> None:
        if self.kind == "semaphore":
            self.value += 1
        else:
            self.count -= count
            if self.count <= 0:
                self.owner, self.count = None, 0

    def release_all(self, who: Owner) -> int:
        """Release every level ``who`` holds (for Condition.wait); returns how many."""
        count = self.count
        self.owner, self.count = None, 0
        self.grant()
        return count

    # -- granting ----------------------------------------------------------------------------
    def park(self, waiter: _Waiter, timeout: Optional[float]) -> None:
        self.waiters.append(waiter)
        if timeout is not None:
            waiter.timer = self.hub.timers.call_at(time.monotonic() + max(timeout, 0.0),
                                                   lambda: self._expire(waiter))

    def _expire(self, waiter: _Waiter) -> None:
        with self.mutex:
            try:
                self.waiters.remove(waiter)
            except ValueError:
                return  # granted meanwhile
        waiter.reply(False)

    def grant(self) -> None:
        """Hand the lock to waiters, oldest first, while it is free (mutex held)."""
        while self.waiters and self.free_for(self.waiters[0].who):
            waiter = self.waiters.popleft()
            if waiter.timer is not None:
                self.hub.timers.cancel(waiter.timer)
            if waiter.run is not None:
                answer(waiter.reply, waiter.run)
                continue
            self._take(waiter.who, waiter.count)
            if not waiter.reply(waiter.result):
                self._untake(waiter.who, waiter.count)  # the waiter's process is gone

    def run_unlocked(self, who: Owner, reply: ReplySink, fn: Callable[[], Any]) -> None:
        """Answer with ``fn()`` once no other thread holds the lock (``Value`` access)."""
        with self.mutex:
            if self.owns(who) or (self.free_for(who) and not self.waiters):
                answer(reply, fn)
            else:
                self.waiters.append(_Waiter(reply, who, run=fn))

    def enqueue(self, waiter: _Waiter) -> None:
        """Queue a waiter that must hold the lock again before its reply (Condition)."""
        self.waiters.append(waiter)
        self.grant()

    # -- operations ----------------------------------------------------------------------
    def op_acquire(self, reply: ReplySink, tid: int, timeout: Optional[float] = None,
                   token: int = 0) -> None:
        who = owner_of(reply, tid)
        with self.mutex:
            if self.free_for(who) and (not self.waiters or self.owns(who)):
                self._take(who, 1)
                reply(True)
            elif timeout is not None and timeout <= 0:
                reply(False)
            else:
                self.park(_Waiter(reply, who, token=token), timeout)

    def op_release(self, reply: ReplySink, tid: int) -> None:
        who = owner_of(reply, tid)
        with self.mutex:
            self._release(who)
            self.grant()
        reply(None)

    def _release(self, who: Owner) -> None:
        if self.kind == "rlock" and self.owner != who:
            raise AssertionError("attempt to release recursive lock not owned by thread")
        if self.kind == "lock" and self.owner is None:
            raise ValueError("semaphore or lock released too many times")
        if self.kind == "semaphore":
            if self.value >= (self.maxvalue or _SEM_VALUE_MAX):
                raise ValueError("semaphore or lock released too many times")
            self.value += 1
            return
        self._untake(who, 1)

    def op_cancel(self, reply: ReplySink, tid: int, token: int) -> None:
        """Drop a parked acquire whose caller was interrupted (it answers False)."""
        who = owner_of(reply, tid)
        with self.mutex:
            found = [w for w in self.waiters if w.who == who and w.token == token]
            for waiter in found:
                self.waiters.remove(waiter)
                if waiter.timer is not None:
                    self.hub.timers.cancel(waiter.timer)
        for waiter in found:
            waiter.reply(False)
        reply(None)

    def op_get_value(self, reply: ReplySink) -> None:
        reply(self.value if self.kind == "semaphore" else int(self.owner is None))

    def op_state(self, reply: ReplySink, tid: int) -> None:
        who = owner_of(reply, tid)
        same = self.owner is not None and self.owner.peer == who.peer
        reply(LockState(self.owns(who), same, self.count,
                        self.value if self.kind == "semaphore" else int(self.owner is None),
                        self.maxvalue))

    def op_new_condition(self, reply: ReplySink) -> None:
        """Host a Condition bound to this lock here (for a Condition made in another process).

        It has no owner handle to follow, so it lives as long as the lock does.
        """
        oid = self.hub.register(ConditionService(self))
        self.conditions.append(oid)
        reply(oid)

    # -- lifecycle -------------------------------------------------------------------------
    def drop_peer(self, peer) -> None:
        for waiter in [w for w in self.waiters if w.reply.peer is peer]:
            self.waiters.remove(waiter)
            if waiter.timer is not None:
                self.hub.timers.cancel(waiter.timer)
        if self.owner is not None and self.owner.peer == peer.id:
            self.owner, self.count = None, 0  # its holder died: do not deadlock the others
        self.grant()

    def closed(self) -> None:
        with self.mutex:
            waiters, self.waiters = list(self.waiters), deque()
        for waiter in waiters:
            waiter.reply.fail(RemoteObjectError(f"{self.oid} was closed by its owner"))
        for oid in self.conditions:
            self.hub.unregister(oid)


class ConditionService(HostedService):
    """The waiters of a Condition; hosted next to its lock so ``wait`` is one atomic step."""

    def __init__(self, lock: LockService) -> None:
        super().__init__()
        self.lock = lock
        self.mutex = lock.mutex
        self.waiters: deque[_Waiter] = deque()

    def op_wait(self, reply: ReplySink, tid: int, timeout: Optional[float] = None,
                token: int = 0) -> None:
        who = owner_of(reply, tid)
        with self.mutex:
            if not self.lock.owns(who):
                raise AssertionError("must acquire() condition before using wait()")
            waiter = _Waiter(reply, who, self.lock.release_all(who), token)
            self.waiters.append(waiter)
            if timeout is not None:
                waiter.timer = self.hub.timers.call_at(
                    time.monotonic() + max(timeout, 0.0), lambda: self._wake(waiter, False))

    def _wake(self, waiter: _Waiter, notified: bool) -> None:
        """Move a waiter to the lock's queue; it is answered once it holds the lock again."""
        with self.mutex:
            try:
                self.waiters.remove(waiter)
            except ValueError:
                return
            if waiter.timer is not None:
                self.hub.timers.cancel(waiter.timer)
            waiter.timer, waiter.result = None, notified
            self.lock.enqueue(waiter)

    def op_notify(self, reply: ReplySink, tid: int, n: int = 1) -> None:
        with self.mutex:
            if not self.lock.owns(owner_of(reply, tid)):
                raise AssertionError("lock is not owned")
            for waiter in list(itertools.islice(self.waiters, max(n, 0))):
                self._wake(waiter, True)
        reply(None)

    def op_cancel(self, reply: ReplySink, tid: int, token: int) -> None:
        """An interrupted wait stops waiting for a notify (it still re-acquires the lock)."""
        who = owner_of(reply, tid)
        for waiter in [w for w in self.waiters if w.who == who and w.token == token]:
            self._wake(waiter, False)
        reply(None)

    def op_waiters(self, reply: ReplySink) -> None:
        reply(len(self.waiters))

    def drop_peer(self, peer) -> None:
        for waiter in [w for w in self.waiters if w.reply.peer is peer]:
            self.waiters.remove(waiter)
            if waiter.timer is not None:
                self.hub.timers.cancel(waiter.timer)

    def closed(self) -> None:
        with self.mutex:
            waiters, self.waiters = list(self.waiters), deque()
        for waiter in waiters:
            waiter.reply.fail(RemoteObjectError(f"{self.oid} was closed by its owner"))


class EventService(HostedService):
    """A flag with parked waiters."""

    def __init__(self) -> None:
        super().__init__()
        self.flag = False
        self.waiters: list[_Waiter] = []

    def op_is_set(self, reply: ReplySink) -> None:
        reply(self.flag)

    def op_set(self, reply: ReplySink) -> None:
        with self.mutex:
            self.flag = True
            waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if waiter.timer is not None:
                self.hub.timers.cancel(waiter.timer)
            waiter.reply(True)
        reply(None)

    def op_clear(self, reply: ReplySink) -> None:
        self.flag = False
        reply(None)

    def op_wait(self, reply: ReplySink, timeout: Optional[float] = None) -> None:
        with self.mutex:
            if self.flag or (timeout is not None and timeout <= 0):
                reply(self.flag)
                return
            waiter = _Waiter(reply, Owner(0, 0))
            self.waiters.append(waiter)
            if timeout is not None:
                waiter.timer = self.hub.timers.call_at(
                    time.monotonic() + max(timeout, 0.0), lambda: self._expire(waiter))

    def _expire(self, waiter: _Waiter) -> None:
        with self.mutex:
            if waiter not in self.waiters:
                return
            self.waiters.remove(waiter)
        waiter.reply(False)

    def drop_peer(self, peer) -> None:
        self.waiters = [w for w in self.waiters if w.reply.peer is not peer]


@dataclass(frozen=True, slots=True)
class BarrierTurn:
    """A barrier's answer to ``wait``: the caller's index, and whether it runs the action."""

    index: int
    run_action: bool = False


class BarrierService(HostedService):
    """Parties arrive, the last one runs the action (in its own process), all leave together.

    States: filling (``action`` None) -> the last arrival gets ``run_action`` and
    the others stay parked until ``op_action_done`` -> filling again. Arrivals
    during the action wait for the next round, as with ``threading.Barrier``.
    """

    def __init__(self, parties: int, has_action: bool) -> None:
        super().__init__()
        self.parties = parties
        self.has_action = has_action
        self.waiters: list[_Waiter] = []
        self.next_round: list[tuple] = []
        self.broken = False
        self.acting: Optional[_Waiter] = None

    def op_wait(self, reply: ReplySink, tid: int, timeout: Optional[float] = None,
                token: int = 0) -> None:
        with self.mutex:
            self._arrive(reply, tid, timeout, token)

    def _arrive(self, reply: ReplySink, tid: int, timeout: Optional[float], token: int) -> None:
        if self.broken:
            reply.fail(threading.BrokenBarrierError())
        elif self.acting is not None:
            self.next_round.append((reply, tid, timeout, token))
        else:
            waiter = _Waiter(reply, owner_of(reply, tid), token=token)
            waiter.count = len(self.waiters)
            if waiter.count + 1 < self.parties:
                self._park(waiter, timeout)
            elif self.has_action:
                self.acting = waiter
                reply(BarrierTurn(waiter.count, True))
            else:
                self._release_round(waiter)

    def _park(self, waiter: _Waiter, timeout: Optional[float]) -> None:
        self.waiters.append(waiter)
        if timeout is not None:
            waiter.timer = self.hub.timers.call_at(
                time.monotonic() + max(timeout, 0.0), lambda: self._timed_out(waiter))

    def _timed_out(self, waiter: _Waiter) -> None:
        with self.mutex:
            if waiter in self.waiters:
                self._break()

    def _release_round(self, last: Optional[_Waiter]) -> None:
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if waiter.timer is not None:
                self.hub.timers.cancel(waiter.timer)
            waiter.reply(BarrierTurn(waiter.count))
        if last is not None:
            last.reply(BarrierTurn(last.count))

    def op_action_done(self, reply: ReplySink, ok: bool) -> None:
        with self.mutex:
            acting, self.acting = self.acting, None
            if not ok:
                self._break()
            else:
                self._release_round(None)
            reply(None)
            if acting is not None and ok:
                self._admit_next_round()

    def _admit_next_round(self) -> None:
        pending, self.next_round = self.next_round, []
        for reply, tid, timeout, token in pending:
            self._arrive(reply, tid, timeout, token)

    def _break(self) -> None:
        self.broken = True
        waiters, self.waiters = self.waiters, []
        pending, self.next_round = self.next_round, []
        acting, self.acting = self.acting, None
        for waiter in waiters:
            if waiter.timer is not None:
                self.hub.timers.cancel(waiter.timer)
            waiter.reply.fail(threading.BrokenBarrierError())
        for reply, *_ in pending:
            reply.fail(threading.BrokenBarrierError())

    def op_abort(self, reply: ReplySink) -> None:
        with self.mutex:
            self._break()
        reply(None)

    def op_reset(self, reply: ReplySink) -> None:
        with self.mutex:
            self._break()
            self.broken = False
        reply(None)

    def op_cancel(self, reply: ReplySink, tid: int, token: int) -> None:
        """An interrupted wait leaves the barrier (``threading.Barrier`` does the same)."""
        who = owner_of(reply, tid)
        with self.mutex:
            for waiter in [w for w in self.waiters if w.who == who and w.token == token]:
                self.waiters.remove(waiter)
                if waiter.timer is not None:
                    self.hub.timers.cancel(waiter.timer)
                waiter.reply.fail(threading.BrokenBarrierError())
        reply(None)

    def op_n_waiting(self, reply: ReplySink) -> None:
        reply(len(self.waiters))

    def op_broken(self, reply: ReplySink) -> None:
        reply(self.broken)

    def drop_peer(self, peer) -> None:
        gone = [w for w in self.waiters if w.reply.peer is peer]
        acting_gone = self.acting is not None and self.acting.reply.peer is peer
        if gone or acting_gone:
            self._break()  # a party died: the others must not wait for it forever


# -- handles ---------------------------------------------------------------------------------
class _Hosted:
    """The client side of a hosted primitive: address + object id, picklable anywhere."""

    _address: str
    _oid: str

    def _host(self, service: HostedService) -> None:
        hub = get_hub()
        self._oid = hub.register(service)
        self._address = hub.address
        finalizer = weakref.finalize(self, _drop_owner, weakref.ref(hub), self._oid)
        finalizer.atexit = False  # at exit the hub closes every service itself

    def __reduce__(self):
        hub = get_hub()
        if hub.is_local(self._address):
            service = hub.service(self._oid)
            if isinstance(service, HostedService):
                service.pickled = True
        return (_rebuild, (type(self), self._address, self._oid, self._state()))

    def _state(self) -> dict:
        return {}

    def _call(self, method: str, *args: Any) -> Any:
        return call_owner(self._address, self._oid, method, *args)

    def _parked(self, method: str, *args: Any) -> Any:
        """A call that may park: when interrupted, withdraw it and undo what it got."""
        hub = get_hub()
        token = next(_tokens)
        try:
            handle = hub.call_async(self._address, self._oid, method, *args, token)
        except TransportError as exc:
            raise _gone(self._address, exc) from exc
        try:
            return wait_reply(handle, self._address, hub)
        except BaseException:
            if not handle.ready():
                self._withdraw(handle, token)
            raise

    def _withdraw(self, handle: Handle, token: int) -> None:
        try:
            self._call("cancel", threading.get_ident(), token)
            self._undo(wait_reply(handle, self._address, get_hub()))
        except Exception:
            pass  # the owner is gone: nothing is held any more

    def _undo(self, result: Any) -> None:
        """Give back what an interrupted call obtained after all."""


def _rebuild(cls: type, address: str, oid: str, state: dict) -> Any:
    obj = cls.__new__(cls)
    obj._address, obj._oid = address, oid
    obj.__dict__.update(state)
    return obj


def _timeout_of(block: bool, timeout: Optional[float]) -> Optional[float]:
    if not block:
        return 0.0
    return None if timeout is None else max(float(timeout), 0.0)


class _LockBase(_Hosted):
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
            from .process import current_process

            name = current_process().name
            if threading.current_thread().name != "MainThread":
                name += "|" + threading.current_thread().name
            return name
        if state.value == 1:
            return "None"
        return "SomeOtherThread" if state.same_process else "SomeOtherProcess"


class Lock(_LockBase):
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


class RLock(_LockBase):
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


class Semaphore(_LockBase):
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
        try:
            value = self.get_value()
        except Exception:
            value = "unknown"
        return f"<{type(self).__name__}(value={value})>"


class BoundedSemaphore(Semaphore):
    """A Semaphore whose ``release`` raises ``ValueError`` above its initial value."""

    _bounded = True

    def __repr__(self) -> str:
        try:
            state = self._lock_state()
            value, maxvalue = state.value, state.maxvalue
        except Exception:
            value = maxvalue = "unknown"
        return f"<BoundedSemaphore(value={value}, maxvalue={maxvalue})>"


class Condition(_Hosted):
    """A condition variable over a fibrl ``Lock`` or ``RLock`` (a new RLock by default).

    ``wait`` releases the lock, waits for ``notify`` or its timeout, and holds
    the lock again before it returns, as in ``multiprocessing``.

    Example:
        >>> cond = Condition()
        >>> with cond:
        ...     cond.wait(0.01)
        False
    """

    def __init__(self, lock: Optional[_LockBase] = None, *, ctx: Any = None) -> None:
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
        result = predicate()
        endtime = None if timeout is None else time.monotonic() + timeout
        waittime = None
        while not result:
            if endtime is not None:
                waittime = endtime - time.monotonic()
                if waittime <= 0:
                    break
            self.wait(waittime)
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        self._call("notify", threading.get_ident(), n)

    def notify_all(self) -> None:
        self._call("notify", threading.get_ident(), _SEM_VALUE_MAX)

    def __repr__(self) -> str:
        try:
            waiters = self._call("waiters")
        except Exception:
            waiters = "unknown"
        return f"<Condition({self._lock!r}, {waiters})>"


class Event(_Hosted):
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


class Barrier(_Hosted):
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
        try:
            self._action()
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
