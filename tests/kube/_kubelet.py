"""Scheduler and kubelet of the fake's single node.

For every pod the store reports ADDED, :class:`Kubelet` starts a
:class:`PodWorker` thread that walks the pod through its real lifecycle:

1. schedule: bind to the node, or stay Pending with ``PodScheduled=False``
   (reason Unschedulable) until resources free up;
2. prepare: resolve env (secrets, config maps, downward API) and "pull"
   images; failures leave the container waiting with
   CreateContainerConfigError / ErrImagePull -> ImagePullBackOff;
3. run: one :class:`ContainerLoop` thread per container starts it through a
   runtime (:mod:`._runtime`), blocks on its exit, records
   running/terminated states and applies ``restartPolicy``;
4. finish: release node resources and, if the pod was being deleted, let the
   API server remove it (``deletionGracePeriodSeconds=0``).

Every status change is a single ``Store.update`` computing the pod phase
and conditions from the container states. Workers block on a condition
the kubelet notifies on every store event, so nothing polls.
"""
from __future__ import annotations

import base64
import copy
import logging
import math
import os
import re
import threading
from decimal import Decimal
from typing import Callable

from kubernetes.utils import parse_quantity

from ._api import Api
from ._meta import CONFIGMAPS, PODS, SECRETS, ApiError, bad_request, not_found, rfc3339
from ._runtime import (ContainerConfig, DockerContainer, ExitInfo, LogBuffer, ProcessContainer, StartError,
                       docker_image_exists)
from ._settings import Settings
from ._store import WatchEvent

log = logging.getLogger(__name__)
POD_IP = "127.0.0.1"     # where pods reach the API server (the pods' own IP is Settings.pod_ip)
_EXPANSION = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


class ConfigError(Exception):
    """The container's configuration cannot be resolved yet (CreateContainerConfigError)."""


class PullError(Exception):
    """The image cannot be pulled (ErrImagePull)."""


class Pulling(Exception):
    """The image is still being pulled (a slow registry, a large image)."""


# --------------------------------------------------------------------------- scheduler


def pod_requests(spec: dict) -> dict[str, Decimal]:
    totals: dict[str, Decimal] = {}
    for container in spec.get("containers") or []:
        for key, value in ((container.get("resources") or {}).get("requests") or {}).items():
            totals[key] = totals.get(key, Decimal(0)) + parse_quantity(value)
    return totals


class Scheduler:
    """Fits pods on the one node by requests, node selector and a test predicate."""

    def __init__(self, settings: Settings):
        self._settings = settings
        self._bound: dict[str, dict[str, Decimal]] = {}
        self._lock = threading.Lock()
        self.predicate: Callable[[dict], str | None] | None = None

    def try_bind(self, pod: dict) -> str | None:
        """``None`` when bound, else the FailedScheduling message."""
        spec, uid = pod.get("spec") or {}, pod["metadata"]["uid"]
        labels = self._settings.node_labels
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
            return ("0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector. "
                    "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.")
        if self.predicate and (message := self.predicate(pod)):
            return message
        requests = pod_requests(spec)
        with self._lock:
            reasons = self._insufficient(requests)
            if not reasons:
                self._bound[uid] = requests
                return None
        return (f"0/1 nodes are available: {', '.join('1 ' + r for r in reasons)}. preemption: 0/1 nodes are "
                f"available: 1 No preemption victims found for incoming pod.")

    def _insufficient(self, requests: dict[str, Decimal]) -> list[str]:
        capacity = {k: parse_quantity(v) for k, v in self._settings.node_capacity.items()}
        if len(self._bound) + 1 > capacity.get("pods", Decimal(110)):
            return ["Too many pods"]
        reasons = []
        for key, wanted in sorted(requests.items()):
            used = sum((r.get(key, Decimal(0)) for r in self._bound.values()), Decimal(0))
            if wanted > 0 and used + wanted > capacity.get(key, Decimal(0)):
                reasons.append(f"Insufficient {key}")
        return reasons

    def release(self, uid: str) -> None:
        with self._lock:
            self._bound.pop(uid, None)


