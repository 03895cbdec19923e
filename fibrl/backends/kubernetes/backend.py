""":class:`KubernetesBackend`: each worker is a pod.

Owns turning a :class:`~fibrl.backends.base.JobSpec` into a worker pod of the
run, following every pod with one watch, and removing what the run created.
It does not own what runs inside the pod (``fibrl.bootstrap``), how the
parent talks to it (``fibrl.wire.transport``), nor the ``fibrl run`` launcher
(``fibrl.launch``). The ``kubernetes`` package is imported only when the
backend first talks to a cluster. Its pieces are the package's other modules.

Data flow::

    create_job(spec)          (caller's thread)
      first time: connect (kubeconfig or in-cluster), start the watch, wait until it runs
      Secret fibrl-<run>-<owner>-<hash> for the run's key (once per key; pods read it
        by secretKeyRef)
      Pod manifest --> first pod: created now (errors raise here)
                   '-> later pods: Creator queue --> waves of concurrent creates (creator.py)
    PodWatcher thread (watch.py): list+watch pods labelled fibrl.owner=<this backend>
      --> KubernetesJob.on_pod / on_deleted: exit code, OOMKilled, Evicted, image pull
          failures and unschedulable pods (after kubernetes_pending_timeout) end the job;
          a pod that can never run is deleted by the delete threads, not the watch's
    Popen's thread: job.wait() --> job.remove(): delete the pod (background propagation)
    at exit (after multiprocessing joined the children): delete leftover pods (concurrently,
    kubernetes_create_batch at a time) and the Secrets

When the parent itself runs in a pod, worker pods (and the Secret) carry an
ownerReference to it: the cluster deletes them when the parent's pod goes.
Outside a cluster, workers exit by themselves when the parent is gone, and
``fibrl stop RUN`` deletes what is left.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import re
import secrets
import socket
import threading
import time
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from ...config import Config
from ...errors import BackendError, BackendUnavailableError
from ...timers import Timers
from ..base import Backend, Job, JobSpec
from .api import Api, KubeApiError, connect
from .creator import Creator
from .job import LOG_TAIL_LINES, KubernetesJob
from .manifests import owner_reference, secret_manifest, worker_pod
from .settings import (CONTAINER, LABEL_BACKEND, LABEL_OWNER, LABEL_PARENT, LABEL_ROLE, LABEL_RUN,
                       KubeSettings, PodIdentity, choose_port, pod_image, pod_name, port_range)
from .watch import PodWatcher

__all__ = ["KubernetesBackend", "KubernetesJob"]

log = logging.getLogger(__name__)

_DEFAULTS = Config()
_LOOPBACK = ("127.", "localhost", "::1", "[::1]")
_START_WAIT = 60.0           # seconds create_job waits for the first watch
_CLOSE_WAIT = 30.0           # seconds close() waits for its pods' deletes
_PROBE_SECONDS = 5.0         # how long the first request retries an unreachable cluster
_IMAGE_FAILURES = ("ImagePullBackOff", "ErrImagePull", "ErrImageNeverPull", "InvalidImageName")


class KubernetesBackend(Backend):
    """Runs each job as a pod in ``kubernetes_namespace``.

    Why one class of this size: it is the ``Backend`` interface (create, watch, stop,
    logs, clean up at exit) over one connection, one watch and one set of pods; the
    manifests, the API client, the watch, pod creation and the job's state machine are
    the package's other modules.

    Example:
        >>> import fibrl
        >>> fibrl.init(backend="kubernetes", image="registry.example/me/train:1")  # doctest: +SKIP
        >>> with fibrl.Pool(8) as pool:                                             # doctest: +SKIP
        ...     pool.map(abs, range(-4, 4))
    """

    name = "kubernetes"
    exit_report_s = 15.0   # a pod's terminated status comes through the node and a watch
    # A node that stopped (or was cut off) reports no exit: its pods show Running until the
    # node lifecycle controller evicts them, 5 minutes after the node goes NotReady.
    silent_exit_s = 60.0

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.settings = KubeSettings.from_config(config)
        self.identity = PodIdentity.detect()
        self.namespace = self._choose_namespace()
        self.token = secrets.token_hex(6)          # value of the fibrl.owner label
        self.api: Optional[Api] = None
        self._lock = threading.RLock()
        self._watcher: Optional[PodWatcher] = None
        self._creator: Optional[Creator] = None
        self._jobs: dict[str, KubernetesJob] = {}
        self._secrets: dict[str, str] = {}         # key (hex) -> Secret name
        self._own_secrets: list[str] = []          # Secrets this backend created
        self._bad_images: dict[str, str] = {}
        self._fatal: Optional[BackendError] = None
        self._unreachable: tuple = (0.0, None)     # (when, error) of the last failed connect
        self._created = 0                          # pods created so far (resync order)
        self._parent: Optional[dict] = None        # this process's pod, when it runs in one
        self._closed = False
        self._timers = Timers()   # deadlines of pending pods (its thread starts on use)
        self._deleter: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._deleting: set = set()   # pods whose delete the deleter has not finished

    @property
    def _api(self) -> Api:
        """The connected :attr:`api`: only what follows the first ``create_job`` uses it."""
        assert self.api is not None, "the kubernetes backend is not connected yet"
        return self.api

    @property
    def pending_timeout(self) -> float:
        return self.settings.pending_timeout

    def call_later(self, delay: float, fn: Callable[..., None], *args: object) -> list:
        """Run ``fn(*args)`` after ``delay`` s; returns an entry for :meth:`cancel_timer`.

        One timer thread waits for every pending pod's deadlines (not a thread per
        pod: a pool of 500 may wait for nodes at once); ``fn`` runs in a thread of
        its own, since ending a job calls the API.
        """
        return self._timers.call_at(time.monotonic() + delay, functools.partial(fn, *args),
                                    blocking=True)

    cancel_timer = staticmethod(Timers.cancel)

    @property
    def start_limit(self) -> float:
        """Seconds a pod may take to run at all, whatever holds it (see KubernetesJob)."""
        return self.config.start_timeout + self.settings.pending_timeout

    def python(self) -> str:
        return "python"

    @classmethod
    def listen_ports_of(cls, config: Config) -> Optional[tuple]:
        return port_range(config.kubernetes_listen_ports)

    def listen_port(self, host: str) -> int:
        """A free port of ``kubernetes_listen_ports`` on ``host`` (0: any port)."""
        ports = self.settings.listen_ports
        return choose_port(host, ports) if ports else 0

    def _choose_namespace(self) -> str:
        # In a pod, "default" (the config default) means "where the parent runs".
        configured = self.settings.namespace
        if configured == _DEFAULTS.kubernetes_namespace and self.identity.namespace:
            return self.identity.namespace
        return configured

    # -- starting ----------------------------------------------------------------------
    def create_job(self, spec: JobSpec) -> Job:
        self._start()
        image = self._image(spec)
        self._check_image(image)
        self._check_address(spec)
        job = self._new_job(spec, image)
        with self._lock:
            synchronous = self._created == 0
        if synchronous:
            self._create(job, raise_errors=True)
        else:
            assert self._creator is not None   # set by _start's connect
            self._creator.submit(job)
        return job

    def _start(self) -> None:
        with self._lock:
            if self._fatal is not None:
                raise self._fatal
            if self._closed:
                raise BackendError("the kubernetes backend was closed (the program is exiting); "
                                   "no new worker pods can start.")
            if self._watcher is None:
                self._connect_once()
            watcher = self._watcher
        assert watcher is not None   # _connect_once set it, or raised
        if not watcher.ready.wait(_START_WAIT):
            raise BackendError(
                f"the watch of worker pods in namespace {self.namespace!r} did not start within "
                f"{_START_WAIT:.0f} s (API server {self._api.host}). Check the cluster's health "
                f"with `kubectl get --raw /readyz`.")
        if watcher.error is not None:
            raise watcher.error

    def _connect_once(self) -> None:
        """Connect, unless the last try found no cluster moments ago: the starts of a
        pool that wait on this lock fail at once with that error, not one probe each."""
        when, error = self._unreachable
        if error is not None and time.monotonic() - when < _PROBE_SECONDS:
            raise error
        try:
            self._connect()
        except BackendUnavailableError as exc:
            self._unreachable = (time.monotonic(), exc)
            raise

    def _connect(self) -> None:
        api = Api(connect(self.settings, self.identity), max_inflight=self.settings.create_batch)
        api.call("list", "pods", api.core.list_namespaced_pod, self.namespace, limit=1,
                 namespace=self.namespace, retry_for=_PROBE_SECONDS)
        self.api = api
        self._watcher = PodWatcher(api, self.namespace, f"{LABEL_OWNER}={self.token}",
                                   self._on_event, self._on_resync, self._on_fatal,
                                   lambda: self._created)
        self._creator = Creator(self._create, self.settings.create_batch, lambda: api.throttled)
        # Deletes the watch asks for run here: a delete retried for up to a minute (an API
        # server answering 5xx) must not hold up the events of every other pod.
        self._deleter = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.settings.create_batch, thread_name_prefix="fibrl-kube-delete")
        self._watcher.start()

    def _new_job(self, spec: JobSpec, image: str) -> KubernetesJob:
        name = pod_name(spec.name)
        labels = {LABEL_RUN: spec.labels.get(LABEL_RUN, ""),
                  LABEL_PARENT: spec.labels.get(LABEL_PARENT, str(os.getpid())),
                  LABEL_ROLE: spec.labels.get(LABEL_ROLE, "process"),
                  LABEL_OWNER: self.token, LABEL_BACKEND: "kubernetes"}
        parent = self._parent_pod() or {}
        same_image = image == _pod_image(parent)
        # Workers of a parent in a pod run as its service account (they may start workers).
        account = self.settings.service_account or (parent.get("spec") or {}).get(
            "serviceAccountName", "")
        manifest = worker_pod(spec, self.settings, name=name, namespace=self.namespace,
                              image=image, secret_name=self._secret(spec, labels), labels=labels,
                              owner=self._owner_reference(), service_account=account,
                              workdir=spec.workdir if same_image else "")
        job = KubernetesJob(spec, self, name, self.namespace, manifest)
        with self._lock:
            self._jobs[name] = job
        return job

    def _create(self, job: KubernetesJob, raise_errors: bool = False) -> None:
        """Create ``job``'s pod (the creator's threads, or the first one inline)."""
        image = job.manifest["spec"]["containers"][0]["image"]
        refusal = self._fatal or self._bad_images.get(image)
        if refusal:   # a queued pod that would fail like the ones before it
            job.fail(1, str(refusal))
            return self.forget(job)
        try:
            self._post_pod(job)
        except KubeApiError as exc:
            self.forget(job)
            if raise_errors:
                raise
            if exc.status in (401, 403, 404) and "exceeded quota" not in str(exc):
                self._fatal = exc
            log.error("worker pod %s could not be created: %s", job.name, exc)
            job.on_create_failed(str(exc))
            return
        with self._lock:
            self._created += 1
            job.created_seq = self._created
        if job.ended:  # stopped while its create request was in flight
            self.delete_pod(job.name, 0, quiet=True)

    def _post_pod(self, job: KubernetesJob) -> None:
        api = self._api
        try:
            # an API server away (restarting, failing over) is waited for as long as a
            # worker may take to start: start_timeout, then the start fails with the error
            api.call("create", "pods", api.core.create_namespaced_pod, self.namespace,
                     job.manifest, namespace=self.namespace,
                     retry_for=max(api.retry_for, self.config.start_timeout))
        except KubeApiError as exc:
            if exc.status != 409 or not self._is_mine(job.name):
                raise  # 409 on a retried create whose first attempt got through: ours

    def _is_mine(self, name: str) -> bool:
        try:
            pod = self._api.call("get", "pods", self._api.core.read_namespaced_pod, name,
                                 self.namespace, namespace=self.namespace)
        except KubeApiError:
            return False
        return (pod.get("metadata", {}).get("labels") or {}).get(LABEL_OWNER) == self.token

    # -- what each pod needs -------------------------------------------------------------
    def _parent_pod(self) -> Optional[dict]:
        """This process's own pod (read once), when it runs in one."""
        if self._parent is None and self.identity.in_pod:
            try:
                self._parent = self._api.call(
                    "get", "pods", self._api.core.read_namespaced_pod, self.identity.name,
                    self.identity.namespace, namespace=self.identity.namespace, retry_for=10)
            except KubeApiError as exc:
                log.warning("cannot read this process's own pod %s/%s (%s): worker pods get "
                            "no owner reference and the configured image.",
                            self.identity.namespace, self.identity.name, exc)
                self._parent = {}
        return self._parent or None

    def _image(self, spec: JobSpec) -> str:
        image = spec.image or self.config.image
        parent = self._parent_pod()
        if image == _DEFAULTS.image and parent and _pod_image(parent):
            return _pod_image(parent)  # default: the image the parent runs in
        return pod_image(image)   # the stock fibrl:latest: fibrl:<version>

    def _owner_reference(self) -> Optional[dict]:
        parent = self._parent_pod()
        if not parent or self.identity.namespace != self.namespace:
            return None
        meta = parent.get("metadata") or {}
        return owner_reference(PodIdentity(meta.get("name", ""), meta.get("namespace", ""),
                                           meta.get("uid", "")))

    def _secret(self, spec: JobSpec, labels: dict) -> str:
        key = spec.env.get("FIBRL_SECRET", "")
        if not key:
            raise BackendError("a job was submitted without FIBRL_SECRET; workers could not "
                               "authenticate. This is a bug in fibrl's Popen: please report it.")
        with self._lock:
            name = self._secrets.get(key)
            if name is None:
                name = self._secrets[key] = self._create_secret(key, labels)
        return name

    def _create_secret(self, key: str, labels: dict) -> str:
        # One Secret per backend and key: its lifetime is this backend's, whoever else
        # (another config, a worker starting workers) runs with the same run id and key.
        run = re.sub(r"[^a-z0-9-]+", "-", labels[LABEL_RUN].lower()).strip("-")[:24] or "run"
        name = f"fibrl-{run}-{self.token}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
        secret_labels = {k: labels[k] for k in (LABEL_RUN, LABEL_OWNER, LABEL_BACKEND)}
        body = secret_manifest(name, self.namespace, key, secret_labels, self._owner_reference())
        try:
            self._api.call("create", "secrets", self._api.core.create_namespaced_secret,
                           self.namespace, body, namespace=self.namespace)
        except KubeApiError as exc:
            if exc.status != 409:  # 409: a retried create whose first attempt got through
                raise
        self._own_secrets.append(name)
        return name

    def _check_image(self, image: str) -> None:
        if image in self._bad_images:
            raise BackendError(self._bad_images[image])

    def _check_address(self, spec: JobSpec) -> None:
        address = urlsplit(str(spec.command[3]) if len(spec.command) > 3 else "")
        self._check_port(address.port)
        host = address.hostname or ""
        if not host.startswith(_LOOPBACK):
            return
        if self.identity.service_account:
            raise BackendError(
                f"this process runs in a pod but listens for its workers on {host}, which other "
                f"pods cannot reach. Fix: set listen_host to this pod's IP: give the pod the env "
                f"FIBRL_LISTEN_HOST from the downward API (fieldRef status.podIP), as `fibrl run` "
                f"does, or fibrl.init(listen_host=<pod IP>).")
        if self.identity.in_pod or self.settings.allow_loopback:
            return   # a pod's own IP (FIBRL_LISTEN_HOST), or loopback on purpose
        raise BackendError(
            f"this process runs outside the cluster and listens for its workers on {host}: "
            f"each worker pod would dial {host} inside its own pod and never reach this "
            f"process (the API server at {self._api.host} being on this machine does not make "
            f"its pods so). Fix: set listen_host to an address of this machine that pods can "
            f"route to{_routable_hint(self._api.host)}, and let workers reach it (firewall, "
            f"NetworkPolicy); or launch the script in the cluster with `fibrl run`. A cluster "
            f"whose pods share this machine's network may set kubernetes_allow_loopback=True.")

    def _check_port(self, port: Optional[int]) -> None:
        ports = self.settings.listen_ports
        if ports is None or port is None or ports[0] <= port <= ports[1]:
            return
        raise BackendError(
            f"this process listens for its workers on port {port}, outside "
            f"kubernetes_listen_ports={ports[0]}-{ports[1]}: a NetworkPolicy that admits only "
            f"that range would drop the workers' connections. It started listening before its "
            f"first worker (a Queue, Pipe, Lock or Event created first listens at once). Fix: "
            f"start a worker before creating those, or leave kubernetes_listen_ports empty and "
            f"admit every port of this process's address in the NetworkPolicy.")

    # -- what the watch reports ------------------------------------------------------------
    def _on_event(self, kind: str, pod: dict) -> None:
        job = self._jobs.get((pod.get("metadata") or {}).get("name", ""))
        if job is None:
            return
        if kind == "DELETED":
            job.on_deleted(pod)
        else:
            job.on_pod(pod)

    def _on_resync(self, pods: list, seq: int) -> None:
        seen = {(p.get("metadata") or {}).get("name"): p for p in pods}
        for name, job in list(self._jobs.items()):
            if name in seen:
                job.on_pod(seen[name])
            elif job.created_seq is not None and job.created_seq <= seq:
                job.on_deleted(None)   # created before the list, absent from it: gone

    def _on_fatal(self, exc: KubeApiError) -> None:
        self._fatal = exc
        log.error("fibrl lost track of its worker pods: %s", exc)
        for job in list(self._jobs.values()):
            if job.fail(1, f"the watch of worker pods failed: {exc}"):
                self._delete_later(job.name)

    def job_failed_to_start(self, job: KubernetesJob, reason: str) -> None:
        """A pod that cannot run (image, scheduling): end its job, delete it, say why."""
        image = job.manifest["spec"]["containers"][0]["image"]
        text = _start_failure(job, image, reason)
        if reason.startswith(_IMAGE_FAILURES):
            self._bad_images[image] = text
        if job.fail(1, text):
            log.error("%s", text)
            self._delete_later(job.name)

    def _delete_later(self, name: str) -> None:
        """Delete pod ``name`` now, with no grace, off the calling (watch or timer) thread."""
        with self._lock:
            self._deleting.add(name)
        try:
            assert self._deleter is not None   # pods are watched only once connected
            self._deleter.submit(self._delete_pending, name)
        except RuntimeError:   # shut down by close(), which deletes what is left itself
            pass

    def _delete_pending(self, name: str) -> None:
        try:
            self.delete_pod(name, 0, quiet=True)
        finally:
            with self._lock:
                self._deleting.discard(name)

    # -- removing --------------------------------------------------------------------------
    def delete_pod(self, name: str, grace: Optional[int], *, quiet: bool = False,
                   forget: Optional[KubernetesJob] = None) -> None:
        """Delete pod ``name`` (``grace`` None: the pod's own grace period)."""
        quiet = quiet or self._closed   # at exit, a gone cluster must not raise
        extra: dict[str, Any] = {} if grace is None else {"grace_period_seconds": grace}
        try:
            self._api.call("delete", "pods", self._api.core.delete_namespaced_pod, name,
                           self.namespace, namespace=self.namespace,
                           propagation_policy="Background", **extra)
        except KubeApiError as exc:
            if exc.status != 404 and not quiet:
                raise
            if exc.status != 404:
                log.warning("could not delete worker pod %s/%s: %s", self.namespace, name, exc)
        finally:
            if forget is not None:
                self.forget(forget)

    def forget(self, job: KubernetesJob) -> None:
        """Stop tracking ``job`` (its pod is gone, or will never be made)."""
        with self._lock:
            if self._jobs.get(job.name) is job:
                del self._jobs[job.name]

    def read_logs(self, name: str) -> str:
        try:
            return self._api.call("get", "pods/log", self._api.core.read_namespaced_pod_log, name,
                                  self.namespace, namespace=self.namespace, container=CONTAINER,
                                  tail_lines=LOG_TAIL_LINES, raw=True, retry_for=5)
        except KubeApiError as exc:
            return f"<logs of pod {self.namespace}/{name} unavailable: {exc}>"

    def pod_events(self, name: str) -> list:
        """The events of pod ``name`` ([] when they cannot be read: without ``list events``
        a pending pod's deadline only ends sooner)."""
        try:
            listing = self._api.call(
                "list", "events", self._api.core.list_namespaced_event, self.namespace,
                namespace=self.namespace, retry_for=5,
                field_selector=f"involvedObject.kind=Pod,involvedObject.name={name}")
        except KubeApiError as exc:
            log.debug("cannot read the events of pod %s/%s: %s", self.namespace, name, exc)
            return []
        return listing.get("items") or []

    def close_at_exit(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop creating and watching; delete this backend's pods and Secrets. Idempotent."""
        with self._lock:
            if self._closed or self.api is None:
                self._closed = True
                return
            self._closed = True
        api, creator, deleter, watcher = self.api, self._creator, self._deleter, self._watcher
        assert creator is not None and deleter is not None and watcher is not None  # connected
        for job in creator.close():
            job.fail(-15, "")
        api.retry_for = 2.0
        # Ours to delete (a requested kill, not a lost pod), all at once: at most
        # kubernetes_create_batch requests in flight, not one pod after another.
        # Threads of its own, not the delete pool: close() runs at interpreter exit, when
        # concurrent.futures refuses new work.
        deleter.shutdown(wait=False)
        with self._lock:   # deletes still retrying (an API server refusing them) are redone
            pending = sorted(self._deleting)   # here: the deleter gives up once closed
        _each_concurrently([job.kill for job in list(self._jobs.values())
                            if job.created_seq is not None]
                           + [functools.partial(self.delete_pod, name, 0, quiet=True)
                              for name in pending],
                           self.settings.create_batch, _CLOSE_WAIT)
        watcher.stop()
        for job in list(self._jobs.values()):
            job.on_deleted(None)   # nothing will report on them any more
        for name in self._own_secrets:
            self._delete_secret(name)
        api.closed.set()
        self._timers.close(1.0)
        api.client.close()   # its pool's kept-alive connections to the API server

    def _delete_secret(self, name: str) -> None:
        try:
            self._api.call("delete", "secrets", self._api.core.delete_namespaced_secret, name,
                           self.namespace, namespace=self.namespace)
        except KubeApiError as exc:
            if exc.status != 404:
                log.warning("could not delete Secret %s/%s: %s. Fix: fibrl stop <run>, or "
                            "kubectl delete secret -n %s %s.", self.namespace, name, exc,
                            self.namespace, name)

    def stats(self) -> dict:
        """Requests and waves so far (for tests and debugging)."""
        watcher, creator = self._watcher, self._creator
        return {"lists": watcher.lists if watcher else 0,
                "watches": watcher.watches if watcher else 0,
                "waves": creator.waves if creator else 0, "live_jobs": len(self._jobs)}


def _each_concurrently(calls: list, width: int, timeout: float) -> None:
    """Run every one of ``calls`` on at most ``width`` threads; wait up to ``timeout`` s."""
    pending = list(calls)
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                if not pending:
                    return
                call = pending.pop()
            call()

    threads = [threading.Thread(target=drain, daemon=True, name="fibrl-kube-close")
               for _ in range(min(width, len(pending)))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _routable_hint(api_url: str) -> str:
    """``" (e.g. 192.168.1.20, the address this machine reaches the API server from)"``."""
    parts = urlsplit(api_url)
    host, port = parts.hostname or "", parts.port or 443
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))      # no packet: only picks the route's source
            local = probe.getsockname()[0]
    except OSError:
        return ""
    if local.startswith(_LOOPBACK):
        return (" (the API server is on loopback, as with kind or minikube: use this "
                "machine's address on the cluster's network, e.g. its address on the "
                "`kind` docker network, `docker network inspect kind`)")
    return f" (e.g. {local}, the address this machine reaches the API server from)"


