"""RemoteVectorEnv against gymnasium's vector envs, a bare pynng loop and Fiber (CartPole-v1).

Every peer is measured in the same run and each row prints its ratio:

- 8 workers x 1 env: RemoteVectorEnv, the same layout as a bare pynng loop
  (one ``Pair0`` per worker, actions out, raw observation bytes back: the
  transport's floor), ``AsyncVectorEnv(8)`` and ``SyncVectorEnv(8)``;
- 2 workers x 32 envs against ``SyncVectorEnv(64)`` and the bare loop;
- an env whose step burns 1 ms of CPU, 2 workers x 4 envs, against
  ``SyncVectorEnv(8)``;
- Fiber's AsyncManager demo (4 CartPole envs in 4 managers, 5,000 steps, sync
  then async) on fibrl, and on Fiber when benchmarks/install_fiber.sh has made
  its venv (skipped, saying so, otherwise).

    python benchmarks/bench_envs.py [--seconds 2] [--rounds 3] [--demo-steps 5000]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
import numpy as np
import pynng

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fibrl.rl import RemoteVectorEnv  # noqa: E402

FIBER_PYTHON = HERE / ".fiber-venv" / "bin" / "python"


class BurnCPU(gymnasium.Wrapper):
    """CartPole whose step burns ``ms`` milliseconds of CPU (a costly simulator)."""

    def __init__(self, ms: float = 1.0) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))
        self.seconds = ms / 1000

    def step(self, action):
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return self.env.step(action)


def cartpole():
    return gymnasium.make("CartPole-v1")


def rate(step, num_envs: int, seconds: float) -> float:
    """Env steps per second of ``step()`` (after a warm-up)."""
    for _ in range(20):
        step()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            step()
        n += 10
    return n * num_envs / (time.perf_counter() - start)


def vector_rate(envs, seconds: float) -> float:
    envs.reset(seed=0)
    actions = np.zeros(envs.num_envs, dtype=np.int64)
    try:
        return rate(lambda: envs.step(actions), envs.num_envs, seconds)
    finally:
        envs.close()


# -- the bare pynng loop --------------------------------------------------------------------
def _bare_worker(address: str, k: int, make) -> None:
    envs = [make() for _ in range(k)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    with pynng.Pair0(dial=address) as sock:
        while True:
            frame = sock.recv()
            if len(frame) < 8:  # the stop byte
                return
            actions = np.frombuffer(frame, dtype=np.int64)
            obs = np.empty((k, 4), dtype=np.float32)
            rewards = np.empty(k, dtype=np.float64)
            flags = np.empty((2, k), dtype=np.bool_)
            for j, (env, a) in enumerate(zip(envs, actions)):
                obs[j], rewards[j], flags[0, j], flags[1, j], _ = env.step(a)
                if flags[0, j] or flags[1, j]:
                    env.reset()
            sock.send(obs.tobytes() + rewards.tobytes() + flags.tobytes())


def bare_rate(workers: int, k: int, seconds: float, make=cartpole) -> float:
    ctx = multiprocessing.get_context("spawn")
    socks, procs = [], []
    for _ in range(workers):
        sock = pynng.Pair0(listen="tcp://127.0.0.1:0", recv_timeout=30000)
        address = "tcp://" + str(sock.listeners[0].local_address)
        proc = ctx.Process(target=_bare_worker, args=(address, k, make), daemon=True)
        proc.start()
        socks.append(sock)
        procs.append(proc)
    actions = np.zeros(k, dtype=np.int64).tobytes()
    obs = np.empty((workers * k, 4), dtype=np.float32)

    def step():
        for sock in socks:
            sock.send(actions)
        for w, sock in enumerate(socks):
            reply = sock.recv()
            obs[w * k:(w + 1) * k] = np.frombuffer(reply, np.float32, k * 4).reshape(k, 4)

    try:
        return rate(step, workers * k, seconds)
    finally:
        for sock in socks:
            sock.send(b"x")  # shorter than an action: stop
        for proc in procs:
            proc.join(10)
        for sock in socks:
            sock.close()


# -- Fiber's AsyncManager demo -------------------------------------------------------------------
def demo(lib: str, python: str, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    out = subprocess.run([python, str(HERE / "fiber_envs_demo.py"), lib, str(steps)],
                         capture_output=True, text=True, timeout=1200, env=env, cwd=HERE)
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"the {lib} demo failed:\n{out.stdout}\n{out.stderr[-3000:]}")


def table(rows: list) -> str:
    lines = ["| measure | fibrl | peer | ratio | better | target |", "|---|---|---|---|---|---|"]
    for name, ours, peer, better, target in rows:
        ratio = ours / peer if peer else float("nan")
        fmt = ",.0f" if min(ours, peer) >= 100 else ".2f"
        lines.append(f"| {name} | {ours:{fmt}} | {peer:{fmt}} | {ratio:.2f}x | {better} | "
                     f"{target} |")
    return "\n".join(lines)


def measure_round(s: float) -> dict:
    """One round of every steps/s measurement (rounds interleave ours and the peers', so
    a burst of load from elsewhere on the machine hits both)."""
    burn = [BurnCPU] * 8
    return {
        "r8": vector_rate(RemoteVectorEnv("CartPole-v1", 8, envs_per_worker=1), s),
        "bare8": bare_rate(8, 1, s),
        # spawn: a child forked after nng started aborts in nng ("not fork-reentrant safe")
        "async8": vector_rate(gymnasium.vector.AsyncVectorEnv([cartpole] * 8,
                                                              context="spawn"), s),
        "sync8": vector_rate(gymnasium.vector.SyncVectorEnv([cartpole] * 8), s),
        "r64": vector_rate(RemoteVectorEnv("CartPole-v1", 64, envs_per_worker=32), s),
        "sync64": vector_rate(gymnasium.vector.SyncVectorEnv([cartpole] * 64), s),
        "bare64": bare_rate(2, 32, s),
        "rburn": vector_rate(RemoteVectorEnv(burn, envs_per_worker=4), s),
        "sburn": vector_rate(gymnasium.vector.SyncVectorEnv(burn), s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="medians over this many")
    parser.add_argument("--demo-steps", type=int, default=5000)
    args = parser.parse_args()
    rounds = [measure_round(args.seconds) for _ in range(args.rounds)]
    m = {key: float(np.median([r[key] for r in rounds])) for key in rounds[0]}
    rows = [
        ("8 workers x 1 env vs bare pynng loop, steps/s", m["r8"], m["bare8"], "higher",
         ">= 0.9x"),
        ("8 workers x 1 env vs AsyncVectorEnv(8), steps/s", m["r8"], m["async8"], "higher", ""),
        ("bare pynng loop 8x1 vs AsyncVectorEnv(8), steps/s", m["bare8"], m["async8"],
         "higher", ""),
        ("8 workers x 1 env vs SyncVectorEnv(8), steps/s", m["r8"], m["sync8"], "higher", ""),
        ("2 workers x 32 envs vs SyncVectorEnv(64), steps/s", m["r64"], m["sync64"], "higher",
         ">= 1.0x"),
        ("2 workers x 32 envs vs bare pynng loop 2x32, steps/s", m["r64"], m["bare64"],
         "higher", ""),
        ("1 ms env, 2 workers x 4 envs vs SyncVectorEnv(8), steps/s", m["rburn"], m["sburn"],
         "higher", ">= 1.8x"),
    ]
    ours = demo("fibrl", sys.executable, args.demo_steps)
    note = ""
    if FIBER_PYTHON.exists():
        theirs = demo("fiber", str(FIBER_PYTHON), args.demo_steps)
        rows.append((f"Fiber's AsyncManager demo, async, {args.demo_steps} steps (s)",
                     ours["async_s"], theirs["async_s"], "lower", "<= 0.5x"))
        rows.append((f"Fiber's AsyncManager demo, sync, {args.demo_steps} steps (s)",
                     ours["sync_s"], theirs["sync_s"], "lower", ""))
    else:
        note = (f"Fiber not measured: no venv at {FIBER_PYTHON} (benchmarks/install_fiber.sh); "
                f"fibrl's demo: sync {ours['sync_s']:.2f} s, async {ours['async_s']:.2f} s")
    print(f"medians of {args.rounds} rounds of {args.seconds:g} s each")
    print(table(rows))
    if note:
        print(note)


if __name__ == "__main__":
    main()
