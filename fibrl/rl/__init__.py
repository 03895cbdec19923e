"""Reinforcement-learning tools on top of fibrl's public API.

- :class:`RemoteEnvManager`, :class:`RemoteVectorEnv` (``fibrl.rl.envs``):
  environments hosted in fibrl workers, stepped in batches, restarted when they
  crash.
- :class:`ReplayStore` (``fibrl.rl.replay``): one replay buffer served by a
  fibrl process, shared by any number of writers and learners.
- :class:`PolicyStore`, :class:`PolicyFollower` (``fibrl.rl.policy``): versioned
  policy parameters, published by a learner, followed by rollout workers.

``import fibrl`` does not import this package, and importing this package
imports neither gymnasium nor numpy: each name loads its module on first use
(``pip install 'fibrl[rl]'`` provides both).
"""
from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "RemoteEnvManager": "fibrl.rl.envs",
    "RemoteVectorEnv": "fibrl.rl.envs",
    "ReplayStore": "fibrl.rl.replay",
    "PolicyStore": "fibrl.rl.policy",
    "PolicyFollower": "fibrl.rl.policy",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'fibrl.rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_HOMES))