# --------------------------------------------------------------------------- pod status


def set_condition(status: dict, kind: str, value: str, reason: str | None = None,
                  message: str | None = None) -> None:
    conditions = status.setdefault("conditions", [])
    old = next((c for c in conditions if c["type"] == kind), None)
    condition = {"type": kind, "status": value, "lastProbeTime": None,
                 "lastTransitionTime": old["lastTransitionTime"] if old and old["status"] == value else rfc3339()}
    if reason:
        condition["reason"] = reason
    if message:
        condition["message"] = message
    if old:
        conditions[conditions.index(old)] = condition
    else:
        conditions.append(condition)


def _restarting(cs: dict) -> bool:
    return "waiting" in cs["state"] and ("terminated" in cs.get("lastState", {}) or cs.get("restartCount", 0))


def pod_phase(statuses: list[dict]) -> str:
    states = [cs["state"] for cs in statuses]
    if any("running" in s for s in states) or any(_restarting(cs) for cs in statuses):
        return "Running"
    if not states or any("waiting" in s for s in states):
        return "Pending"
    return "Succeeded" if all(s["terminated"]["exitCode"] == 0 for s in states) else "Failed"


def refresh_pod_status(pod: dict) -> None:
    """Phase and readiness conditions derived from the container statuses."""
    status = pod["status"]
    statuses = status.get("containerStatuses") or []
    if status.get("reason") in ("Evicted", "DeadlineExceeded"):
        status["phase"] = "Failed"
    else:
        status["phase"] = pod_phase(statuses)
    terminal = status["phase"] in ("Succeeded", "Failed")
    for cs in statuses:
        cs["ready"] = cs["started"] = "running" in cs["state"]
    unready = [cs["name"] for cs in statuses if not cs["ready"]]
    if terminal:
        for kind in ("Ready", "ContainersReady"):
            set_condition(status, kind, "False", "PodCompleted")
        set_condition(status, "PodReadyToStartContainers", "False")
        if any(c["type"] == "Initialized" for c in status["conditions"]):
            set_condition(status, "Initialized", "True", "PodCompleted")
    elif unready:
        message = f"containers with unready status: [{' '.join(unready)}]"
        for kind in ("Ready", "ContainersReady"):
            set_condition(status, kind, "False", "ContainersNotReady", message)
    else:
        for kind in ("Ready", "ContainersReady"):
            set_condition(status, kind, "True")
    order = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled",
             "DisruptionTarget")
    status["conditions"].sort(key=lambda c: order.index(c["type"]) if c["type"] in order else len(order))


def _container_status(container: dict, state: dict, restart_count: int = 0, last: dict | None = None,
                      container_id: str = "") -> dict:
    image = container["image"]
    cs = {"name": container["name"], "state": state, "lastState": last or {}, "ready": False,
          "restartCount": restart_count, "image": image if "/" in image else f"docker.io/library/{image}",
          "imageID": "", "started": False}
    if container_id:
        cs["containerID"] = container_id
        cs["imageID"] = cs["image"].split(":")[0] + "@sha256:" + "0" * 64
        mounts = [{"name": m["name"], "mountPath": m["mountPath"],
                   **({"readOnly": True, "recursiveReadOnly": "Disabled"} if m.get("readOnly") else {})}
                  for m in container.get("volumeMounts") or []]
        if mounts:
            cs["volumeMounts"] = mounts
    return cs


def _terminated_state(info: ExitInfo, container_id: str) -> dict:
    state = {"exitCode": info.exit_code, "reason": info.reason, "startedAt": info.started_at,
             "finishedAt": info.finished_at}
    if info.signal:
        state["signal"] = info.signal
    if info.message:
        state["message"] = info.message
    if container_id:
        state["containerID"] = container_id
    return {"terminated": state}


# --------------------------------------------------------------------------- environment


def _expand(text: str, env: dict) -> str:
    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _EXPANSION.sub(replace, text)


def _pod_field(pod: dict, path: str, pod_ip: str) -> str:
    meta, spec = pod["metadata"], pod.get("spec") or {}
    if match := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    values = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
              "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
              "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": pod_ip, "status.hostIPs": pod_ip}
    if path not in values:
        raise ConfigError(f"unsupported fieldPath: {path}")
    return values[path]


