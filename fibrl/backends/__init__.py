"""Backends start, watch, stop and log jobs; they know nothing of pools or queues.

A backend is chosen by name and imported only when first used, so ``import
fibrl`` never imports docker or kubernetes.
"""
from __future__ import annotations

import importlib
import threading

from typing import TYPE_CHECKING

from ..errors import ConfigError
from .base import Backend, Job, JobSpec, JobStatus

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["Backend", "Job", "JobSpec", "JobStatus", "backend_class", "get_backend",
           "REGISTRY"]

REGISTRY = {  # one entry per name of config.BACKENDS
    "local": "fibrl.backends.local:LocalBackend",
    "docker": "fibrl.backends.docker:DockerBackend",
    "kubernetes": "fibrl.backends.kubernetes:KubernetesBackend",
}

_instances: dict = {}
_lock = threading.Lock()


def backend_class(name: str) -> type:
    """The class of backend ``name`` (its module imported, nothing started)."""
    try:
        path = REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown backend {name!r}; "
                          f"choose one of {', '.join(REGISTRY)}") from None
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def get_backend(config: Config) -> Backend:
    """The backend instance for ``config`` (one per backend name and config)."""
    key = (config.backend, config)
    with _lock:
        backend = _instances.get(key)
        if backend is None:
            backend = _instances[key] = backend_class(config.backend)(config)
    return backend
