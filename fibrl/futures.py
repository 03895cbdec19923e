"""``fibrl.futures``: a ``concurrent.futures`` executor with the Pool's recovery.

:class:`ProcessPoolExecutor` has the signature and behaviour of the running
Python's ``concurrent.futures.ProcessPoolExecutor`` (``submit``,
``map(timeout, chunksize)``, ``shutdown(wait, cancel_futures)``), with workers
on the context's backend. It runs on the same machinery as
:class:`fibrl.pool.Pool` (``fibrl.pool.engine``), so a lost worker does not
break it: the stdlib raises ``BrokenProcessPool`` for every pending future,
this executor replaces the worker and runs its tasks again; a task that keeps
killing its worker fails alone with :class:`fibrl.errors.TaskFailedError`.

This module owns the executor API and the future objects; scheduling and
workers are the pool package's.

Example:
    >>> from fibrl.futures import ProcessPoolExecutor
    >>> with ProcessPoolExecutor(2) as ex:            # doctest: +SKIP
    ...     ex.submit(pow, 2, 5).result(timeout=30)
    32
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Executor as _BaseExecutor
from concurrent.futures import Future, InvalidStateError
from multiprocessing import TimeoutError as MpTimeoutError
from typing import Any, Callable, Iterator, Optional

from .janitor import Finalizer
from .pool import chunked, fibrl_context
from .pool.engine import Engine, worker_meta
from .pool.protocol import Kind, ResultSink, pack
from .pool.results import IMapIterator, outcome

__all__ = ["ProcessPoolExecutor", "Executor"]

_BACKLOG_CHUNKS = 256


class _PoolFuture(Future, ResultSink):
    """A future that is also a pool result sink (see ``fibrl.pool.protocol``)."""

    def sink_claim(self) -> bool:
        return self.set_running_or_notify_cancel()

    def sink_deliver(self, index: int, outcomes: list, clean: bool = False) -> None:
        ok, value = outcome(outcomes[0])
        try:
            if ok:
                self.set_result(value)
            else:
                self.set_exception(value)
        except InvalidStateError:
            pass  # terminated meanwhile

    def sink_abort(self, exc: BaseException) -> None:
        try:
            self.set_exception(exc)
        except InvalidStateError:
            pass  # cancelled or already done


class _Stream(IMapIterator):
    """The ordered results of one ``map`` call."""


class ProcessPoolExecutor(_BaseExecutor):
    """An executor whose workers run on a fibrl backend and survive lost workers.

    Args:
        max_workers: number of workers (None: ``cpu_count()`` of the backend).
        mp_context: fibrl context (or a stdlib one, mapped by its start method).
        initializer: called as ``initializer(*initargs)`` in every worker before its
            first task.
        initargs: arguments of ``initializer``.
        max_tasks_per_child: tasks a worker runs before it is replaced.
        max_task_retries: keyword-only; runs of a task whose worker was lost
            before it fails (default: the config's ``max_task_retries``).
        meta: keyword-only; resource requests of every worker, as ``@fibrl.meta``
            takes them; ``@fibrl.meta`` on ``initializer`` counts too (see ``Pool``).
    """

    def __init__(self, max_workers: Optional[int] = None, mp_context: Any = None,
                 initializer: Optional[Callable] = None, initargs: tuple = (), *,
                 max_tasks_per_child: Optional[int] = None,
                 max_task_retries: Optional[int] = None, meta: Optional[dict] = None) -> None:
        ctx = fibrl_context(mp_context)
        max_workers = ctx.cpu_count() if max_workers is None else max_workers
        _check_args(max_workers, initializer, max_tasks_per_child)
        retries = ctx.config.max_task_retries if max_task_retries is None \
            else max_task_retries
        self._max_workers = max_workers
        self._engine = Engine(ctx, max_workers, initializer, tuple(initargs),
                              max_tasks_per_child, retries, _BACKLOG_CHUNKS,
                              meta=worker_meta(initializer, meta, "ProcessPoolExecutor"))
        self._shutdown_lock = threading.Lock()
        self._shutdown = False
        # Dropped without shutdown(): pending work still completes, as with the stdlib.
        self._finalizer = Finalizer(self, self._engine.close, atexit=True)

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        """Schedule ``fn(*args, **kwargs)``; unpicklable ``fn`` or arguments raise here."""
        with self._shutdown_lock:
            self._check_open()
            future = _PoolFuture()
            payload = pack((args, kwargs))
            self._engine.submit(future, fn, Kind.APPLY, [(payload, 1)])
            return future

    def map(self, fn: Callable, *iterables: Any, timeout: Optional[float] = None,
            chunksize: int = 1) -> Iterator:
        """Like the builtin ``map`` (inputs read at once), results in order.

        Raises:
            TimeoutError: from the iterator, when a result is not ready
                ``timeout`` seconds after the call.
        """
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        deadline = None if timeout is None else time.monotonic() + timeout
        items = list(zip(*iterables))
        with self._shutdown_lock:
            self._check_open()
            stream = _Stream(self)
            stream.sink_set_length(len(items))
            job = self._engine.submit(stream, fn, Kind.STARMAP, chunked(items, chunksize)) \
                if items else None
        return self._results(stream, job, len(items), deadline)

    def _results(self, stream: _Stream, job: Any, count: int,
                 deadline: Optional[float]) -> Iterator:
        try:
            for _ in range(count):
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    yield stream.next(left)
                except MpTimeoutError:
                    raise TimeoutError("map() results not ready within the timeout") from None
        finally:
            if job is not None:
                self._engine.service.cancel(job)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Accept no more work; optionally cancel what has not started; wait for workers."""
        with self._shutdown_lock:
            self._shutdown = True
        self._finalizer.detach()
        if cancel_futures:
            for sink in self._engine.service.sinks_waiting():
                if isinstance(sink, Future):
                    sink.cancel()
        self._engine.close()
        if wait:
            self._engine.join()

    def _check_open(self) -> None:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")

    def __repr__(self) -> str:
        state = "shutdown" if self._shutdown else "running"
        return f"<fibrl.futures.ProcessPoolExecutor {state} max_workers={self._max_workers}>"


def _check_args(max_workers: int, initializer: Optional[Callable],
                max_tasks_per_child: Optional[int]) -> None:
    if max_workers <= 0:
        raise ValueError("max_workers must be greater than 0")
    if initializer is not None and not callable(initializer):
        raise TypeError("initializer must be a callable")
    if max_tasks_per_child is not None:
        if not isinstance(max_tasks_per_child, int):
            raise TypeError("max_tasks_per_child must be an integer")
        if max_tasks_per_child <= 0:
            raise ValueError("max_tasks_per_child must be >= 1")


Executor = ProcessPoolExecutor
