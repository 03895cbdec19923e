"""``@fibrl.meta``: per-function resource requests for container workers.

Owns only the annotation. The docker and kubernetes backends read it from a
Process target (and a Pool's worker function) and set the container's limits.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

__all__ = ["meta", "resources", "KEYS"]

KEYS = ("cpu", "memory", "gpu")

F = TypeVar("F", bound=Callable[..., Any])


def meta(*, cpu: Optional[float] = None, memory: Optional[str] = None,
         gpu: Optional[int] = None) -> Callable[[F], F]:
    """Attach resource requests to a function used as a worker target.

    Args:
        cpu: CPU limit (cores, may be fractional).
        memory: memory limit such as ``"256m"`` or ``"2g"``.
        gpu: number of GPUs.

    Example:
        >>> @meta(cpu=1, memory="256m")
        ... def work(x): return x
        >>> work.__fibrl_meta__
        {'cpu': 1, 'memory': '256m'}
    """
    chosen = resources(cpu=cpu, memory=memory, gpu=gpu)

    def mark(fn: F) -> F:
        fn.__fibrl_meta__ = chosen  # type: ignore[attr-defined]
        return fn

    return mark


def resources(*, cpu: Optional[float] = None, memory: Optional[str] = None,
              gpu: Optional[int] = None) -> dict:
    """The requests given (None left out), checked as :func:`meta` checks them.

    Example:
        >>> resources(cpu=2, gpu=None)
        {'cpu': 2}
    """
    if cpu is not None and cpu <= 0:
        raise ValueError(f"meta(cpu=...) must be > 0, got {cpu}")
    if gpu is not None and gpu < 0:
        raise ValueError(f"meta(gpu=...) must be >= 0, got {gpu}")
    values = {"cpu": cpu, "memory": memory, "gpu": gpu}
    return {k: v for k, v in values.items() if v is not None}
