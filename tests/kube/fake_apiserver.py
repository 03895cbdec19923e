"""A small, faithful fake Kubernetes API server that really runs pods.

It owns nothing of fibrl: tests start it, point the official ``kubernetes``
client at it through a kubeconfig (:meth:`FakeApiServer.write_kubeconfig`),
and drive everything through that client.

Data flow::

    kubernetes client --HTTP--> _http.Router --> _api.Api --> _store.Store
                                   |  401/429/5xx/403 hooks       |  every write: rv+1, WatchEvent
                                   |                              v
                      watch/log streams <----- history ----- ControllerManager thread
                                                                 |-- _kubelet.Kubelet: scheduler, one
                                                                 |   PodWorker thread per pod running its
                                                                 |   containers (local processes or docker)
                                                                 |-- _controllers.GarbageCollector
                                                                 '-- _controllers.JobController

What is served: core/v1 pods (+ ``status``, ``log``, ``eviction``), secrets,
configmaps, events and namespaces; batch/v1 jobs (+ ``status``); discovery,
``/version``, health endpoints and SelfSubjectAccessReviews. Namespaces are
not enforced by default: any valid namespace name exists (``GET`` of one
answers an Active Namespace) unless ``strict_namespaces=True``, which then
404s (``namespaces "x" not found``) outside the built-in and created ones.

Faithful on purpose (clients must cope as with a real server): batch/v1 Jobs
deleted without ``propagationPolicy`` orphan their pods (with the real
``Warning`` header); Job pods carry the ``batch.kubernetes.io/job-tracking``
finalizer; list items have no kind/apiVersion; watches re-shape events to
the selector (ADDED/DELETED on entering/leaving it); updates of the main
resource ignore ``status``; a resourceVersion in a create is a 500.

Strict like a real cluster: the API server's quantity grammar ("512K" is a
422); statuses sorted by container name; a pull policy of Always (the default
for ``:latest`` and untagged images) fails for images outside ``registry``;
namespace labels drive admission (tests/kube/_admission.py): the "restricted"
Pod Security standard, and istio sidecar injection of a container that never
exits; quiet watches get a BOOKMARK every ``bookmark_interval`` seconds; a watch
from a resourceVersion newer than the store's is a 504 "Too large resource
version" with Retry-After (as from a lagging API server after a failover).

Deliberate differences from a real cluster: one node ("fake-node"); pod IP =
host IP = ``pod_ip`` (127.0.0.1; "::1" for IPv6); the SIGTERM->SIGKILL delay is min(grace period,
``max_grace_seconds`` = 2 s); Job pod-replacement backoff is
``job_backoff_seconds`` (default 0; real 10 s doubling); watch errors use
reason ``Expired``; no ``managedFields``; lists are served from the latest
state (no ``resourceVersionMatch`` snapshots, continue tokens are keys);
server-side apply is a strategic merge; no init containers, probes,
volumes (the service-account volume is only data), services, nodes or
``timestamps``/``sinceSeconds`` for logs; in process mode resource limits
are not enforced and a pod's env is the pod's plus ``host_env`` and
``image_env`` (PATH, PYTHONPATH, ... and PYTHONUNBUFFERED=1).
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
import threading
from typing import Callable

from ._api import Api
from ._controllers import ControllerManager, GarbageCollector, JobController
from ._http import Fault, HttpServer, Policy, RequestRecord, Router
from ._kubelet import Kubelet
from ._meta import PODS
from ._runtime import DOCKER_LABEL, docker, docker_engine_answers, docker_leaked_containers
from ._settings import Settings
from ._store import Store

__all__ = ["FakeApiServer", "RequestRecord", "docker_engine_answers", "docker_leaked_containers", "DOCKER_LABEL"]


class FakeApiServer:
    """Start with :meth:`start` (or ``with FakeApiServer() as server``); :meth:`stop` kills every pod.

    Keyword arguments are the fields of :class:`tests.kube._settings.Settings`, e.g.
    ``runtime="process"|"docker"|"auto"``, ``history_limit=1000``,
    ``node_capacity={"cpu": "2", "memory": "4Gi"}``, ``image_commands={"img": ["python", "-m", "x"]}``.
    """

    def __init__(self, **settings):
        self.settings = Settings(**settings)
        self.policy = Policy()
        self._manager = ControllerManager()
        self.store = Store(self.settings.history_limit, on_event=self._manager.submit_event)
        self.api = Api(self.store, self.settings)
        self._http: HttpServer | None = None
        self.kubelet: Kubelet | None = None
        self._jobs: JobController | None = None
        self._kubeconfigs: list[str] = []
        self._lock = threading.Lock()
        self._started = self._stopped = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "FakeApiServer":
        self._http = HttpServer()
        self.kubelet = Kubelet(self.api, self.settings, self._http.port, self._docker_ok)
        self._http.router = Router(self.api, self.kubelet, self.settings, self.policy, self._http.port)
        self._manager.add_handler(self.kubelet.on_event)
        self._manager.add_handler(GarbageCollector(self.api).on_event)
        self._jobs = JobController(self.api, self._manager.submit, self.settings.job_backoff_seconds)
        self._manager.add_handler(self._jobs.on_event)
        self._manager.start()
        self._http.start()
        self._started = True
        return self

    def stop(self) -> None:
        """Stop serving, kill every container/process the fake started, remove its files."""
        with self._lock:
            if self._stopped or not self._started:
                return
            self._stopped = True
        self._http.router.stalls.clear()
        self._http.stop()
        self.store.close()
        self._manager.stop()
        self._jobs.stop()
        self.kubelet.stop()
        self._remove_leftover_containers()
        for path in self._kubeconfigs:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "FakeApiServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @functools.cached_property
    def _docker_engine(self) -> bool:
        return docker_engine_answers()

    def _docker_ok(self) -> bool:
        return self._docker_engine

    def _remove_leftover_containers(self) -> None:
        if self.settings.runtime == "process" or not self._docker_engine:
            return
        mine = docker_leaked_containers(self.settings.instance)
        if mine:
            docker("rm", "-f", *mine)

    # ------------------------------------------------------------------ connection

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig_dict(self, namespace: str = "default") -> dict:
        return {"apiVersion": "v1", "kind": "Config", "current-context": "fibrl-fake",
                "clusters": [{"name": "fibrl-fake", "cluster": {"server": self.url}}],
                "users": [{"name": "fibrl", "user": {"token": self.settings.token}}],
                "contexts": [{"name": "fibrl-fake", "context": {"cluster": "fibrl-fake", "user": "fibrl",
                                                                "namespace": namespace}}],
                "preferences": {}}

    def write_kubeconfig(self, path: str | None = None, namespace: str = "default") -> str:
        """Write a kubeconfig (JSON is YAML) for ``kubernetes.config.load_kube_config``; returns its path."""
        if path is None:
            fd, path = tempfile.mkstemp(prefix="fibrl-fake-", suffix=".kubeconfig")
            os.close(fd)
            self._kubeconfigs.append(path)
        with open(path, "w") as handle:
            json.dump(self.kubeconfig_dict(namespace), handle, indent=1)
        return path

    def api_client(self):
        """A ``kubernetes.client.ApiClient`` for this server (the global configuration is untouched)."""
        from kubernetes import config
        return config.new_client_from_config(config_file=self.write_kubeconfig())

    # ------------------------------------------------------------------ test hooks

    def fail_image_pulls(self, *images: str) -> None:
        """Pods using these images stay Pending: ErrImagePull, then ImagePullBackOff."""
        self.kubelet.failing_images.update(images)
        self.kubelet.notify()

    def pull_images_slowly(self, *images: str) -> None:
        """Pods using these images stay Pending in ContainerCreating (a pull in progress)
        until :meth:`allow_image_pulls` lets the pull finish."""
        self.kubelet.slow_images.update(images)
        self.kubelet.notify()

    def allow_image_pulls(self, *images: str) -> None:
        """Undo :meth:`fail_image_pulls` and :meth:`pull_images_slowly` (all images when none
        given); waiting pods then start."""
        for held in (self.kubelet.failing_images, self.kubelet.slow_images):
            if images:
                held.difference_update(images)
            else:
                held.clear()
        self.kubelet.notify()

    def set_unschedulable(self, predicate: Callable[[dict], str | None] | None) -> None:
        """``predicate(pod) -> message | None``; a message keeps the pod Pending/Unschedulable."""
        self.kubelet.scheduler.predicate = predicate
        self.kubelet.notify()

    def evict_pod(self, namespace: str, name: str,
                  message: str = "The node was low on resource: memory. Threshold quantity: 100Mi, "
                                 "available: 50Mi.") -> None:
        """Node-pressure eviction: the pod is killed and ends Failed with reason Evicted (it is not deleted)."""
        self.kubelet.worker(namespace, name).fail("Evicted", message, self.settings.max_grace_seconds)

    def forbid(self, verb: str, resource: str, namespace: str | None = None) -> None:
        """Answer 403 Forbidden to ``verb`` on ``resource`` (e.g. "create", "pods" or "get", "pods/log")."""
        self.policy.forbid(verb, resource, namespace)

    def inject_errors(self, code: int = 429, count: int = 1, verb: str | None = None,
                      resource: str | None = None, retry_after: int | None = 1,
                      namespace: str | None = None) -> None:
        """Answer the next ``count`` matching requests with ``code`` (429, 500, 503, 504)."""
        self.policy.add_fault(Fault(code, count, verb, resource, retry_after, namespace))

    def record_pod_event(self, namespace: str, name: str, reason: str, message: str,
                         kind: str = "Normal", component: str = "cluster-autoscaler") -> None:
        """An Event about pod ``name``, as another component (the cluster autoscaler:
        ``TriggeredScaleUp`` / ``NotTriggerScaleUp``) would record it."""
        self.api.record_event(self.api.get(PODS, namespace, name), kind, reason, message,
                              component)

    def slow_requests(self, verb: str, resource: str, seconds: float):
        """Hold every ``verb`` ``resource`` request (e.g. "delete", "pods") ``seconds`` before
        answering it; the returned object's ``max_in_flight`` says how many overlapped."""
        self._http.router.delays.add(verb, resource, seconds)
        return self._http.router.delays

    def stall_log_streams(self, count: int = 1, after_lines: int = 1) -> None:
        """The next ``count`` followed log streams send ``after_lines`` lines, then nothing more,
        and stay open (a stream dropped silently on the way); :meth:`reset_hooks` ends them."""
        self._http.router.stalls.add(count, after_lines)

    def reset_hooks(self) -> None:
        """Clear forbidden rules, injected faults, failing images, the scheduling predicate
        and stalled log streams."""
        self._http.router.stalls.clear()
        self._http.router.delays.clear()
        self.policy.clear()
        self.allow_image_pulls()
        self.set_unschedulable(None)

    # ------------------------------------------------------------------ introspection

    @property
    def requests(self) -> list[RequestRecord]:
        return list(self._http.router.requests)

    def count_requests(self, verb: str | None = None, resource: str | None = None,
                       code: int | None = None, namespace: str | None = None) -> int:
        return sum(1 for r in self.requests if verb in (None, r.verb) and resource in (None, r.resource)
                   and code in (None, r.code) and namespace in (None, r.namespace))

    def running_pods(self) -> list[str]:
        """``namespace/name`` of pods whose worker (and so maybe a process/container) is still alive."""
        return sorted(f"{w.namespace}/{w.name}" for w in self.kubelet.workers() if w.alive())

    @property
    def resource_version(self) -> int:
        return self.store.resource_version
