"""``fibrl run`` on kubernetes: the script runs as a one-pod Job, the run's parent.

Owns the launcher Job's life seen from outside the cluster: create it, wait
for its pod (reporting image pull failures and unschedulable pods instead of
waiting forever), stream its log, read its exit code, list runs, and delete
everything labelled with a run id. Worker pods are the backend's business
(:mod:`fibrl.backends.kubernetes`); here they are only counted and deleted.

Waiting is a list+watch of the parent pod (one stream, relisted when it
ends), never a poll::

    launch --> Job fibrl-run-<run> (backoffLimit 0, restartPolicy Never)
    wait   --> watch pod fibrl.run=<run>,fibrl.role=parent until its container runs
               (bounded by kubernetes_pending_timeout only while the Job has no pod yet
               or its pod is stuck: Unschedulable, ErrImagePull, a container config
               error; a pod pulling its image is waited for, ImagePullBackOff is
               reported at once)
               --follow: GET pods/log?follow=true&timestamps=true --> out; a stream
               that ends or stays silent for _FOLLOW_READ_TIMEOUT s is opened again
               from sinceTime of the last line, each line written once
           --> watch until Succeeded/Failed --> the container's exit status (+ why, if it
               was OOMKilled, evicted...)
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import re
import time
from collections import Counter
from typing import Any, BinaryIO, Callable, Optional

from ..backends.kubernetes.api import Api, KubeApiError, admission_denial, api_error, connect
from ..backends.kubernetes.job import (autoscaler_refusal, ended_code, fatal_waiting, pod_failure,
                                       progress_marks, stuck_pending)
from ..backends.kubernetes.manifests import LAUNCHER_CONTAINER, launcher_job
from ..backends.kubernetes.settings import (LABEL_BACKEND, LABEL_ROLE, LABEL_RUN, KubeSettings,
                                            PodIdentity, pod_image)
from ..errors import BackendError
from . import Ended, Launcher, RunInfo, RunRequest, age

__all__ = ["KubernetesLauncher", "job_name"]

log = logging.getLogger(__name__)

MAIN_CONTAINER = LAUNCHER_CONTAINER
_WATCH_SECONDS = 60
_FOLLOW_READ_TIMEOUT = 60.0   # seconds of a silent log stream before it is opened again
_FOLLOW_REOPEN_PAUSE = 1.0    # seconds before reopening a stream the API server ended
_NO_POD_RECHECK = 5.0    # seconds between reads of the Job's events while it has no pod


def job_name(run_id: str) -> str:
    """The launcher Job of a run.

    Example:
        >>> job_name("3f2a9c01be77")
        'fibrl-run-3f2a9c01be77'
    """
    return f"fibrl-run-{run_id}"


def _parent_selector(run_id: str) -> str:
    return f"{LABEL_RUN}={run_id},{LABEL_ROLE}=parent"


class KubernetesLauncher(Launcher):
    """Runs ``fibrl run`` scripts as Jobs in ``kubernetes_namespace``."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.settings = KubeSettings.from_config(config)
        self.namespace = self.settings.namespace
        self._api: Optional[Api] = None

    @property
    def api(self) -> Api:
        if self._api is None:
            self._api = Api(connect(self.settings, PodIdentity.detect()), retry_for=20)
        return self._api

    # -- run -------------------------------------------------------------------------
    def launch(self, request: RunRequest) -> str:
        name = job_name(request.run_id)
        body = launcher_job(name=name, namespace=self.namespace, run_id=request.run_id,
                            image=pod_image(request.image), command=request.command,
                            env=request.env,
                            settings=self.settings, service_account=request.service_account,
                            cpu=request.cpu, memory=request.memory, gpu=request.gpu)
        self.api.call("create", "jobs", self.api.batch.create_namespaced_job, self.namespace,
                      body, namespace=self.namespace)
        return name

    def wait(self, run_id: str, follow: bool, out: BinaryIO) -> Ended:
        selector = _parent_selector(run_id)
        pod = self._wait_for(selector, _Starting(self, run_id))
        if follow:
            self._stream(pod["metadata"]["name"], out)
        pod = self._wait_for(selector, _Finishing())
        terminated = _main_state(pod).get("terminated")
        if terminated is None:
            return Ended(1, f"its pod ended {pod['status'].get('phase')} before the script ran: "
                            f"{pod_failure(pod) or 'no reason given'}")
        return Ended(int(terminated.get("exitCode", 1)), pod_failure(pod))

    # -- waiting on one pod: list, then watch until ``until`` says ---------------------
    def _wait_for(self, selector: str, until: "_Until") -> dict:
        while True:
            listing = self.api.call("list", "pods", self.api.core.list_namespaced_pod,
                                    self.namespace, namespace=self.namespace,
                                    label_selector=selector)
            for pod in listing.get("items") or []:
                found = until(pod)
                if found is not None:
                    return found
            until.check()
            deadline = until.deadline()
            if deadline is not None and time.monotonic() > deadline:
                if not until.progressed():
                    raise until.expired()
                deadline = until.deadline()
            found = self._watch(selector, until, listing["metadata"].get("resourceVersion", ""),
                                deadline)
            if found is not None:
                return found

    def _watch(self, selector: str, decide: "_Until", rv: str,
               deadline: Optional[float]) -> Optional[dict]:
        from kubernetes.watch.watch import iter_resp_lines

        left = _WATCH_SECONDS if deadline is None else max(1, min(_WATCH_SECONDS,
                                                                  deadline - time.monotonic()))
        left = min(left, decide.recheck())
        try:
            resp = self.api.core.list_namespaced_pod(
                self.namespace, label_selector=selector, watch=True, resource_version=rv,
                timeout_seconds=int(left) + 1, _preload_content=False,
                _request_timeout=(10, left + 30))
        except self.api.ApiException as exc:
            if exc.status == 410:
                return None
            raise api_error(exc, "watch", "pods", self.namespace, self.api) from exc
        try:
            for line in iter_resp_lines(resp):
                found = self._event(line, decide)
                if found is not None:
                    return found
                if decide.deadline() != deadline:
                    return None   # the pod just got stuck: watch again, bounded by that
        except (OSError, _Relist):
            return None   # dropped or expired stream: list again
        finally:
            resp.release_conn()
        return None

    def _event(self, line: str, decide: Callable) -> Optional[dict]:
        if not line.strip():
            return None
        event = json.loads(line)
        obj = event.get("object") or {}
        if event.get("type") == "ERROR":
            if obj.get("code") == 410:
                raise _Relist()
            raise KubeApiError(f"watch of the run's parent pod failed: {obj.get('message')}",
                               int(obj.get("code") or 0))
        if event.get("type") == "DELETED" and not _finished(obj):
            raise BackendError(
                f"the run's parent pod {obj['metadata']['name']} was deleted before it finished "
                f"(fibrl stop, kubectl delete, or the cluster).")
        return decide(obj) if event.get("type") in ("ADDED", "MODIFIED", "DELETED") else None

    def pod_events(self, pod: str) -> list:
        """The events of ``pod`` ([] when they cannot be read)."""
        try:
            return self.api.call(
                "list", "events", self.api.core.list_namespaced_event, self.namespace,
                namespace=self.namespace,
                field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod}"
            ).get("items") or []
        except KubeApiError:
            return []

    def refusal(self, run_id: str) -> Optional[BackendError]:
        """Why the Job's controller could not create its pod (its FailedCreate events:
        Pod Security, an admission webhook, a quota, a missing service account), if it said."""
        try:
            events = self.api.call(
                "list", "events", self.api.core.list_namespaced_event, self.namespace,
                namespace=self.namespace, field_selector=f"involvedObject.kind=Job,"
                f"involvedObject.name={job_name(run_id)},reason=FailedCreate")
        except KubeApiError:
            return None   # no permission to read events: the timeout will report it
        messages = [e.get("message", "") for e in events.get("items") or []]
        if not messages:
            return None
        last = messages[-1]
        return BackendError(
            f"the Job {job_name(run_id)} in namespace {self.namespace} cannot create its pod: "
            f"{last}. {admission_denial(last) or _FAILED_CREATE_FIX} Clean up with "
            f"`fibrl stop {run_id}`.")

    def no_pod(self, run_id: str, timeout: float) -> BackendError:
        """The error for a Job that created no pod within ``timeout`` seconds."""
        try:
            job = self.api.call("get", "jobs", self.api.batch.read_namespaced_job,
                                job_name(run_id), self.namespace, namespace=self.namespace)
            conditions = [f"{c.get('type')}: {c.get('message', c.get('reason', ''))}"
                          for c in (job.get("status") or {}).get("conditions") or []]
        except KubeApiError as exc:
            conditions = [str(exc)]
        return BackendError(
            f"the Job {job_name(run_id)} in namespace {self.namespace} created no pod within "
            f"{timeout:g} s ({'; '.join(conditions) or 'no condition reported'}). Likely cause: "
            f"the service account does not exist (kubectl apply -f deploy/rbac.yaml), or a "
            f"quota or admission policy refused the pod. Fix: see `kubectl describe job -n "
            f"{self.namespace} {job_name(run_id)}`.")

    def _stream(self, pod: str, out: BinaryIO, container: str = MAIN_CONTAINER) -> None:
        """Copy the followed log of ``container`` to ``out`` until the container ends.

        A stream that ends, or stays silent for ``_FOLLOW_READ_TIMEOUT`` s (a connection a
        proxy or NAT dropped without a word looks exactly like a quiet script), is opened
        again from ``sinceTime`` of the last line written; each line is written once
        (lines carry the kubelet's timestamps, ``timestamps=true``, and those already
        written are skipped).
        """
        follower = _LogFollower(out)
        while True:
            follower.restart()
            resp = self._open_log(pod, container, follower.since())
            if resp is None:
                return   # the pod is gone: waiting for its end says why
            dropped = False
            try:
                for chunk in resp.stream(4096, decode_content=False):
                    follower.feed(chunk)
            except (OSError, _urllib3_errors()) as exc:  # a read timeout, a reset stream
                dropped = True
                log.debug("log stream of pod %s dropped (%r); resuming from %s", pod, exc,
                          follower.since())
            finally:
                _discard(resp, dropped)
            if not dropped and self._container_ended(pod, container):
                follower.flush()
                return
            if not dropped:
                time.sleep(_FOLLOW_REOPEN_PAUSE)   # the API server ended a live stream

    def _open_log(self, pod: str, container: str, since: str) -> Any:
        """The response of ``GET pods/log?follow=true&timestamps=true[&sinceTime=...]``, or
        None when the pod is gone. The generated client has no ``sinceTime``, so the request
        is made with its ApiClient directly."""
        query = [("container", container), ("follow", "true"), ("timestamps", "true")]
        if since:
            query.append(("sinceTime", since))
        client = self.api.client
        request = client.param_serialize(
            "GET", "/api/v1/namespaces/{namespace}/pods/{name}/log",
            path_params={"namespace": self.namespace, "name": pod}, query_params=query,
            # the body is the log's text whatever is accepted; an API server may refuse a
            # text/plain Accept (1.20 answers 406), so ask as kubectl does
            header_params={"Accept": "application/json, */*"}, auth_settings=["BearerToken"])
        deadline = time.monotonic() + self.api.retry_for
        while True:
            try:
                resp = client.call_api(*request, _request_timeout=(10, _FOLLOW_READ_TIMEOUT))
            except (OSError, _urllib3_errors()) as exc:
                if time.monotonic() > deadline:
                    raise BackendError(f"cannot follow the log of pod {pod}: the API server at "
                                       f"{self.api.host} did not answer ({exc}).") from exc
                time.sleep(1.0)
                continue
            if resp.status < 400:
                return resp.response
            resp.read()
            error = self.api.ApiException(http_resp=resp)
            if resp.status == 404:
                return None
            raise api_error(error, "get", "pods/log", self.namespace, self.api)

    def _container_ended(self, pod: str, container: str) -> bool:
        try:
            found = self.api.call("get", "pods", self.api.core.read_namespaced_pod, pod,
                                  self.namespace, namespace=self.namespace)
        except KubeApiError as exc:
            if exc.status == 404:
                return True
            raise
        return "terminated" in _state(found, container) or _phase_ended(found)

    # -- ps / logs / stop ----------------------------------------------------------------
    def _list(self, verb_fn: Callable, resource: str, selector: str) -> list:
        return self.api.call("list", resource, verb_fn, self.namespace, namespace=self.namespace,
                             label_selector=selector).get("items") or []

    def runs(self) -> list:
        pods = self._list(self.api.core.list_namespaced_pod, "pods", LABEL_RUN)
        jobs = self._list(self.api.batch.list_namespaced_job, "jobs", f"{LABEL_ROLE}=parent")
        by_run: dict = {}
        for obj in pods + jobs:
            labels = obj["metadata"].get("labels") or {}
            if labels.get(LABEL_BACKEND, "kubernetes") == "kubernetes":
                by_run.setdefault(labels.get(LABEL_RUN, "?"), []).append(obj)
        return [_run_info(run, objs) for run, objs in sorted(by_run.items())]

    def logs(self, run_id: str, follow: bool, out: BinaryIO, pod: Optional[str] = None) -> None:
        if pod is None:
            parents = self._list(self.api.core.list_namespaced_pod, "pods",
                                 _parent_selector(run_id))
            pods = parents or self._list(self.api.core.list_namespaced_pod, "pods",
                                         f"{LABEL_RUN}={run_id}")
            if not pods:
                raise BackendError(f"no pod of run {run_id!r} in namespace {self.namespace} "
                                   f"(see `fibrl ps`).")
            if len(pods) > 1 and follow:
                raise BackendError(f"run {run_id} has no parent pod and {len(pods)} worker "
                                   f"pods; choose one with --pod NAME to follow it.")
            names = [p["metadata"]["name"] for p in pods]
        else:
            names = [pod]
        for name in names:
            if len(names) > 1:
                out.write(f"==> {name} <==\n".encode())
            self._write_log(name, follow, out)

    def _write_log(self, name: str, follow: bool, out: BinaryIO) -> None:
        if follow:
            pod = self.api.call("get", "pods", self.api.core.read_namespaced_pod, name,
                                self.namespace, namespace=self.namespace)
            self._stream_container(name, pod, out)
            return
        out.write(self.api.call("get", "pods/log", self.api.core.read_namespaced_pod_log, name,
                                self.namespace, namespace=self.namespace, raw=True).encode())
        out.flush()

    def _stream_container(self, name: str, pod: dict, out: BinaryIO) -> None:
        containers = [c["name"] for c in pod["spec"]["containers"]]
        self._stream(name, out, MAIN_CONTAINER if MAIN_CONTAINER in containers
                     else containers[0])

    def stop(self, run_id: str) -> list:
        selector = f"{LABEL_RUN}={run_id}"
        core, batch = self.api.core, self.api.batch
        kinds = (("jobs", batch.list_namespaced_job, batch.delete_namespaced_job),
                 ("pods", core.list_namespaced_pod, core.delete_namespaced_pod),
                 ("secrets", core.list_namespaced_secret, core.delete_namespaced_secret))
        deleted = []
        for resource, lister, deleter in kinds:
            for obj in self._list(lister, resource, selector):
                name = obj["metadata"]["name"]
                if self._delete(resource, deleter, name):
                    deleted.append(f"{resource[:-1]}/{name}")
        return deleted

    def _delete(self, resource: str, deleter: Callable, name: str) -> bool:
        try:
            self.api.call("delete", resource, deleter, name, self.namespace,
                          namespace=self.namespace, propagation_policy="Background")
            return True
        except KubeApiError as exc:
            if exc.status == 404:
                return False
            raise


