"""One worker pod as a :class:`~fibrl.backends.base.Job`, and what a pod's status means.

Owns reading a pod dict (as the API serves it) into an exit code and a failure
reason, and the job's state machine. The job never asks the API server about
its pod: the backend's single watch calls :meth:`KubernetesJob.on_pod` /
:meth:`KubernetesJob.on_deleted`, and ``wait()`` blocks on an event::

    queued --creator--> created --watch: terminal phase / DELETED--> ended
       |                   |--watch: ImagePullBackOff, InvalidImageName --> ended (1)
       |                   '--watch: Unschedulable, ErrImagePull, CreateContainer*Error
       |                             longer than pending_timeout --> ended (1)
       '--terminate()/kill() before creation --> ended (-15 / -9)

Popen's ``start_timeout`` counts from the pod's ``Running`` phase
(:meth:`KubernetesJob.when_running`): before that, a pending pod is this
job's to end with its reason.

Exit codes follow ``multiprocessing``: a container killed by signal N exits
128+N, reported as -N. A pod that ends badly says why (OOMKilled, Evicted,
ImagePullBackOff, Unschedulable, deleted by someone else) in
:meth:`~KubernetesJob.failure_reason`, and a warning names the fix.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable, Optional

from ...errors import describe_exitcode
from ..base import Job, JobSpec, JobStatus
from .settings import CONTAINER

__all__ = ["KubernetesJob", "exit_code", "ended_code", "pod_failure", "fatal_waiting",
           "stuck_pending", "progress_marks", "autoscaler_refusal", "PROGRESS_EVENTS",
           "LOG_TAIL_LINES"]

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 500
_MAX_SIGNAL = 64
_FATAL_WAITING = ("ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName")
# ErrImagePull comes before ImagePullBackOff (which ends the job at once); a kubelet that
# keeps retrying a flaky registry may show it for long, so it starts the pending timer.
_STUCK_WAITING = ("CreateContainerConfigError", "CreateContainerError", "ErrImagePull")
# Events that say a pending pod is on its way: the cluster autoscaler is adding a node
# for it, the scheduler placed it, the kubelet pulls (or pulled) its image.
PROGRESS_EVENTS = ("TriggeredScaleUp", "Scheduled", "Pulling", "Pulled")
_DELETED_ELSEWHERE = ("the pod was deleted by someone else (kubectl delete, a node drain, "
                      "the cluster)")


# -- reading a pod ------------------------------------------------------------------------

def exit_code(status: int) -> int:
    """A container's exit status as a process exit code: ``128+N`` becomes ``-N``.

    Example:
        >>> exit_code(137), exit_code(143), exit_code(3)
        (-9, -15, 3)
    """
    return 128 - status if 128 < status <= 128 + _MAX_SIGNAL else status


def _container(pod: dict, name: str = CONTAINER) -> dict:
    """The status of container ``name``: the kubelet sorts statuses by name, and an injected
    sidecar (istio-proxy, linkerd-proxy) may come first."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((s for s in statuses if s.get("name") == name), {})


def ended_code(pod: dict, container: str = CONTAINER) -> Optional[int]:
    """The exit code of the pod's ``container`` once it terminated, or of a pod in a terminal
    phase (None while it may still run). The container's end is the job's end: a sidecar
    that never exits keeps the pod Running after it (restartPolicy Never: no restart)."""
    terminated = (_container(pod, container).get("state") or {}).get("terminated")
    if terminated is not None:
        return exit_code(int(terminated.get("exitCode", 1)))
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return -signal.SIGKILL   # failed before its container ran (evicted while pending...)
    return None


def pod_failure(pod: dict) -> str:
    """Why a pod ended badly, in kubernetes' words (``""`` if it did not)."""
    status = pod.get("status") or {}
    if status.get("reason"):
        return f"{status['reason']}: {status.get('message', '')}".rstrip(": ")
    disruption = _condition(pod, "DisruptionTarget")
    if disruption.get("status") == "True":  # evicted: API eviction, node pressure, drain
        return f"Evicted: {disruption.get('message', '')} ({disruption.get('reason', '')})"
    terminated = (_container(pod).get("state") or {}).get("terminated") or {}
    if terminated.get("reason") == "OOMKilled":
        return "OOMKilled"
    if terminated and terminated.get("exitCode", 0) != 0 and terminated.get("message"):
        return f"{terminated.get('reason', 'Error')}: {terminated['message']}"
    return ""


def _condition(pod: dict, kind: str) -> dict:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), {})


