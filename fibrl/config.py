"""Configuration: one frozen object, resolved from four sources.

Precedence, strongest first: keyword arguments (``fibrl.init(**kw)``),
``FIBRL_<KEY>`` environment variables, a ``.fibrlconfig`` file (``key = value``
lines, optionally under a ``[fibrl]`` header) in the current directory, and the
defaults below. Unknown keys are rejected with the closest valid ones; values
from text sources are parsed to the field's type (``FIBRL_DEBUG=false`` is
``False``).

This module owns parsing and validation only. The config in force is kept by
``fibrl.hosting.runtime`` (set through ``fibrl.init`` or the default context); the
parent hands its config to every worker it starts. The backend names are
``fibrl.backends.base``'s.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

__all__ = ["Config", "resolve", "BACKENDS", "CLUSTER_BACKENDS"]

#: The backends a config may name (``fibrl.backends`` has one implementation of each).
BACKENDS = ("local", "docker", "kubernetes")
#: What ``fibrl run``, ``ps`` and ``stop`` act on.
CLUSTER_BACKENDS = ("kubernetes", "docker")

CONFIG_FILE = ".fibrlconfig"
ENV_PREFIX = "FIBRL_"


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of a fibrl run. Build one with :func:`resolve` or ``fibrl.init``.

    Example:
        >>> Config(backend="local").backend
        'local'
    """

    backend: str = "local"
    """Where workers run: ``local`` processes, ``docker`` containers or ``kubernetes`` pods."""
    listen_host: str = "127.0.0.1"
    """Address this process listens on for its workers; must be reachable by them."""
    debug: bool = False
    """Log transport and lifecycle events at DEBUG level."""
    start_timeout: float = 120.0
    """Seconds a new worker has to connect back before its start is reported failed."""
    auth_timeout: float = 10.0
    """Seconds a connecting peer has to finish the authentication handshake."""
    tls: bool = False
    """Encrypt connections with TLS (``tls+tcp://``, a certificate derived from the run's
    secret); needs the ``cryptography`` package in the parent and the worker image."""
    heartbeat_interval: float = 5.0
    """Seconds between liveness pings from a worker to its parent."""
    parent_timeout: float = 30.0
    """A worker that hears nothing from its parent for this long exits by itself."""
    max_task_retries: int = 3
    """Pool: how many times a task is resubmitted after its worker was lost."""
    local_fork_server: bool = True
    """Local backend: fork workers from a pre-imported interpreter (faster starts)."""
    image: str = "fibrl:latest"
    """Container image of docker and kubernetes workers (kubernetes: left at this default,
    pods run ``fibrl:<fibrl's version>``, a fixed tag a node keeps)."""
    cpu: float = 0.0
    """Default CPU limit per container worker (0: none)."""
    memory: str = ""
    """Default memory limit per container worker, e.g. ``512m`` (empty: none)."""
    gpu: int = 0
    """Default number of GPUs per container worker."""
    docker_network: str = "host"
    """Docker network mode of worker containers."""
    docker_mount_cwd: bool = True
    """Mount the parent's working directory into docker workers."""
    docker_mount_readonly: bool = True
    """Mount that directory read-only."""
    docker_workdir: str = ""
    """Working directory inside docker workers (empty: the parent's path)."""
    kubernetes_namespace: str = "default"
    """Namespace of worker pods."""
    kubernetes_service_account: str = ""
    """Service account of worker pods (empty: the namespace default)."""
    kubernetes_kubeconfig: str = ""
    """Path of a kubeconfig (empty: in-cluster config, then ``~/.kube/config``)."""
    kubernetes_node_selector: str = ""
    """Node selector of worker pods, ``"k=v,k=v"``."""
    kubernetes_tolerations: str = ""
    """Tolerations of worker pods, a JSON list of toleration objects."""
    kubernetes_image_pull_secrets: str = ""
    """Image pull secrets of worker pods, ``"name,name"``."""
    kubernetes_labels: str = ""
    """Extra labels of worker pods, ``"k=v,k=v"``."""
    kubernetes_env: str = ""
    """Extra environment of worker pods, ``"K=V,K=V"``."""
    kubernetes_pending_timeout: float = 600.0
    """Seconds a worker pod may stay unschedulable before its start is reported failed
    (long enough for a cluster autoscaler to add a node and pull a large image)."""
    kubernetes_create_batch: int = 20
    """Worker pods created concurrently, per wave (a large Pool is created in waves)."""
    kubernetes_image_pull_policy: str = "IfNotPresent"
    """``imagePullPolicy`` of fibrl's pods: ``IfNotPresent``, ``Always`` or ``Never``."""
    kubernetes_run_as_user: int = 10001
    """Numeric uid fibrl's pods run as (the worker image's user; 0: the image's own USER)."""
    kubernetes_mesh_annotations: str = "sidecar.istio.io/inject=false,linkerd.io/inject=disabled"
    """Annotations of fibrl's pods, ``"k=v,k=v"``: by default, no service-mesh sidecar."""
    kubernetes_job_ttl: int = 3600
    """``ttlSecondsAfterFinished`` of a ``fibrl run`` Job: the cluster removes it and its pod."""
    kubernetes_allow_loopback: bool = False
    """Allow a parent outside the cluster to listen on a loopback ``listen_host``."""
    kubernetes_listen_ports: str = ""
    """Ports a parent with kubernetes workers listens on for them, ``"30000-30099"`` (one
    free port of the range; empty: any free port), so a NetworkPolicy can admit them."""
    registry: str = ""
    """Registry that ``fibrl run --build`` pushes the image to (empty: no push)."""

    def replace(self, **changes: Any) -> "Config":
        """Return a copy with ``changes`` applied and validated."""
        return resolve(changes, base=self, environ={}, cwd=None)


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(Config)}