class _Relist(Exception):
    """The watch expired (410): list again."""


_FAILED_CREATE_FIX = ("Fix: see `kubectl describe job` for the Job; a missing service "
                      "account is created by kubectl apply -f deploy/rbac.yaml.")


class _Until:
    """Decides, from each state of the run's parent pod, whether waiting is over."""

    def __call__(self, pod: dict) -> Optional[dict]:
        raise NotImplementedError

    def check(self) -> None:
        """Raise when something other than the pod shows that waiting is over."""

    def recheck(self) -> float:
        """Seconds one watch of the pod may last before :meth:`check` runs again."""
        return _WATCH_SECONDS

    def deadline(self) -> Optional[float]:
        """``time.monotonic()`` past which waiting fails with :meth:`expired` (None: none)."""
        return None

    def expired(self) -> BackendError:
        raise NotImplementedError

    def progressed(self) -> bool:
        """At the deadline: True (and a new deadline) when the wait is making progress."""
        return False


class _Finishing(_Until):
    """Until the script's pod ends: as long as the script runs."""

    def __call__(self, pod: dict) -> Optional[dict]:
        return _finished(pod)


class _Starting(_Until):
    """Until the script's container runs.

    ``kubernetes_pending_timeout`` bounds only the states nothing else ends: no pod yet
    (a missing service account, a quota), and a pod stuck Unschedulable, in ErrImagePull
    or on a container config error; a stuck pod whose events show progress at the
    deadline (TriggeredScaleUp, Scheduled, Pulling, Pulled) gets another timeout. A pod
    pulling its image or creating its container is waited for (a large image takes
    minutes); ImagePullBackOff ends it at once.
    """

    def __init__(self, launcher: KubernetesLauncher, run_id: str) -> None:
        self._launcher, self._run_id = launcher, run_id
        self._timeout = launcher.settings.pending_timeout
        self._since = time.monotonic()
        self._pod: Optional[dict] = None
        self._stuck = ""
        self._stuck_since: Optional[float] = None
        self._events: list = []      # the pod's events at the last deadline
        self._marks: dict = {}       # their progress_marks()

    def __call__(self, pod: dict) -> Optional[dict]:
        self._pod = pod
        state = _main_state(pod)
        if "running" in state or "terminated" in state or _finished(pod):
            return pod
        reason = fatal_waiting(pod, MAIN_CONTAINER)
        if reason:
            raise BackendError(_cannot_start(pod, reason, self._run_id))
        self._stuck = stuck_pending(pod, MAIN_CONTAINER)
        if not self._stuck:
            self._stuck_since = None
        elif self._stuck_since is None:
            self._stuck_since = time.monotonic()
        return None

    def check(self) -> None:
        if self._pod is None:   # a Job whose pod is refused never gets one: its events say why
            refused = self._launcher.refusal(self._run_id)
            if refused is not None:
                raise refused

    def recheck(self) -> float:
        return _NO_POD_RECHECK if self._pod is None else _WATCH_SECONDS

    def deadline(self) -> Optional[float]:
        if self._pod is None:
            return self._since + self._timeout
        if self._stuck_since is not None:
            return self._stuck_since + self._timeout
        return None

    def progressed(self) -> bool:
        """A stuck pod whose events show progress since the last reading (the cluster
        autoscaler adding a node, an image pull) is given another pending timeout."""
        if self._pod is None or self._stuck_since is None:
            return False
        self._events = self._launcher.pod_events(self._pod["metadata"]["name"])
        marks = progress_marks(self._events)
        new = any(self._marks.get(name) != mark for name, mark in marks.items())
        self._marks.update(marks)
        if new:
            self._stuck_since = time.monotonic()
        return new

    def expired(self) -> BackendError:
        if self._pod is None:
            return self._launcher.no_pod(self._run_id, self._timeout)
        refusal = autoscaler_refusal(self._events)
        return BackendError(_cannot_start(
            self._pod, f"{self._stuck} (pending longer than kubernetes_pending_timeout="
                       f"{self._timeout:g} s with no progress{'; ' + refusal if refusal else ''})",
            self._run_id))


