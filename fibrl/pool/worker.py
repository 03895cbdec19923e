"""The loop a pool worker process runs (the target of every pool worker).

Owns the worker's side of the protocol in ``protocol``: run the initializer,
then pull chunks with ``next`` and push their results back, until told to
stop. It keeps at most one request outstanding: the next batch is asked for
while the current one runs (when the service said to, via ``refill``), so a
worker rarely waits for a round trip. Results go back with the next request,
or on their own at least every ``FLUSH_S`` (longer in a large pool: the
service says how long in each batch) and before the worker blocks, so a dead
worker loses little and ``imap`` callers see results as they come.

Data flow (one worker process)::

    Pool service (parent) <--- next(wid, reports) --- ask() when few tasks are left
          |                <--- report(wid, reports)  flush() while a next is parked
          +--- Batch ----------> local deque of TaskSpec --> run items --> reports

Every ``heartbeat_interval`` the hub's timer thread also sends ``alive``, so that
the parent can tell a worker busy with a long task from a frozen one
(``liveness``).

A *careful* task (one a lost worker held) runs alone: the worker announces
that it is unpickling the task, then each item before it starts, and each
item's result is acknowledged before the next starts: if this worker dies,
the parent knows exactly what it was doing.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from itertools import starmap
from typing import Any, Callable

from ..wire import serialization
from ..errors import SerializationError
from ..hosting.hub import get_hub
from ..wire.messages import RemoteError
from .protocol import LOADING, STOP, Kind, Raised, Report, TaskSpec, WorkerArgs, pack, unpack

__all__ = ["run_worker", "FLUSH_S"]

FLUSH_S = 0.02        # longest a finished result waits in the worker
_WAIT_S = 30.0         # re-check the connection this often while idle
_CALL_TIMEOUT_S = 120.0
_MAX_FUNCS = 256


def run_worker(args: WorkerArgs) -> None:
    """Entry point of a pool worker process."""
    hub = get_hub()
    # (before the initializer, which may take long: the pool starts the next worker now)
    hub.send(args.address, args.oid, "booted", args.wid)
    if args.init is not None and not _initialize(hub, args, args.init):
        return
    _Loop(hub, args).run()


def _initialize(hub: Any, args: WorkerArgs, init: bytes) -> bool:
    try:
        initializer, initargs = serialization.loads(init)
        initializer(*initargs)
        return True
    except BaseException as exc:  # reported to the parent, which fails the pool clearly
        hub.call(args.address, args.oid, "init_failed", args.wid, RemoteError.capture(exc),
                 timeout=_CALL_TIMEOUT_S)
        return False


class _Broken:
    """Stands for a callable that could not be unpickled here: each call raises why."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self.exc


def _not_loaded(what: str, exc: Exception) -> SerializationError:
    """The error every item of a task gets when its ``what`` cannot be unpickled here."""
    if isinstance(exc, SerializationError):   # it says why, and what to do: that first
        error = SerializationError(f"{exc} (in the worker, unpickling the task's {what})")
    else:
        error = SerializationError(
            f"the task's {what} could not be unpickled in the worker: {exc}")
    error.__cause__ = exc
    return error


class _Beat:
    """Tells the pool every ``interval`` seconds that this worker still runs, from the
    hub's timer thread, while a task keeps the loop busy (see ``liveness``)."""

    def __init__(self, timers: Any, interval: float, client: Any, oid: str, wid: int) -> None:
        self._timers, self._interval = timers, interval
        self._client, self._oid, self._wid = client, oid, wid
        self._stopped = False
        self._entry = timers.call_at(time.monotonic() + interval, self._send)

    def _send(self) -> None:
        if self._stopped or self._client.lost:
            return
        try:
            self._client.send(self._oid, "alive", (self._wid,))
        except Exception:  # the connection is gone: the loop notices it by itself
            return
        self._entry = self._timers.call_at(time.monotonic() + self._interval, self._send)

    def stop(self) -> None:
        self._stopped = True
        self._timers.cancel(self._entry)


