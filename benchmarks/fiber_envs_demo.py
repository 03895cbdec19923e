"""Fiber's AsyncManager demo: 4 CartPole envs in 4 managers, stepped sync then async.

Runs on Uber Fiber (``python fiber_envs_demo.py fiber``, in the venv made by
install_fiber.sh) or on fibrl (``... fibrl``): the same program with a different
import, as the demo in Fiber's documentation. Prints one JSON line:
``{"sync_s": ..., "async_s": ...}`` for ``--steps`` steps of each env.
"""
from __future__ import annotations

import importlib
import json
import sys
import time

import gymnasium

LIB = sys.argv[1] if len(sys.argv) > 1 else "fibrl"
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
managers_mod = importlib.import_module(f"{LIB}.managers")


class SyncEnvs(managers_mod.BaseManager):
    pass


class AsyncEnvs(managers_mod.AsyncManager):
    pass


def make_env():
    return gymnasium.make("CartPole-v1")


# Fiber's AutoProxy reads every attribute of the object to list its methods, which a
# gymnasium wrapper refuses for some private ones: name the methods (same for both).
SyncEnvs.register("CartPole", make_env, exposed=("reset", "step"))
AsyncEnvs.register("CartPole", make_env, exposed=("reset", "step"))


def run(manager_class, wait) -> float:
    managers = [manager_class() for _ in range(4)]
    for m in managers:
        m.start()
    envs = [m.CartPole() for m in managers]
    for result in [env.reset() for env in envs]:
        wait(result)
    start = time.perf_counter()
    for i in range(STEPS):
        results = [wait(r) for r in [env.step(i % 2) for env in envs]]
        for env, (_o, _r, term, trunc, _i) in zip(envs, results):
            if term or trunc:
                wait(env.reset())
    seconds = time.perf_counter() - start
    for m in managers:
        try:
            m.shutdown()
        except TypeError:
            pass  # Fiber 0.2.1's finalizer predates Python 3.11's signature; measured already
    return seconds


if __name__ == "__main__":
    if LIB == "fiber":
        import fiber

        fiber.init(backend="local")
    sync_s = run(SyncEnvs, lambda r: r)
    async_s = run(AsyncEnvs, lambda h: h.get())
    print(json.dumps({"sync_s": sync_s, "async_s": async_s}))
