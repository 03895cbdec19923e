"""Kubernetes settings: config keys parsed once, names, labels and quantities.

Owns turning the flat ``kubernetes_*`` config strings into checked values
(a bad value is a :class:`~fibrl.errors.ConfigError` naming the key and an
example), the RFC 1123 names and label values fibrl generates, the resource
quantities of a pod, and finding out whether this process runs in a pod
(:class:`PodIdentity`). It talks to no API server.

Value formats (kept simple so they fit an environment variable)::

    kubernetes_node_selector      "disktype=ssd,pool=gpu"
    kubernetes_labels             "team=rl,project=walker"
    kubernetes_env                "OMP_NUM_THREADS=1,WANDB_MODE=offline"
    kubernetes_image_pull_secrets "regcred,other-cred"
    kubernetes_tolerations        '[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]'
    kubernetes_mesh_annotations   "sidecar.istio.io/inject=false,linkerd.io/inject=disabled"
    kubernetes_listen_ports       "30000-30099" (or one port, "30000")
    kubernetes_image_pull_policy  "IfNotPresent" | "Always" | "Never"
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import string
from dataclasses import dataclass, field
from typing import Mapping, Optional

from ..._version import __version__
from ...config import Config
from ...errors import BackendError, ConfigError
from ..base import LABEL_BACKEND, LABEL_PARENT, LABEL_ROLE, LABEL_RUN

__all__ = ["KubeSettings", "PodIdentity", "parse_pairs", "parse_tolerations", "parse_names",
           "cpu_quantity", "memory_quantity", "port_range", "choose_port", "pod_image",
           "pod_name", "label_value", "OLDEST_KUBERNETES",
           "NEWEST_KUBERNETES", "LABEL_RUN", "LABEL_PARENT", "LABEL_ROLE", "LABEL_OWNER",
           "LABEL_BACKEND", "SECRET_KEY", "CONTAINER"]

# Kubernetes versions fibrl's manifests are checked against (tests/unit/test_manifests.py).
OLDEST_KUBERNETES = "1.28"
NEWEST_KUBERNETES = "1.37"

LABEL_OWNER = "fibrl.owner"        # one value per backend instance: what its watch selects
ANNOTATION_NAME = "fibrl.process-name"
RESERVED_LABELS = (LABEL_RUN, LABEL_PARENT, LABEL_ROLE, LABEL_OWNER, LABEL_BACKEND)
SECRET_KEY = "secret"
CONTAINER = "worker"

# Environment of every pod fibrl creates (downward API), and how a process finds its pod.
ENV_POD_NAME = "FIBRL_POD_NAME"
ENV_POD_NAMESPACE = "FIBRL_POD_NAMESPACE"
ENV_POD_UID = "FIBRL_POD_UID"
ENV_LISTEN_HOST = "FIBRL_LISTEN_HOST"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_DOCKER_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)b?$")
# The API server's quantity grammar (k8s.io/apimachinery resource.Quantity): binary Ki..Ei,
# decimal n u m "" k M G T P E (lower-case k only), or a decimal exponent.
_NUMBER = r"[+-]?(\d+(\.\d*)?|\.\d+)"
_KUBE_QUANTITY = re.compile(rf"^{_NUMBER}([KMGTPE]i|[numkMGTPE]|[eE]{_NUMBER})?$")
PULL_POLICIES = ("IfNotPresent", "Always", "Never")
_BINARY = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}
_SUFFIX_CHARS = string.ascii_lowercase + string.digits


# -- parsing the config strings ----------------------------------------------------------

def parse_pairs(text: str, key: str) -> dict:
    """``"a=1,b=2"`` -> ``{"a": "1", "b": "2"}``; a ConfigError naming ``key`` otherwise.

    Example:
        >>> parse_pairs("disktype=ssd, zone=a", "kubernetes_node_selector")
        {'disktype': 'ssd', 'zone': 'a'}
    """
    found: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(
                f"config {key}={text!r}: {item!r} is not name=value. Fix: write "
                f"comma-separated pairs, e.g. {key}='disktype=ssd,zone=a'.")
        found[name.strip()] = value.strip()
    return found


def parse_names(text: str, key: str) -> list:
    """``"regcred, other"`` -> ``["regcred", "other"]`` (each a valid object name)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
            raise ConfigError(
                f"config {key}={text!r}: {name!r} is not a valid kubernetes object name "
                f"(lower-case letters, digits, '-' and '.'). Fix the name, e.g. {key}='regcred'.")
    return names


