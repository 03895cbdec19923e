"""The policy of a pool: which worker runs which task, and what a lost worker costs.

:class:`PoolService` lives on the parent's hub and owns every task's state:
pending chunks, which worker holds which chunk, how far each chunk got, the
attempts and exit codes charged to it. It never starts or kills processes
(:mod:`fibrl.supervisor` does) and never waits: workers *pull* work with ``next``,
whose reply is parked until there is work for them. A worker that sends
nothing for ``parent_timeout`` (``liveness``: frozen, or its machine gone) is
lost like one whose process ended.

Data flow::

    Pool / Executor (caller threads)            workers (one connection each)
      submit(chunks) --+                          next(wid, reports) / report(...)
                       v                                |
                 +------------ PoolService (one lock) <-+
                 | pending  deque of fresh chunks       |
                 | careful  deque of chunks a lost      |  replies (Batch) and
                 |          worker held: run alone,     |  deliveries to result
                 |          one item at a time          |  objects are made
                 | tasks    tid -> chunk state          |  *after* the lock is
                 | workers  wid -> held chunks, parked  |  released (_Effects)
                 +--------------------------------------+
                       ^ lose(wid, exitcode)      | wake() / kill(wid)
                       |                          v
                 Supervisor thread (sentinels, starts replacements)

Rules that make results right:

* A chunk's ``lo`` is the first item whose result was not recorded; a report
  for items below ``lo`` is a duplicate and is dropped, so every item is
  delivered exactly once, whichever worker (a dead one's late report
  included) answers first.
* Prefetch is bounded by time, not count: a worker holds at most
  ``HORIZON_S`` of estimated work, more in a pool of hundreds (each worker's
  share of ``MESSAGES_PER_S``: see :meth:`PoolService._pace`; at least one
  chunk; a callable whose cost was not measured yet gets one chunk; a job's
  cost is its own items' from its first result on, before that its
  callable's in earlier jobs), never more than its fair share of what is
  pending, and idle workers are served first, so no worker hoards a queue.
* A lost worker's chunks go to the front, *careful*: from then on they are
  run alone, and the worker announces that it unpickles the chunk, then each
  item before starting it, and reports it before the next, so what was
  running when a worker died is known. The first loss charges every item
  the worker held once; later losses charge only the announced item, or
  every item left when the worker died unpickling the chunk (its callable or
  arguments kill workers: no item of it can run). An item charged more than
  ``max_task_retries`` times fails with :class:`~fibrl.errors.TaskFailedError`;
  the other items go on.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Optional, Protocol

from ..wire import serialization
from ..errors import (BackendUnavailableError, SerializationError, TaskFailedError, WorkerLostError,
                      describe_exitcode)
from ..backends.base import Backend
from ..wire.gate import descriptor_room, descriptor_shortage
from ..hosting.hub import ReplySink, Service
from .protocol import (CLOSE, LOADING, RUN, STOP, TERMINATE, Batch, Kind, Report, TaskSpec,
                       describe, shorten, unpack)
from .liveness import Liveness
from .results import Failure
from ..supervisor import Policy
from .salvage import salvage

__all__ = ["PoolService", "Hooks"]

log = logging.getLogger(__name__)

# Starts that failed in a row, while other workers run, before the pool gives up on
# reaching its size and goes on with the workers it has.
_SHORT_AFTER = 3

HORIZON_S = 0.05        # estimated work a worker may hold (hides the round trip)
# Requests and reports that the workers of one pool send together, per second, about
# (once each is busy): the parent handles every one in Python (100-200 us each), so
# the workers of a large pool each talk less often, holding more work and keeping
# their results longer, and the parent's CPU per task stays flat as the pool grows.
MESSAGES_PER_S = 2000.0
# The least time a result may wait in its worker (the worker's FLUSH_S).
_HOLD_S = 0.02
# Descriptors a worker holds in this process once it runs (its sentinel, its connection,
# the fork server's and the supervisor's share: 4-6 measured), and those a starting one
# still needs to connect (the handshake's connection, its data port, its connection).
_FDS_PER_WORKER = 6
_FDS_TO_CONNECT = 3
# A worker that went silent is killed this long after its tasks were requeued (at
# least twice parent_timeout): time to end by itself if it was only stalled.
_KILL_SILENT_AFTER_S = 30.0
_EWMA = 0.3
_MAX_FUNCS = 256


class Hooks(Protocol):
    """What the service asks of its supervisor (:class:`fibrl.supervisor.Supervisor`)."""

    def wake(self) -> None:
        """Re-check how many workers are wanted."""

    def kill(self, wid: int) -> None:
        """Kill worker ``wid`` (its connection dropped but its process may live)."""

    def exit_grace(self, wid: int) -> float:
        """Seconds worker ``wid``'s backend may take to report its exit after its
        connection dropped (a container's or pod's status arrives later than a child's)."""


class _Detached:
    """The hooks of a service no supervisor is attached to yet (a unit test's)."""

    def wake(self) -> None:
        return None

    def kill(self, wid: int) -> None:
        return None

    def exit_grace(self, wid: int) -> float:
        return Backend.exit_report_s


class _Func:
    __slots__ = ("fid", "data", "name", "per_item", "jobs")

    def __init__(self, fid: int, data: bytes, name: str) -> None:
        self.fid, self.data, self.name = fid, data, name
        self.per_item: Optional[float] = None  # seconds per item, once measured
        self.jobs = 0


class _Job:
    __slots__ = ("jid", "sink", "func", "kind", "open", "inputs_open", "claimed", "per_item")

    def __init__(self, jid: int, sink: Any, func: _Func, kind: Kind, lazy: bool) -> None:
        self.jid, self.sink, self.func, self.kind = jid, sink, func, kind
        self.open = 0                # chunks not finished
        self.inputs_open = lazy      # more chunks may come (imap)
        self.claimed = False
        # seconds per item of this job's own results, once one came: the same callable
        # may take far longer or shorter on another job's arguments
        self.per_item: Optional[float] = None


class _Task:
    __slots__ = ("tid", "job", "start", "n", "payload", "lo", "holder", "careful", "running",
                 "cost", "attempts", "codes", "base_attempts", "base_codes", "done",
                 "killed_loading")

    def __init__(self, tid: int, job: _Job, start: int, n: int, payload: bytes) -> None:
        self.tid, self.job, self.start, self.n, self.payload = tid, job, start, n, payload
        self.lo = 0
        self.holder: Optional[int] = None
        self.careful = False
        self.running: Optional[int] = None  # careful: what its holder said it started
        self.cost = 0.0
        # lost workers and their exit codes (None: unknown)
        self.attempts = 0
        self.codes: list[Optional[int]] = []       # charged to item ``lo``
        self.base_attempts = 0
        self.base_codes: list[Optional[int]] = []  # charged to every item left
        self.done = False
        self.killed_loading = False  # a holder died unpickling it: never unpickle it here

    def spec(self) -> TaskSpec:
        return TaskSpec(self.tid, self.job.func.fid, self.job.kind, self.payload, self.lo,
                        self.n, self.careful)


class _Worker:
    __slots__ = ("wid", "peer", "parked", "held", "held_cost", "known", "granted", "retiring",
                 "connected", "booted")

    def __init__(self, wid: int) -> None:
        self.wid = wid
        self.peer: Any = None
        self.parked: Optional[ReplySink] = None
        self.held: dict[int, _Task] = {}
        self.held_cost = 0.0
        self.known: set[int] = set()
        self.granted = 0
        self.retiring = False   # asked to exit (maxtasksperchild or no more work)
        self.connected = False
        self.booted = False     # its process runs and reached this service (see op_booted)

    def holds_careful(self) -> bool:
        return any(t.careful for t in self.held.values())


class _Effects:
    """What an operation decided under the lock, done after releasing it."""

    __slots__ = ("sends", "deliveries", "failures", "aborts", "lengths", "wake")

    def __init__(self) -> None:
        self.sends: list = []
        self.deliveries: list = []
        self.failures: list = []
        self.aborts: list = []
        self.lengths: list = []
        self.wake = False

    def run(self, service: "PoolService") -> None:
        for worker, reply, batch in self.sends:
            if not reply(batch):
                service._undelivered(worker, batch)
        for sink, index, payload, skip, report in self.deliveries:
            values, whole = _decode(payload, skip, report.count)
            sink.sink_deliver(index, values, report.clean and whole)
        for sink, index, exc in self.failures:
            sink.sink_deliver(index, [Failure(exc)])
        for sink, exc in self.aborts:
            sink.sink_abort(exc)
        for sink, length in self.lengths:
            sink.sink_set_length(length)
        if self.wake:
            service.hooks.wake()


def _decode(payload: bytes, skip: int, count: int) -> tuple[list, bool]:
    """The outcomes in ``payload`` from item ``skip`` on, and whether all decoded at once."""
    try:
        values, whole = unpack(payload), True
    except SerializationError as exc:  # e.g. a result class the parent cannot import
        values, whole = salvage(payload, count, exc), False  # fail only the items at fault
    return (values[skip:] if skip else values), whole


class PoolService(Service, Policy):
    """Task state and dispatch of one pool (hosted on the parent's hub).

    Why one class of this size: every decision (which worker gets which chunk, what a
    lost worker's chunks cost, when a job is done) reads and changes the same state
    under one lock, and each operation is answered without waiting. Split across
    objects, that state would need several locks taken in a fixed order. What does not
    need the lock lives elsewhere: results and their delivery (``results``), decoding a
    failed block (``salvage``), processes (:mod:`fibrl.supervisor`), lazy inputs
    (``feeder``).

    Args:
        processes: how many workers the pool keeps.
        max_retries: times an item may be charged with a lost worker before it fails.
        maxtasks: chunks a worker runs before it is replaced (None: no limit).
        max_starting: workers started but not yet booted, at most (None: no limit): the
            workers of a local pool share this machine's cores, and hundreds booting at
            once would each take longer than the handshake allows.
    """

    def __init__(self, processes: int, max_retries: int, maxtasks: Optional[int],
                 max_starting: Optional[int] = None) -> None:
        self.processes = processes
        self.max_starting = max_starting
        self.max_retries = max_retries
        self.maxtasks = maxtasks
        self.hooks: Hooks = _Detached()
        self._lock = threading.Lock()
        self._state = RUN
        self._broken: Optional[BaseException] = None
        self._pending: deque[_Task] = deque()
        self._careful: deque[_Task] = deque()
        self._tasks: dict[int, _Task] = {}
        self._jobs: dict[int, _Job] = {}
        self._funcs: OrderedDict[bytes, _Func] = OrderedDict()
        self._fids: dict[int, _Func] = {}
        self._workers: dict[int, _Worker] = {}
        self._by_peer: dict[int, _Worker] = {}
        self._parked: OrderedDict[int, _Worker] = OrderedDict()
        self._idle: OrderedDict[int, _Worker] = OrderedDict()   # parked, holding nothing
        self._ids = itertools.count(1)
        self._failed_starts: list = []   # evidence of consecutive failed starts
        self._short_of: set = set()   # causes of refused starts, each logged once
        self._load_errors: set = set()   # what workers said when they could not load
        self._first_failure = ""   # evidence of the first failed start in a row
        self._retiring = 0   # workers in _workers that are retiring, kept as they change
        self._booting = 0    # workers in _workers not booted yet, kept as they change
        self.liveness = Liveness(self._silent)   # started by the engine once hosted
        self.stats = {"lost": 0, "requeued": 0, "failed": 0}

    # == caller side ======================================================================
    def open_job(self, sink: Any, func: bytes, name: str, kind: Kind, lazy: bool) -> _Job:
        """Register a job whose chunks come with :meth:`add_chunks`."""
        with self._lock:
            self._check_open()
            return self._open_job(sink, func, name, kind, lazy)

    def submit(self, sink: Any, func: bytes, name: str, kind: Kind, chunks: list) -> _Job:
        """Register a job and all its chunks (``[(payload, n_items), ...]``) at once."""
        effects = _Effects()
        with self._lock:
            self._check_open()
            job = self._open_job(sink, func, name, kind, lazy=False)
            self._add(job, 0, chunks)
            self._finish_job_if_done(job, effects)
            self._dispatch(effects, new_work=True)
        effects.run(self)
        return job

    def add_chunks(self, job: _Job, start: int, chunks: list) -> None:
        """More chunks of a lazy job, numbered from item ``start``."""
        effects = _Effects()
        with self._lock:
            if job.jid in self._jobs:
                self._add(job, start, chunks)
                self._dispatch(effects, new_work=True)
        effects.run(self)

    def end_inputs(self, job: _Job, length: int) -> None:
        """A lazy job has no more chunks; it has ``length`` items in all."""
        effects = _Effects()
        with self._lock:
            job.inputs_open = False
            effects.lengths.append((job.sink, length))
            if job.jid in self._jobs:
                self._finish_job_if_done(job, effects)
                self._dispatch(effects)
        effects.run(self)

    def cancel(self, job: _Job) -> None:
        """Drop the job's chunks that no worker holds (an abandoned ``Executor.map``)."""
        effects = _Effects()
        with self._lock:
            for task in [t for t in self._tasks.values() if t.job is job and t.holder is None]:
                self._finish_task(task, effects)
            job.inputs_open = False
            self._finish_job_if_done(job, effects)
            self._dispatch(effects)
        effects.run(self)

    def sinks_waiting(self) -> list:
        """Result objects of jobs that no worker has started (for ``cancel_futures``)."""
        with self._lock:
            return [j.sink for j in self._jobs.values() if not j.claimed]

    def close(self) -> None:
        """Accept no more jobs; workers exit once every job finished."""
        effects = _Effects()
        with self._lock:
            if self._state == RUN:
                self._state = CLOSE
            effects.wake = True
            self._dispatch(effects)
        effects.run(self)

    def terminate(self, exc: BaseException) -> None:
        """Fail every unfinished job with ``exc`` and tell every worker to stop."""
        effects = _Effects()
        with self._lock:
            self._state = TERMINATE
            self._abort_all(exc, effects)
            self._dispatch(effects)
        effects.run(self)

    def _check_open(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._state != RUN:
            raise ValueError("Pool not running")

    def _open_job(self, sink: Any, data: bytes, name: str, kind: Kind, lazy: bool) -> _Job:
        func = self._func(data, name)
        job = _Job(next(self._ids), sink, func, kind, lazy)
        func.jobs += 1
        self._jobs[job.jid] = job
        return job

    def _func(self, data: bytes, name: str) -> _Func:
        func = self._funcs.get(data)
        if func is None:
            self._evict_funcs()
            func = _Func(next(self._ids), data, name)
            self._funcs[data] = func
            self._fids[func.fid] = func
        self._funcs.move_to_end(data)
        return func

    def _evict_funcs(self) -> None:
        """Forget the least recently used callables no job uses (keeps memory bounded)."""
        if len(self._funcs) < _MAX_FUNCS:
            return
        for data in [d for d, f in self._funcs.items() if f.jobs == 0][:len(self._funcs) // 4]:
            func = self._funcs.pop(data)
            del self._fids[func.fid]
            for worker in self._workers.values():
                worker.known.discard(func.fid)

    def _add(self, job: _Job, start: int, chunks: list) -> None:
        for payload, n in chunks:
            task = _Task(next(self._ids), job, start, n, payload)
            self._tasks[task.tid] = task
            self._pending.append(task)
            job.open += 1
            start += n

    # == worker side (hub operations) ======================================================
    def op_next(self, reply: ReplySink, wid: int, reports: list) -> None:
        """A worker reports results and asks for work; parked until there is some."""
        effects = _Effects()
        self.liveness.heard(wid)
        with self._lock:
            worker = self._workers.get(wid)
            self._record(reports, effects)
            if worker is None:  # lost already: whatever it held was requeued
                effects.sends.append((None, reply, STOP))
            else:
                self._connected(worker, reply.peer, effects)
                self._park(worker, reply)
                self._dispatch(effects, worker)
        effects.run(self)

    def op_report(self, reply: ReplySink, wid: int, reports: list,
                  starting: Optional[tuple] = None) -> None:
        """Results sent while a ``next`` is parked.

        A careful worker waits for the answer, and says which item it starts
        next (``(tid, lo)``): only an item that was started is charged when
        its worker dies.
        """
        effects = _Effects()
        self.liveness.heard(wid)
        with self._lock:
            self._record(reports, effects)
            self._mark_running(wid, starting)
            # its results may end what it held: if parked, it may be due an answer (STOP)
            self._dispatch(effects, self._workers.get(wid))
        effects.run(self)
        reply(None)

    def _mark_running(self, wid: int, starting: Optional[tuple]) -> None:
        if starting is None:
            return
        task = self._tasks.get(starting[0])
        if task is not None and task.holder == wid:
            task.running = starting[1]
            if starting[1] != LOADING:
                task.killed_loading = False  # a worker unpickled it: the payload is harmless

    def op_alive(self, reply: ReplySink, wid: int) -> None:
        """A worker's heartbeat (one-way): it runs, even if it has nothing to say."""
        self.liveness.heard(wid)

    def op_booted(self, reply: ReplySink, wid: int) -> None:
        """Worker ``wid``'s process runs (one-way, before its initializer): it no longer
        counts against ``max_starting``."""
        with self._lock:
            worker = self._workers.get(wid)
            wake = worker is not None and self._booted(worker)
        if wake:
            self.hooks.wake()

    def _booted(self, worker: _Worker) -> bool:
        """Count ``worker`` as booted; True when the supervisor may start another now."""
        if worker.booted:
            return False
        worker.booted = True
        self._booting -= 1
        return self.max_starting is not None

    def _silent(self, wid: int, seconds: float) -> None:
        """Worker ``wid`` sent nothing for ``seconds``: its process is frozen, or its
        machine or network is gone. Its tasks go to other workers now; it is killed
        only later, so that one that was merely stalled can still end by itself (its
        late results are dropped as duplicates and it is told to stop)."""
        self.lose(wid, None, f"sent nothing for {seconds:.0f} s: frozen, or its machine or "
                             f"network is gone")
        grace = max(_KILL_SILENT_AFTER_S, 2 * self.hub.parent_timeout)
        self.hub.timers.call_at(time.monotonic() + grace, lambda: self.hooks.kill(wid),
                                blocking=True)   # a backend call

    def op_func(self, reply: ReplySink, fid: int) -> None:
        """The pickled callable ``fid`` (for a worker that evicted it from its cache)."""
        with self._lock:
            func = self._fids.get(fid)
        if func is None:
            raise KeyError(f"the pool no longer knows callable {fid}")
        reply(func.data)

    def op_func_by_value(self, reply: ReplySink, fid: int) -> None:
        """Callable ``fid`` pickled by value: a function the main script defines under
        ``if __name__ == "__main__":``, which a worker's ``__mp_main__`` lacks (as a
        ``Process`` target gets it)."""
        with self._lock:
            func = self._fids.get(fid)
        if func is None:
            raise KeyError(f"the pool no longer knows callable {fid}")
        reply(serialization.dumps(unpack(func.data), by_value=True))

    def op_init_failed(self, reply: ReplySink, wid: int, error: BaseException) -> None:
        """The initializer raised in worker ``wid``: every task would fail the same way."""
        exc = error  # unpickled with the worker's traceback as __cause__
        broken = WorkerLostError(
            f"the pool's initializer raised {type(exc).__name__}: {exc} (in worker {wid}), so "
            f"no worker can run tasks; the pool is broken and its pending tasks fail. Fix the "
            f"initializer; its exception is chained below.")
        broken.__cause__ = exc
        self._break(broken)
        reply(None)

    def peer_lost(self, peer: Any) -> None:
        with self._lock:
            worker = self._by_peer.pop(peer.id, None)
            if worker is None:
                return
            self._unpark(worker)
        wid = worker.wid
        grace = self.hooks.exit_grace(wid)
        self.hub.timers.call_at(time.monotonic() + grace, lambda: self._no_exit_code(wid),
                                blocking=True)  # may kill the job: a backend call

    def _no_exit_code(self, wid: int) -> None:
        with self._lock:
            alive = wid in self._workers
        if alive:  # the process did not end (or its backend did not tell): stop waiting
            self.lose(wid, None)
            self.hooks.kill(wid)

    def _connected(self, worker: _Worker, peer: Any, effects: _Effects) -> None:
        if worker.connected:
            return
        worker.connected = True
        if self._booted(worker):   # (its booted message was lost, or comes later)
            effects.wake = True
        if len(self._workers) - self._retiring < self.processes:
            effects.wake = True   # starts held back for want of descriptors may fit now
        self.liveness.watch(worker.wid)
        worker.peer = peer
        if peer is not None:
            self._by_peer[peer.id] = worker
        self._failed_starts.clear()
        self._first_failure = ""
        self._load_errors.clear()   # loading works: an error seen before was not for all

    # == recording results =================================================================
    def _record(self, reports: list, effects: _Effects) -> None:
        for report in reports:
            task = self._tasks.get(report.tid)
            if task is None:
                continue  # finished already (a duplicate from a dead worker)
            self._learn(task.job, report)
            task.killed_loading = False  # a worker unpickled it: the payload is harmless
            end = report.lo + report.count
            if end <= task.lo:
                continue
            skip = task.lo - report.lo
            effects.deliveries.append((task.job.sink, task.start + task.lo, report.payload, skip,
                                       report))
            self._advance(task, end, effects)

    @staticmethod
    def _learn(job: _Job, report: Report) -> None:
        """A job's first result sets its cost per item, later ones move it; the
        callable keeps the latest, for its next job's first chunks."""
        sample = report.seconds / max(report.count, 1)
        old = job.per_item
        job.per_item = job.func.per_item = (sample if old is None
                                            else old + _EWMA * (sample - old))

    def _advance(self, task: _Task, lo: int, effects: _Effects) -> None:
        task.lo = lo
        task.attempts, task.codes = task.base_attempts, list(task.base_codes)
        if task.lo >= task.n:
            self._finish_task(task, effects)

    def _finish_task(self, task: _Task, effects: _Effects) -> None:
        if task.done:
            return
        task.done = True
        del self._tasks[task.tid]
        self._release(task)
        task.job.open -= 1
        self._finish_job_if_done(task.job, effects)

    def _release(self, task: _Task) -> None:
        worker = self._workers.get(task.holder) if task.holder is not None else None
        task.holder = None
        if worker is not None and worker.held.pop(task.tid, None) is not None:
            worker.held_cost -= task.cost
            if not worker.held and worker.parked is not None:
                self._idle[worker.wid] = worker

    def _finish_job_if_done(self, job: _Job, effects: _Effects) -> None:
        if job.open or job.inputs_open or job.jid not in self._jobs:
            return
        del self._jobs[job.jid]
        job.func.jobs -= 1
        if not self._jobs and self._state != RUN:
            effects.wake = True

    # == dispatch ==========================================================================
    def _dispatch(self, effects: _Effects, touched: Optional[_Worker] = None,
                  new_work: bool = False) -> None:
        """Answer the parked workers that can use an answer now: with work, or with STOP.

        Its cost follows the answers it gives, not the number of workers waiting: while
        the pool goes on, idle workers are served first (in the order they parked) and
        only while work is left; the workers that hold tasks are visited only when work
        was added (``new_work``: nothing else lets one of them take more), and ``touched``,
        the worker whose own state just changed (it parked, or reported results), is
        answered last. Every other parked worker was answered when it parked and nothing
        changed for it since. Once the pool ends (terminated, broken, or closed with
        every job done), every parked worker is told to stop.
        """
        if not self._parked:
            return
        if not self._ending():
            self._serve(self._idle, effects)
            if new_work:
                self._serve(self._parked, effects)
            if touched is not None and touched.parked is not None:
                self._answer(touched, effects)
            if not self._ending():
                return
        for worker in sorted(self._parked.values(), key=_idleness):
            self._answer(worker, effects)

    def _serve(self, parked: "OrderedDict[int, _Worker]", effects: _Effects) -> None:
        """Answer ``parked`` workers in order while work is left."""
        for worker in list(parked.values()) if self._has_work() else ():
            if not self._has_work():
                return
            if worker.parked is not None:
                self._answer(worker, effects)

    def _has_work(self) -> bool:
        return bool(self._pending or self._careful)

    def _ending(self) -> bool:
        """Every parked worker is due STOP: terminated, broken, or closed and done."""
        return (self._state == TERMINATE or self._broken is not None
                or (self._state != RUN and not self._jobs))

    def _answer(self, worker: _Worker, effects: _Effects) -> None:
        if self._has_work() and not self._should_stop(worker):
            tasks = self._grant(worker, effects)
            if tasks:
                self._send(worker, self._batch(worker, tasks), effects)
                return
        if self._should_stop(worker):  # checked after granting: that may end the last job
            self._retire(worker)
            self._send(worker, STOP, effects)
            effects.wake = True

    def _retire(self, worker: _Worker) -> None:
        if not worker.retiring:
            worker.retiring = True
            self._retiring += 1

    def _send(self, worker: _Worker, batch: Batch, effects: _Effects) -> None:
        reply = worker.parked
        self._unpark(worker)
        effects.sends.append((worker, reply, batch))

    def _park(self, worker: _Worker, reply: ReplySink) -> None:
        worker.parked = reply
        self._parked[worker.wid] = worker
        if not worker.held:
            self._idle[worker.wid] = worker

    def _unpark(self, worker: _Worker) -> None:
        worker.parked = None
        self._parked.pop(worker.wid, None)
        self._idle.pop(worker.wid, None)

    def _should_stop(self, worker: _Worker) -> bool:
        if self._state == TERMINATE or self._broken is not None:
            return True
        if worker.held:
            return False
        return worker.retiring or (self._state == CLOSE and not self._jobs)

    def _grant(self, worker: _Worker, effects: _Effects) -> list:
        if worker.retiring or worker.holds_careful():
            return []
        if not self._careful_waiting():
            return self._grant_fresh(worker, effects)
        if worker.held:  # let it drain: a retried task runs alone, and before fresh work
            return []
        task = self._careful.popleft()
        self._hold(worker, task, self._cost(task), effects)
        return [task]

    def _careful_waiting(self) -> bool:
        while self._careful and self._careful[0].done:
            self._careful.popleft()
        return bool(self._careful)

    def _grant_fresh(self, worker: _Worker, effects: _Effects) -> list:
        tasks: list = []
        share = self._share()
        budget = self._horizon() - worker.held_cost
        while self._pending and len(tasks) < share and not worker.retiring:
            task = self._pending[0]
            if task.done:
                self._pending.popleft()
                continue
            cost = self._cost(task)
            if worker.held and (cost is None or cost > budget):
                break
            self._pending.popleft()
            if self._claim(task, effects):
                budget -= self._hold(worker, task, cost, effects)
                tasks.append(task)
        return tasks

    def _claim(self, task: _Task, effects: _Effects) -> bool:
        job = task.job
        if job.claimed:
            return True
        job.claimed = True
        if job.sink.sink_claim():
            return True
        self._finish_task(task, effects)  # a cancelled future: nothing to deliver
        return False

    def _hold(self, worker: _Worker, task: _Task, cost: Optional[float],
              effects: _Effects) -> float:
        task.holder = worker.wid
        task.cost = HORIZON_S if cost is None else cost
        worker.held[task.tid] = task
        self._idle.pop(worker.wid, None)
        worker.held_cost += task.cost
        worker.granted += 1
        if self.maxtasks is not None and worker.granted >= self.maxtasks:
            self._retire(worker)  # its replacement starts now, not when it exits
            effects.wake = True
        return task.cost

    def _cost(self, task: _Task) -> Optional[float]:
        job = task.job
        per_item = job.func.per_item if job.per_item is None else job.per_item
        return None if per_item is None else per_item * (task.n - task.lo)

    def _share(self) -> int:
        workers = len(self._workers) - self._retiring or 1
        return max(1, math.ceil(len(self._pending) / workers))

    def _batch(self, worker: _Worker, tasks: list) -> Batch:
        funcs = {}
        for task in tasks:
            func = task.job.func
            if func.fid not in worker.known:
                worker.known.add(func.fid)
                funcs[func.fid] = func.data
        last = self._cost(tasks[-1])
        if self._scarce(len(tasks)):
            refill = -1
        elif not last or tasks[-1].careful:
            refill = 0
        else:
            refill = int(self._horizon() / 2 / last)
        return Batch(tuple(t.spec() for t in tasks), funcs, refill, False,
                     max(_HOLD_S, self._pace()))

    def _scarce(self, batch: int) -> bool:
        """Fewer chunks are pending than a batch like this one for every worker: an early
        request would most likely be parked, and its worker would then send its last
        results on their own before it blocks; asked for once it is done, the request
        carries them."""
        return len(self._pending) < batch * len(self._workers)

    def _pace(self) -> float:
        """Seconds between two messages of one worker, at least, for the pool's workers
        to send ``MESSAGES_PER_S`` together: a thousandth of a second per two workers."""
        return len(self._workers) / MESSAGES_PER_S

    def _horizon(self) -> float:
        """Estimated work a worker may hold: it asks for more with half of it left, so
        it asks about once per pace."""
        return max(HORIZON_S, 2 * self._pace())

    def _undelivered(self, worker: Optional[_Worker], batch: Batch) -> None:
        """A batch could not reach its worker (it is gone): put its tasks back, uncharged."""
        if worker is None or not batch.tasks:
            return
        effects = _Effects()
        with self._lock:
            for spec in reversed(batch.tasks):
                task = self._tasks.get(spec.tid)
                if task is not None and task.holder == worker.wid:
                    self._release(task)
                    (self._careful if task.careful else self._pending).appendleft(task)
            self._dispatch(effects, new_work=True)
        effects.run(self)

    # == workers (called by the supervisor) ================================================
    def reserve_workers(self) -> list:
        """Ids of the workers to start now so that ``processes`` are running."""
        with self._lock:
            if not self._wants_workers():
                return []
            wanted = self.processes - (len(self._workers) - self._retiring)
            if self.max_starting is not None:
                wanted = min(wanted, self.max_starting - self._booting)
            if wanted > 0 and self._short_of_descriptors():
                return []
            wanted = self._within_descriptors(wanted)
            wids = [next(self._ids) for _ in range(wanted)]
            for wid in wids:
                self._workers[wid] = _Worker(wid)
            self._booting += len(wids)
            return wids

    def finished(self) -> bool:
        """True once no worker is wanted any more: terminated, broken, or closed and done."""
        with self._lock:
            return not self._wants_workers()

    def _wants_workers(self) -> bool:
        if self._state == TERMINATE or self._broken is not None:
            return False
        return self._state == RUN or bool(self._jobs)

    def still_wanted(self, wid: int) -> bool:
        """Whether worker ``wid``, not connected yet, is still needed: no longer once the
        pool is closed with every job done (or terminated); it is then forgotten, so a
        pool closed while its workers start does not wait for the rest to start."""
        with self._lock:
            worker = self._workers.get(wid)
            if worker is not None and (worker.connected or self._wants_workers()):
                return True   # (one that connected meanwhile is told to stop as usual)
            if worker is not None:
                del self._workers[wid]
                self._booting -= not worker.booted
                if worker.retiring:
                    self._retiring -= 1
            return False

    def start_failed(self, wid: int, exc: BaseException) -> None:
        """Starting worker ``wid`` raised ``exc`` (the backend refused the job)."""
        self._drop(wid, None, f"start raised {type(exc).__name__}: {exc}", exc)

    def lose(self, wid: int, exitcode: Optional[int], detail: str = "",
             load_error: str = "") -> None:
        """Worker ``wid`` ended (``exitcode``; None: unknown). Requeue what it held.
        ``load_error``: why it said it could not load its process (its exception)."""
        evidence = _evidence(exitcode, detail)
        self._drop(wid, exitcode, f"{evidence}: {load_error}" if load_error else evidence,
                   None, load_error)

    def _drop(self, wid: int, exitcode: Optional[int], evidence: str,
              exc: Optional[BaseException], load_error: str = "") -> None:
        effects = _Effects()
        with self._lock:
            worker = self._workers.pop(wid, None)
            if worker is None:
                return
            self._booting -= not worker.booted
            if worker.retiring:
                self._retiring -= 1
            if worker.parked is not None:   # given up alive (silent): its next() must not wait
                effects.sends.append((None, worker.parked, STOP))
                worker.parked = None
            self._forget(worker)
            self.liveness.forget(wid)
            if worker.held:
                self.stats["lost"] += 1
            for task in reversed(list(worker.held.values())):
                self._requeue(task, exitcode, effects)
            if not worker.connected and self._wants_workers():
                self._failed_start(evidence, exc, load_error, effects)
            effects.wake = True
            self._dispatch(effects, new_work=True)
        effects.run(self)

    def _forget(self, worker: _Worker) -> None:
        self._parked.pop(worker.wid, None)
        self._idle.pop(worker.wid, None)
        if worker.peer is not None:
            self._by_peer.pop(worker.peer.id, None)

    def _requeue(self, task: _Task, exitcode: Optional[int], effects: _Effects) -> None:
        task.holder = None
        self.stats["requeued"] += 1
        if task.careful and task.running == LOADING:
            # Its callable or arguments killed the worker as they were unpickled; no item
            # can run without them, so every item left is charged.
            task.killed_loading = True
            self._charge(task, exitcode, every_item=True)
        elif task.careful:  # exact: charge the item it was running, if it had started one
            if task.running == task.lo:
                self._charge(task, exitcode, every_item=False)
        else:  # anything it held may have been running: charge every item left once
            task.careful = True
            self._charge(task, exitcode, every_item=True)
        task.running = None
        while not task.done and task.attempts > self.max_retries:
            self.stats["failed"] += 1
            effects.failures.append((task.job.sink, task.start + task.lo, self._failed(task)))
            self._advance(task, task.lo + 1, effects)
        if not task.done:
            self._careful.appendleft(task)

    @staticmethod
    def _charge(task: _Task, exitcode: Optional[int], every_item: bool) -> None:
        task.attempts += 1
        task.codes.append(exitcode)
        if every_item:
            task.base_attempts += 1
            task.base_codes.append(exitcode)

    def _failed(self, task: _Task) -> TaskFailedError:
        codes = "; ".join(_evidence(code) for code in task.codes)
        cause = ("The worker died while unpickling the task's callable or arguments, before "
                 "running it: fix how they unpickle (a __setstate__ or __reduce__ that "
                 "crashes, a native module that cannot load in the worker)"
                 if task.killed_loading else
                 "The task itself most likely kills the process that runs it (a crash in "
                 "native code, os._exit(), exceeding a memory limit). Fix the task")
        return TaskFailedError(
            f"task {task.start + task.lo} of {task.job.func.name}({self._args_of(task)}) was "
            f"held by a worker that died, {task.attempts} times (max_task_retries="
            f"{self.max_retries}): {codes}. {cause}; if workers are lost for other reasons "
            f"(preempted nodes, memory used by other work), allow more attempts with "
            f"Pool(max_task_retries=...) or fibrl.init(max_task_retries=...).")

    @staticmethod
    def _args_of(task: _Task) -> str:
        if task.killed_loading:  # unpickling them here could kill this process too
            return "<arguments not shown: unpickling them killed workers>"
        try:
            items = unpack(task.payload)
        except Exception:
            return "<arguments that cannot be unpickled here>"
        if task.job.kind == Kind.APPLY:
            args, kwds = items
            parts = [describe(a, 60) for a in args] + [f"{k}={describe(v, 60)}"
                                                       for k, v in kwds.items()]
            return shorten(", ".join(parts))   # each part is a repr already
        return describe(items[task.lo])

    def _failed_start(self, evidence: str, exc: Optional[BaseException], load_error: str,
                      effects: _Effects) -> None:
        if isinstance(exc, BackendUnavailableError):
            self._give_up(exc, effects)   # no engine or cluster: every start fails alike
            return
        if load_error and load_error in self._load_errors:
            self._give_up(WorkerLostError(
                f"the pool stopped starting workers: two of them could not load their "
                f"process with the same error, {load_error} (the worker's traceback is "
                f"logged above); every other worker would fail alike. Fix that error and "
                f"create a new Pool."), effects)
            return
        if load_error:
            self._load_errors.add(load_error)
        self._failed_starts.append(evidence)
        self._first_failure = self._first_failure or evidence
        if self._going_on_short(evidence, exc):
            return
        limit = max(10, 2 * self.processes)
        if len(self._failed_starts) < limit:
            return
        seen = "; ".join(sorted(set(self._failed_starts)))
        self._give_up(WorkerLostError(
            f"the pool could not start a worker: {limit} starts in a row failed before the "
            f"worker connected back. The first failure: {self._first_failure}. All of them: "
            f"{seen}. Check the backend (image, resources, start_timeout) and the worker's "
            f"logs; fix it and create a new Pool."), effects, exc)

    def _going_on_short(self, evidence: str, exc: Optional[BaseException]) -> bool:
        running = sum(1 for w in self._workers.values() if w.connected and not w.retiring)
        alive = len(self._workers) - self._retiring   # running or still starting
        if not ((exc is not None and alive) or
                (running and len(self._failed_starts) >= _SHORT_AFTER)):
            return False
        # The backend refused a start (descriptors, processes, memory, a refused
        # container), or starts keep failing, while others run: go on with those
        # (and the starts under way), and say so once per cause.
        shortage = descriptor_shortage()
        if shortage and "Too many open files" not in evidence:
            # the worker's own report ("connection shutdown") hides the cause
            evidence = f"{evidence}; this process refused connections: {shortage}"
        self._go_on_with(evidence, running, alive)
        return True

    def _short_of_descriptors(self) -> bool:
        """This process refused a worker's connection for want of descriptors while others
        run: starting more would only add workers that cannot connect (and hold
        descriptors until their start times out), so the pool goes on with those."""
        shortage = descriptor_shortage()
        if shortage is None:
            return False
        running = sum(1 for w in self._workers.values() if w.connected and not w.retiring)
        if not running:
            return False
        self._go_on_with(f"this process refused connections: {shortage}", running,
                         len(self._workers) - self._retiring)
        return True

    def _within_descriptors(self, wanted: int) -> int:
        """``wanted`` cut to the starts this process has descriptors for. Each worker holds
        a few here, more while it connects, and this process's listener refuses
        connections once fewer than its reserve are left: a start past that makes a
        worker that cannot connect, and holds descriptors (others' too) until it gives
        up; with no worker running yet, none might ever connect. A pool held back so, with
        nothing starting, goes on with the workers it has and says so."""
        left = descriptor_room()
        if left is None or wanted <= 0:
            return wanted
        room, reserve = left
        starting = sum(1 for w in self._workers.values() if not w.connected)
        fit = (room - starting * _FDS_TO_CONNECT) // _FDS_PER_WORKER
        if fit > 0:
            return min(wanted, fit)
        running = len(self._workers) - self._retiring - starting
        if not self._workers:
            return 1   # nothing runs or starts: one start, whose failure says why
        if not starting and running > 0:
            self._go_on_with(f"fewer than {reserve + _FDS_PER_WORKER} file descriptors "
                             f"are left (ulimit -n), and this process keeps {reserve} for "
                             f"its own work", running, running)
        return 0

    def _go_on_with(self, evidence: str, running: int, alive: int) -> None:
        """Keep the workers running or starting now, no more; say why once per cause."""
        self.processes = alive
        self._failed_starts.clear()
        if evidence not in self._short_of:
            self._short_of.add(evidence)
            log.warning("pool: could not start another worker (%s); the pool goes on "
                        "with the workers it has (%d running, %d starting). Raise the "
                        "limit, or create a smaller Pool.", evidence, running,
                        alive - running)

    def _give_up(self, broken: BaseException, effects: _Effects,
                 cause: Optional[BaseException] = None) -> None:
        if cause is not None:
            broken.__cause__ = cause
        self._broken = broken
        self._abort_all(broken, effects)

    def _break(self, exc: BaseException) -> None:
        effects = _Effects()
        with self._lock:
            if self._broken is None:
                self._broken = exc
                self._abort_all(exc, effects)
            effects.wake = True
            self._dispatch(effects)
        effects.run(self)

    def _abort_all(self, exc: BaseException, effects: _Effects) -> None:
        effects.aborts.extend((job.sink, exc) for job in self._jobs.values())
        for func in self._funcs.values():
            func.jobs = 0
        self._jobs.clear()
        self._tasks.clear()
        self._pending.clear()
        self._careful.clear()
        for worker in self._workers.values():
            worker.held.clear()
            worker.held_cost = 0.0
        self._idle = OrderedDict(self._parked)
        effects.wake = True

    def closed(self) -> None:
        self.liveness.stop()
        self._break(WorkerLostError("the pool's service was closed by its owner"))

    def missing_main_guard(self) -> None:
        """A worker found the main script without its guard: every start would fail alike."""
        self._break(WorkerLostError(
            "the pool stopped starting workers: its main script starts processes when a "
            "worker imports it (the missing main guard, explained above with the fix)."))


def _idleness(worker: _Worker) -> float:
    return worker.held_cost


def _evidence(exitcode: Optional[int], detail: str = "") -> str:
    text = ("connection lost, exit status unknown" if exitcode is None
            else describe_exitcode(exitcode))
    return f"{text} ({detail})" if detail else text
