"""The official ``kubernetes`` client, wrapped: connect, call with retries, explain errors.

Owns every request fibrl makes to an API server except the watch stream
(``watch``). A call is bounded twice: at most ``max_inflight`` requests are in
flight per :class:`Api` (500 workers ending at once do not become 500
concurrent DELETEs), and 429/5xx answers and lost connections are retried
with capped, jittered exponential backoff that honours ``Retry-After``, for
at most ``retry_for`` seconds. Other failures become a :class:`KubeApiError`
that says what happened, the likely cause, the evidence and the fix: no
cluster reachable, forbidden (naming the missing RBAC verbs and resources),
namespace missing, quota exceeded, manifest rejected.

Responses are read as plain JSON (``_preload_content=False``), not as client
model objects: cheaper for hundreds of pods, and the same dicts the
manifests are built as.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
import time
from typing import Any, Callable, Optional

from ...errors import BackendError, BackendUnavailableError
from .settings import KubeSettings, PodIdentity

__all__ = ["Api", "KubeApiError", "connect", "sdk", "RBAC_HINT", "REQUIRED_PERMISSIONS",
           "OPTIONAL_PERMISSIONS",
           "admission_denial"]

log = logging.getLogger(__name__)

RETRYABLE = frozenset({429, 500, 502, 503, 504})
# An API server that was just unreachable (restarted) may answer 403 for a while, before
# its authorizer has read the cluster's roles (seen on kube-apiserver 1.20): a 403 this
# soon after a failed connection is retried like a 503, until this much time has passed.
WARMUP_S = 30.0
RBAC_HINT = ("kubectl apply -f deploy/rbac.yaml (from the fibrl source tree; it creates the "
             "service account 'fibrl' and a Role with exactly what fibrl needs)")
# What a parent needs in its namespace: (verb, resource) as RBAC names them. No get or
# list of Secrets: workers run as the parent's account, and pods reference the run's
# Secret by name (the kubelet reads it), so reading Secrets would only widen access.
REQUIRED_PERMISSIONS = (
    ("create", "pods"), ("get", "pods"), ("list", "pods"), ("watch", "pods"),
    ("delete", "pods"), ("get", "pods/log"), ("create", "secrets"), ("delete", "secrets"))
# What a parent uses when it may (nothing fails without it): a pending pod's events show a
# node being added or an image being pulled, and keep its start deadline from ending it.
OPTIONAL_PERMISSIONS = (("list", "events"),)
_FORBIDDEN = re.compile(r'User "(?P<user>[^"]*)" cannot (?P<verb>\S+) resource "(?P<res>[^"]*)"'
                        r'(?: in API group "[^"]*")?')


def sdk():
    """The ``kubernetes`` package, or a BackendError saying how to install it."""
    try:
        import kubernetes
    except ImportError as exc:
        raise BackendUnavailableError(
            "the kubernetes backend needs the official kubernetes client, which is not "
            "installed. Fix: pip install 'fibrl[kubernetes]' (or choose another backend with "
            "fibrl.init(backend='local')).") from exc
    return kubernetes


class KubeApiError(BackendError):
    """An API request failed; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after   # seconds the server asked to wait (Retry-After)


class KubeUnreachableError(KubeApiError, BackendUnavailableError):
    """The API server did not answer at all (after retrying for a while)."""


# The last advice of the no-cluster errors; `fibrl run` drops it (it is what failed).
IN_CLUSTER_ADVICE = "launch the script inside the cluster with `fibrl run`"


# -- connecting -------------------------------------------------------------------------

def _default_kubeconfig() -> str:
    return os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or os.path.expanduser(
        "~/.kube/config")


def connect(settings: KubeSettings, identity: PodIdentity, pool_size: int = 32) -> Any:
    """An ``ApiClient`` from ``kubernetes_kubeconfig``, the in-cluster service account, or
    ``$KUBECONFIG`` / ``~/.kube/config``, in that order. The global client config is untouched.
    """
    kubernetes = sdk()
    cfg = kubernetes.client.Configuration()
    path = settings.kubeconfig
    if path and not os.path.isfile(path) and identity.service_account:
        log.debug("kubeconfig %s is not in this pod (a path of the parent's machine); using "
                  "the pod's service account", path)
        path = ""
    if not path and identity.service_account:
        _load(lambda: kubernetes.config.load_incluster_config(client_configuration=cfg),
              "the in-cluster service account")
    else:
        path = path or _default_kubeconfig()
        if not os.path.isfile(path):
            raise _no_config(path, bool(settings.kubeconfig))
        _load(lambda: kubernetes.config.load_kube_config(
            config_file=path, client_configuration=cfg, persist_config=False), path)
    cfg.connection_pool_maxsize = pool_size
    return kubernetes.client.ApiClient(cfg)