def _resource_field(container: dict, ref: dict, capacity: dict) -> str:
    kind, _, name = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(name) or capacity.get(name, "0")
    divisor = parse_quantity(ref.get("divisor") or "1")
    return str(math.ceil(parse_quantity(value) / divisor))


class EnvResolver:
    """Builds a container's environment from the pod spec and stored objects."""

    def __init__(self, api: Api, settings: Settings, api_port: int):
        self._api, self._settings, self._port = api, settings, api_port

    def _lookup(self, kind: str, namespace: str, ref: dict) -> dict | None:
        rt = SECRETS if kind == "Secret" else CONFIGMAPS
        try:
            obj = self._api.get(rt, namespace, ref.get("name", ""))
        except ApiError as exc:
            if ref.get("optional"):
                return None
            raise ConfigError(f'{"secret" if kind == "Secret" else "configmap"} "{ref.get("name")}" not found') from exc
        data = dict(obj.get("data") or {})
        if kind == "Secret":
            data = {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in data.items()}
        return data

    def _key_ref(self, kind: str, namespace: str, ref: dict) -> str | None:
        data = self._lookup(kind, namespace, ref)
        if data is None:
            return None
        if ref.get("key") not in data:
            if ref.get("optional"):
                return None
            raise ConfigError(f"couldn't find key {ref.get('key')} in {kind} {namespace}/{ref.get('name')}")
        return data[ref["key"]]

    def _value_from(self, pod: dict, container: dict, source: dict) -> str | None:
        namespace = pod["metadata"]["namespace"]
        if "secretKeyRef" in source:
            return self._key_ref("Secret", namespace, source["secretKeyRef"])
        if "configMapKeyRef" in source:
            return self._key_ref("ConfigMap", namespace, source["configMapKeyRef"])
        if "fieldRef" in source:
            return _pod_field(pod, source["fieldRef"]["fieldPath"], self._settings.pod_ip)
        if "resourceFieldRef" in source:
            return _resource_field(container, source["resourceFieldRef"], self._settings.node_capacity)
        raise ConfigError(f"unsupported valueFrom: {sorted(source)}")

    def resolve(self, pod: dict, container: dict, process_mode: bool) -> dict:
        env: dict[str, str] = {}
        if process_mode:
            env.update({k: os.environ[k] for k in self._settings.host_env if k in os.environ})
            env.update(self._settings.image_env)
        env.update({"HOSTNAME": pod["metadata"]["name"], "KUBERNETES_SERVICE_HOST": POD_IP,
                    "KUBERNETES_SERVICE_PORT": str(self._port), "KUBERNETES_PORT": f"tcp://{POD_IP}:{self._port}"})
        namespace = pod["metadata"]["namespace"]
        for source in container.get("envFrom") or []:
            kind, ref = ("Secret", source["secretRef"]) if "secretRef" in source else \
                ("ConfigMap", source.get("configMapRef") or {})
            data = self._lookup(kind, namespace, ref) or {}
            env.update({source.get("prefix", "") + k: v for k, v in data.items()})
        for var in container.get("env") or []:
            if "valueFrom" in var and var["valueFrom"]:
                value = self._value_from(pod, container, var["valueFrom"])
                if value is not None:
                    env[var["name"]] = value
            else:
                env[var["name"]] = _expand(var.get("value") or "", env)
        return env


# --------------------------------------------------------------------------- workers


