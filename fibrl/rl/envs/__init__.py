"""Remote environments: :class:`RemoteEnvManager` (an AsyncManager hosting envs) and
:class:`RemoteVectorEnv` (a batched gymnasium vector env that survives crashes).

Importing this package imports gymnasium and numpy (the ``rl`` extra).
"""
from __future__ import annotations

from .manager import RemoteEnvManager
from .spaces import InvalidActionError
from .vector import AsyncState, EnvCrashError, RemoteVectorEnv

__all__ = ["AsyncState", "EnvCrashError", "InvalidActionError", "RemoteEnvManager",
           "RemoteVectorEnv"]
