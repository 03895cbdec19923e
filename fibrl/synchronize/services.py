"""The hosted side of the sync primitives: state machines that park replies.

Each service lives in the hub of the process that created the primitive and
owns all of its state and every deadline: a blocking ``acquire`` or ``wait``
*parks* its reply until it can be granted or its timeout passes (the hub's
timer thread), so a grant never races a client-side timeout. Ops never block.

A holder or waiter is an :class:`Owner`, ``(connection, thread id)``: RLock
ownership and Condition checks work per thread, and when a connection drops
(process killed, node lost) ``peer_lost`` releases the Lock or RLock it held
and drops what it parked. The handles users hold are in ``fibrl.synchronize``
(on ``fibrl.hosting.hosted.HostedHandle``, whose waits ping the owner between slices,
so a lost owner raises instead of hanging); ``sharedctypes`` builds
``Value``/``Array`` on :class:`LockService`.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import object_gone
from ..hosting.hosted import HostedService, answer
from ..hosting.hub import ReplySink

__all__ = ["Owner", "owner_of", "LockState", "LockService",
           "ConditionService", "EventService", "BarrierTurn", "BarrierService",
           "SEM_VALUE_MAX"]

SEM_VALUE_MAX = 2 ** 31 - 1


# -- identity and waiting --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Owner:
    """Who holds or waits: one thread (``tid``) behind one connection (``peer``, 0: local)."""

    peer: int
    tid: int


def owner_of(reply: ReplySink, tid: int) -> Owner:
    return Owner(reply.peer.id if reply.peer is not None else 0, tid)


class _Waiter:
    """A parked request: an acquire, a condition wait, or an operation waiting for a lock."""

    __slots__ = ("reply", "who", "count", "token", "timer", "result", "run")

    def __init__(self, reply: ReplySink, who: Owner, count: int = 1, token: int = 0,
                 run: Optional[Callable[[], Any]] = None) -> None:
        self.reply = reply
        self.who = who
        self.count = count
        self.token = token
        self.timer: Optional[list] = None  # the Timers entry of its timeout
        self.result = True
        self.run = run


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
            if self.value >= (self.maxvalue or SEM_VALUE_MAX):
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
            waiter.reply.fail(object_gone(self.oid, "its process", "closed"))
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
            waiter.reply.fail(object_gone(self.oid, "its process", "closed"))


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
        self.acting = None
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