def _check_keys(keys, source: str) -> None:
    valid = _fields()
    unknown = sorted(k for k in keys if k not in valid)
    if unknown:
        raise ConfigError(" ".join(_unknown_key(k, source, valid) for k in unknown) +
                          " Fix the spelling or remove the key (every key is described "
                          "in docs/configuration.md).")


def _unknown_key(key: str, source: str, valid) -> str:
    close = difflib.get_close_matches(str(key).lower(), list(valid), n=3, cutoff=0.6)
    if close:
        return (f"unknown fibrl config key {key!r} in {source}: did you mean "
                f"{' or '.join(map(repr, close))}?")
    return f"unknown fibrl config key {key!r} in {source}; valid keys: {_compact(valid)}."


def _compact(names) -> str:
    """The key names with shared prefixes folded: ``docker_{network, workdir}``."""
    groups: dict[str, list] = {}
    for name in sorted(names):
        head, _, tail = name.partition("_")
        family = name.startswith(("docker_", "kubernetes_"))
        groups.setdefault(head if family else name, []).append(tail if family else "")
    return ", ".join(head if tails == [""] else f"{head}_{{{', '.join(tails)}}}"
                     for head, tails in groups.items())


def _parse(name: str, value: Any, source: str) -> Any:
    kind = typing.get_type_hints(Config)[name]
    try:
        if kind is bool:
            return _parse_bool(value)
        if kind in (int, float):
            return kind(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"config key {name!r} from {source} must be {kind.__name__}, got {value!r}. "
            f"Fix the value (for example {name}={getattr(Config(), name)!r}).") from exc


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def _from_env(environ: Mapping[str, str]) -> dict[str, str]:
    found = {k[len(ENV_PREFIX):].lower(): v for k, v in environ.items()
             if k.startswith(ENV_PREFIX) and k not in _ENV_NOT_CONFIG
             and not k.startswith(_ENV_TEST_PREFIX)}
    _check_keys(found, "environment variables FIBRL_*")
    return found


# Variables the runtime itself passes to workers; they are not config keys.
_ENV_NOT_CONFIG = frozenset({"FIBRL_SECRET", "FIBRL_SECRET_FD", "FIBRL_SECRET_STDIN",
                             "FIBRL_RUN_ID", "FIBRL_TOKEN", "FIBRL_PARENT", "FIBRL_POD_NAME",
                             "FIBRL_POD_NAMESPACE", "FIBRL_POD_UID",
                             # read by fibrl.wire.transport before nng starts, in any process
                             "FIBRL_NNG_THREADS"})
# Switches of fibrl's own test suite (FIBRL_TEST_KUBECONFIG ...), not config keys.
_ENV_TEST_PREFIX = "FIBRL_TEST_"


def _from_file(path: Path) -> dict[str, tuple[str, str]]:
    """``key -> (value, "path:line")`` from a ``.fibrlconfig`` file."""
    if not path.is_file():
        return {}
    found: dict[str, tuple[str, str]] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.lower() == "[fibrl]":
            continue
        if "=" not in line:
            raise ConfigError(f"{path}:{lineno}: expected 'key = value', got {raw!r}.")
        key, value = (part.strip() for part in line.split("=", 1))
        _check_keys([key], f"{path}:{lineno}")
        found[key] = (value.strip("'\""), f"{path}:{lineno}")
    return found


def resolve(overrides: Mapping[str, Any] | None = None, *, base: Config | None = None,
            environ: Mapping[str, str] | None = None, cwd: str | None = ".") -> Config:
    """Build a :class:`Config` from overrides, ``FIBRL_*`` variables, the file and defaults.

    Args:
        overrides: explicit settings (strongest).
        base: start from this config instead of the defaults (then file and
            environment are skipped unless given).
        environ: environment to read (default ``os.environ``).
        cwd: directory holding ``.fibrlconfig``; ``None`` skips the file.
    """
    overrides = dict(overrides or {})
    _check_keys(overrides, "fibrl.init() arguments")
    merged: dict[str, tuple[Any, str]] = {}
    if cwd is not None:
        path = Path(cwd) / CONFIG_FILE
        merged.update(_from_file(path))
    env = os.environ if environ is None else environ
    merged.update({k: (v, f"FIBRL_{k.upper()}") for k, v in _from_env(env).items()})
    merged.update({k: (v, "fibrl.init()") for k, v in overrides.items()})
    values = {k: _parse(k, v, src) for k, (v, src) in merged.items()}
    config = dataclasses.replace(base or Config(), **values)
    _validate(config, {k: src for k, (_, src) in merged.items()})
    return config


def _validate(config: Config, sources: Mapping[str, str]) -> None:
    def where(name: str) -> str:
        return f" (set in {sources[name]})" if name in sources else ""

    if config.backend not in BACKENDS:
        raise ConfigError(
            f"backend {config.backend!r} is not known{where('backend')}. Choose one of "
            f"{', '.join(BACKENDS)} (fibrl.init(backend=...) or FIBRL_BACKEND).")
    for name in ("start_timeout", "auth_timeout", "heartbeat_interval", "parent_timeout"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"config {name} must be > 0 seconds, got "
                              f"{getattr(config, name)}{where(name)}.")
    if config.max_task_retries < 0:
        raise ConfigError(f"config max_task_retries must be >= 0, got "
                          f"{config.max_task_retries}{where('max_task_retries')}.")
