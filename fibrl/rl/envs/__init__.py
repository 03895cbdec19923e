"""Remote environments: :class:`RemoteEnvManager` (an AsyncManager hosting envs) and
:class:`RemoteVectorEnv` (a batched gymnasium vector env that survives crashes).

Importing this package imports gymnasium and numpy (the ``rl`` extra).
"""
from __future__ import annotations

from .manager import RemoteEnvManager
from .vector import AsyncState, EnvCrashError, RemoteVectorEnv

__all__ = ["AsyncState", "EnvCrashError", "RemoteEnvManager", "RemoteVectorEnv"]
