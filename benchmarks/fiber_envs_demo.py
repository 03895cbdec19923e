"""Fiber's AsyncManager demo: 4 CartPole envs in 4 managers, stepped sync then async.

Runs on Uber Fiber (``python fiber_envs_demo.py fiber``, in the venv made by
install_fiber.sh) or on fibrl (``... fibrl``): the same program with a different
import, as the demo in Fiber's documentation. ``... nng`` runs the same loop
against 4 bare pynng request/reply servers (a pickled call out, a pickled result
back, each on a ``Pair0`` of its own): the transport's floor for this program.
Prints one JSON line: ``{"sync_s": ..., "async_s": ...}`` for ``--steps`` steps
of each env.
"""
from __future__ import annotations

import importlib
import json
import sys
import time

import gymnasium

LIB = sys.argv[1] if len(sys.argv) > 1 else "fibrl"
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
# (the bare pynng servers need no manager: the stdlib's stand in for the classes below)
managers_mod = importlib.import_module(f"{LIB}.managers" if LIB != "nng" else "fibrl.managers")


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


def step_loop(envs: list, wait) -> float:
    """The demo: reset every env, then step each ``STEPS`` times, all four calls sent
    before their results are taken (``wait``), resetting an env whose episode ended;
    returns the seconds the steps took."""
    for result in [env.reset() for env in envs]:
        wait(result)
    start = time.perf_counter()
    for i in range(STEPS):
        results = [wait(r) for r in [env.step(i % 2) for env in envs]]
        for env, (_o, _r, term, trunc, _i) in zip(envs, results):
            if term or trunc:
                wait(env.reset())
    return time.perf_counter() - start


def run(manager_class, wait) -> float:
    managers = [manager_class() for _ in range(4)]
    for m in managers:
        m.start()
    seconds = step_loop([m.CartPole() for m in managers], wait)
    for m in managers:
        try:
            m.shutdown()
        except TypeError:
            pass  # Fiber 0.2.1's finalizer predates Python 3.11's signature; measured already
    return seconds


# -- the same loop on bare pynng servers ---------------------------------------------------------
def bare_server(address: str) -> None:
    import pickle

    import pynng

    env = make_env()
    with pynng.Pair0(dial=address) as sock:
        while True:
            method, args = pickle.loads(sock.recv())
            if method is None:
                return
            sock.send(pickle.dumps(getattr(env, method)(*args), protocol=5))


class BareEnv:
    """``sync``: a call returns its result. Else it returns a handle whose ``get()``
    receives the reply (one server's replies come in the order of its calls)."""

    def __init__(self, sync: bool) -> None:
        import multiprocessing
        import pickle

        import pynng

        self._pickle = pickle
        self.sync = sync
        self.sock = pynng.Pair0(listen="tcp://127.0.0.1:0", recv_timeout=60_000)
        address = "tcp://" + str(self.sock.listeners[0].local_address)
        self.proc = multiprocessing.get_context("spawn").Process(target=bare_server,
                                                                 args=(address,))
        self.proc.start()

    def _call(self, method: str, *args):
        self.sock.send(self._pickle.dumps((method, args), protocol=5))
        return self.get() if self.sync else self

    def get(self):
        return self._pickle.loads(self.sock.recv())

    def reset(self):
        return self._call("reset")

    def step(self, action):
        return self._call("step", action)

    def close(self) -> None:
        self.sock.send(self._pickle.dumps((None, ())))
        self.proc.join(30)
        self.sock.close()


def run_bare(sync: bool) -> float:
    """:func:`step_loop` on four :class:`BareEnv`."""
    envs = [BareEnv(sync) for _ in range(4)]
    seconds = step_loop(envs, (lambda r: r) if sync else (lambda h: h.get()))
    for env in envs:
        env.close()
    return seconds


if __name__ == "__main__" and LIB == "nng":
    print(json.dumps({"sync_s": run_bare(True), "async_s": run_bare(False)}))
elif __name__ == "__main__":
    if LIB == "fiber":
        import fiber

        fiber.init(backend="local")
    sync_s = run(SyncEnvs, lambda r: r)
    async_s = run(AsyncEnvs, lambda h: h.get())
    print(json.dumps({"sync_s": sync_s, "async_s": async_s}))
