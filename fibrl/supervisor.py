"""Start, watch and replace a group of worker processes: the one supervisor of fibrl.

A ``Pool`` and a ``RemoteVectorEnv`` both keep a set of workers running on any
backend, replace the ones that are lost and must not hang on a start that takes
minutes (a pod waiting for a node). The mechanism is this module; the *policy*
(which workers, how many, what a loss costs, when to give up) stays with the
owner, as a :class:`Policy`. A worker is a ``Process`` of the owner's context,
running whatever loop the owner gives it (a pool's task loop, an env's step loop).

One :class:`Supervisor` thread per group waits, in a single ``select``, on every
worker's sentinel and on a wake-up pipe. It never decides which or how many
workers run: it asks the policy (``reserve_workers``) and tells it when a worker
ended (``lose``). Starts run on a few starter threads, so a slow start never
blocks the watching::

    owner --wake()--> [wake pipe] --+
                                    v
    supervisor thread: select(sentinels + wake pipe)
      |  wake:     policy.reserve_workers() -> wids --> starter threads (<= 8)
      |                                 ctx.Process(**policy's spec(wid)).start()
      |                                 -> policy.started(wid, proc); watch its sentinel
      |                (a start that raises: policy.start_failed(wid, exc))
      |  sentinel: exit code -> policy.lose(wid, code, detail, load_error)
      v
    ends when the policy is finished and no worker is alive or starting

``terminate()`` kills every worker, including ones whose start is still in
progress: the supervisor does not wait for those; their starter thread kills
and reaps them as soon as their start returns. So ``terminate()`` and ``join()``
are prompt.

Example:
    >>> import fibrl, fibrl.supervisor as sv
    >>> class Once(sv.Policy):
    ...     def __init__(self): self.todo, self.codes = [0, 1], {}
    ...     def reserve_workers(self): todo, self.todo = self.todo, []; return todo
    ...     def finished(self): return len(self.codes) == 2
    ...     def lose(self, wid, exitcode, detail="", load_error=""): self.codes[wid] = exitcode
    ...     def start_failed(self, wid, exc): self.codes[wid] = exc
    >>> policy = Once()
    >>> group = sv.Supervisor(fibrl.get_context(), policy,
    ...                       lambda wid: {"target": abs, "args": (wid,)}, "demo")
    >>> group.start(); group.join(60)
    True
    >>> policy.codes
    {0: 0, 1: 0}
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from .backends.base import Backend

__all__ = ["Policy", "Supervisor"]

log = logging.getLogger(__name__)

_MAX_STARTERS = 8
_SELECT_S = 5.0


class Policy:
    """What a :class:`Supervisor` asks of the owner of its workers. Subclass it; the
    supervisor calls these from its own thread and its starter threads, so they must
    be quick and thread-safe (none may block on a worker)."""

    def reserve_workers(self) -> list[int]:
        """The ids of workers to start now (each id once; an id is never reused)."""
        raise NotImplementedError

    def finished(self) -> bool:
        """True once no more workers are wanted: the supervisor ends when none is left."""
        raise NotImplementedError

    def lose(self, wid: int, exitcode: Optional[int], detail: str = "",
             load_error: str = "") -> None:
        """Worker ``wid`` ended with ``exitcode`` (None: unknown). ``detail``: the
        backend's reason (``OOMKilled``...); ``load_error``: why it could not load its
        process (an import error...), if that is why."""
        raise NotImplementedError

    def start_failed(self, wid: int, exc: BaseException) -> None:
        """The backend refused to start worker ``wid``."""
        raise NotImplementedError

    def still_wanted(self, wid: int) -> bool:
        """Whether worker ``wid``, reserved but not started yet (its start waited for a
        starter thread), is still wanted; False forgets it and it is never started."""
        return True   # a hook: most policies want every worker they reserved

    def started(self, wid: int, process: Any) -> None:
        """Worker ``wid``'s ``start()`` returned; its process is ``process``."""
        return None   # a hook: most policies need only lose()

    def missing_main_guard(self) -> None:
        """A worker found the main module without ``if __name__ == "__main__":``
        (called before :meth:`lose`): starting more would fail alike."""
        return None   # a hook: most policies need only lose()