def parse_tolerations(text: str, key: str = "kubernetes_tolerations") -> list:
    """A JSON list (or one object) of tolerations, each checked for known fields."""
    if not text.strip():
        return []
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config {key} is not JSON ({exc}): {text!r}. Fix: give a JSON list, e.g. "
            f"{key}='[{{\"key\": \"gpu\", \"operator\": \"Exists\", \"effect\": "
            f"\"NoSchedule\"}}]'.") from exc
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not all(isinstance(t, dict) for t in items):
        raise ConfigError(f"config {key} must be a JSON list of objects, got {text!r}.")
    for item in items:
        unknown = sorted(set(item) - _TOLERATION_KEYS)
        if unknown:
            raise ConfigError(
                f"config {key}: unknown toleration field(s) {unknown} in {item}. Valid fields: "
                f"{', '.join(sorted(_TOLERATION_KEYS))}.")
    return items


def _check_labels(labels: Mapping[str, str], key: str) -> dict:
    for name, value in labels.items():
        prefix, _, base = name.rpartition("/")
        if (not _LABEL_NAME.match(base) or len(base) > 63
                or (prefix and not _DNS_SUBDOMAIN.match(prefix))):
            raise ConfigError(f"config {key}: {name!r} is not a valid label key. Fix: letters, "
                              f"digits, '-', '_' and '.', at most 63 characters.")
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            raise ConfigError(f"config {key}: label value {value!r} of {name!r} is not valid. Fix: "
                              f"letters, digits, '-', '_' and '.', at most 63 characters, "
                              f"starting and ending with a letter or digit.")
    return dict(labels)


def _check_env(env: Mapping[str, str], key: str) -> dict:
    for name in env:
        if not _ENV_NAME.match(name):
            raise ConfigError(f"config {key}: {name!r} is not a valid environment variable name.")
        if name == "FIBRL_SECRET":
            raise ConfigError(f"config {key} may not set FIBRL_SECRET: fibrl passes the run's "
                              f"secret from a kubernetes Secret. Remove it from {key}.")
    return dict(env)


# -- quantities, names, labels -----------------------------------------------------------

def cpu_quantity(cpu: float) -> str:
    """Cores as a kubernetes quantity.

    Example:
        >>> cpu_quantity(0.5), cpu_quantity(2), cpu_quantity(1.25)
        ('500m', '2', '1250m')
    """
    millis = round(float(cpu) * 1000)
    if millis <= 0:
        raise ConfigError(f"cpu={cpu!r} is below one millicore. Fix: use cpu >= 0.001 (or 0 for "
                          f"no limit).")
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def memory_quantity(memory: str) -> str:
    """A memory size as a kubernetes quantity; docker-style ``512m``/``2g`` mean MiB/GiB.

    Example:
        >>> memory_quantity("512m"), memory_quantity("1.5g"), memory_quantity("2Gi")
        ('512Mi', '1536Mi', '2Gi')
    """
    text = str(memory).strip()
    match = _DOCKER_MEMORY.match(text)
    if match:
        size = int(float(match.group(1)) * _BINARY[match.group(2)])
        for suffix, unit in (("Gi", 1024 ** 3), ("Mi", 1024 ** 2), ("Ki", 1024)):
            if size and size % unit == 0:
                return f"{size // unit}{suffix}"
        return str(size)
    if _KUBE_QUANTITY.match(text):
        return text
    raise ConfigError(
        f"memory={memory!r} is not a size a kubernetes API server accepts (suffixes: k, M, G, "
        f"T, P, E, Ki, Mi, Gi, Ti, Pi, Ei; 'K' alone is not one). Fix: write e.g. '512m' or "
        f"'2g' (MiB, GiB, as docker reads them) or a kubernetes quantity such as '512Ki', "
        f"'512Mi' or '2Gi'.")


