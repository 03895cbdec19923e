"""What a real cluster's admission adds to the fake, driven by namespace labels.

* Pod Security (``pod-security.kubernetes.io/enforce: restricted``): a pod that
  does not meet the "restricted" standard is refused with the real 403
  (``violates PodSecurity "restricted:latest": ...``). A Job is still admitted;
  its controller's pod create fails and shows as a ``FailedCreate`` event.
* Istio sidecar injection (``istio-injection: enabled``): unless the pod opts
  out with the annotation ``sidecar.istio.io/inject: "false"``, an
  ``istio-proxy`` container that never exits is added, as istiod's webhook
  does. Its name sorts before most containers' names in ``containerStatuses``.

Only the checks of the restricted standard that a pod spec without volumes,
host namespaces or ports can fail are made.
"""
from __future__ import annotations

from ._meta import ApiError

ENFORCE = "pod-security.kubernetes.io/enforce"
ISTIO_INJECTION = "istio-injection"
ISTIO_OPT_OUT = "sidecar.istio.io/inject"
SIDECAR = "istio-proxy"
SIDECAR_IMAGE = "docker.io/istio/proxyv2:1.22.0"


def admit_pod(pod: dict, namespace_labels: dict) -> None:
    """Mutate (sidecar) then validate (Pod Security) ``pod``, as the admission chain does."""
    if namespace_labels.get(ISTIO_INJECTION) == "enabled":
        _inject_sidecar(pod)
    if namespace_labels.get(ENFORCE) == "restricted":
        violations = restricted_violations(pod["spec"])
        if violations:
            name = pod["metadata"].get("name") or pod["metadata"].get("generateName", "")
            raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: violates PodSecurity '
                                             f'"restricted:latest": {", ".join(violations)}',
                           {"name": name, "kind": "pods"})


def _inject_sidecar(pod: dict) -> None:
    annotations = pod["metadata"].get("annotations") or {}
    if annotations.get(ISTIO_OPT_OUT, "true").lower() == "false":
        return
    spec = pod["spec"]
    if any(c.get("name") == SIDECAR for c in spec["containers"]):
        return
    spec["containers"].append({
        "name": SIDECAR, "image": SIDECAR_IMAGE, "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-c", "import time\nwhile True: time.sleep(3600)"],
        "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
        "resources": {}, "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True, "runAsUser": 1337, "seccompProfile": {"type": "RuntimeDefault"}}})


def restricted_violations(spec: dict) -> list[str]:
    """The "restricted" checks ``spec`` fails, worded as the API server words them."""
    pod_ctx = spec.get("securityContext") or {}
    containers = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
    ctxs = {c.get("name", ""): c.get("securityContext") or {} for c in containers}
    found = []
    escalating = [n for n, c in ctxs.items() if c.get("allowPrivilegeEscalation") is not False]
    if escalating:
        found.append(f"allowPrivilegeEscalation != false ({_containers(escalating)} must set "
                     f"securityContext.allowPrivilegeEscalation=false)")
    capable = [n for n, c in ctxs.items()
               if "ALL" not in ((c.get("capabilities") or {}).get("drop") or [])]
    if capable:
        found.append(f"unrestricted capabilities ({_containers(capable)} must set "
                     f'securityContext.capabilities.drop=["ALL"])')
    root = [n for n, c in ctxs.items()
            if not c.get("runAsNonRoot", pod_ctx.get("runAsNonRoot", False))]
    if root:
        found.append(f"runAsNonRoot != true (pod or {_containers(root)} must set "
                     f"securityContext.runAsNonRoot=true)")
    if pod_ctx.get("runAsUser") == 0 or any(c.get("runAsUser") == 0 for c in ctxs.values()):
        found.append("runAsUser=0 (pod and containers must not set runAsUser=0)")
    unconfined = [n for n, c in ctxs.items()
                  if ((c.get("seccompProfile") or pod_ctx.get("seccompProfile") or {})
                      .get("type")) not in ("RuntimeDefault", "Localhost")]
    if unconfined:
        found.append(f"seccompProfile (pod or {_containers(unconfined)} must set "
                     f'securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")')
    return found


def _containers(names: list[str]) -> str:
    quoted = ", ".join(f'"{n}"' for n in names)
    return f"container {quoted}" if len(names) == 1 else f"containers {quoted}"
