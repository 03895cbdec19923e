"""RemoteVectorEnv against gymnasium's vector envs, a bare pynng loop and Fiber (CartPole-v1).

Every peer is measured in the same run and each row prints its ratio:

- 8 workers x 1 env: RemoteVectorEnv, the same layout as a bare pynng loop
  (one ``Pair0`` per worker, actions out, raw observation bytes back: the
  transport's floor), ``AsyncVectorEnv(8)`` and ``SyncVectorEnv(8)``;
- 2 workers x 32 envs against ``SyncVectorEnv(64)`` and the bare loop;
- an env whose step burns 1 ms of CPU, 2 workers x 4 envs, against
  ``SyncVectorEnv(8)``;
- the 2x32 and 1 ms layouts as bare pynng loops too (the transport's floor for
  them);
- Fiber's AsyncManager demo (4 CartPole envs in 4 managers, 5,000 steps, sync
  then async) on fibrl, on bare pynng request/reply servers (the floor), and on
  Fiber when benchmarks/install_fiber.sh has made its venv or ``FIBER_PYTHON``
  names a Python that has Fiber (skipped, saying so, otherwise), alternating runs.

Every vector env is started once; each round then measures all of them in 0.1 s
windows, round robin, until each has had ``--seconds`` (its rate: the median of
its windows), and a ratio is the median of the rounds' ratios, so a burst of load
from elsewhere on a shared machine hits both sides of a ratio.

    python benchmarks/bench_envs.py [--seconds 1] [--rounds 7] [--demo-steps 5000]
        [--demo-runs 3]
    python benchmarks/bench_envs.py --quick   # 3 rounds of 0.5 s, 2 demo runs (~1.5 min)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
# the workers import this checkout's fibrl too
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)

from fibrl.rl import RemoteVectorEnv  # noqa: E402
from floor import start_env_workers, stop_env_workers  # noqa: E402

# Uber Fiber's interpreter: $FIBER_PYTHON, else the venv benchmarks/install_fiber.sh makes
FIBER_PYTHON = Path(os.environ.get("FIBER_PYTHON") or HERE / ".fiber-venv" / "bin" / "python")


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


WINDOW_S = 0.1


def window(step, num_envs: int) -> float:
    """Env steps per second of ``step()`` over one window of ``WINDOW_S``."""
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < WINDOW_S:
        step()
        n += 1
    return n * num_envs / (time.perf_counter() - start)


class Vector:
    """A gymnasium vector env, reset once, stepped with zero actions."""

    def __init__(self, envs) -> None:
        self.envs, self.num_envs = envs, envs.num_envs
        envs.reset(seed=0)
        self.actions = np.zeros(envs.num_envs, dtype=np.int64)

    def step(self) -> None:
        self.envs.step(self.actions)

    def close(self) -> None:
        self.envs.close()


# -- the bare pynng loop --------------------------------------------------------------------
class Bare:
    """One pynng ``Pair0`` per worker, actions out and raw result bytes back."""

    def __init__(self, workers: int, k: int, make=cartpole) -> None:
        self.k, self.num_envs = k, workers * k
        self.socks, self.procs = start_env_workers(workers, k, make)
        self.actions = b"S" + np.zeros(k, dtype=np.int64).tobytes()
        self.obs = np.empty((workers * k, 4), dtype=np.float32)

    def step(self) -> None:
        k = self.k
        for sock in self.socks:
            sock.send(self.actions)
        for w, sock in enumerate(self.socks):
            reply = sock.recv()
            self.obs[w * k:(w + 1) * k] = np.frombuffer(reply, np.float32, k * 4).reshape(k, 4)

    def close(self) -> None:
        stop_env_workers(self.socks, self.procs)


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
    for name, ours, peer, ratio, better, target in rows:
        fmt = ",.0f" if min(ours, peer) >= 100 else ".2f"
        lines.append(f"| {name} | {ours:{fmt}} | {peer:{fmt}} | {ratio:.2f}x | {better} | "
                     f"{target} |")
    return "\n".join(lines)


def contenders() -> dict:
    """Every vector env of the run, started once and kept for all rounds."""
    burn = [BurnCPU] * 8
    return {
        "r8": Vector(RemoteVectorEnv("CartPole-v1", 8, envs_per_worker=1)),
        "bare8": Bare(8, 1),
        # spawn: a child forked after nng started aborts in nng ("not fork-reentrant safe")
        "async8": Vector(gymnasium.vector.AsyncVectorEnv([cartpole] * 8, context="spawn")),
        "sync8": Vector(gymnasium.vector.SyncVectorEnv([cartpole] * 8)),
        "r64": Vector(RemoteVectorEnv("CartPole-v1", 64, envs_per_worker=32)),
        "bare64": Bare(2, 32),
        "sync64": Vector(gymnasium.vector.SyncVectorEnv([cartpole] * 64)),
        "rburn": Vector(RemoteVectorEnv(burn, envs_per_worker=4)),
        "bareburn": Bare(2, 4, make=BurnCPU),
        "sburn": Vector(gymnasium.vector.SyncVectorEnv(burn)),
    }


def measure(rounds: int, seconds: float) -> list:
    """Steps/s of every contender, ``rounds`` times. A round gives each contender windows
    of ``WINDOW_S`` in turn, round robin (every other round in reverse order), until each
    has had ``seconds``; its rate is the median of its windows. On a shared 2-core VM the
    rate swings by a third for seconds at a time (load from outside the run): the two
    members of a pair, measured a window apart, see the same phases, and the median
    sets aside the windows a burst hit. Ratios are taken per round."""
    envs = contenders()
    try:
        names = list(envs)
        for name in names:
            for _ in range(20):   # a warm-up
                envs[name].step()
        results = []
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            windows: dict = {name: [] for name in names}
            for _ in range(max(1, round(seconds / WINDOW_S))):
                for name in order:
                    windows[name].append(window(envs[name].step, envs[name].num_envs))
            results.append({name: float(np.median(w)) for name, w in windows.items()})
        return results
    finally:
        for env in envs.values():
            env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds of 0.5 s and 2 runs of each demo (unless given)")
    parser.add_argument("--seconds", type=float, help="per measurement (default 1)")
    parser.add_argument("--rounds", type=int, help="medians over this many (default 7)")
    parser.add_argument("--demo-steps", type=int, default=5000)
    parser.add_argument("--demo-runs", type=int, help="runs of each demo (default 3)")
    args = parser.parse_args()
    quick = args.quick
    args.seconds = args.seconds or (0.5 if quick else 1.0)
    args.rounds = args.rounds or (3 if quick else 7)
    args.demo_runs = args.demo_runs or (2 if quick else 3)
    rounds = measure(args.rounds, args.seconds)
    m = {key: float(np.median([r[key] for r in rounds])) for key in rounds[0]}
    pairs = [
        ("8 workers x 1 env vs bare pynng loop, steps/s", "r8", "bare8", ">= 0.9x"),
        ("8 workers x 1 env vs AsyncVectorEnv(8), steps/s", "r8", "async8", ""),
        ("bare pynng loop 8x1 vs AsyncVectorEnv(8), steps/s", "bare8", "async8", ""),
        ("8 workers x 1 env vs SyncVectorEnv(8), steps/s", "r8", "sync8", ""),
        ("2 workers x 32 envs vs SyncVectorEnv(64), steps/s", "r64", "sync64", ""),
        ("2 workers x 32 envs vs bare pynng loop 2x32, steps/s", "r64", "bare64", ">= 0.9x"),
        ("bare pynng loop 2x32 vs SyncVectorEnv(64), steps/s", "bare64", "sync64", ""),
        ("1 ms env, 2 workers x 4 envs vs SyncVectorEnv(8), steps/s", "rburn", "sburn", ""),
        ("1 ms env, 2 workers x 4 envs vs bare pynng loop 2x4, steps/s", "rburn", "bareburn",
         ">= 0.9x"),
        ("1 ms env, bare pynng loop 2x4 vs SyncVectorEnv(8), steps/s", "bareburn", "sburn", ""),
    ]
    rows = [(name, m[a], m[b], float(np.median([r[a] / r[b] for r in rounds])), "higher",
             target) for name, a, b, target in pairs]
    note = ""
    # the demo on fibrl, as bare pynng request/reply servers (the transport's floor for
    # this program) and on Fiber, alternating runs so load bursts hit all alike
    libs = {"fibrl": sys.executable, "nng": sys.executable}
    if FIBER_PYTHON.exists():
        libs["fiber"] = str(FIBER_PYTHON)
    else:
        note = (f"Fiber not measured: no {FIBER_PYTHON} (set FIBER_PYTHON, or run "
                f"benchmarks/install_fiber.sh)")
    runs: dict = {lib: [] for lib in libs}
    for _ in range(args.demo_runs):
        for lib, python in libs.items():
            runs[lib].append(demo(lib, python, args.demo_steps))
    demo_pairs = [("fibrl", "fiber", "Fiber's AsyncManager demo", ""),
                  ("fibrl", "nng", "Fiber's demo on fibrl vs on bare pynng servers", "<= 1.2x"),
                  ("nng", "fiber", "Fiber's demo on bare pynng servers vs on Fiber", "")]
    for a, b, name, target in demo_pairs:
        if a in runs and b in runs:
            for mode in ("async", "sync"):
                key = f"{mode}_s"
                rows.append((f"{name}, {mode}, {args.demo_steps} steps (s)",
                             float(np.median([o[key] for o in runs[a]])),
                             float(np.median([t[key] for t in runs[b]])),
                             float(np.median([o[key] / t[key]
                                              for o, t in zip(runs[a], runs[b])])),
                             "lower", target if mode == "async" else ""))
    print(f"medians of {args.rounds} rounds, each giving every vector env {args.seconds:g} s in "
          f"{WINDOW_S:g} s windows round robin (its rate: the median of its windows; ratio: "
          f"median of the rounds' ratios); demos: medians of {args.demo_runs} alternating runs")
    print(table(rows))
    if note:
        print(note)


if __name__ == "__main__":
    main()