def pod_name(process_name: str, suffix: Optional[str] = None) -> str:
    """A valid, unique RFC 1123 pod name derived from a process name.

    Example:
        >>> pod_name("SpawnPoolWorker-1:2", suffix="x7k2p")
        'fibrl-spawnpoolworker-1-2-x7k2p'
    """
    base = re.sub(r"[^a-z0-9]+", "-", process_name.lower()).strip("-")[:40].rstrip("-")
    base = base or "worker"
    if not base.startswith("fibrl"):
        base = f"fibrl-{base}"
    suffix = suffix or "".join(secrets.choice(_SUFFIX_CHARS) for _ in range(5))
    return f"{base}-{suffix}"


def label_value(text: str) -> str:
    """``text`` made a valid label value (63 characters of ``[-_.A-Za-z0-9]``, alnum ends).

    Example:
        >>> label_value("Process-1:2")
        'Process-1-2'
    """
    value = re.sub(r"[^-A-Za-z0-9_.]+", "-", str(text))[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


# -- this process: a pod or not ------------------------------------------------------------

@dataclass(frozen=True)
class PodIdentity:
    """The pod this process runs in (empty fields when unknown).

    fibrl puts ``FIBRL_POD_NAME``/``_NAMESPACE``/``_UID`` (downward API) in every
    pod it creates; any other pod is recognised by its service account files.
    """

    name: str = ""
    namespace: str = ""
    uid: str = ""
    service_account: bool = False

    @property
    def in_pod(self) -> bool:
        return bool(self.name)

    @classmethod
    def detect(cls, environ: Mapping[str, str] = os.environ,
               sa_dir: str = SERVICE_ACCOUNT_DIR) -> "PodIdentity":
        has_sa = os.path.isfile(os.path.join(sa_dir, "token")) and bool(
            environ.get("KUBERNETES_SERVICE_HOST"))
        name = environ.get(ENV_POD_NAME) or (environ.get("HOSTNAME", "") if has_sa else "")
        namespace = environ.get(ENV_POD_NAMESPACE) or (_read(os.path.join(sa_dir, "namespace"))
                                                       if has_sa else "")
        return cls(name, namespace, environ.get(ENV_POD_UID, ""), has_sa)


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


# -- all of it, parsed once ----------------------------------------------------------------

@dataclass(frozen=True)
class KubeSettings:
    """The kubernetes keys of a :class:`~fibrl.config.Config`, parsed and checked."""

    namespace: str
    service_account: str
    kubeconfig: str
    node_selector: Mapping[str, str]
    tolerations: tuple
    image_pull_secrets: tuple
    labels: Mapping[str, str]
    env: Mapping[str, str]
    pending_timeout: float
    create_batch: int
    image_pull_policy: str = "IfNotPresent"
    run_as_user: int = 10001
    annotations: Mapping[str, str] = field(default_factory=dict)
    job_ttl: int = 3600
    allow_loopback: bool = False
    listen_ports: Optional[tuple] = None    # (first, last), inclusive; None: any port

    @classmethod
    def from_config(cls, config: Config) -> "KubeSettings":
        labels = _check_labels(parse_pairs(config.kubernetes_labels, "kubernetes_labels"),
                               "kubernetes_labels")
        clash = sorted(set(labels) & set(RESERVED_LABELS))
        if clash:
            raise ConfigError(f"config kubernetes_labels may not set fibrl's own labels {clash}; "
                              f"remove them.")
        selector = parse_pairs(config.kubernetes_node_selector, "kubernetes_node_selector")
        return cls(
            namespace=_namespace(config.kubernetes_namespace),
            service_account=config.kubernetes_service_account,
            kubeconfig=config.kubernetes_kubeconfig,
            node_selector=_check_labels(selector, "kubernetes_node_selector"),
            tolerations=tuple(parse_tolerations(config.kubernetes_tolerations)),
            image_pull_secrets=tuple(parse_names(config.kubernetes_image_pull_secrets,
                                                 "kubernetes_image_pull_secrets")),
            labels=labels,
            env=_check_env(parse_pairs(config.kubernetes_env, "kubernetes_env"), "kubernetes_env"),
            pending_timeout=_positive(config.kubernetes_pending_timeout,
                                      "kubernetes_pending_timeout"),
            create_batch=int(_positive(config.kubernetes_create_batch, "kubernetes_create_batch")),
            image_pull_policy=_pull_policy(config.kubernetes_image_pull_policy),
            run_as_user=_uid(config.kubernetes_run_as_user),
            annotations=parse_pairs(config.kubernetes_mesh_annotations,
                                    "kubernetes_mesh_annotations"),
            job_ttl=int(_positive(config.kubernetes_job_ttl, "kubernetes_job_ttl")),
            allow_loopback=bool(config.kubernetes_allow_loopback),
            listen_ports=port_range(config.kubernetes_listen_ports))


def port_range(text: str, key: str = "kubernetes_listen_ports") -> Optional[tuple]:
    """``"30000-30099"`` -> ``(30000, 30099)``; ``"30000"`` -> ``(30000, 30000)``; ``""`` -> None.

    Example:
        >>> port_range("30000-30099"), port_range(" 8470 "), port_range("")
        ((30000, 30099), (8470, 8470), None)
    """
    text = str(text).strip()
    if not text:
        return None
    match = re.match(r"^(\d{1,5})\s*(?:-\s*(\d{1,5}))?$", text)
    first, last = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    if not match or not 1024 <= first <= last <= 65535:
        raise ConfigError(
            f"config {key}={text!r} is not a port range. Fix: FIRST-LAST with 1024 <= FIRST <= "
            f"LAST <= 65535, e.g. {key}='30000-30099' (room for one port per parent process "
            f"and per Manager on the machine), or one port, or empty for any free port.")
    return first, last


def choose_port(host: str, ports: tuple) -> int:
    """A port of the inclusive range ``ports`` that nothing listens on at ``host``, tried
    from a random place in the range (parents sharing a machine spread over it).

    Raises:
        BackendError: every port of the range is taken.
    """
    first, last = ports
    count = last - first + 1
    start = secrets.randbelow(count)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = host.strip("[]")
    for step in range(count):
        port = first + (start + step) % count
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((bind_host, port))
            except OSError:
                continue
        return port
    raise BackendError(
        f"every port of kubernetes_listen_ports={first}-{last} is taken on {host}, so this "
        f"process cannot listen for its workers there. Fix: widen the range (and the "
        f"NetworkPolicy that admits it), or end the other fibrl parents on this machine.")


def pod_image(image: str) -> str:
    """The image fibrl's pods run for a configured ``image``: the stock default
    ``fibrl:latest`` becomes ``fibrl:<this fibrl's version>``. A ``:latest`` tag makes
    kubernetes' default pull policy Always (an image loaded into the nodes would be pulled
    again from a registry that lacks it), and the pods' fibrl must be the parent's.

    Example:
        >>> pod_image("fibrl:latest") == f"fibrl:{__version__}", pod_image("me/app:1")
        (True, 'me/app:1')
    """
    return f"fibrl:{__version__}" if image == Config().image else image


def _namespace(name: str) -> str:
    if len(name) > 63 or not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", name):
        raise ConfigError(f"config kubernetes_namespace={name!r} is not a valid namespace name "
                          f"(lower-case letters, digits and '-'). Fix it, e.g. "
                          f"kubernetes_namespace='default'.")
    return name


def _pull_policy(policy: str) -> str:
    if policy not in PULL_POLICIES:
        raise ConfigError(f"config kubernetes_image_pull_policy={policy!r} is not one of "
                          f"{', '.join(PULL_POLICIES)}. Fix: IfNotPresent (an image loaded into "
                          f"the nodes or pushed once), Always (a moving tag in a registry).")
    return policy


def _uid(uid: int) -> int:
    if uid < 0:
        raise ConfigError(f"config kubernetes_run_as_user must be a uid >= 0 (0: the image's "
                          f"own USER), got {uid}.")
    return int(uid)


def _positive(value: float, key: str) -> float:
    if value <= 0:
        raise ConfigError(f"config {key} must be > 0, got {value}.")
    return value
