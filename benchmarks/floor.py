"""The transport's floor: bare pynng between two processes, for the benchmarks' ratios.

Every fibrl message costs at least one pynng message, so a bare ``Pair0``
exchange between two processes on the same transport (tcp on loopback, as
fibrl's local backend uses) is the floor that fibrl's hot paths are measured
against:

- :class:`NngEcho`: round trip of one frame to an echo in another process;
- :class:`NngStream`: a stream of frames in either direction, ended by a
  one-frame acknowledgement (the receiver has them all);
- :class:`PickledEcho`: :class:`NngEcho` with the object pickled before each
  send and unpickled after each receive, on both sides: the least that any
  Python library sending objects over nng pays, with nothing else (no
  envelope, dispatch, ordering or end-of-file bookkeeping);
- :func:`serve_envs`: the worker of the bare vector-env loops (``bench_envs``,
  ``bench_ppo``): envs stepped on raw actions, raw results back; started and
  stopped with :func:`start_env_workers` and :func:`stop_env_workers`.

No authentication and no dispatch; no pickling but in :class:`PickledEcho`.
The worker is a stdlib spawn process, so nothing of fibrl runs on either side.
"""
from __future__ import annotations

import multiprocessing
import pickle
import time

ACK = b"ok"


def _listen():
    import pynng

    sock = pynng.Pair0(recv_max_size=0)
    sock.listen("tcp://127.0.0.1:0")
    return sock, "tcp://" + str(sock.listeners[0].local_address)


def serve(address: str, pickled: bool = False) -> None:
    """Worker: dial ``address``; echo frames, or run stream commands, until ``b"stop"``.
    ``pickled``: every frame is an object pickled, echoed unpickled and pickled again."""
    import pynng

    sock = pynng.Pair0(recv_max_size=0)
    sock.dial(address, block=True)
    if pickled:
        dumps, loads = pickle.dumps, pickle.loads
        while True:
            msg = sock.recv()
            if msg == b"stop":
                return
            sock.send(dumps(loads(msg), 5))
    while True:
        msg = sock.recv()
        if msg == b"stop":
            return
        if msg.startswith(b"produce "):      # send n frames of size bytes
            _, n, size = msg.split()
            frame = b"x" * int(size)
            for _ in range(int(n)):
                sock.send(frame)
        elif msg.startswith(b"consume "):    # receive n frames, then acknowledge
            for _ in range(int(msg.split()[1])):
                sock.recv()
            sock.send(ACK)
        else:
            sock.send(msg)


def serve_envs(address: str, k: int, make) -> None:
    """Worker of a bare vector-env loop: ``k`` envs made by ``make`` (4-float
    observations, as CartPole's) behind a ``Pair0`` that dials ``address``. It resets
    env ``i`` with seed ``i`` and sends ``b"ready"``, then answers each frame:

    - ``b"S"`` + ``k`` int64 actions: a step; an env whose episode ends is reset in
      the same step and its new first observation returned (gymnasium's SAME_STEP);
    - ``b"R"`` + a seed: a reset, env ``i`` seeded ``seed + i``;
    - ``b"Q"``: the end.

    The answer: the observations (float32), rewards (float64) and terminated and
    truncated flags, as raw bytes.
    """
    import numpy as np
    import pynng

    envs = [make() for _ in range(k)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    obs = np.empty((k, 4), dtype=np.float32)
    rewards = np.zeros(k, dtype=np.float64)
    flags = np.zeros((2, k), dtype=np.bool_)
    with pynng.Pair0(dial=address) as sock:
        sock.send(b"ready")   # its envs are made: nothing of its start-up overlaps a measure
        while True:
            frame = sock.recv()
            kind = frame[:1]
            if kind == b"Q":
                return
            if kind == b"R":
                seed = int(frame[1:])
                for i, env in enumerate(envs):
                    obs[i] = env.reset(seed=seed + i)[0]
                rewards[:], flags[:] = 0.0, False
            else:
                actions = np.frombuffer(frame, np.int64, offset=1)
                for i, (env, a) in enumerate(zip(envs, actions)):
                    obs[i], rewards[i], flags[0, i], flags[1, i], _ = env.step(a)
                    if flags[0, i] or flags[1, i]:
                        obs[i] = env.reset()[0]
            sock.send(obs.tobytes() + rewards.tobytes() + flags.tobytes())


def start_env_workers(workers: int, k: int, make) -> tuple[list, list]:
    """``(sockets, processes)``: ``workers`` spawned :func:`serve_envs` processes of
    ``k`` envs each, a listening ``Pair0`` per process, once every one is ready."""
    socks, procs = [], []
    for _ in range(workers):
        sock, address = _listen()
        sock.recv_timeout = 60_000
        proc = multiprocessing.get_context("spawn").Process(
            target=serve_envs, args=(address, k, make), daemon=True)
        proc.start()
        socks.append(sock)
        procs.append(proc)
    for sock in socks:
        assert sock.recv() == b"ready"
    return socks, procs


def stop_env_workers(socks: list, procs: list) -> None:
    for sock in socks:
        sock.send(b"Q")
    for proc in procs:
        proc.join(30)
    for sock in socks:
        sock.close()


class _Worker:
    pickled = False

    def __init__(self) -> None:
        self.sock, address = _listen()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=serve, args=(address, self.pickled), daemon=True)
        self.proc.start()
        self.sock.recv_timeout = 120_000
        hello = pickle.dumps(b"hello", 5) if self.pickled else b"hello"
        self.sock.send(hello)
        assert self.sock.recv() == hello

    def close(self) -> None:
        self.sock.send(b"stop")
        self.proc.join(60)
        self.sock.close()


class NngEcho(_Worker):
    """Round trips of ``size``-byte frames (the Pipe row's floor)."""

    def rounds(self, n: int, size: int = 100) -> float:
        sock, msg = self.sock, b"x" * size
        start = time.perf_counter()
        for _ in range(n):
            sock.send(msg)
            sock.recv()
        return time.perf_counter() - start


class PickledEcho(_Worker):
    """Round trips of a ``size``-byte ``bytes`` object, pickled (protocol 5) before each
    send and unpickled after each receive, in both processes."""

    pickled = True

    def rounds(self, n: int, size: int = 100) -> float:
        sock, msg = self.sock, b"x" * size
        dumps, loads = pickle.dumps, pickle.loads
        start = time.perf_counter()
        for _ in range(n):
            sock.send(dumps(msg, 5))
            loads(sock.recv())
        return time.perf_counter() - start


class NngStream(_Worker):
    """``n`` frames of ``size`` bytes one way (the 1 MB Queue rows' floor)."""

    def child_produces(self, n: int, size: int) -> float:
        start = time.perf_counter()
        self.sock.send(f"produce {n} {size}".encode())
        for _ in range(n):
            self.sock.recv()
        return time.perf_counter() - start

    def parent_produces(self, n: int, size: int) -> float:
        frame = b"x" * size
        start = time.perf_counter()
        self.sock.send(f"consume {n}".encode())
        for _ in range(n):
            self.sock.send(frame)
        assert self.sock.recv() == ACK
        return time.perf_counter() - start