class _Loop:
    def __init__(self, hub: Any, args: WorkerArgs) -> None:
        self._hub = hub
        self._address, self._oid, self._wid = args.address, args.oid, args.wid
        self._client = hub.client(args.address)
        self._local: deque[TaskSpec] = deque()
        self._funcs: OrderedDict[int, Callable | bytes] = OrderedDict()  # bytes: not loaded
        self._results: list[Report] = []
        self._request: Any = None     # the outstanding next() Handle
        self._refill = 0
        self._hold = FLUSH_S          # longest a finished result waits (the service's say)
        self._flushed = time.perf_counter()
        self._stopped = False

    def run(self) -> None:
        beat = _Beat(self._hub.timers, self._hub.heartbeat_interval, self._client, self._oid,
                     self._wid)
        try:
            self._ask(inline=True)
            while not self._stopped:
                if not self._local:
                    self._wait_for_work()
                    continue
                task = self._local.popleft()
                if self._request is None and not self._local and self._refill >= 0:
                    self._ask()  # the last one: more will come while it runs
                self._execute(task)
                self._after_task()
        finally:
            beat.stop()

    # -- talking to the service ---------------------------------------------------------
    def _after_task(self) -> None:
        """Take an answer that came meanwhile; ask for more when few tasks are left
        (the results ride along), or send results that waited long enough."""
        if self._request is not None and self._request.ready():
            self._take()
        if self._request is None and len(self._local) <= self._refill and not self._stopped:
            self._ask()
        elif self._results and time.perf_counter() - self._flushed >= self._hold:
            self._flush()

    def _ask(self, inline: bool = False) -> None:
        # A prefetching ask goes through the connection's feeder thread, so the
        # next task starts at once; an ask the worker will wait on goes inline.
        reports, self._results = self._results, []
        self._request = self._hub.call_async(self._address, self._oid, "next", self._wid,
                                             reports, inline=inline)
        self._flushed = time.perf_counter()

    def _flush(self) -> None:
        reports, self._results = self._results, []
        self._hub.send(self._address, self._oid, "report", self._wid, reports)
        self._flushed = time.perf_counter()

    def _wait_for_work(self) -> None:
        """Send what is done, then block until a batch (or STOP) arrives."""
        if self._request is None:
            self._ask(inline=True)
        elif self._results:
            self._flush()
        while not self._client.wait(self._request, _WAIT_S):   # (read here: no hand-over)
            if self._client.lost:
                self._stopped = True
                return
        self._take()

    def _take(self) -> None:
        """Absorb the answer to the outstanding ``next``."""
        request, self._request = self._request, None
        try:
            batch = request.get(0)
        except Exception:  # the pool is gone (terminated, parent exiting): just stop
            batch = STOP
        if batch.stop:
            self._stopped = True
            return
        for fid, data in batch.funcs.items():
            self._remember(fid, data)
        self._local.extend(batch.tasks)
        self._refill = batch.refill
        self._hold = max(FLUSH_S, batch.hold)

    def _remember(self, fid: int, data: bytes) -> None:
        # Kept pickled until a task uses it: unpickling may crash this process, and
        # for a careful task that must happen after the task was announced.
        self._funcs[fid] = data
        if len(self._funcs) > _MAX_FUNCS:
            self._funcs.popitem(last=False)

    def _func(self, fid: int) -> Callable:
        func = self._funcs.get(fid)
        if func is None:  # evicted: ask again
            func = self._hub.call(self._address, self._oid, "func", fid, timeout=_CALL_TIMEOUT_S)
            self._remember(fid, func)
        if isinstance(func, bytes):  # not unpickled yet (a callable is never bytes)
            try:
                func = self._unpack_func(fid, func)
            except Exception as exc:  # each call of the task raises why
                func = _Broken(_not_loaded("callable", exc))
            self._funcs[fid] = func
        return func

    def _unpack_func(self, fid: int, data: bytes) -> Callable:
        """By reference; a function the main script defines only when run as ``__main__``
        comes again by value, as a ``Process`` target does."""
        try:
            return unpack(data)
        except SerializationError as exc:
            if serialization.guarded_main_name(exc) is None:
                raise
            data = self._hub.call(self._address, self._oid, "func_by_value", fid,
                                  timeout=_CALL_TIMEOUT_S)
            return unpack(data)

    def _load(self, task: TaskSpec) -> tuple:
        """The task's callable and items (a callable that raises why, if they cannot load)."""
        func = self._func(task.fid)
        try:
            return func, unpack(task.payload)
        except Exception as exc:  # every item fails with the reason
            items: Any = ((), {}) if task.kind == Kind.APPLY else [()] * task.n
            return _Broken(_not_loaded("arguments", exc)), items

    # -- running tasks ------------------------------------------------------------------
    def _execute(self, task: TaskSpec) -> None:
        if task.careful:  # if unpickling the task kills this worker, the parent must know
            self._report_now([], (task.tid, LOADING))
        started = time.perf_counter()
        func, items = self._load(task)
        stop = task.n
        if task.careful:
            self._run_careful(task, func, items, stop)
            return
        lo = task.lo
        while lo < stop:
            deadline = self._flushed + self._hold
            report = _run(task, func, items, lo, stop, deadline, started)
            self._results.append(report)
            lo += report.count
            started = time.perf_counter()
            if started >= deadline and lo < stop:
                self._flush()  # a long chunk: report what is done so far

    def _run_careful(self, task: TaskSpec, func: Callable, items: Any, stop: int) -> None:
        # Each call acknowledges the previous item and announces the next one before
        # it starts, so if this worker dies the parent knows which item killed it.
        reports: list = []
        for lo in range(task.lo, stop):
            self._report_now(reports, (task.tid, lo))
            reports = [_run(task, func, items, lo, lo + 1, 0.0, time.perf_counter())]
        self._report_now(reports, None)

    def _report_now(self, reports: list, starting: Any) -> None:
        self._hub.call(self._address, self._oid, "report", self._wid, reports, starting,
                       timeout=_CALL_TIMEOUT_S)


