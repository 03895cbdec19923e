"""kube-controller-manager of the fake: the Job controller and the garbage
collector, driven by one :class:`ControllerManager` thread.

The store hands every write event to :meth:`ControllerManager.submit_event`
(a queue put); the manager thread feeds each event, in order, to the
kubelet, the garbage collector and the Job controller. Controllers only
ever run on that thread, so they never race each other; their writes go
back through the store and come around as new events.
"""
from __future__ import annotations

import calendar
import copy
import logging
import queue
import threading
import time
from typing import Callable

from ._api import Api, DeleteOptions
from ._meta import CONFIGMAPS, JOBS, PODS, SECRETS, ApiError, rfc3339
from ._store import WatchEvent
from ._validation import JOB_TRACKING_FINALIZER

log = logging.getLogger(__name__)
_OWNER_KINDS = {rt.kind: rt for rt in (PODS, SECRETS, CONFIGMAPS, JOBS)}
INDEX_KEY = "batch.kubernetes.io/job-completion-index"


class ControllerManager:
    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._handlers: list[Callable[[WatchEvent], None]] = []
        self._thread = threading.Thread(target=self._run, name="fake-controller-manager", daemon=True)

    def add_handler(self, handler: Callable[[WatchEvent], None]) -> None:
        self._handlers.append(handler)

    def start(self) -> None:
        self._thread.start()

    def submit_event(self, event: WatchEvent) -> None:
        self._queue.put(event)

    def submit(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the controller thread (used by timers)."""
        self._queue.put(call)

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            calls = [item] if callable(item) else [lambda h=h: h(item) for h in self._handlers]
            for call in calls:
                try:
                    call()
                except Exception:
                    log.exception("fake controller failed on %r", item)


def _remove_finalizer(name: str) -> Callable[[dict], None]:
    def mutate(obj: dict) -> None:
        obj["metadata"]["finalizers"] = [f for f in obj["metadata"].get("finalizers") or [] if f != name]
        if not obj["metadata"]["finalizers"]:
            del obj["metadata"]["finalizers"]
    return mutate


def _drop_owner(uid: str) -> Callable[[dict], None]:
    def mutate(obj: dict) -> None:
        refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
        if refs:
            obj["metadata"]["ownerReferences"] = refs
        else:
            obj["metadata"].pop("ownerReferences", None)
    return mutate


# --------------------------------------------------------------------------- garbage collector


class GarbageCollector:
    """ownerReferences cascade, and the ``orphan``/``foregroundDeletion`` finalizers."""

    def __init__(self, api: Api):
        self.api = api
        self.store = api.store

    def on_event(self, event: WatchEvent) -> None:
        meta = event.obj["metadata"]
        if event.type == "DELETED":
            self._owner_gone(meta.get("namespace", ""), meta["uid"])
            self._recheck_owners(event.obj)
            return
        finalizers = meta.get("finalizers") or []
        if meta.get("deletionTimestamp") and "orphan" in finalizers:
            self._orphan(event.resource, event.obj)
        if meta.get("deletionTimestamp") and "foregroundDeletion" in finalizers:
            self._foreground(event.resource, event.obj)
        if event.type == "ADDED" and meta.get("ownerReferences"):
            self._delete_if_dangling(event.resource, event.obj)

    def _dependents(self, namespace: str, uid: str) -> list[tuple]:
        found = []
        for rt in _OWNER_KINDS.values():
            for obj in self.store.list(rt.plural, namespace)[0]:
                if any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or []):
                    found.append((rt, obj))
        return found

    def _owner(self, namespace: str, ref: dict) -> dict | None:
        rt = _OWNER_KINDS.get(ref.get("kind"))
        obj = self.store.get(Api.key(rt, namespace, ref.get("name", ""))) if rt else None
        return obj if obj is not None and obj["metadata"]["uid"] == ref.get("uid") else None

    def _delete(self, rt, obj: dict, policy: str) -> None:
        try:
            self.api.delete(rt, obj["metadata"]["namespace"], obj["metadata"]["name"],
                            DeleteOptions(propagation=policy,
                                          preconditions={"uid": obj["metadata"]["uid"]}))
        except ApiError:
            pass    # already gone or replaced

    def _owner_gone(self, namespace: str, uid: str) -> None:
        for rt, dependent in self._dependents(namespace, uid):
            others = [r for r in dependent["metadata"]["ownerReferences"]
                      if r.get("uid") != uid and self._owner(namespace, r) is not None]
            key = Api.key(rt, namespace, dependent["metadata"]["name"])
            if others:
                self.store.update(key, _drop_owner(uid))
            elif not dependent["metadata"].get("deletionTimestamp"):
                self._delete(rt, dependent, "Background")

    def _recheck_owners(self, dependent: dict) -> None:
        namespace = dependent["metadata"].get("namespace", "")
        for ref in dependent["metadata"].get("ownerReferences") or []:
            owner = self._owner(namespace, ref)
            if owner and "foregroundDeletion" in (owner["metadata"].get("finalizers") or []):
                self._foreground(_OWNER_KINDS[ref["kind"]].plural, owner)

    def _orphan(self, resource: str, owner: dict) -> None:
        meta = owner["metadata"]
        for rt, dependent in self._dependents(meta["namespace"], meta["uid"]):
            self.store.update(Api.key(rt, meta["namespace"], dependent["metadata"]["name"]), _drop_owner(meta["uid"]))
        self.store.update((resource, meta["namespace"], meta["name"]), _remove_finalizer("orphan"))

    def _foreground(self, resource: str, owner: dict) -> None:
        meta = owner["metadata"]
        dependents = self._dependents(meta["namespace"], meta["uid"])
        if not dependents:
            self.store.update((resource, meta["namespace"], meta["name"]), _remove_finalizer("foregroundDeletion"))
        for rt, dependent in dependents:
            if not dependent["metadata"].get("deletionTimestamp"):
                self._delete(rt, dependent, "Foreground")

    def _delete_if_dangling(self, resource: str, obj: dict) -> None:
        namespace, refs = obj["metadata"]["namespace"], obj["metadata"]["ownerReferences"]
        if all(r.get("kind") in _OWNER_KINDS for r in refs) and \
                all(self._owner(namespace, r) is None for r in refs):
            rt = next(rt for rt in _OWNER_KINDS.values() if rt.plural == resource)
            self._delete(rt, obj, "Background")


# --------------------------------------------------------------------------- jobs


def format_indexes(indexes: set[int]) -> str:
    ranges, ordered = [], sorted(indexes)
    for index in ordered:
        if ranges and ranges[-1][1] == index - 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def parse_indexes(text: str | None) -> set[int]:
    indexes: set[int] = set()
    for part in filter(None, (text or "").split(",")):
        first, _, last = part.partition("-")
        indexes.update(range(int(first), int(last or first) + 1))
    return indexes


def _controller_uid(pod: dict) -> str | None:
    for ref in pod["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "Job":
            return ref.get("uid")
    return None


def _terminal(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _pod_index(pod: dict) -> int | None:
    value = (pod["metadata"].get("annotations") or {}).get(INDEX_KEY)
    return int(value) if value is not None else None


def _condition(kind: str, reason: str, message: str) -> dict:
    now = rfc3339()
    return {"type": kind, "status": "True", "lastProbeTime": now, "lastTransitionTime": now,
            "reason": reason, "message": message}


class JobController:
    """batch/v1 Job controller: completions, parallelism, backoffLimit, Indexed mode."""

    def __init__(self, api: Api, submit: Callable[[Callable[[], None]], None], backoff_seconds: float):
        self.api, self.store = api, api.store
        self._submit = submit
        self._backoff = backoff_seconds
        self._timers: dict[tuple, threading.Timer] = {}
        self._last_failure: dict[str, float] = {}

    def on_event(self, event: WatchEvent) -> None:
        meta = event.obj["metadata"]
        if event.resource == JOBS.plural and event.type != "DELETED":
            self.sync(meta["namespace"], meta["name"])
        elif event.resource == PODS.plural and event.type != "DELETED":
            owner = self._owner_job(event.obj)
            if owner is not None:
                self.sync(meta["namespace"], owner["metadata"]["name"])
            elif JOB_TRACKING_FINALIZER in (meta.get("finalizers") or []):
                # an orphan (its Job is gone or let it go): nobody will count it any more
                self.store.update(Api.key(PODS, meta["namespace"], meta["name"]),
                                  _remove_finalizer(JOB_TRACKING_FINALIZER))

    def _owner_job(self, pod: dict) -> dict | None:
        uid = _controller_uid(pod)
        ref = next((r for r in pod["metadata"].get("ownerReferences") or [] if r.get("uid") == uid), None)
        job = self.store.get(Api.key(JOBS, pod["metadata"]["namespace"], ref["name"])) if ref else None
        return job if job is not None and job["metadata"]["uid"] == uid else None

    def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()

    def _resync_in(self, seconds: float, namespace: str, name: str, purpose: str) -> None:
        key = (namespace, name, purpose)
        if key in self._timers and self._timers[key].is_alive():
            return
        timer = threading.Timer(seconds, self._submit, args=(lambda: self.sync(namespace, name),))
        timer.daemon = True
        self._timers[key] = timer
        timer.start()

    # ------------------------------------------------------------------ sync

    def sync(self, namespace: str, name: str) -> None:
        job = self.store.get(Api.key(JOBS, namespace, name))
        if job is None:
            return
        uid = job["metadata"]["uid"]
        pods = [p for p in self.store.list(PODS.plural, namespace)[0] if _controller_uid(p) == uid]
        status = copy.deepcopy(job.get("status") or {})
        self._account(job, pods, status)
        active = [p for p in pods if not _terminal(p) and not p["metadata"].get("deletionTimestamp")]
        if not _finished(status):
            active = self._reconcile(job, pods, active, status)
        if _finished(status):
            for pod in active:
                self._delete_pod(pod)
            active = []
        self._write_status(job, pods, active, status)

    def _account(self, job: dict, pods: list[dict], status: dict) -> None:
        """Count terminated pods exactly once: the job-tracking finalizer marks the uncounted ones."""
        indexed = job["spec"].get("completionMode") == "Indexed"
        completed = parse_indexes(status.get("completedIndexes"))
        done = []
        for pod in pods:
            meta = pod["metadata"]
            if JOB_TRACKING_FINALIZER not in (meta.get("finalizers") or []):
                continue
            removed = meta.get("deletionTimestamp") and not meta.get("deletionGracePeriodSeconds")
            if not (_terminal(pod) or removed):
                continue
            if pod["status"].get("phase") == "Succeeded":
                status["succeeded"] = status.get("succeeded", 0) + 1
                if indexed and _pod_index(pod) is not None:
                    completed.add(_pod_index(pod))
            else:
                status["failed"] = status.get("failed", 0) + 1
                self._last_failure[job["metadata"]["uid"]] = time.monotonic()
            done.append(pod)
        if indexed:
            status["completedIndexes"] = format_indexes(completed)
        if done:
            self.store.update(Api.key(JOBS, job["metadata"]["namespace"], job["metadata"]["name"]),
                              lambda obj: obj.update(status={**obj.get("status", {}), **status}))
        for pod in done:
            self.store.update(Api.key(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"]),
                              _remove_finalizer(JOB_TRACKING_FINALIZER))

    def _reconcile(self, job: dict, pods: list[dict], active: list[dict], status: dict) -> list[dict]:
        spec, meta = job["spec"], job["metadata"]
        status.setdefault("startTime", rfc3339())
        failure = self._failure(job, status)
        if failure:
            status["conditions"] = (status.get("conditions") or []) + [
                _condition("FailureTarget", *failure), _condition("Failed", *failure)]
            self.api.record_event(job, "Warning", failure[0], failure[1], "job-controller")
            return active
        if self._complete(spec, status, active):
            reason = ("CompletionsReached", "Reached expected number of succeeded pods")
            status["conditions"] = (status.get("conditions") or []) + [
                _condition("SuccessCriteriaMet", *reason), _condition("Complete", *reason)]
            status["completionTime"] = rfc3339()
            self.api.record_event(job, "Normal", "Completed", "Job completed", "job-controller")
            return active
        if spec.get("suspend") or meta.get("deletionTimestamp"):
            return active
        return active + self._create_pods(job, active, status)

    def _failure(self, job: dict, status: dict) -> tuple[str, str] | None:
        spec = job["spec"]
        if status.get("failed", 0) > spec.get("backoffLimit", 6):
            return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        deadline = spec.get("activeDeadlineSeconds")
        if deadline:
            started = calendar.timegm(time.strptime(status["startTime"], "%Y-%m-%dT%H:%M:%SZ"))
            remaining = started + deadline - time.time()
            if remaining <= 0:
                return "DeadlineExceeded", "Job was active longer than specified deadline"
            self._resync_in(remaining + 0.05, job["metadata"]["namespace"], job["metadata"]["name"], "deadline")
        return None

    @staticmethod
    def _complete(spec: dict, status: dict, active: list[dict]) -> bool:
        completions = spec.get("completions")
        if spec.get("completionMode") == "Indexed":
            return len(parse_indexes(status.get("completedIndexes"))) >= completions
        if completions is None:
            return status.get("succeeded", 0) > 0 and not active
        return status.get("succeeded", 0) >= completions

    def _create_pods(self, job: dict, active: list[dict], status: dict) -> list[dict]:
        spec, uid = job["spec"], job["metadata"]["uid"]
        completions = spec.get("completions")
        if completions is None:
            wanted = 0 if status.get("succeeded") else spec["parallelism"]
        else:
            wanted = min(spec["parallelism"], completions - status.get("succeeded", 0))
        missing = wanted - len(active)
        if missing <= 0:
            for pod in active[wanted:]:
                self._delete_pod(pod)
            return []
        delay = self._backoff_remaining(uid, status.get("failed", 0))
        if delay > 0:
            self._resync_in(delay, job["metadata"]["namespace"], job["metadata"]["name"], "backoff")
            return []
        indexes = self._free_indexes(job, active, status, missing)
        created = [self._create_pod(job, index) for index in indexes]
        return [pod for pod in created if pod is not None]

    def _backoff_remaining(self, uid: str, failed: int) -> float:
        if not failed or not self._backoff or uid not in self._last_failure:
            return 0.0
        delay = min(self._backoff * 2 ** (failed - 1), 360.0)
        return self._last_failure[uid] + delay - time.monotonic()

    @staticmethod
    def _free_indexes(job: dict, active: list[dict], status: dict, count: int) -> list[int | None]:
        if job["spec"].get("completionMode") != "Indexed":
            return [None] * count
        taken = parse_indexes(status.get("completedIndexes")) | {_pod_index(p) for p in active}
        free = [i for i in range(job["spec"]["completions"]) if i not in taken]
        return free[:count]

    def _create_pod(self, job: dict, index: int | None) -> dict | None:
        meta, template = job["metadata"], copy.deepcopy(job["spec"]["template"])
        pod_meta = template.get("metadata") or {}
        pod_meta.pop("creationTimestamp", None)
        pod_meta["generateName"] = f"{meta['name']}-" + (f"{index}-" if index is not None else "")
        pod_meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                        "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]
        pod_meta["finalizers"] = [JOB_TRACKING_FINALIZER]
        spec = template.get("spec") or {}
        if index is not None:
            pod_meta.setdefault("annotations", {})[INDEX_KEY] = str(index)
            pod_meta.setdefault("labels", {})[INDEX_KEY] = str(index)
            spec.setdefault("hostname", f"{meta['name']}-{index}")
            for container in spec.get("containers") or []:
                container.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {
                    "fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.labels['{INDEX_KEY}']"}}})
        try:
            pod = self.api.create(PODS, meta["namespace"], {"metadata": pod_meta, "spec": spec})
        except ApiError as exc:
            self.api.record_event(job, "Warning", "FailedCreate", f"Error creating: {exc.message}",
                                  "job-controller")
            return None
        self.api.record_event(job, "Normal", "SuccessfulCreate", f"Created pod: {pod['metadata']['name']}",
                              "job-controller")
        return pod

    def _delete_pod(self, pod: dict) -> None:
        try:
            self.api.delete(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"],
                            DeleteOptions(propagation="Background"))
        except ApiError:
            pass

    def _write_status(self, job: dict, pods: list[dict], active: list[dict], status: dict) -> None:
        terminating = [p for p in pods if p["metadata"].get("deletionTimestamp") and not _terminal(p)]
        ready = [p for p in active if any(c["type"] == "Ready" and c["status"] == "True"
                                          for c in (p.get("status") or {}).get("conditions") or [])]
        status.update(terminating=len(terminating), ready=len(ready), uncountedTerminatedPods={})
        status["active"] = len(active)
        for key in ("active", "succeeded", "failed"):
            if not status.get(key):
                status.pop(key, None)
        key = Api.key(JOBS, job["metadata"]["namespace"], job["metadata"]["name"])
        self.store.update(key, lambda obj: obj.update(status=status))


def _finished(status: dict) -> bool:
    return any(c["type"] in ("Complete", "Failed") and c["status"] == "True"
               for c in status.get("conditions") or [])
