"""PPO on CartPole-v1 with RemoteVectorEnv against gymnasium's vector envs.

The same CleanRL-style PPO (``examples/ppo_cartpole.py``: its ``Agent``,
``advantages`` and ``update``, its hyper-parameters and seed; torch on the CPU
with one thread) trains for a fixed number of env steps on each of:

- fibrl: ``RemoteVectorEnv("CartPole-v1", 8, envs_per_worker=4)`` (2 workers);
- ``AsyncVectorEnv(8)`` (started with spawn: fork aborts in nng once fibrl runs);
- ``SyncVectorEnv(8)`` (every env in this process);
- the bare pynng loop of fibrl's layout (:class:`BareVectorEnv`: 2 spawned processes
  of 4 CartPoles each, raw actions out and raw result bytes back on a ``Pair0`` per
  worker, no authentication, no validation, no infos): the transport's floor for
  this program, so its ratio to AsyncVectorEnv is the least any vector env that
  steps its CartPoles in other processes over these sockets could reach here.

Each is started once; a round then trains on each in turn (every other round in
reverse order, so a burst of load from elsewhere hits all alike), and a ratio is
the median of the rounds' ratios. The wall time of a training run (from its
reset to its last update; starting the vector env is not in it) is split into
the time inside the vector env's ``step`` (and the CPU time this process spent
there, its nng threads included: for the rest of it this process waited for
the workers) and the learner's (the rest: the policy's forward passes, the
rollout's tensors and the update), with the CPU time of the learner and, when
psutil is installed, of the env workers over the run. The learner shares the
machine's cores with the env workers, so the split shows where each
contender's time goes.

The three must learn the same thing: with the same seeds the envs give the
same trajectories, so the episodes' returns and the final weights of every run
are compared, bit for bit, with those of the first run of ``SyncVectorEnv``; a
difference stops the benchmark.

The sweep: env steps/s of PPO's rollout phase (the policy's forward pass on the
batch of observations, ``step``, the tensors made of the result) against the envs
per worker k in 1, 2, 4, 8, 16, with 2 workers (2k envs), for fibrl,
``SyncVectorEnv(2k)`` and ``AsyncVectorEnv(2k)``, each for ``--seconds`` per
round. The update is left out there: it is the same computation on the same
data for all three, whichever vector env stepped the envs (the first table
gives its time), so it would only add the same time to each; and
timing slices instead of whole training runs is what lets every point take
turns with its peers round after round. ``--plot`` draws the sweep.

    python benchmarks/bench_ppo.py [--steps 32768] [--rounds 5] [--seconds 2]
        [--sweep-rounds 3] [--plot ppo_envs_per_worker.png]   # about 4 min on 2 cores
    python benchmarks/bench_ppo.py --quick   # 8,192 steps, 3 rounds; sweep 2 rounds of
                                             # 0.5 s (about a minute)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode, VectorWrapper
from gymnasium.wrappers.vector import RecordEpisodeStatistics

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))   # ppo_cartpole
# the workers import this checkout's fibrl too
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)

from fibrl.rl import RemoteVectorEnv  # noqa: E402
from floor import start_env_workers, stop_env_workers  # noqa: E402

# torch and the example are imported where they are used: env workers (fibrl's and
# AsyncVectorEnv's, both started with spawn semantics) rebuild this module as their
# __main__, and have no use for torch.

SEED = 1
NUM_ENVS, PER_WORKER = 8, 4
SWEEP = (1, 2, 4, 8, 16)   # envs per worker, 2 workers
NAMES = {"fibrl": "RemoteVectorEnv", "async": "AsyncVectorEnv", "sync": "SyncVectorEnv",
         "bare": "bare pynng loop"}
SWEPT = ("fibrl", "async", "sync")   # the sweep's contenders


def cartpole():
    return gymnasium.make("CartPole-v1")


def make(kind: str, num_envs: int, per_worker: int):
    """A vector env of ``num_envs`` CartPoles, autoreset as ``examples/ppo_cartpole.py``."""
    mode = AutoresetMode.SAME_STEP
    if kind == "fibrl":
        return RemoteVectorEnv("CartPole-v1", num_envs, envs_per_worker=per_worker,
                               autoreset_mode=mode, seed=SEED)
    if kind == "bare":
        return BareVectorEnv(num_envs // per_worker, per_worker)
    if kind == "async":
        # spawn: a child forked after nng started aborts in nng ("not fork-reentrant safe")
        return gymnasium.vector.AsyncVectorEnv([cartpole] * num_envs, context="spawn",
                                               autoreset_mode=mode)
    return gymnasium.vector.SyncVectorEnv([cartpole] * num_envs, autoreset_mode=mode)


def start(kinds: list, num_envs: int, per_worker: int) -> tuple:
    """``({kind: vector env}, {kind: seconds it took to start})``."""
    envs, started = {}, {}
    try:
        for kind in kinds:
            t0 = time.perf_counter()
            envs[kind] = make(kind, num_envs, per_worker)
            envs[kind].reset(seed=SEED)   # every env up and answering
            started[kind] = time.perf_counter() - t0
    except BaseException:
        close(envs)
        raise
    return envs, started


def close(envs: dict) -> None:
    for env in envs.values():
        env.close()


# -- the floor: the same layout on bare pynng sockets --------------------------------------
class BareVectorEnv(gymnasium.vector.VectorEnv):
    """``workers`` x ``k`` CartPoles stepped over bare pynng: only what a PPO loop
    reads (observations, rewards, flags; empty infos), for :func:`train` to measure the
    floor of fibrl's layout with the same learner."""

    def __init__(self, workers: int, k: int) -> None:
        one = cartpole()
        self.single_observation_space = one.observation_space
        self.single_action_space = one.action_space
        one.close()
        self.num_envs, self.k = workers * k, k
        self.metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}
        self.observation_space = gymnasium.vector.utils.batch_space(
            self.single_observation_space, self.num_envs)
        self.action_space = gymnasium.vector.utils.batch_space(self.single_action_space,
                                                               self.num_envs)
        self.socks, self.procs = start_env_workers(workers, k, cartpole)

    def _exchange(self, frames: list) -> tuple:
        for sock, frame in zip(self.socks, frames):
            sock.send(frame)
        replies = b"".join(sock.recv() for sock in self.socks)
        k, n = self.k, len(self.socks)
        size = k * (16 + 8 + 2)
        parts = [replies[w * size:(w + 1) * size] for w in range(n)]
        obs = np.concatenate([np.frombuffer(p, np.float32, 4 * k).reshape(k, 4)
                              for p in parts])
        rewards = np.concatenate([np.frombuffer(p, np.float64, k, 16 * k) for p in parts])
        flags = np.concatenate([np.frombuffer(p, np.bool_, 2 * k, 24 * k).reshape(2, k)
                                for p in parts], axis=1)
        return obs, rewards, flags[0].copy(), flags[1].copy()

    def reset(self, *, seed: Any = None, options: Any = None) -> tuple:
        base = 0 if seed is None else int(seed)
        frames = [b"R%d" % (base + w * self.k) for w in range(len(self.socks))]
        return self._exchange(frames)[0], {}

    def step(self, actions: Any) -> tuple:
        acts = np.asarray(actions, dtype=np.int64)
        frames = [b"S" + acts[w * self.k:(w + 1) * self.k].tobytes()
                  for w in range(len(self.socks))]
        obs, rewards, terms, truncs = self._exchange(frames)
        return obs, rewards, terms, truncs, {}

    def close_extras(self, **kwargs: Any) -> None:
        stop_env_workers(self.socks, self.procs)