def _main_state(pod: dict) -> dict:
    return _state(pod, MAIN_CONTAINER)


def _state(pod: dict, container: str) -> dict:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == container:
            return status.get("state") or {}
    return {}


def _phase_ended(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _urllib3_errors() -> type[Exception]:
    import urllib3

    return urllib3.exceptions.HTTPError


def _discard(resp: Any, broken: bool) -> None:
    """Give back the connection of a log stream; a broken one is closed, not reused."""
    try:
        if broken:
            resp.close()
        resp.release_conn()
    except Exception:  # closing a broken stream may fail in many urllib3 ways
        pass


_STAMP = re.compile(rb"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d) ")


def _stamp_key(line: bytes) -> Optional[tuple]:
    """``(seconds, nanoseconds)`` of a log line's RFC 3339 timestamp and its length, else None."""
    match = _STAMP.match(line)
    if not match:
        return None
    zone = "+00:00" if match.group(3) == b"Z" else match.group(3).decode()
    seconds = int(dt.datetime.fromisoformat(match.group(1).decode() + zone).timestamp())
    return (seconds, int((match.group(2) or b"0").ljust(9, b"0"))), match.end()


class _LogFollower:
    """Writes the lines of a followed log, each once, across reopened streams.

    Lines come as ``<RFC3339Nano> <text>`` (``timestamps=true``). A reopened stream starts at
    ``sinceTime`` (whole seconds, as the API takes it), so it repeats the lines of that second
    that were written already: lines older than the last one written are skipped, and of the
    lines stamped like the last one, as many as were written already.
    """

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._last: Optional[tuple] = None   # (seconds, ns) of the last line written
        self._at_last = 0                    # lines written with that stamp
        self._skip = 0                       # of those, still to skip in this stream
        self._partial = b""

    def since(self) -> str:
        """``sinceTime`` for the next stream ("" before any line)."""
        if self._last is None:
            return ""
        return dt.datetime.fromtimestamp(self._last[0], dt.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")

    def restart(self) -> None:
        """A new stream begins: a line cut short by the old one comes again, whole."""
        self._partial = b""
        self._skip = self._at_last

    def feed(self, chunk: bytes) -> None:
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._line(line + b"\n")
        self._out.flush()

    def flush(self) -> None:
        """The stream ended with the container: write a last line without a newline."""
        if self._partial:
            self._line(self._partial)
            self._partial = b""
        self._out.flush()

    def _line(self, line: bytes) -> None:
        stamped = _stamp_key(line)
        if stamped is None:   # not stamped (not expected with timestamps=true): write it
            self._out.write(line)
            return
        key, start = stamped
        if self._last is not None and key < self._last:
            return
        if key == self._last:
            if self._skip:
                self._skip -= 1
                return
            self._at_last += 1
        else:
            self._last, self._at_last, self._skip = key, 1, 0
        self._out.write(line[start:])


def _finished(pod: dict) -> Optional[dict]:
    """``pod`` once the script's container ended (a sidecar may keep the pod Running)."""
    return pod if ended_code(pod, MAIN_CONTAINER) is not None else None


def _cannot_start(pod: dict, reason: str, run_id: str) -> str:
    name, image = pod["metadata"]["name"], pod["spec"]["containers"][0].get("image")
    return (f"the run's parent pod {name} cannot start: {reason}. Image {image!r}. Likely cause: "
            f"an image the cluster cannot pull (wrong tag, not pushed, private registry), or "
            f"resources no node has. Fix: --build --registry REGISTRY (or push the image), "
            f"kubernetes_image_pull_secrets, or smaller --cpu/--memory/--gpu. Clean up with "
            f"`fibrl stop {run_id}`.")


def _created(obj: dict) -> float:
    stamp = obj["metadata"].get("creationTimestamp")
    if not stamp:
        return time.time()
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _run_info(run_id: str, objs: list) -> RunInfo:
    jobs = [o for o in objs if o.get("kind") == "Job" or "template" in (o.get("spec") or {})]
    pods = [o for o in objs if o not in jobs]
    parents = [p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_ROLE) == "parent"]
    workers = Counter((p.get("status") or {}).get("phase", "Unknown") for p in pods
                      if p not in parents)
    status = (parents[0].get("status") or {}).get("phase", "-") if parents else "-"
    parent = jobs[0]["metadata"]["name"] if jobs else "-"
    oldest = min(_created(o) for o in objs)
    return RunInfo(run_id, parent, status, dict(workers), age(time.time() - oldest))
