"""``fibrl.Pool``: ``multiprocessing.pool.Pool`` that survives lost workers.

Same class, signature and methods as the running Python's
``multiprocessing.pool.Pool``; its workers run on the context's backend
(local processes, docker containers or kubernetes pods). What differs is what
happens when something goes wrong:

* a task that raises fails only itself: ``get()`` raises the task's own
  exception with the worker's traceback as ``__cause__``; the worker lives on;
* a lost worker (killed, crashed, OOM, container or pod gone) is noticed at
  once (its sentinel and its connection), a frozen one or one whose machine
  vanished once it was silent for ``parent_timeout``; it is replaced, and the
  tasks it held are run again; results are still delivered exactly once and in order, even when
  it died half-way through a chunk;
* a task that keeps killing its worker fails, after ``max_task_retries``
  resubmissions, with :class:`fibrl.errors.TaskFailedError` naming the task and
  the exit codes; the rest of the work completes;
* ``terminate()`` never hangs, and fails the results still pending (the stdlib
  leaves them waiting forever).

The package splits policy from mechanism: ``service`` decides which worker
runs what and what a loss costs; :mod:`fibrl.supervisor` (shared with
the RL envs) starts and watches processes;
``worker`` is the loop inside each worker; ``liveness`` finds workers that went
silent; ``feeder`` reads ``imap`` inputs
lazily; ``results`` holds what callers wait on; ``salvage`` decodes, item by
item, results the parent cannot unpickle as a block; ``engine`` wires them up
(also for :mod:`fibrl.futures`).
"""
from __future__ import annotations

import functools
import multiprocessing.spawn as mp_spawn
import warnings
from itertools import islice
from typing import Any, Callable, Collection, Iterable, Iterator, Optional, Sequence, cast

from ..janitor import Finalizer
from .engine import Engine, worker_meta
from .protocol import CLOSE, INIT, RUN, TERMINATE, Kind, pack
from .results import ApplyResult, AsyncResult, IMapIterator, IMapUnorderedIterator, MapResult

__all__ = ["Pool", "ApplyResult", "AsyncResult", "MapResult", "IMapIterator",
           "IMapUnorderedIterator"]

BACKLOG_CHUNKS = 256


def fibrl_context(context: Any) -> Any:
    """The fibrl context for ``context`` (None: the default; a stdlib one: its method).

    Anything with a ``config`` and a ``Process`` factory is used as it is.
    """
    from ..context import default_context

    if context is None:
        return default_context
    if hasattr(context, "config") and hasattr(context, "Process"):
        return context
    return default_context.get_context(context.get_start_method())


def chunked(iterable: Iterable, size: int) -> list:
    """``[(payload, n), ...]``: ``iterable`` pickled ``size`` items at a time.

    Raises:
        SerializationError: an item cannot be pickled (so ``map`` fails at submit).
    """
    pieces: Iterator[Sequence[Any]]
    if isinstance(iterable, (list, tuple, range)):
        pieces = (iterable[i:i + size] for i in range(0, len(iterable), size))
    else:
        it = iter(iterable)
        pieces = iter(lambda: list(islice(it, size)), [])
    return [(pack(list(piece)), len(piece)) for piece in pieces]