class ContainerLoop(threading.Thread):
    """Runs one container, restarting it as the pod's restartPolicy says."""

    def __init__(self, worker: "PodWorker", container: dict, config: ContainerConfig, runtime: str):
        super().__init__(name=f"container {config.pod_key}/{config.name}", daemon=True)
        self.worker, self.container, self.config, self.runtime = worker, container, config, runtime
        self.current: LogBuffer | None = None
        self.previous: LogBuffer | None = None
        self._handle = None
        self._lock = threading.Lock()

    def _new_handle(self):
        if self.runtime == "docker":
            return DockerContainer(self.config)
        settings = self.worker.kubelet.settings
        return ProcessContainer(self.config, settings.python, settings.workdir or os.getcwd())

    def terminate(self, grace: float) -> None:
        with self._lock:
            handle = self._handle
        if handle is not None:
            handle.terminate(grace)

    def _run_once(self, restarts: int, last: dict | None) -> tuple[ExitInfo, str]:
        handle = self._new_handle()
        name, image = self.config.name, self.config.image
        self.worker.record("Normal", "Pulled", f'Container image "{image}" already present on machine', name)
        self.worker.record("Normal", "Created", f"Created container: {name}", name)
        with self._lock:
            self.previous, self.current, self._handle = self.current, handle.log, handle
        try:
            handle.start()
        except StartError as exc:
            now = rfc3339()
            return ExitInfo(128, "StartError", now, now, message=str(exc)), ""
        if self.worker.stopping.is_set():
            handle.terminate(self.worker.grace)
        self.worker.set_container_state(self.container, {"running": {"startedAt": rfc3339()}},
                                        restarts, last, handle.container_id)
        self.worker.record("Normal", "Started", f"Started container {self.config.name}", self.config.name)
        return handle.wait(), handle.container_id

    def run(self) -> None:
        restarts, last, delay = 0, None, self.worker.kubelet.settings.crash_backoff_seconds
        while not self.worker.stopping.is_set():
            info, container_id = self._run_once(restarts, last)
            terminated = _terminated_state(info, container_id)
            if self.worker.stopping.is_set() or not self._should_restart(info.exit_code):
                self.worker.set_container_state(self.container, terminated, restarts, last, container_id)
                return
            last = terminated
            self.worker.set_container_state(self.container, {"waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container={self.config.name} "
                           f"pod={self.worker.name}_{self.worker.namespace}({self.worker.uid})"}},
                restarts, last, container_id)
            if self.worker.stopping.wait(delay):
                return
            restarts, delay = restarts + 1, min(delay * 2, 5.0)

    def _should_restart(self, exit_code: int) -> bool:
        policy = self.worker.restart_policy
        return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