class Timed(VectorWrapper):
    """Adds up the wall and CPU (this process, all its threads) time spent in ``step``."""

    def __init__(self, env) -> None:
        super().__init__(env)
        self.wall = self.cpu = 0.0

    def step(self, actions):
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.env.step(actions)
        self.cpu += time.process_time() - c0
        self.wall += time.perf_counter() - t0
        return out


def workers_cpu() -> float:
    """CPU seconds used so far by every live descendant of this process (fibrl's and
    AsyncVectorEnv's workers), or NaN without psutil. The contenders not training are
    idle, so the change over a run is the training contender's workers'."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:   # ended meanwhile
            continue
        total += times.user + times.system
    return total


@dataclasses.dataclass
class Run:
    """One training run: its times and what it learned."""

    wall: float
    cpu: float          # this process's CPU time, all its threads
    env: float          # inside step
    env_cpu: float      # this process's CPU time inside step
    workers_cpu: float  # the env workers' CPU time
    update: float       # advantages and update
    steps: int
    returns: list       # every finished episode's return, in order
    weights: bytes      # the final parameters

    @property
    def learner(self) -> float:
        return self.wall - self.env

    @property
    def learner_cpu(self) -> float:
        return self.cpu - self.env_cpu


def train(vec, total_steps: int) -> Run:
    """PPO as ``examples/ppo_cartpole.py`` trains it, for ``total_steps`` env steps
    (whole rollouts) whatever the return reached, timing where the time goes."""
    import torch
    from ppo_cartpole import Agent, Args, Rollout

    args = Args(num_envs=vec.num_envs, seed=SEED)
    timed = Timed(vec)
    envs = RecordEpisodeStatistics(timed)
    torch.manual_seed(args.seed)
    n_obs = envs.single_observation_space.shape[0]
    agent = Agent(n_obs, int(envs.single_action_space.n))
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    rollout = Rollout(args, n_obs)
    returns: list = []
    steps, in_update = 0, 0.0
    others = workers_cpu()
    start, cpu = time.perf_counter(), time.process_time()
    next_obs = torch.tensor(envs.reset(seed=args.seed)[0], dtype=torch.float32)
    next_done = torch.zeros(args.num_envs)
    for _ in range(max(1, total_steps // (args.num_steps * args.num_envs))):
        next_obs, next_done, ended = rollout.collect(envs, agent, next_obs, next_done)
        returns += [r for _, r in ended]
        steps += args.num_steps * args.num_envs
        t0 = time.perf_counter()
        rollout.learn(agent, optimizer, next_obs, next_done)
        in_update += time.perf_counter() - t0
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    others = workers_cpu() - others
    weights = b"".join(p.detach().numpy().tobytes() for p in agent.parameters())
    return Run(wall, cpu, timed.wall, timed.cpu, others, in_update, steps, returns, weights)


def same_result(run: Run, reference: Run, who: str) -> None:
    """Raise unless ``run`` learned exactly what ``reference`` did."""
    if run.returns != reference.returns:
        at = next((i for i, (a, b) in enumerate(zip(run.returns, reference.returns)) if a != b),
                  min(len(run.returns), len(reference.returns)))
        raise RuntimeError(
            f"{who} did not give SyncVectorEnv's trajectories with the same seeds: "
            f"{len(run.returns)} episodes (mean return {np.mean(run.returns or [0]):.2f}) "
            f"against {len(reference.returns)} ({np.mean(reference.returns or [0]):.2f}), "
            f"first difference at episode {at}")
    if run.weights != reference.weights:
        raise RuntimeError(f"{who} gave SyncVectorEnv's episodes but other final weights: "
                           f"the learner is not deterministic (torch threads?)")


def measure_training(steps: int, rounds: int) -> tuple:
    """``({kind: [Run per round]}, {kind: start seconds})``, every run checked against
    the first SyncVectorEnv run."""
    kinds = list(NAMES)
    envs, started = start(kinds, NUM_ENVS, PER_WORKER)
    runs: dict = {kind: [] for kind in kinds}
    try:
        reference = train(envs["sync"], steps)   # warms torch up too; not counted
        for r in range(rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                run = train(envs[kind], steps)
                same_result(run, reference, f"{NAMES[kind]} (round {r + 1})")
                runs[kind].append(run)
    finally:
        close(envs)
    return runs, started


# -- the sweep --------------------------------------------------------------------------
def rollout_rate(vec, agent, seconds: float) -> float:
    """Env steps/s of PPO's rollout phase on ``vec`` (after a warm-up)."""
    import torch

    obs = torch.tensor(vec.reset(seed=SEED)[0], dtype=torch.float32)

    def step() -> Any:
        with torch.no_grad():
            action, _, _, _ = agent.act(obs)
        o, reward, term, trunc, _ = vec.step(action.numpy())
        torch.as_tensor(reward, dtype=torch.float32)
        torch.as_tensor(term | trunc, dtype=torch.float32)
        return torch.tensor(o, dtype=torch.float32)

    for _ in range(20):
        obs = step()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            obs = step()
        n += 10
    return n * vec.num_envs / (time.perf_counter() - t0)


