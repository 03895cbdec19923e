"""One pool's machinery, shared by :class:`fibrl.pool.Pool` and ``fibrl.futures``.

Owns the wiring and the life cycle: the :class:`~fibrl.pool.service.PoolService`
hosted on this process's hub (the workers' policy), the
:class:`~fibrl.supervisor.Supervisor` that runs the workers, and the
:class:`~fibrl.pool.feeder.Feeder` of lazy inputs. The public classes own the API;
this module owns how a call becomes a job and how the pool ends (close/join,
terminate, garbage collection).

Threads per pool, whatever the number of workers: one supervisor, up to eight
short-lived starters while workers start, and one feeder once ``imap`` is used.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Any, Callable, Iterable, Mapping, Optional

from ..wire import serialization
from ..errors import WorkerLostError
from ..hosting.hub import get_hub
from ..meta import KEYS as META_KEYS
from ..meta import resources
from ..supervisor import Supervisor
from .feeder import Feeder
from .protocol import Kind, WorkerArgs, pack
from .service import PoolService
from .worker import run_worker

__all__ = ["Engine", "func_name", "worker_meta"]

log = logging.getLogger(__name__)

_names = itertools.count(1)
TERMINATE_WAIT_S = 30.0
# Chunks of a lazy input fed ahead per worker, at least: a fixed backlog smaller than
# what the workers can hold starves a large pool (each batch shrinks to one chunk).
BACKLOG_PER_WORKER = 16
# Workers of a local pool booting at once, at most: they share this machine's cores,
# and hundreds booting together would each miss the handshake's deadlines.
LOCAL_STARTS_PER_CORE = 16


def func_name(func: Callable) -> str:
    """How error messages name a task's callable."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    return name if isinstance(name, str) else type(func).__name__


def worker_meta(initializer: Optional[Callable], meta: Optional[Mapping],
                owner: str = "Pool") -> dict:
    """Resource requests of every worker: ``meta`` over the initializer's ``@fibrl.meta``.

    Raises:
        TypeError: ``meta`` is not a mapping.
        ValueError: an unknown key or a bad value (as ``@fibrl.meta`` refuses it).
    """
    chosen = dict(getattr(initializer, "__fibrl_meta__", None) or {})
    if meta is None:
        return chosen
    if not isinstance(meta, Mapping):
        raise TypeError(f"{owner}(meta=...) must be a dict such as {{'cpu': 1, 'memory': "
                        f"'2g'}}, not {type(meta).__name__}")
    unknown = sorted(set(meta) - set(META_KEYS))
    if unknown:
        raise ValueError(f"{owner}(meta=...) has unknown keys {unknown}; the valid keys are "
                         f"{sorted(META_KEYS)}, as for @fibrl.meta")
    chosen.update(resources(**meta))
    return chosen


def _start_window(ctx: Any) -> Optional[int]:
    """Workers booting at once, at most: bounded by this machine's cores for local
    workers; none for containers and pods (a cluster scales up for the ones waiting)."""
    if ctx.config.backend != "local":
        return None
    return LOCAL_STARTS_PER_CORE * (os.cpu_count() or 1)


class Engine:
    """Service + supervisor + feeder of one pool.

    Args:
        ctx: fibrl context that starts the workers.
        processes: number of workers.
        initializer, initargs: run in every worker (replacements included) before tasks.
        maxtasks: chunks a worker runs before it is replaced (None: no limit).
        max_retries: times an item may be charged with a lost worker.
        backlog: chunks of a lazy input fed ahead of its consumer (at least
            ``BACKLOG_PER_WORKER`` per worker).
        meta: resource requests of every worker process (see :func:`worker_meta`).
        new_process: makes a worker process (default: ``ctx.Process``).
    """

    def __init__(self, ctx: Any, processes: int, initializer: Optional[Callable],
                 initargs: tuple, maxtasks: Optional[int], max_retries: int,
                 backlog: int, meta: Optional[dict] = None,
                 new_process: Optional[Callable] = None) -> None:
        init = None if initializer is None else serialization.dumps((initializer, initargs))
        name = f"fibrl-pool-{next(_names)}"
        self.service = PoolService(processes, max_retries, maxtasks,
                                   max_starting=_start_window(ctx))
        hub = get_hub()
        self._hub = hub
        self._oid = hub.register(self.service)
        self.service.liveness.start(hub.timers, hub)
        address = hub.address
        oid = self._oid
        self._ended = False
        self._end_lock = threading.Lock()
        def spec(wid: int) -> dict:
            return {"target": run_worker, "args": (WorkerArgs(address, oid, wid, init),),
                    "name": f"{name}-worker-{wid}"}

        self.supervisor = Supervisor(ctx, self.service, spec, name, role="pool-worker",
                                     on_done=self._end, meta=meta, new_process=new_process,
                                     max_starters=processes)
        self.service.hooks = self.supervisor
        self.feeder = Feeder(self.service, name, max(backlog, BACKLOG_PER_WORKER * processes))
        self.supervisor.start()

    def submit(self, sink: Any, func: Callable, kind: Kind, chunks: list) -> Any:
        """Queue a job whose chunks are all known (raises if ``func`` cannot be pickled)."""
        data = pack(func)
        return self.service.submit(sink, data, func_name(func), kind, chunks)

    def submit_lazy(self, sink: Any, func: Callable, kind: Kind, iterable: Iterable,
                    chunksize: int) -> Any:
        """Queue a job whose chunks are read from ``iterable`` as the caller consumes."""
        data = pack(func)
        job = self.service.open_job(sink, data, func_name(func), kind, lazy=True)
        self.feeder.add(job, sink, iterable, chunksize)
        return job

    def close(self) -> None:
        self.service.close()
        self.feeder.close()

    def terminate(self, wait: float = TERMINATE_WAIT_S) -> bool:
        """Kill every worker, fail every unfinished task; wait at most ``wait`` s."""
        self.service.terminate(WorkerLostError(
            "the pool was terminated before this task finished (terminate() was called, "
            "the pool's with-block ended, or the pool was garbage-collected)."))
        self.feeder.stop()
        self.supervisor.terminate()
        done = self.supervisor.join(wait)
        if not done:
            log.warning("pool workers did not all end within %.0f s of terminate()", wait)
        return done

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait until every worker exited (after close or terminate)."""
        done = self.supervisor.join(timeout)
        if done:
            self.feeder.join(1.0)
        return done

    def _end(self) -> None:
        """Every worker is gone: stop hosting the service (from the supervisor thread)."""
        with self._end_lock:
            ended, self._ended = self._ended, True
        if not ended:
            self._hub.unregister(self._oid)