class Supervisor:
    """Keeps the workers a :class:`Policy` wants running.

    Args:
        ctx: the fibrl context whose ``Process`` class starts workers.
        policy: which workers to start, and what their ends mean.
        spec: ``spec(wid)``, the keyword arguments of worker ``wid``'s ``Process``
            (``target``, ``args``, ``name``, ``backend``...); it is a daemon process.
        name: prefix of the supervisor's thread names.
        role: the workers' role label on docker and kubernetes.
        on_done: called by the supervisor thread once every worker is gone.
        meta: resource requests (``@fibrl.meta``) given to every worker process.
        new_process: makes a worker process (default: ``ctx.Process``).
        max_starters: starts in flight at most.
        close_ended: ``close()`` a worker's process once its end was reported (frees its
            resources at once); False when the owner hands its processes out (a
            ``RemoteVectorEnv``'s ``processes``), whose holders may still ``join()`` them.
    """

    def __init__(self, ctx: Any, policy: Policy, spec: Callable[[int], dict[str, Any]],
                 name: str, role: str = "worker", on_done: Callable[[], None] = lambda: None,
                 meta: Optional[dict[str, Any]] = None,
                 new_process: Optional[Callable[..., Any]] = None,
                 max_starters: int = _MAX_STARTERS, close_ended: bool = True) -> None:
        self._new_process = new_process or ctx.Process
        self._meta = dict(meta or {})
        self._on_done = on_done
        self._policy = policy
        self._spec = spec
        self._role = role
        self._close_ended = close_ended
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
        self._starter = ThreadPoolExecutor(max_workers=max(1, min(_MAX_STARTERS, max_starters)),
                                           thread_name_prefix=f"{name}-start")
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"{name}-supervisor")

    def start(self) -> None:
        """Start the supervisor thread (it asks the policy for workers at once)."""
        self._thread.start()

    # -- called from other threads ----------------------------------------------------
    def wake(self) -> None:
        """Make the supervisor thread ask the policy again (cheap; coalesces)."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:
                pass  # the pipe is full: a wake-up is pending anyway

    def kill(self, wid: int) -> None:
        """Kill worker ``wid`` if it runs (its end then reaches :meth:`Policy.lose`)."""
        with self._lock:
            proc = self._procs.get(wid)
        if proc is not None:
            _kill(proc)

    def exit_grace(self, wid: int) -> float:
        """Seconds worker ``wid``'s backend may take to report its exit after its
        connection dropped (a container's or pod's status comes later than a child's)."""
        with self._lock:
            proc = self._procs.get(wid)
        backend = getattr(getattr(proc, "_popen", None), "backend", None)
        return float(getattr(backend, "exit_report_s", Backend.exit_report_s))

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

    def processes(self) -> list[Any]:
        """The worker processes currently started."""
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
            log.exception("%s failed; terminating its workers", self._thread.name)
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
        for wid in self._policy.reserve_workers():
            with self._lock:
                self._starting.add(wid)
            self._starter.submit(self._start_one, wid)

    def _done(self) -> bool:
        with self._lock:
            # After terminate() a start still in progress is not waited for (a pod may
            # wait minutes for a node): its starter thread kills it once the start returns.
            busy = self._procs or (self._starting and not self._killing)
            killing = self._killing
        return not busy and (killing or self._policy.finished())

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
            self._policy.missing_main_guard()   # before lose(): no replacement starts
        self._policy.lose(wid, code, detail, getattr(proc._popen, "load_error", ""))
        if code is not None and self._close_ended:
            proc.close()

    def _reap_all(self) -> None:
        with self._lock:
            wids = list(self._procs)
        for wid in wids:
            self._procs[wid].join(_SELECT_S)
            try:
                self._reap(wid)
            except Exception:
                log.exception("could not reap worker %s", wid)

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
        if not self._policy.still_wanted(wid):   # queued when the owner's need ended
            with self._lock:
                self._starting.discard(wid)
            self.wake()
            return
        try:
            proc = self._new_process(daemon=True, **self._spec(wid))
            proc._fibrl_role = self._role
            if self._meta:  # what a Process reads from its target's @fibrl.meta
                proc._fibrl_meta = dict(self._meta)
            proc.start()
        except BaseException as exc:  # the backend refused: the policy decides what next
            with self._lock:
                self._starting.discard(wid)
            self._policy.start_failed(wid, exc)
            self.wake()
            return
        self._policy.started(wid, proc)
        unwanted = not self._policy.still_wanted(wid)   # the need ended while it started
        with self._lock:
            self._starting.discard(wid)
            late = self._killing or unwanted
            if not late:
                self._procs[wid] = proc
                self._fresh.append(wid)
        if late:  # terminated (or not needed) while it started: the supervisor may be
            self._end_late(wid, proc)   # gone already
        self.wake()

    def _end_late(self, wid: int, proc: Any) -> None:
        """Kill and reap a worker whose start returned after ``terminate()``, or once
        its policy no longer wanted it."""
        _kill(proc)
        proc.join(_SELECT_S)
        self._policy.lose(wid, proc.exitcode)
        if proc.exitcode is not None and self._close_ended:
            proc.close()
        else:
            log.warning("worker %s, started after terminate(), did not end within "
                        "%.0f s of being killed", proc.name, _SELECT_S)


def _kill(proc: Any) -> None:
    try:
        proc.kill()
    except ValueError:
        pass  # reaped and closed meanwhile: it is dead already
    except AttributeError:
        # Being closed on the supervisor thread right now: BaseProcess.close() clears
        # _popen before it marks the process closed, and closes only one that ended.
        if getattr(proc, "_popen", True) is not None:
            raise


def _failure_reason(proc: Any) -> str:
    try:
        reason: str = proc._popen.job.failure_reason()
        return reason
    except Exception:  # the backend could not say; the exit code is evidence enough
        return ""