def _waiting(pod: dict, container: str = CONTAINER) -> dict:
    return (_container(pod, container).get("state") or {}).get("waiting") or {}


def fatal_waiting(pod: dict, container: str = CONTAINER) -> str:
    """``"ImagePullBackOff: ..."`` when the container can never start, else ``""``."""
    waiting = _waiting(pod, container)
    if waiting.get("reason") in _FATAL_WAITING:
        return f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    return ""


def stuck_pending(pod: dict, container: str = CONTAINER) -> str:
    """The scheduler's (or kubelet's) reason a pending pod does not start, else ``""``."""
    if (pod.get("status") or {}).get("phase") not in (None, "Pending"):
        return ""
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return f"Unschedulable: {scheduled.get('message', '')}"
    waiting = _waiting(pod, container)
    if waiting.get("reason") in _STUCK_WAITING:
        return f"{waiting['reason']}: {waiting.get('message', '')}"
    return ""


def progress_marks(events: list) -> dict:
    """``{event name: what changes when it happens again}`` of the progress events
    (:data:`PROGRESS_EVENTS`) among a pod's events: a new key, or a changed value, between
    two readings is progress. Compares nothing with this machine's clock.

    Example:
        >>> progress_marks([{"metadata": {"name": "p.1"}, "reason": "TriggeredScaleUp",
        ...                  "count": 2, "lastTimestamp": "2026-11-24T03:00:00Z"},
        ...                 {"metadata": {"name": "p.2"}, "reason": "FailedScheduling"}])
        {'p.1': (2, '2026-11-24T03:00:00Z', None, None)}
    """
    return {(e.get("metadata") or {}).get("name", ""): (
        e.get("count"), e.get("lastTimestamp"), (e.get("series") or {}).get("count"),
        (e.get("series") or {}).get("lastObservedTime") or e.get("eventTime"))
        for e in events if e.get("reason") in PROGRESS_EVENTS}