class PodWorker:
    def __init__(self, kubelet: "Kubelet", pod: dict):
        meta = pod["metadata"]
        self.kubelet = kubelet
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.key = Api.key(PODS, self.namespace, self.name)
        self.restart_policy = pod["spec"].get("restartPolicy", "Always")
        self.stopping = threading.Event()
        self.grace = 0.0
        self.deleting = False
        self.finished = False       # _finish ran: a deletion arriving later must complete itself
        self._state_lock = threading.Lock()
        self.failure: tuple[str, str] | None = None     # (reason, message): Evicted, DeadlineExceeded
        self.loops: dict[str, ContainerLoop] = {}
        self._deadline: threading.Timer | None = None
        self._pull_reported = False
        self._thread = threading.Thread(target=self._run, name=f"pod {self.namespace}/{self.name}", daemon=True)

    # ------------------------------------------------------------------ control (other threads)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def request_termination(self, grace: float, deleting: bool = True) -> None:
        with self._state_lock:
            newly_deleting = deleting and not self.deleting
            self.deleting = self.deleting or deleting
            finished = self.finished
        if finished:
            # The containers ended before the deletion reached the kubelet (it
            # is queued behind other events): nothing is left to stop, so let
            # the API server remove the pod now, as the real kubelet does.
            if newly_deleting:
                self._confirm_deletion()
            return
        if self.stopping.is_set() and grace >= self.grace:
            return
        self.grace = min(grace, self.kubelet.settings.max_grace_seconds)
        self.stopping.set()
        for loop in list(self.loops.values()):
            loop.terminate(self.grace)
        self.kubelet.notify()

    def fail(self, reason: str, message: str, grace: float) -> None:
        """Kubelet-initiated termination (eviction, deadline): the pod ends Failed but stays."""
        self.failure = (reason, message)
        self.update(lambda pod: set_condition(pod["status"], "DisruptionTarget", "True",
                                              "TerminationByKubelet", message))
        self.record("Warning", reason, message)
        self.request_termination(grace, deleting=False)

    # ------------------------------------------------------------------ status helpers

    def update(self, mutate: Callable[[dict], None]) -> dict | None:
        return self.kubelet.api.store.update(self.key, mutate)

    def record(self, kind: str, reason: str, message: str, container: str | None = None,
               component: str = "kubelet") -> None:
        pod = self.kubelet.api.store.get(self.key)
        if pod is not None:
            field = f"spec.containers{{{container}}}" if container else None
            self.kubelet.api.record_event(pod, kind, reason, message, component, field)

    def set_container_state(self, container: dict, state: dict, restarts: int = 0, last: dict | None = None,
                            container_id: str = "") -> None:
        def mutate(pod: dict) -> None:
            statuses = pod["status"].setdefault("containerStatuses", [])
            new = _container_status(container, state, restarts, last, container_id)
            index = next((i for i, cs in enumerate(statuses) if cs["name"] == container["name"]), None)
            if index is None:
                statuses.append(new)
            else:
                statuses[index] = new
            statuses.sort(key=lambda cs: cs["name"])   # as the kubelet orders them
            refresh_pod_status(pod)
        self.update(mutate)

    def _set_waiting(self, containers: list[dict], reason: str, message: str | None = None) -> None:
        state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        for container in containers:
            self.set_container_state(container, copy.deepcopy(state))

    # ------------------------------------------------------------------ lifecycle (own thread)

    def _run(self) -> None:
        try:
            if self._schedule() and (configs := self._prepare()):
                self._run_containers(configs)
        except Exception:   # a bug in the fake must not leave the pod silently stuck
            log.exception("pod worker %s/%s crashed", self.namespace, self.name)
        finally:
            self._finish()

    def _wait_for_change(self, generation: int) -> int:
        return self.kubelet.wait_for_change(generation, self.stopping)

    def _schedule(self) -> bool:
        reported, generation = None, self.kubelet.generation
        while not self.stopping.is_set():
            pod = self.kubelet.api.store.get(self.key)
            if pod is None:
                return False
            message = self.kubelet.scheduler.try_bind(pod)
            if message is None:
                self._bind()
                return True
            if message != reported:
                reported = message
                self.update(lambda p, message=message: set_condition(
                    p["status"], "PodScheduled", "False", "Unschedulable", message))
                self.record("Warning", "FailedScheduling", message, component="default-scheduler")
            generation = self._wait_for_change(generation)
        return False

    def _bind(self) -> None:
        node = self.kubelet.settings.node_name

        def mutate(pod: dict) -> None:
            pod["spec"]["nodeName"] = node
            set_condition(pod["status"], "PodScheduled", "True")
        self.update(mutate)
        self.record("Normal", "Scheduled", f"Successfully assigned {self.namespace}/{self.name} to {node}",
                    component="default-scheduler")

    def _prepare(self) -> list[tuple[dict, ContainerConfig, str]] | None:
        generation = self.kubelet.generation
        while not self.stopping.is_set():
            pod = self.kubelet.api.store.get(self.key)
            if pod is None:
                return None
            try:
                return [self.kubelet.container_config(pod, c) for c in pod["spec"]["containers"]]
            except PullError as exc:
                self._pull_backoff(pod, str(exc))
            except Pulling as exc:
                self._pulling(pod, str(exc))
            except ConfigError as exc:
                self._set_waiting(pod["spec"]["containers"], "CreateContainerConfigError", str(exc))
                self.record("Warning", "Failed", f"Error: {exc}")
            generation = self._wait_for_change(generation)
        return None

    def _pulling(self, pod: dict, image: str) -> None:
        # As a real kubelet shows a pull in progress: waiting ContainerCreating, one event.
        if self._pull_reported:
            return   # updating the pod again would wake this loop forever
        self._pull_reported = True
        self._set_waiting(pod["spec"]["containers"], "ContainerCreating")
        self.record("Normal", "Pulling", f'Pulling image "{image}"')

    def _pull_backoff(self, pod: dict, message: str) -> None:
        containers = pod["spec"]["containers"]
        image = message.split('"')[1] if '"' in message else ""
        self._set_waiting(containers, "ErrImagePull", message)
        self.record("Warning", "Failed", f"Failed to pull image \"{image}\": {message}")
        if self.stopping.wait(self.kubelet.settings.image_pull_backoff_seconds):
            return
        self._set_waiting(containers, "ImagePullBackOff", f'Back-off pulling image "{image}"')
        self.record("Normal", "BackOff", f'Back-off pulling image "{image}"')

    def _run_containers(self, configs: list[tuple[dict, ContainerConfig, str]]) -> None:
        def mutate(pod: dict) -> None:
            status = pod["status"]
            ip = self.kubelet.settings.pod_ip
            status.update(hostIP=ip, hostIPs=[{"ip": ip}], podIP=ip, podIPs=[{"ip": ip}],
                          startTime=status.get("startTime") or rfc3339())
            set_condition(status, "PodReadyToStartContainers", "True")
            set_condition(status, "Initialized", "True")
        self.update(mutate)
        self._set_waiting([c for c, _, _ in configs], "ContainerCreating")
        self.loops = {cfg.name: ContainerLoop(self, c, cfg, runtime) for c, cfg, runtime in configs}
        for loop in self.loops.values():
            loop.start()
        self._arm_deadline()
        for loop in self.loops.values():
            loop.join()

    def _arm_deadline(self) -> None:
        pod = self.kubelet.api.store.get(self.key) or {}
        seconds = (pod.get("spec") or {}).get("activeDeadlineSeconds")
        if seconds:
            self._deadline = threading.Timer(seconds, self.fail, args=(
                "DeadlineExceeded", "Pod was active on the node longer than the specified deadline", 0))
            self._deadline.daemon = True
            self._deadline.start()

    def _finish(self) -> None:
        if self._deadline:
            self._deadline.cancel()
        self.kubelet.scheduler.release(self.uid)
        if self.failure:
            reason, message = self.failure

            def mark_failed(pod: dict) -> None:
                pod["status"].update(reason=reason, message=message)
                refresh_pod_status(pod)
            self.update(mark_failed)
        with self._state_lock:
            self.finished = True
            deleting = self.deleting
        if deleting:
            self._confirm_deletion()
        self.kubelet.notify()

    def _confirm_deletion(self) -> None:
        self.update(lambda pod: pod["metadata"].update(deletionGracePeriodSeconds=0)
                    if pod["metadata"].get("deletionTimestamp") else None)


