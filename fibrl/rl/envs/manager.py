"""``RemoteEnvManager``: an AsyncManager made for hosting environments.

Each registered environment lives in the manager's server process (a local
process, a docker container or a kubernetes pod); its proxy returns a
:class:`~fibrl.managers.ProxyHandle` from ``reset``/``step``/any public
method, so many environments step in parallel and the caller collects the
results with ``handle.get(timeout)``. Calls to one environment run one at a
time in arrival order, so an environment needs no lock.

This module owns only the manager class and its ready-made ``GymEnv`` typeid;
batched, crash-surviving stepping is :mod:`fibrl.rl.envs.vector`'s job.
"""
from __future__ import annotations

from typing import Any

from ...managers import AsyncManager

__all__ = ["RemoteEnvManager"]


def make_gym_env(env_id: str, **kwargs: Any) -> Any:
    """``gymnasium.make(env_id, **kwargs)``, importing gymnasium only in the server."""
    import gymnasium

    return gymnasium.make(env_id, **kwargs)


class RemoteEnvManager(AsyncManager):
    """An :class:`~fibrl.managers.AsyncManager` whose objects are environments.

    Subclass it and register environment factories, as with any manager; the
    ``GymEnv`` typeid is registered already (``manager.GymEnv("CartPole-v1")``).

    Example:
        >>> import gymnasium
        >>> class Envs(RemoteEnvManager): pass
        >>> Envs.register("Env", lambda: gymnasium.make("CartPole-v1"))
        >>> m = Envs(); m.start()
        >>> env = m.Env()
        >>> obs, info = env.reset(seed=0).get(timeout=30)
        >>> obs, reward, terminated, truncated, info = env.step(0).get(timeout=30)
        >>> m.shutdown()
    """

    _registry: dict = {}


RemoteEnvManager.register("GymEnv", make_gym_env)