class Pool:
    """A pool of worker processes on the context's backend.

    Args:
        processes: number of workers (None: ``cpu_count()`` as the backend sees it).
        initializer: called as ``initializer(*initargs)`` in every worker when it
            starts, replacements included. If it raises, the pool breaks: pending
            and later tasks fail with :class:`fibrl.errors.WorkerLostError`.
        initargs: arguments of ``initializer``.
        maxtasksperchild: chunks a worker runs before it is replaced (None: never).
        context: the fibrl context (or a stdlib one, mapped by its start method).
        max_task_retries: keyword-only; how many times an item whose worker was
            lost is run again before it fails (default: the config's
            ``max_task_retries``, 3).
        meta: keyword-only; resource requests of every worker, as ``@fibrl.meta``
            takes them (``{"cpu": 1, "memory": "2g", "gpu": 1}``); containers and pods
            get them as limits. ``@fibrl.meta`` on ``initializer`` counts too; keys
            given here win.

    Example:
        >>> import fibrl
        >>> with fibrl.Pool(2) as pool:           # doctest: +SKIP
        ...     pool.map(abs, [-1, -2, 3])
        [1, 2, 3]
    """

    def __init__(self, processes: Optional[int] = None, initializer: Optional[Callable] = None,
                 initargs: Iterable = (), maxtasksperchild: Optional[int] = None,
                 context: Any = None, *, max_task_retries: Optional[int] = None,
                 meta: Optional[dict] = None) -> None:
        self._state = INIT
        # a worker still importing the main script (no `if __name__ == "__main__":`
        # guard): refuse before any worker starts, so the parent says it once
        mp_spawn._check_not_importing_main()  # type: ignore[attr-defined]  # (not in typeshed)
        self._ctx = fibrl_context(context)
        processes = self._ctx.cpu_count() if processes is None else processes
        _check_args(processes, initializer, maxtasksperchild)
        retries = self._ctx.config.max_task_retries if max_task_retries is None \
            else max_task_retries
        if retries < 0:
            raise ValueError(f"max_task_retries must be 0 or more, got {retries}")
        self._processes = processes
        self._engine = Engine(self._ctx, processes, initializer, tuple(initargs),
                              maxtasksperchild, retries, BACKLOG_CHUNKS,
                              meta=worker_meta(initializer, meta),
                              new_process=functools.partial(type(self).Process, self._ctx))
        self._state = RUN
        self._finalizer = Finalizer(self, self._engine.terminate, atexit=True)

    @staticmethod
    def Process(ctx: Any, *args: Any, **kwds: Any) -> Any:
        """Make a worker process (as the stdlib's; a subclass may override it)."""
        return ctx.Process(*args, **kwds)

    # -- submitting ---------------------------------------------------------------------
    # (the stdlib's signatures, defaults included; kwds is only read)
    def apply(self, func: Callable, args: tuple = (), kwds: dict = {}) -> Any:  # noqa: B006
        """Call ``func(*args, **kwds)`` in a worker and wait for the result."""
        return self.apply_async(func, args, kwds).get()

    def apply_async(self, func: Callable, args: tuple = (), kwds: dict = {},  # noqa: B006
                    callback: Optional[Callable] = None,
                    error_callback: Optional[Callable] = None) -> ApplyResult:
        """Like :meth:`apply`, returning an :class:`AsyncResult` at once.

        Raises:
            SerializationError: ``func`` or an argument cannot be pickled.
        """
        self._check_running()
        result = ApplyResult(self, callback, error_callback)
        payload = pack((tuple(args), dict(kwds)))
        self._engine.submit(result, func, Kind.APPLY, [(payload, 1)])
        return result

    def map(self, func: Callable, iterable: Iterable, chunksize: Optional[int] = None) -> list:
        """``[func(x) for x in iterable]``, computed by the workers."""
        return self._map_async(func, iterable, Kind.MAP, chunksize).get()

    def map_async(self, func: Callable, iterable: Iterable, chunksize: Optional[int] = None,
                  callback: Optional[Callable] = None,
                  error_callback: Optional[Callable] = None) -> MapResult:
        return self._map_async(func, iterable, Kind.MAP, chunksize, callback, error_callback)

    def starmap(self, func: Callable, iterable: Iterable,
                chunksize: Optional[int] = None) -> list:
        """``[func(*args) for args in iterable]``, computed by the workers."""
        return self._map_async(func, iterable, Kind.STARMAP, chunksize).get()

    def starmap_async(self, func: Callable, iterable: Iterable,
                      chunksize: Optional[int] = None, callback: Optional[Callable] = None,
                      error_callback: Optional[Callable] = None) -> MapResult:
        return self._map_async(func, iterable, Kind.STARMAP, chunksize, callback,
                               error_callback)

    def imap(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> IMapIterator:
        """Results of ``func`` over ``iterable`` in order, as they complete.

        The input is read lazily, a bounded number of chunks ahead of the
        caller, so it may be endless or larger than memory.
        """
        return self._imap(IMapIterator, func, iterable, chunksize)

    def imap_unordered(self, func: Callable, iterable: Iterable,
                       chunksize: int = 1) -> IMapIterator:
        """Like :meth:`imap`, in completion order."""
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize)

    def _imap(self, cls: type, func: Callable, iterable: Iterable, chunksize: int):
        self._check_running()
        if chunksize < 1:
            raise ValueError("Chunksize must be 1+, not {0:n}".format(chunksize))
        result = cls(self)
        self._engine.submit_lazy(result, func, Kind.MAP, iterable, chunksize)
        return result

    def _map_async(self, func: Callable, iterable: Iterable, kind: Kind,
                   chunksize: Optional[int], callback: Optional[Callable] = None,
                   error_callback: Optional[Callable] = None) -> MapResult:
        self._check_running()
        items = cast("Collection[Any]",
                     iterable if hasattr(iterable, "__len__") else list(iterable))
        chunksize = self._chunksize(len(items), chunksize)
        result = MapResult(self, len(items), callback, error_callback)
        if len(items):
            self._engine.submit(result, func, kind, chunked(items, chunksize))
        return result

    def _chunksize(self, length: int, chunksize: Optional[int]) -> int:
        if chunksize is None:  # the stdlib's heuristic: about four chunks per worker
            chunksize, extra = divmod(length, self._processes * 4)
            return chunksize + 1 if extra else max(chunksize, 1)
        if chunksize < 1:
            raise ValueError("Chunksize must be 1+, not {0:n}".format(chunksize))
        return chunksize

    # -- life cycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Accept no more tasks; workers exit once the submitted ones are done."""
        if self._state == RUN:
            self._state = CLOSE
            self._engine.close()

    def terminate(self) -> None:
        """Stop the workers now (even ones still starting); pending results fail."""
        self._state = TERMINATE
        self._finalizer()

    def join(self, *, timeout: Optional[float] = None) -> None:
        """Wait for the workers to exit, after :meth:`close` or :meth:`terminate`.

        Args:
            timeout: keyword extra: seconds to wait at most (``TimeoutError`` after).
        """
        if self._state == RUN:
            raise ValueError("Pool is still running")
        if self._state not in (CLOSE, TERMINATE):
            raise ValueError("In unknown state")
        if not self._engine.join(timeout):
            raise TimeoutError(f"the pool's workers did not exit within {timeout} s")

    def _check_running(self) -> None:
        if self._state != RUN:
            raise ValueError("Pool not running")

    def __enter__(self) -> "Pool":
        self._check_running()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.terminate()

    def __reduce__(self):
        raise NotImplementedError(
            "pool objects cannot be passed between processes or pickled")

    def __del__(self, _warn=warnings.warn) -> None:
        if getattr(self, "_state", None) == RUN:
            _warn(f"unclosed running multiprocessing pool {self!r}", ResourceWarning,
                  source=self)

    def __repr__(self) -> str:
        return (f"<{type(self).__module__}.{type(self).__qualname__} "
                f"state={self._state} pool_size={getattr(self, '_processes', None)}>")

    @property
    def _pool(self) -> list:
        """The worker processes now started (as the stdlib's ``Pool._pool``)."""
        return self._engine.supervisor.processes()


def _check_args(processes: int, initializer: Optional[Callable],
                maxtasksperchild: Optional[int]) -> None:
    if processes < 1:
        raise ValueError("Number of processes must be at least 1")
    if maxtasksperchild is not None and (not isinstance(maxtasksperchild, int)
                                         or maxtasksperchild <= 0):
        raise ValueError("maxtasksperchild must be a positive int or None")
    if initializer is not None and not callable(initializer):
        raise TypeError("initializer must be a callable")
