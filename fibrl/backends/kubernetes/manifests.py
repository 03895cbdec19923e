"""The objects fibrl sends to kubernetes, as plain dicts: Secret, worker Pod, launcher Job.

Pure functions of their arguments: no API calls, no environment reads, so
tests validate every manifest against the official schemas
(``kubernetes-validate``, strict) without a cluster.

What every pod fibrl creates carries::

    labels       fibrl.run / fibrl.parent / fibrl.role / fibrl.owner / fibrl.backend (+ extra)
    env          the run's secret from a Secret (secretKeyRef), never a literal;
                 FIBRL_POD_NAME / _NAMESPACE / _UID and FIBRL_LISTEN_HOST (the pod IP)
                 from the downward API, so a worker can start workers of its own
    spec         restartPolicy Never; requests = limits for cpu, memory, nvidia.com/gpu;
                 ownerReferences to the parent pod when the parent runs in one;
                 imagePullPolicy kubernetes_image_pull_policy (IfNotPresent: an image
                 loaded with `kind load` is used, not pulled again)
    security     what the "restricted" Pod Security standard asks: runAsNonRoot, a
                 numeric runAsUser (kubernetes_run_as_user), seccomp RuntimeDefault; no
                 privilege escalation, every capability dropped
    annotations  kubernetes_mesh_annotations (default: no istio / linkerd sidecar, which
                 would keep a finished pod Running and intercept the workers' connections)
"""
from __future__ import annotations

import base64
from typing import Any, Mapping, Optional, Sequence

from ..base import JobSpec
from .settings import (ANNOTATION_NAME, CONTAINER, ENV_LISTEN_HOST, ENV_POD_NAME, ENV_POD_NAMESPACE,
                       ENV_POD_UID, LABEL_BACKEND, LABEL_ROLE, LABEL_RUN, SECRET_KEY, KubeSettings,
                       PodIdentity, cpu_quantity, label_value, memory_quantity)

__all__ = ["secret_manifest", "worker_pod", "launcher_job", "owner_reference", "resources",
           "launcher_labels", "GPU_RESOURCE", "TERMINATION_GRACE", "LAUNCHER_CONTAINER"]

GPU_RESOURCE = "nvidia.com/gpu"
LAUNCHER_CONTAINER = "main"
TERMINATION_GRACE = 10  # seconds between SIGTERM and SIGKILL when a pod is deleted
_DOWNWARD = ((ENV_POD_NAME, "metadata.name"), (ENV_POD_NAMESPACE, "metadata.namespace"),
             (ENV_POD_UID, "metadata.uid"), (ENV_LISTEN_HOST, "status.podIP"))


def owner_reference(identity: PodIdentity) -> dict:
    """An ownerReferences entry naming the pod ``identity`` (the cluster deletes dependents)."""
    return {"apiVersion": "v1", "kind": "Pod", "name": identity.name, "uid": identity.uid}


def _metadata(name: str, namespace: str, labels: Mapping[str, str],
              owner: Optional[dict], annotations: Optional[dict] = None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": {k: label_value(v) for k, v in labels.items()}}
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner:
        meta["ownerReferences"] = [dict(owner)]
    return meta


def secret_manifest(name: str, namespace: str, secret_hex: str, labels: Mapping[str, str],
                    owner: Optional[dict] = None) -> dict:
    """The run's secret as an immutable Secret (pods read it through ``secretKeyRef``)."""
    data = base64.b64encode(secret_hex.encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
            "metadata": _metadata(name, namespace, labels, owner),
            "data": {SECRET_KEY: data}}


def resources(cpu: float, memory: str, gpu: int) -> dict:
    """Requests equal to limits for cpu, memory and ``nvidia.com/gpu`` (none when all unset)."""
    limits: dict = {}
    if cpu:
        limits["cpu"] = cpu_quantity(cpu)
    if memory:
        limits["memory"] = memory_quantity(memory)
    if gpu:
        limits[GPU_RESOURCE] = str(int(gpu))
    return {"requests": dict(limits), "limits": limits} if limits else {}


def _env(values: Mapping[str, str], secret_name: Optional[str] = None) -> list:
    env = [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
           for name, path in _DOWNWARD if name not in values]
    env += [{"name": k, "value": str(v)} for k, v in values.items() if k != "FIBRL_SECRET"]
    if secret_name:
        env.append({"name": "FIBRL_SECRET", "valueFrom": {"secretKeyRef": {
            "name": secret_name, "key": SECRET_KEY}}})
    return env


def _pod_security(settings: KubeSettings) -> dict:
    context: dict = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if settings.run_as_user:
        context["runAsUser"] = settings.run_as_user
        context["runAsGroup"] = settings.run_as_user
    return context


def _container(name: str, image: str, command: Sequence[str], env: list, resources_: dict,
               settings: KubeSettings) -> dict:
    return {"name": name, "image": image, "imagePullPolicy": settings.image_pull_policy,
            "command": [str(a) for a in command], "env": env, "resources": resources_,
            "securityContext": {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}}}