class Kubelet:
    def __init__(self, api: Api, settings: Settings, api_port: int, docker_ok: Callable[[], bool]):
        self.api, self.settings = api, settings
        self.scheduler = Scheduler(settings)
        self.env = EnvResolver(api, settings, api_port)
        self.failing_images: set[str] = set()
        self.slow_images: set[str] = set()
        self._docker_ok = docker_ok
        self._images: dict[str, bool] = {}
        self._workers: dict[str, PodWorker] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self.generation = 0

    # ------------------------------------------------------------------ events (controller thread)

    def on_event(self, event: WatchEvent) -> None:
        if event.resource == PODS.plural:
            self._on_pod_event(event)
        self.notify()

    def _on_pod_event(self, event: WatchEvent) -> None:
        meta = event.obj["metadata"]
        with self._lock:
            worker = self._workers.get(meta["uid"])
            if event.type == "ADDED" and worker is None:
                worker = self._workers[meta["uid"]] = PodWorker(self, event.obj)
                worker.start()
                return
        if worker is None:
            return
        if event.type == "DELETED":
            worker.request_termination(0)
            with self._lock:
                self._workers.pop(meta["uid"], None)
        elif meta.get("deletionTimestamp"):
            worker.request_termination(meta.get("deletionGracePeriodSeconds") or 0)

    def notify(self) -> None:
        with self._changed:
            self.generation += 1
            self._changed.notify_all()

    def wait_for_change(self, generation: int, stop: threading.Event) -> int:
        with self._changed:
            self._changed.wait_for(lambda: self.generation != generation or stop.is_set())
            return self.generation

    # ------------------------------------------------------------------ containers

    def _runtime_for(self, image: str, policy: str = "IfNotPresent") -> str:
        mode = self.settings.runtime
        if image in self.failing_images:
            raise PullError(_pull_message(image))
        if policy == "Always" and not self._in_registry(image):
            # Always pulls, even an image loaded into the node (kind load, minikube image load).
            raise PullError(_pull_message(image))
        if image in self.slow_images:
            raise Pulling(image)
        if mode == "process":
            return "process"
        available = self._docker_ok() and self._image_present(image)
        if mode == "docker" and not available:
            raise PullError(_pull_message(image))
        return "docker" if available else "process"

    def _in_registry(self, image: str) -> bool:
        registry = self.settings.registry
        return registry is None or any(image.startswith(prefix) for prefix in registry)

    def _image_present(self, image: str) -> bool:
        image = self.settings.node_images.get(image, image)
        if not self._images.get(image):
            self._images[image] = docker_image_exists(image)
        return self._images[image]

    def container_config(self, pod: dict, container: dict) -> tuple[dict, ContainerConfig, str]:
        runtime = self._runtime_for(container["image"], container.get("imagePullPolicy", "IfNotPresent"))
        env = self.env.resolve(pod, container, process_mode=runtime == "process")
        command = container.get("command")
        if command is None and runtime == "process":
            command = self.settings.image_commands.get(container["image"])
        limits = (container.get("resources") or {}).get("limits") or {}
        config = ContainerConfig(
            pod_key=f"{pod['metadata']['namespace']}/{pod['metadata']['name']}", name=container["name"],
            image=self.settings.node_images.get(container["image"], container["image"]), command=[_expand(a, env) for a in command] if command else None,
            args=[_expand(a, env) for a in container.get("args") or []] or None, env=env,
            working_dir=container.get("workingDir"), server=self.settings.instance,
            memory_limit=int(parse_quantity(limits["memory"])) if "memory" in limits else None,
            cpu_limit=float(parse_quantity(limits["cpu"])) if "cpu" in limits else None)
        return container, config, runtime

    # ------------------------------------------------------------------ hooks / queries

    def workers(self) -> list[PodWorker]:
        with self._lock:
            return list(self._workers.values())

    def worker(self, namespace: str, name: str) -> PodWorker:
        pod = self.api.get(PODS, namespace, name)
        with self._lock:
            worker = self._workers.get(pod["metadata"]["uid"])
        if worker is None:
            raise not_found(PODS, name)
        return worker

    def logs(self, namespace: str, name: str, container: str | None, previous: bool) -> LogBuffer:
        pod = self.api.get(PODS, namespace, name)
        names = [c["name"] for c in pod["spec"]["containers"]]
        if container is None:
            if len(names) != 1:
                raise bad_request(f"a container name must be specified for pod {name}, choose one of: "
                                  f"[{' '.join(names)}]")
            container = names[0]
        if container not in names:
            raise bad_request(f"container {container} is not valid for pod {name}")
        with self._lock:
            worker = self._workers.get(pod["metadata"]["uid"])
        loop = worker.loops.get(container) if worker else None
        buffer = (loop.previous if previous else loop.current) if loop else None
        if buffer is not None:
            return buffer
        if previous:
            raise bad_request(f'previous terminated container "{container}" in pod "{name}" not found')
        raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: '
                          f'{_waiting_reason(pod, container)}')

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.request_termination(0, deleting=False)
        for worker in workers:
            worker.join(timeout)
        for worker in workers:
            for loop in worker.loops.values():
                loop.join(timeout)


def _pull_message(image: str) -> str:
    ref = image if "/" in image else f"docker.io/library/{image}"
    return (f'rpc error: code = NotFound desc = failed to pull and unpack image "{ref}": failed to resolve '
            f'reference "{ref}": {ref}: not found')


def _waiting_reason(pod: dict, container: str) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs["name"] == container and "waiting" in cs["state"]:
            reason = cs["state"]["waiting"].get("reason", "ContainerCreating")
            return "trying and failing to pull image" if reason in ("ErrImagePull", "ImagePullBackOff") else reason
    return "ContainerCreating"
