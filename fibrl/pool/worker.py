"""The loop a pool worker process runs (the target of every pool worker).

Owns the worker's side of the protocol in ``protocol``: run the initializer,
then pull chunks with ``next`` and push their results back, until told to
stop. It keeps at most one request outstanding: the next batch is asked for
while the current one runs (when the service said to, via ``refill``), so a
worker rarely waits for a round trip. Results go back with the next request,
or on their own at least every ``FLUSH_S`` and before the worker blocks, so a
dead worker loses little and ``imap`` callers see results as they come.

Data flow (one worker process)::

    Pool service (parent) <--- next(wid, reports) --- ask() when few tasks are left
          |                <--- report(wid, reports)  flush() while a next is parked
          +--- Batch ----------> local deque of TaskSpec --> run items --> reports

A *careful* task (one a lost worker held) runs alone, and each item's result
is reported and acknowledged before the next item starts: if this worker
dies, the parent knows exactly which item was running.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Any, Callable

from .. import serialization
from ..errors import SerializationError
from ..hub import _as_remote, get_hub
from .protocol import Kind, Raised, Report, TaskSpec, WorkerArgs

__all__ = ["run_worker", "FLUSH_S"]

FLUSH_S = 0.005        # longest a finished result waits in the worker
_WAIT_S = 30.0         # re-check the connection this often while idle
_CALL_TIMEOUT_S = 120.0
_MAX_FUNCS = 256


def run_worker(args: WorkerArgs) -> None:
    """Entry point of a pool worker process."""
    hub = get_hub()
    if args.init is not None and not _initialize(hub, args):
        return
    _Loop(hub, args).run()


def _initialize(hub: Any, args: WorkerArgs) -> bool:
    try:
        initializer, initargs = serialization.loads(args.init)
        initializer(*initargs)
        return True
    except BaseException as exc:  # reported to the parent, which fails the pool clearly
        hub.call(args.address, args.oid, "init_failed", args.wid, _as_remote(exc),
                 timeout=_CALL_TIMEOUT_S)
        return False


class _Broken:
    """Stands for a callable that could not be unpickled here: each call raises why."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self.exc


class _Loop:
    def __init__(self, hub: Any, args: WorkerArgs) -> None:
        self._hub = hub
        self._address, self._oid, self._wid = args.address, args.oid, args.wid
        self._local: deque[TaskSpec] = deque()
        self._funcs: OrderedDict[int, Callable] = OrderedDict()
        self._results: list[Report] = []
        self._request: Any = None     # the outstanding next() Handle
        self._refill = 0
        self._flushed = time.perf_counter()

    def run(self) -> None:
        self._ask()
        while True:
            if not self._local and not self._receive():
                return
            task = self._local.popleft()
            if self._request is None and len(self._local) <= self._refill:
                self._ask()
            self._execute(task)

    # -- talking to the service ---------------------------------------------------------
    def _ask(self) -> None:
        reports, self._results = self._results, []
        self._request = self._hub.call_async(self._address, self._oid, "next", self._wid,
                                             reports)
        self._flushed = time.perf_counter()

    def _flush(self) -> None:
        reports, self._results = self._results, []
        self._hub.send(self._address, self._oid, "report", self._wid, reports)
        self._flushed = time.perf_counter()

    def _receive(self) -> bool:
        """Wait for the next batch; False when told to stop (or the parent is gone)."""
        if self._request is None:
            self._ask()
        elif self._results:
            self._flush()
        request, self._request = self._request, None
        while not request.wait(_WAIT_S):
            if self._hub.client(self._address).lost:
                return False
        try:
            batch = request.get(0)
        except Exception:  # the pool is gone (terminated, parent exiting): just stop
            return False
        if batch.stop:
            return False
        for fid, data in batch.funcs.items():
            self._remember(fid, data)
        self._local.extend(batch.tasks)
        self._refill = batch.refill
        return True

    def _remember(self, fid: int, data: bytes) -> Callable:
        try:
            func = serialization.loads(data)
        except SerializationError as exc:
            func = _Broken(exc)
        self._funcs[fid] = func
        if len(self._funcs) > _MAX_FUNCS:
            self._funcs.popitem(last=False)
        return func

    def _func(self, fid: int) -> Callable:
        func = self._funcs.get(fid)
        if func is None:  # evicted: ask again
            data = self._hub.call(self._address, self._oid, "func", fid, timeout=_CALL_TIMEOUT_S)
            func = self._remember(fid, data)
        return func

    # -- running tasks ------------------------------------------------------------------
    def _execute(self, task: TaskSpec) -> None:
        started = time.perf_counter()
        func = self._func(task.fid)
        try:
            items = serialization.loads(task.payload)
        except SerializationError as exc:  # every item fails with the reason
            func, items = _Broken(exc), ((), {}) if task.kind == Kind.APPLY else [()] * task.n
        stop = task.n
        if task.careful:
            self._run_careful(task, func, items, stop)
            return
        lo = task.lo
        while lo < stop:
            deadline = self._flushed + FLUSH_S
            report = _run(task, func, items, lo, stop, deadline, started)
            self._results.append(report)
            lo += report.count
            started = time.perf_counter()
            if started >= deadline:
                self._flush_or_ask()

    def _flush_or_ask(self) -> None:
        if self._request is None:
            self._ask()
        else:
            self._flush()

    def _run_careful(self, task: TaskSpec, func: Callable, items: Any, stop: int) -> None:
        for lo in range(task.lo, stop):
            report = _run(task, func, items, lo, lo + 1, 0.0, time.perf_counter())
            self._hub.call(self._address, self._oid, "report", self._wid, [report],
                           timeout=_CALL_TIMEOUT_S)


def _run(task: TaskSpec, func: Callable, items: Any, lo: int, stop: int, deadline: float,
         started: float) -> Report:
    """Run items ``lo``.. of ``task`` until ``stop`` or ``deadline``; one Report."""
    outcomes = []
    kind = task.kind
    i = lo
    while i < stop:
        try:
            if kind == Kind.MAP:
                value = func(items[i])
            elif kind == Kind.STARMAP:
                value = func(*items[i])
            else:
                value = func(*items[0], **items[1])
        except BaseException as exc:  # SystemExit too: a task's exception, not a lost worker
            value = Raised(_as_remote(exc))
        outcomes.append(value)
        i += 1
        if time.perf_counter() >= deadline:
            break
    seconds = time.perf_counter() - started
    return Report(task.tid, lo, i - lo, _encode(outcomes), seconds)


def _encode(outcomes: list) -> bytes:
    try:
        return serialization.dumps(outcomes)
    except Exception:  # find which results cannot travel; only those fail
        return serialization.dumps([_sendable(o) for o in outcomes])


def _sendable(value: Any) -> Any:
    try:
        serialization.dumps(value)
        return value
    except Exception as exc:
        error = SerializationError(f"the task's result could not be sent back: {exc}")
        return Raised(_as_remote(error))