def autoscaler_refusal(events: list) -> str:
    """The cluster autoscaler's last word on why it adds no node for a pod (its
    ``NotTriggerScaleUp`` event), else ``""``."""
    refusals = [e for e in events if e.get("reason") == "NotTriggerScaleUp"]
    if not refusals:
        return ""
    last = max(refusals, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    return f"the cluster autoscaler adds no node for it: {last.get('message', '')}"


# -- the job -------------------------------------------------------------------------------

class KubernetesJob(Job):
    """A worker running as a pod. Created by :class:`~fibrl.backends.kubernetes.KubernetesBackend`.

    ``owner`` is the backend: it provides ``delete_pod(name, grace)``,
    ``read_logs(name)``, ``pod_events(name)``, ``job_failed_to_start(job, message)``,
    ``pending_timeout``, ``start_limit`` and ``call_later(delay, fn, *args)`` /
    ``cancel_timer(entry)``.

    A deadline of a pending pod (``pending_timeout`` stuck, ``start_limit`` not running)
    that passes while the pod's events show progress since the last reading (a node being
    added by the cluster autoscaler, an image pull started or done) starts over instead of
    failing the job: a new node and a large image take minutes.
    """

    def __init__(self, spec: JobSpec, owner: Any, name: str, namespace: str,
                 manifest: dict) -> None:
        self.spec = spec
        self.name = name
        self.namespace = namespace
        self.manifest = manifest
        self.created_seq: Optional[int] = None   # creation order, for resyncs
        self._owner = owner
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._pod: Optional[dict] = None
        self._code: Optional[int] = None
        self._reason = ""
        self._requested = 0                      # -15 / -9 once terminate()/kill() asked
        self._stuck: Optional[list] = None       # owner.call_later entries
        self._removed = False
        self._final_logs = ""
        self._running = False
        self._on_running: list = []              # callbacks of when_running()
        self._never_ran: Optional[list] = None
        self._waiting_since: Optional[float] = None   # when when_running() was first asked
        # progress_marks() of the last reading, per deadline ("stuck", "start"): each of
        # the two deadlines asks whether anything happened since it last asked
        self._progress: dict = {"stuck": {}, "start": {}}

    @property
    def id(self) -> str:
        return self.name

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    # -- what the watch reports ---------------------------------------------------------
    def on_pod(self, pod: dict) -> None:
        """A new state of this job's pod (ADDED / MODIFIED, or from a list)."""
        with self._lock:
            if self._ended.is_set():
                return
            self._pod = pod
            started = [] if self._running else self._runs(pod)
        for callback in started:
            callback()
        code = ended_code(pod)
        if code is not None:
            self._end(code, self._why_ended(pod, code))
            return
        fatal = fatal_waiting(pod)
        if fatal:
            self._owner.job_failed_to_start(self, fatal)
            return
        self._watch_stuck(stuck_pending(pod))

    def _why_ended(self, pod: dict, code: int) -> str:
        """The reason of a pod that ended with ``code``; a pod that ended because someone
        deleted it says so whether its last status or its DELETED event came first."""
        if code == 0:
            return ""
        reason = pod_failure(pod)
        if reason or not (pod.get("metadata") or {}).get("deletionTimestamp"):
            return reason
        with self._lock:
            return "" if self._requested else _DELETED_ELSEWHERE

    def _runs(self, pod: dict) -> list:
        """The when_running() callbacks to call now that ``pod`` runs (under the lock)."""
        if (pod.get("status") or {}).get("phase") != "Running":
            return []
        self._running = True
        callbacks, self._on_running = self._on_running, []
        if self._never_ran is not None:
            self._owner.cancel_timer(self._never_ran)
        return callbacks

    def when_running(self, callback: Callable[[], None]) -> None:
        """``callback`` once the pod runs: until then, Unschedulable / image pull failures
        are this job's to report (kubernetes_pending_timeout), not a missed connect-back.

        A pod that never runs for a reason the pod does not report (a volume that never
        mounts, an image pull that never ends) still ends: after ``start_limit`` seconds
        from now (start_timeout + kubernetes_pending_timeout), with what the pod shows.
        """
        with self._lock:
            if self._ended.is_set():
                return   # ended before it ran (creation failed): nothing to bound
            if not self._running:
                self._on_running.append(callback)
                if self._never_ran is None:
                    limit = self._owner.start_limit
                    self._waiting_since = time.monotonic()
                    self._never_ran = self._owner.call_later(limit, self._not_running_in,
                                                             limit)
                return
        callback()

    def _not_running_in(self, limit: float) -> None:
        with self._lock:
            if self._running or self._ended.is_set():
                return
        progress, events = self._progressed("start")
        with self._lock:
            pod, waited = self._pod, time.monotonic() - (self._waiting_since or 0.0)
            if progress and not self._running and not self._ended.is_set():
                self._never_ran = self._owner.call_later(limit, self._not_running_in, limit)
                log.info("worker pod %s/%s is not running after %.0f s but is on its way "
                         "(%s); waiting up to %g s more", self.namespace, self.name, waited,
                         progress, limit)
                return
        if not self._running and not self._ended.is_set():
            refusal = autoscaler_refusal(events)
            self._owner.job_failed_to_start(
                self, f"the pod did not start running within {waited:.0f} s (start_timeout + "
                      f"kubernetes_pending_timeout = {limit:g} s with no progress since): "
                      f"{_describe_pending(self, pod)}{'; ' + refusal if refusal else ''}")

    def _progressed(self, deadline: str) -> tuple:
        """(``"TriggeredScaleUp: ..."`` when the pod's events show progress since
        ``deadline`` last read them else ``""``, the events)."""
        events = self._owner.pod_events(self.name)
        marks = progress_marks(events)
        with self._lock:
            seen = self._progress[deadline]
            new = [name for name, mark in marks.items() if seen.get(name) != mark]
            seen.update(marks)
        found = [e for e in events if (e.get("metadata") or {}).get("name") in new]
        if not found:
            return "", events
        last = found[-1]
        return f"{last.get('reason')}: {last.get('message', '')}", events

    def on_deleted(self, pod: Optional[dict]) -> None:
        """The pod is gone (DELETED, or missing from a resync)."""
        code = ended_code(pod) if pod else None
        with self._lock:
            requested = self._requested
        if code is None:
            code = requested or -signal.SIGKILL
        reason = "" if requested else pod_failure(pod or {}) or _DELETED_ELSEWHERE
        self._end(code, reason)

    def on_create_failed(self, message: str) -> None:
        self._end(1, message)

    def _watch_stuck(self, reason: str) -> None:
        with self._lock:
            if not reason:
                timer, self._stuck = self._stuck, None
            elif self._stuck is None:
                self._stuck = self._owner.call_later(self._owner.pending_timeout,
                                                     self._stuck_too_long)
                return
            else:
                return
        if timer is not None:
            self._owner.cancel_timer(timer)

    def _stuck_too_long(self) -> None:
        with self._lock:
            reason = stuck_pending(self._pod or {})
        if not reason or self._ended.is_set():
            return
        progress, events = self._progressed("stuck")
        timeout = self._owner.pending_timeout
        with self._lock:
            if progress and self._stuck is not None and not self._ended.is_set():
                self._stuck = self._owner.call_later(timeout, self._stuck_too_long)
                log.info("worker pod %s/%s is still pending (%s) but on its way (%s); waiting "
                         "up to %g s more", self.namespace, self.name, reason, progress, timeout)
                return
            reason = stuck_pending(self._pod or {})
        if reason and not self._ended.is_set():
            refusal = autoscaler_refusal(events)
            self._owner.job_failed_to_start(
                self, f"{reason} (pending longer than kubernetes_pending_timeout={timeout:g} s"
                      f" with no progress{'; ' + refusal if refusal else ''})")

    def _end(self, code: int, reason: str) -> bool:
        with self._lock:
            if self._ended.is_set():
                return False
            self._code, self._reason = code, reason
            timers = (self._stuck, self._never_ran)
            self._stuck = self._never_ran = None
            self._on_running = []   # (they hold the Process: it would live as long as this)
            self._ended.set()
        for timer in timers:
            if timer is not None:
                self._owner.cancel_timer(timer)
        if reason and code != self._requested:
            _report(self, code, reason)
        return True

    def fail(self, code: int, reason: str) -> bool:
        """End the job now with ``code`` (used when its pod can never run)."""
        return self._end(code, reason)

    # -- the Job surface -------------------------------------------------------------------
    def status(self) -> JobStatus:
        if self._ended.is_set():
            return JobStatus.SUCCEEDED if self._code == 0 else JobStatus.FAILED
        with self._lock:
            phase = ((self._pod or {}).get("status") or {}).get("phase")
        return JobStatus.RUNNING if phase == "Running" else JobStatus.PENDING

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._ended.wait(timeout)
        return self._code

    def terminate(self) -> None:
        self._stop(-signal.SIGTERM, None)

    def kill(self) -> None:
        self._stop(-signal.SIGKILL, 0)

    def _stop(self, code: int, grace: Optional[int]) -> None:
        with self._lock:
            if self._ended.is_set():
                return
            self._requested = self._requested or code
            queued = self.created_seq is None
        if queued and self._end(code, ""):
            self._owner.forget(self)   # the creator skips it: no pod will tell the end
            return
        self._owner.delete_pod(self.name, grace)

    def logs(self) -> str:
        """The last lines the pod printed, or why it has not started."""
        if self._removed:
            return self._final_logs
        with self._lock:
            pod = self._pod
        if pod is None or _waiting(pod) or not (pod.get("status") or {}).get("containerStatuses"):
            return _describe_pending(self, pod)
        return self._owner.read_logs(self.name)

    def failure_reason(self) -> str:
        return self._reason

    def remove(self) -> None:
        """Keep the tail of a failed pod's logs, then delete the pod (background propagation)."""
        self._ended.wait()
        with self._lock:
            if self._removed:
                return
            created = self.created_seq is not None
        logs = self.logs() if created and self._code not in (0, None) else ""
        with self._lock:
            self._final_logs, self._removed = logs, True
        if created:
            self._owner.delete_pod(self.name, None, forget=self)


def _describe_pending(job: KubernetesJob, pod: Optional[dict]) -> str:
    if pod is None:
        return f"<pod {job.namespace}/{job.name} was not created yet>"
    reason = stuck_pending(pod) or fatal_waiting(pod) or (
        _waiting(pod).get("reason") or (pod.get("status") or {}).get("phase") or "Pending")
    return f"<pod {job.namespace}/{job.name} has not started: {reason}>"


def _report(job: KubernetesJob, code: int, reason: str) -> None:
    fixes: dict[str, Callable[[], str]] = {
        "OOMKilled": lambda: (f"raise the memory limit (now {job.spec.memory or 'none'}) with "
                              f"@fibrl.meta(memory=...) or fibrl.init(memory=...), or make the "
                              f"worker use less memory"),
        "Evicted": lambda: ("the node ran short of a resource; give the worker requests that "
                            "match its use (memory=..., cpu=...) so the scheduler places it well"),
    }
    key = reason.split(":", 1)[0]
    fix = fixes.get(key)
    log.warning("worker pod %s/%s ended with %s: %s.%s", job.namespace, job.name,
                describe_exitcode(code), reason, f" Fix: {fix()}." if fix else "")