_MAP, _STARMAP = int(Kind.MAP), int(Kind.STARMAP)
_BLOCK_S = 0.0005   # a block of items runs in one C-level loop for about this long
_MAX_BLOCK = 4096


def _run(task: TaskSpec, func: Callable, items: Any, lo: int, stop: int, deadline: float,
         started: float) -> Report:
    """Run items ``lo``.. of ``task`` until ``stop`` or ``deadline``; one Report.

    Items run in blocks (``map`` in C), growing while they are fast and never
    much past ``deadline``; an item that raises gets its own outcome and the
    block goes on after it.
    """
    outcomes: list = []
    clock = time.perf_counter
    calls = _calls(task.kind, func, items)
    errors, i, block = 0, lo, 1
    while i < stop:
        t0, before = clock(), len(outcomes)
        end = min(i + block, stop)
        try:
            outcomes.extend(calls(i, end))
            i = end
        except BaseException as exc:  # SystemExit too: a task's exception, not a lost worker
            outcomes.append(Raised(RemoteError.capture(exc)))
            errors += 1
            i += len(outcomes) - before
        now = clock()
        if now >= deadline:
            break
        block = min(block * 2, _MAX_BLOCK) if now - t0 < _BLOCK_S else max(block // 2, 1)
    payload, errors = _encode(outcomes, errors)
    return Report(task.tid, lo, i - lo, payload, clock() - started, errors == 0)


def _calls(kind: int, func: Callable, items: Any) -> Callable[[int, int], Any]:
    """``calls(i, j)``: an iterator of the outcomes of items ``i``..``j``."""
    if kind == _MAP:
        return lambda i, j: map(func, items[i:j])
    if kind == _STARMAP:
        return lambda i, j: starmap(func, items[i:j])
    return lambda i, j: (func(*items[0], **items[1]),)


def _encode(outcomes: list, errors: int) -> tuple[bytes, int]:
    try:
        return pack(outcomes), errors
    except Exception:  # find which results cannot travel; only those fail
        sendable = [_sendable(o) for o in outcomes]
        return pack(sendable), sum(type(o) is Raised for o in sendable)


def _sendable(value: Any) -> Any:
    try:
        serialization.dumps(value)
        return value
    except Exception as exc:
        error = SerializationError(f"the task's result could not be sent back: {exc}")
        return Raised(RemoteError.capture(error))
