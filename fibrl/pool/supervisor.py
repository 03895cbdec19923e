"""The mechanism of a pool: start, watch and replace its worker processes.

One :class:`Supervisor` thread per pool waits, in a single ``select``, on
every worker's sentinel and on a wake-up pipe. It never decides *which* or
*how many* workers run: it asks the service (``reserve_workers``) and tells
it when a worker ended (``lose``). Starting a process can take long on docker
or kubernetes, so starts run concurrently on a few starter threads and never
block the watching.

Data flow::

    PoolService --wake()--> [wake pipe] --+
                                           v
    Supervisor thread: select(sentinels + wake pipe)
      |  wake:     reserve_workers() -> wids --submit--> starter threads (<= 8)
      |                                                    ctx.Process(...).start()
      |                                                    -> register the sentinel
      |  sentinel: exit code -> service.lose(wid, code) -> requeue, replace
      v
    ends when the service wants no workers and none is alive or starting

``terminate()`` kills every worker, including ones whose start is still in
progress: the supervisor does not wait for those (a pod may wait minutes for
a node); their starter thread kills and reaps them as soon as their start
returns. So ``terminate()`` and ``join()`` are prompt.
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from .service import LOST_GRACE_S, Hooks, PoolService
from .worker import run_worker

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)

_MAX_STARTERS = 8
_SELECT_S = 5.0


class Supervisor(Hooks):
    """Keeps the service's wanted number of worker processes running.

    Args:
        ctx: the fibrl context whose ``Process`` class starts workers.
        service: the pool's policy (see ``service``).
        make_args: the :class:`~fibrl.pool.protocol.WorkerArgs` of worker ``wid``.
        name: prefix of worker process names.
        on_done: called by the supervisor thread once every worker is gone.
        meta: resource requests (``@fibrl.meta``) given to every worker process.
        new_process: makes a worker process (default: ``ctx.Process``).
    """

    def __init__(self, ctx: Any, service: PoolService, make_args: Callable[[int], Any],
                 name: str, on_done: Callable[[], None] = lambda: None,
                 meta: Optional[dict] = None, new_process: Optional[Callable] = None) -> None:
        self._new_process = new_process or ctx.Process
        self._meta = dict(meta or {})
        self._on_done = on_done
        self._service = service
        self._make_args = make_args
        self._name = name
        self._lock = threading.Lock()
        self._procs: dict[int, Any] = {}      # wid -> started process
        self._starting: set[int] = set()
        self._fresh: list[int] = []            # started, sentinel not registered yet
        self._killing = False
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._starter = ThreadPoolExecutor(max_workers=min(_MAX_STARTERS, service.processes),
                                           thread_name_prefix=f"{name}-start")
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"{name}-supervisor")

    def start(self) -> None:
        self._thread.start()

    # -- called from other threads ----------------------------------------------------
    def wake(self) -> None:
        """Make the supervisor thread look again (cheap; coalesces)."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:
                pass  # the pipe is full: a wake-up is pending anyway

    def kill(self, wid: int) -> None:
        with self._lock:
            proc = self._procs.get(wid)
        if proc is not None:
            _kill(proc)

    def exit_grace(self, wid: int) -> float:
        with self._lock:
            proc = self._procs.get(wid)
        backend = getattr(getattr(proc, "_popen", None), "backend", None)
        return float(getattr(backend, "exit_report_s", LOST_GRACE_S))

    def terminate(self) -> None:
        """Kill every worker now, and any whose start is still in progress once it returns."""
        with self._lock:
            self._killing = True
            procs = list(self._procs.values())
        for proc in procs:
            _kill(proc)
        self.wake()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the supervisor (and so every worker) to end; False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def processes(self) -> list:
        """The worker processes currently started (for ``Pool._pool``)."""
        with self._lock:
            return list(self._procs.values())

    # -- the supervisor thread ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._register_fresh()
                self._start_missing()
                if self._done():
                    return
                for key, _ in self._selector.select(_SELECT_S):
                    if key.data is None:
                        self._drain_wake()
                    else:
                        self._reap(key.data)
        except Exception:
            log.exception("pool supervisor failed; terminating the pool's workers")
            self.terminate()
            self._reap_all()
        finally:
            self._close()

    def _register_fresh(self) -> None:
        with self._lock:
            fresh, self._fresh = self._fresh, []
        for wid in fresh:
            self._selector.register(self._procs[wid].sentinel, selectors.EVENT_READ, wid)

    def _start_missing(self) -> None:
        if self._killing:
            return
        for wid in self._service.reserve_workers():
            with self._lock:
                self._starting.add(wid)
            self._starter.submit(self._start_one, wid)

    def _done(self) -> bool:
        with self._lock:
            # After terminate() a start still in progress is not waited for (a pod may
            # wait minutes for a node): its starter thread kills it once the start returns.
            busy = self._procs or (self._starting and not self._killing)
            killing = self._killing
        return not busy and (killing or self._service.finished())

    def _drain_wake(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def _reap(self, wid: int) -> None:
        with self._lock:
            proc = self._procs.pop(wid)
        self._selector.unregister(proc.sentinel)
        proc.join(_SELECT_S)
        code = proc.exitcode
        detail = "" if code == 0 else _failure_reason(proc)
        if getattr(proc._popen, "missing_main_guard", False):
            self._service.missing_main_guard()   # before lose(): no replacement starts
        self._service.lose(wid, code, detail, getattr(proc._popen, "load_error", ""))
        if code is not None:
            proc.close()

    def _reap_all(self) -> None:
        with self._lock:
            wids = list(self._procs)
        for wid in wids:
            self._procs[wid].join(_SELECT_S)
            try:
                self._reap(wid)
            except Exception:
                log.exception("could not reap pool worker %s", wid)

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._starter.shutdown(wait=False)
        self._on_done()

    # -- starter threads ----------------------------------------------------------------
    def _start_one(self, wid: int) -> None:
        with self._lock:
            if self._killing:  # queued behind other starts when terminate() came
                self._starting.discard(wid)
                return
        try:
            proc = self._new_process(target=run_worker, args=(self._make_args(wid),),
                                     daemon=True, name=f"{self._name}-worker-{wid}")
            proc._fibrl_role = "pool-worker"
            if self._meta:  # what a Process reads from its target's @fibrl.meta
                proc._fibrl_meta = dict(self._meta)
            proc.start()
        except BaseException as exc:  # the backend refused: the service decides what next
            with self._lock:
                self._starting.discard(wid)
            self._service.start_failed(wid, exc)
            self.wake()
            return
        with self._lock:
            self._starting.discard(wid)
            late = self._killing
            if not late:
                self._procs[wid] = proc
                self._fresh.append(wid)
        if late:  # terminated while it started: the supervisor may be gone already
            self._end_late(wid, proc)
        self.wake()

    def _end_late(self, wid: int, proc: Any) -> None:
        """Kill and reap a worker whose start returned after ``terminate()``."""
        _kill(proc)
        proc.join(_SELECT_S)
        self._service.lose(wid, proc.exitcode)
        if proc.exitcode is not None:
            proc.close()
        else:
            log.warning("pool worker %s, started after terminate(), did not end within "
                        "%.0f s of being killed", proc.name, _SELECT_S)


def _kill(proc: Any) -> None:
    try:
        proc.kill()
    except ValueError:
        pass  # reaped and closed meanwhile: it is dead already


def _failure_reason(proc: Any) -> str:
    try:
        return proc._popen.job.failure_reason()
    except Exception:  # the backend could not say; the exit code is evidence enough
        return ""