def _load(load: Callable[[], None], source: str) -> None:
    try:
        load()
    except Exception as exc:  # the loaders raise ConfigException, ValueError, OSError...
        raise BackendUnavailableError(
            f"cannot load the kubernetes client configuration from {source}: {exc}. Fix: check "
            f"it with `kubectl cluster-info`, or point kubernetes_kubeconfig at a working "
            f"kubeconfig.") from exc


def _no_config(path: str, explicit: bool) -> BackendError:
    if explicit:
        return BackendUnavailableError(
            f"kubernetes_kubeconfig={path!r} does not exist. Fix: give the path of a "
            f"kubeconfig (kubectl config view --raw > FILE), or leave it empty inside a cluster.")
    return BackendUnavailableError(
        f"no kubernetes cluster configured: this process does not run in a pod (no service "
        f"account token) and there is no kubeconfig at {path}. Fix: set kubernetes_kubeconfig "
        f"(fibrl.init(kubernetes_kubeconfig=...) or FIBRL_KUBERNETES_KUBECONFIG), export "
        f"KUBECONFIG, or {IN_CLUSTER_ADVICE}.")


# -- calling ----------------------------------------------------------------------------

class Api:
    """Bounded, retried requests to one API server, answered as JSON dicts.

    Example:
        >>> api = Api(connect(settings, PodIdentity.detect()))      # doctest: +SKIP
        >>> api.call("list", "pods", api.core.list_namespaced_pod, "default",
        ...          limit=1)                                    # doctest: +SKIP
        {'kind': 'PodList', ...}
    """

    def __init__(self, api_client: Any, *, max_inflight: int = 16, timeout: float = 30.0,
                 retry_for: float = 60.0) -> None:
        kubernetes = sdk()
        self.client = api_client
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.batch = kubernetes.client.BatchV1Api(api_client)
        self.authz = kubernetes.client.AuthorizationV1Api(api_client)
        self.host = api_client.configuration.host
        self.timeout = timeout
        self.retry_for = retry_for
        self.closed = threading.Event()
        self.throttled = 0                   # 429 answers seen (the creator slows down on them)
        self._unreachable_at = -WARMUP_S     # when a connection to the server last failed
        self._slots = threading.BoundedSemaphore(max_inflight)
        self.ApiException = kubernetes.client.exceptions.ApiException

    def call(self, verb: str, resource: str, fn: Callable, *args: Any,
             namespace: str = "", retry_for: Optional[float] = None, raw: bool = False,
             **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, retried on 429/5xx and lost connections.

        ``verb`` and ``resource`` (RBAC names, e.g. ``"create"``, ``"pods"``) only
        serve the error message. Returns the decoded JSON (``raw``: the body text).
        """
        deadline = time.monotonic() + (self.retry_for if retry_for is None else retry_for)
        attempt = 0
        while True:
            try:
                return self._once(fn, args, kwargs, raw)
            except self.ApiException as exc:
                retry = exc.status in RETRYABLE or self._warming_up(exc)
                if not retry or not self._backoff(attempt, deadline, exc):
                    raise api_error(exc, verb, resource, namespace, self) from exc
            except (OSError, _urllib3_errors()) as exc:
                self._unreachable_at = time.monotonic()
                if not self._backoff(attempt, deadline, exc):
                    raise unreachable(self.host, exc) from exc
            attempt += 1

    def _once(self, fn: Callable, args: tuple, kwargs: dict, raw: bool) -> Any:
        with self._slots:
            resp = fn(*args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
            try:
                data = resp.data
            finally:
                resp.release_conn()
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
        if raw:
            return text
        return json.loads(text) if text.strip() else {}

    def _warming_up(self, exc: Any) -> bool:
        """A 403 from a server that was unreachable less than ``WARMUP_S`` ago."""
        return exc.status == 403 and time.monotonic() - self._unreachable_at < WARMUP_S

    def _backoff(self, attempt: int, deadline: float, exc: Exception) -> bool:
        """Wait before the next attempt; False when there is no time (or we are closing)."""
        if getattr(exc, "status", None) == 429:
            self.throttled += 1
        delay = min(8.0, 0.2 * 2 ** attempt) * random.uniform(0.5, 1.0)
        delay = max(delay, _retry_after(exc))
        left = deadline - time.monotonic()
        if left <= 0 or self.closed.is_set():
            return False
        log.debug("kubernetes API answered %s; retrying in %.2f s", _brief(exc), min(delay, left))
        return not self.closed.wait(min(delay, left))

    def missing_permissions(self, namespace: str) -> list:
        """``["create pods", ...]``: what of :data:`REQUIRED_PERMISSIONS` we may not do.

        Asks the API server (SelfSubjectAccessReview); [] when it cannot say.
        """
        missing = []
        for verb, resource in REQUIRED_PERMISSIONS:
            name, _, sub = resource.partition("/")
            attrs = {"namespace": namespace, "verb": verb, "resource": name}
            if sub:
                attrs["subresource"] = sub
            body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                    "spec": {"resourceAttributes": attrs}}
            try:
                review = self._once(self.authz.create_self_subject_access_review, (body,), {},
                                    False)
            except Exception:  # no answer: the error keeps what the 403 itself said
                return []
            if not (review.get("status") or {}).get("allowed"):
                missing.append(f"{verb} {resource}")
        return missing


def _urllib3_errors() -> type[Exception]:
    import urllib3

    return urllib3.exceptions.HTTPError


def _retry_after(exc: Exception) -> float:
    headers = getattr(exc, "headers", None) or {}
    try:
        return min(30.0, float(headers.get("Retry-After", 0)))
    except (TypeError, ValueError):
        return 0.0


def _brief(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    return f"{status} {getattr(exc, 'reason', '')}".strip() if status else repr(exc)


# -- explaining failures ------------------------------------------------------------------

def status_message(exc: Any) -> str:
    """The ``message`` of the Status body of an ApiException (else its reason)."""
    try:
        return json.loads(exc.body).get("message") or exc.reason
    except (TypeError, ValueError, AttributeError):
        return str(getattr(exc, "reason", "") or exc)


def unreachable(host: str, exc: Exception) -> KubeApiError:
    return KubeUnreachableError(
        f"no kubernetes cluster reachable at {host}: {exc}. Likely cause: the cluster is down, "
        f"the kubeconfig points at another address, or a VPN or firewall is in the way. Fix: "
        f"check `kubectl cluster-info` with the same kubeconfig, set kubernetes_kubeconfig, or "
        f"{IN_CLUSTER_ADVICE}.")


def api_error(exc: Any, verb: str, resource: str, namespace: str, api: Api) -> KubeApiError:
    """Map an ApiException to an error with the likely cause and the fix."""
    status, message = exc.status, status_message(exc)
    where = f" in namespace {namespace!r}" if namespace else ""
    if status == 401:
        text = (f"the API server at {api.host} rejected fibrl's credentials (401 Unauthorized: "
                f"{message}). Likely cause: an expired token or client certificate. Fix: renew "
                f"the kubeconfig's credentials (does `kubectl get pods` work?).")
    elif status == 403 and "exceeded quota" in message:
        text = (f"cannot {verb} {resource}{where}: a ResourceQuota is exhausted ({message}). Fix: "
                f"ask fewer workers or smaller requests (cpu/memory/gpu), or raise the quota.")
    elif status in (400, 403) and admission_denial(message):
        text = (f"cannot {verb} {resource}{where}: the cluster's admission control refused it, "
                f"not RBAC ({message}). {admission_denial(message)}")
    elif status == 403:
        text = _forbidden(message, verb, resource, namespace, api)
    elif status == 404 and "namespaces" in message:
        text = (f"namespace {namespace!r} does not exist ({message}). Fix: kubectl create "
                f"namespace {namespace}, or set kubernetes_namespace to an existing one.")
    elif status == 422:
        text = (f"the API server rejected the {resource} manifest fibrl sent{where} (422 "
                f"Invalid: {message}). Likely cause: a config value (kubernetes_node_selector, "
                f"kubernetes_tolerations, kubernetes_labels, kubernetes_env, image, cpu, memory, "
                f"gpu). Fix that value.")
    else:
        text = (f"kubernetes API request '{verb} {resource}'{where} failed: {status} "
                f"{exc.reason}: {message}.")
    return KubeApiError(text, status, _retry_after(exc))


def admission_denial(message: str) -> str:
    """The likely cause and fix of a Pod Security or admission webhook denial ("" if
    ``message`` is neither): these are 403s too, but granting RBAC does not help."""
    if "violates PodSecurity" in message:
        return ("Likely cause: the namespace enforces a Pod Security standard (its label "
                "pod-security.kubernetes.io/enforce) that the pod does not meet. fibrl's pods "
                "meet \"restricted\" as long as kubernetes_run_as_user is a non-zero uid (or "
                "the image's USER is a numeric non-root uid); the message names the field. Fix: "
                "set that config, or run in a namespace whose standard the pod meets.")
    if "admission webhook" in message:
        return ("Likely cause: an admission webhook of the cluster (a policy engine such as "
                "Gatekeeper or Kyverno, or a service mesh) denied the pod; its message above "
                "says which rule. Fix: meet that rule (kubernetes_labels, "
                "kubernetes_mesh_annotations, image, resources) or ask the cluster's admins "
                "for an exception.")
    return ""


def _forbidden(message: str, verb: str, resource: str, namespace: str, api: Api) -> str:
    match = _FORBIDDEN.search(message)
    who = match.group("user") if match else "this identity"
    refused = f"{match.group('verb')} {match.group('res')}" if match else f"{verb} {resource}"
    missing = (api.missing_permissions(namespace) if namespace else []) or [refused]
    return (f"forbidden: {who} may not {refused} in namespace {namespace!r} (RBAC). Missing "
            f"permissions: {', '.join(missing)}. Evidence: {message}. Fix: grant them to the "
            f"identity the parent runs as: {RBAC_HINT}; in a pod, run it with "
            f"serviceAccountName 'fibrl' (fibrl run does).")