def _pod_image(pod: dict) -> str:
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    return containers[0].get("image", "")


def _start_failure(job: KubernetesJob, image: str, reason: str) -> str:
    where = f"worker pod {job.namespace}/{job.name}"
    if reason.startswith(_IMAGE_FAILURES):
        return (f"{where} cannot pull its image {image!r}: {reason}. Likely cause: a wrong name "
                f"or tag, an image never pushed, a private registry without credentials, or an "
                f"image only loaded into the nodes (kind load, minikube image load) pulled "
                f"again under kubernetes_image_pull_policy=Always. Fix: push the image (fibrl "
                f"run --build --registry ...), set image=..., give "
                f"kubernetes_image_pull_secrets, or use kubernetes_image_pull_policy="
                f"IfNotPresent for a loaded image.")
    if reason.startswith("Unschedulable"):
        spec = job.spec
        return (f"{where} cannot be scheduled: {reason}. Likely cause: no node has the "
                f"requested cpu={spec.cpu or '-'} memory={spec.memory or '-'} gpu={spec.gpu or '-'}"
                f" free, or none matches kubernetes_node_selector / kubernetes_tolerations. "
                f"Fix: ask for less (@fibrl.meta / fibrl.init), add nodes, or fix the selector.")
    return (f"{where} cannot start its container: {reason}. Fix: see `kubectl describe pod -n "
            f"{job.namespace} {job.name}`.")