def _pod_spec(settings: KubeSettings, container: dict, service_account: str) -> dict:
    spec: dict = {"restartPolicy": "Never", "enableServiceLinks": False,
                  "terminationGracePeriodSeconds": TERMINATION_GRACE, "containers": [container],
                  "securityContext": _pod_security(settings)}
    if service_account:
        spec["serviceAccountName"] = service_account
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        spec["tolerations"] = [dict(t) for t in settings.tolerations]
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in settings.image_pull_secrets]
    return spec


def worker_pod(spec: JobSpec, settings: KubeSettings, *, name: str, namespace: str, image: str,
               secret_name: str, labels: Mapping[str, str], owner: Optional[dict] = None,
               workdir: str = "", service_account: Optional[str] = None) -> dict:
    """The Pod of one worker: ``spec.command`` in ``image``, restartPolicy Never.

    ``service_account`` (None: ``settings.service_account``) is the pod's.
    """
    container = _container(CONTAINER, image, spec.command,
                           _env({**settings.env, **spec.env}, secret_name),
                           resources(spec.cpu, spec.memory, spec.gpu), settings)
    if workdir:
        container["workingDir"] = workdir
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": _metadata(name, namespace, {**settings.labels, **labels}, owner,
                                  {**settings.annotations, ANNOTATION_NAME: spec.name}),
            "spec": _pod_spec(settings, container, settings.service_account
                              if service_account is None else service_account)}


def launcher_labels(run_id: str) -> dict:
    """Labels of the pod that runs a ``fibrl run`` script (the run's parent)."""
    return {LABEL_RUN: run_id, LABEL_ROLE: "parent", LABEL_BACKEND: "kubernetes"}


def launcher_job(*, name: str, namespace: str, run_id: str, image: str, command: Sequence[str],
                 env: Mapping[str, str], settings: KubeSettings, service_account: str,
                 cpu: float = 0.0, memory: str = "", gpu: int = 0) -> dict:
    """The Job of ``fibrl run``: one pod, no retries, running ``command`` as the parent.

    Its environment makes the script's workers pods of the same run in the same
    namespace (``FIBRL_BACKEND``, ``FIBRL_RUN_ID``, ``FIBRL_KUBERNETES_NAMESPACE``)
    reachable at the pod IP (``FIBRL_LISTEN_HOST``).
    """
    values = {"FIBRL_BACKEND": "kubernetes", "FIBRL_RUN_ID": run_id,
              "FIBRL_KUBERNETES_NAMESPACE": namespace, **env}
    container = _container(LAUNCHER_CONTAINER, image, command, _env(values),
                           resources(cpu, memory, gpu), settings)
    labels = {**settings.labels, **launcher_labels(run_id)}
    template = {"metadata": {"labels": {k: label_value(v) for k, v in labels.items()}},
                "spec": _pod_spec(settings, container, service_account)}
    if settings.annotations:
        template["metadata"]["annotations"] = dict(settings.annotations)
    # ttlSecondsAfterFinished: a parent that crashed (or was OOM-killed) deletes nothing; the
    # TTL controller then removes the Job, and with it its pod, whose dependents (worker pods,
    # the run's Secret) the garbage collector removes in turn.
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _metadata(name, namespace, labels, None),
            "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": settings.job_ttl,
                     "template": template}}