def sweep(per_worker: tuple, rounds: int, seconds: float) -> dict:
    """``{k: [{kind: steps/s} per round]}``: each k's three vector envs are started,
    measured in turn for ``rounds`` rounds (alternating the order), and closed."""
    import torch
    from ppo_cartpole import Agent

    torch.manual_seed(SEED)
    agent = Agent(4, 2)
    kinds = list(SWEPT)
    points = {}
    for k in per_worker:
        envs, _ = start(kinds, 2 * k, k)
        try:
            points[k] = [{kind: rollout_rate(envs[kind], agent, seconds)
                          for kind in (kinds if r % 2 == 0 else kinds[::-1])}
                         for r in range(rounds)]
        finally:
            close(envs)
    return points


def plot(points: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(points)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in SWEPT:
        label = ("fibrl RemoteVectorEnv(2k), 2 workers x k" if kind == "fibrl"
                 else f"{NAMES[kind]}(2k)")
        ax.plot(ks, [_median(points[k], kind) for k in ks], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set(xlabel="envs per worker k (2k envs)", ylabel="env steps/s (rollout phase)",
           title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# -- tables -----------------------------------------------------------------------------
def _median(rounds: list, key: str, of: Callable = lambda x: x) -> float:
    return float(np.median([of(r[key]) for r in rounds]))


LAYOUT = f"{NUM_ENVS // PER_WORKER} workers x {PER_WORKER} envs"
SPLIT = ("wall", "env", "env_cpu", "workers_cpu", "learner", "learner_cpu", "update")


def ratio_table(rounds: list) -> str:
    wall = attrgetter("wall")
    lines = ["| measure | this | against | ratio | better | target |",
             "|---|---|---|---|---|---|"]
    rows = (("fibrl", f"{LAYOUT}", "async", f"{NAMES['async']}({NUM_ENVS})", "<= 0.5x"),
            ("fibrl", f"{LAYOUT}", "sync", f"{NAMES['sync']}({NUM_ENVS})", ""),
            ("fibrl", f"{LAYOUT}", "bare", f"the {NAMES['bare']} {LAYOUT}", ""),
            ("bare", f"the {NAMES['bare']} {LAYOUT}", "async", f"{NAMES['async']}({NUM_ENVS})",
             ""))
    for kind, who, peer, against, target in rows:
        ratio = float(np.median([r[kind].wall / r[peer].wall for r in rounds]))
        lines.append(f"| PPO wall time, {who} vs {against}, s | "
                     f"{_median(rounds, kind, wall):.2f} | {_median(rounds, peer, wall):.2f} "
                     f"| {ratio:.2f}x | lower | {target} |")
    return "\n".join(lines)


def split_table(rounds: list, started: dict) -> str:
    lines = ["| vector env | wall s | in step s | this process's CPU in step s | "
             "workers' CPU s | learner s | learner CPU s | of which update s | "
             "env steps/s | started in s |", "|" + "---|" * 10]
    for kind, name in NAMES.items():
        label = (f"{name}, {LAYOUT}" if kind == "bare"
                 else f"{name}({NUM_ENVS})" + (f", {LAYOUT}" if kind == "fibrl" else ""))
        cells = [_median(rounds, kind, attrgetter(field)) for field in SPLIT]
        rate = _median(rounds, kind, lambda run: run.steps / run.wall)
        lines.append(f"| {label} | " + " | ".join(f"{c:.2f}" if np.isfinite(c) else "—"
                                                  for c in cells)
                     + f" | {rate:,.0f} | {started[kind]:.1f} |")
    return "\n".join(lines)


def sweep_table(points: dict) -> str:
    lines = ["| envs per worker | envs | fibrl steps/s | Sync steps/s | Async steps/s | "
             "fibrl/Sync | fibrl/Async | better |", "|---|---|---|---|---|---|---|---|"]
    for k, rounds in sorted(points.items()):
        rates = [f"{_median(rounds, kind):,.0f}" for kind in ("fibrl", "sync", "async")]
        ratios = [float(np.median([r["fibrl"] / r[peer] for r in rounds]))
                  for peer in ("sync", "async")]
        lines.append(f"| {k} | {2 * k} | {rates[0]} | {rates[1]} | {rates[2]} | "
                     f"{ratios[0]:.2f}x | {ratios[1]:.2f}x | higher |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="8,192 steps and 3 rounds; the sweep 2 rounds of 0.5 s "
                             "(unless given)")
    parser.add_argument("--steps", type=int,
                        help="env steps per training run, in whole rollouts of 128 steps of "
                             "the 8 envs, at least one (default 32768)")
    parser.add_argument("--rounds", type=int, help="training rounds (default 5)")
    parser.add_argument("--seconds", type=float, help="per sweep measurement (default 2)")
    parser.add_argument("--sweep-rounds", type=int, help="sweep rounds (default 3)")
    parser.add_argument("--sweep", type=int, nargs="*", default=list(SWEEP),
                        help="envs per worker of the sweep (default 1 2 4 8 16; none: skip it)")
    parser.add_argument("--plot", help="write the sweep's PNG here")
    args = parser.parse_args()
    sizes = {"steps": (32768, 8192), "rounds": (5, 3), "seconds": (2.0, 0.5),
             "sweep_rounds": (3, 2)}
    for name, (full, quick) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
        elif getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if any(k <= 0 for k in args.sweep):
        parser.error("--sweep takes envs per worker >= 1")
    import torch

    torch.set_num_threads(1)   # the learner uses one core, as the env workers do
    load_before = os.getloadavg()[0]
    runs, started = measure_training(args.steps, args.rounds)
    points = sweep(tuple(args.sweep), args.sweep_rounds, args.seconds) if args.sweep else {}
    rounds = [{kind: runs[kind][r] for kind in runs} for r in range(args.rounds)]
    reference = runs["sync"][0]
    print(f"{platform.python_implementation()} {platform.python_version()}, torch "
          f"{torch.__version__} (CPU, 1 thread), gymnasium {gymnasium.__version__}, "
          f"{os.cpu_count()} cores; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print(f"PPO (examples/ppo_cartpole.py's, seed {SEED}): {reference.steps:,} env steps per "
          f"run, {NUM_ENVS} envs; medians of {args.rounds} rounds (ratio: median of the "
          f"rounds' ratios); the {len(NAMES) * args.rounds} runs all learned the same: "
          f"{len(reference.returns)} episodes, mean return {np.mean(reference.returns):.1f}, "
          f"final weights bit-identical")
    print()
    print(ratio_table(rounds))
    print()
    print("Where the time went (seconds per run; in step: inside the vector env's step, "
          "of which this process's CPU, all its threads; workers' CPU: the env processes'; "
          "learner: the rest, i.e. the policy's forward passes, the rollout's tensors and "
          "the update; started: the vector env made and first reset, not in the wall time)")
    print()
    print(split_table(rounds, started))
    if points:
        print()
        per_step = _median(rounds, "sync", lambda run: run.update / run.steps) * 1e6
        print(f"Rollout phase (the policy's forward pass, step, the result's tensors; no "
              f"update), 2 workers x k envs against {NAMES['sync']}(2k) and "
              f"{NAMES['async']}(2k); medians of {args.sweep_rounds} rounds of "
              f"{args.seconds:g} s. The update, the same for all three, adds about "
              f"{per_step:.0f} µs per env step with {NUM_ENVS} envs (measured above; more with "
              f"fewer envs, whose minibatches are smaller)")
        print()
        print(sweep_table(points))
        if args.plot:
            plot(points, args.plot, f"PPO's rollout phase on CartPole-v1 "
                                    f"({os.cpu_count()} cores)")
            print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
