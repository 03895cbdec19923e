"""Evolution strategies on CartPole-v1 with a Pool: the workload Fiber was built for.

A linear policy (push right when ``obs @ w + b > 0``) is trained with OpenAI-style
evolution strategies: each generation perturbs the parameters with ``population``
Gaussian noise vectors (in antithetic pairs), a Pool evaluates every perturbed
policy on its own episodes in parallel, and the parameters move along the
noise weighted by the centred ranks of the returns. Only the parameters and the
returns travel; the environment lives in the workers.

    python examples/evolution_strategies.py                      # a few seconds
    python examples/evolution_strategies.py --generations 30 --plot es.png
    python examples/evolution_strategies.py --backend docker --workers 4

Needs gymnasium and numpy (``pip install -e '.[rl]'``); ``--plot`` needs matplotlib.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

import fibrl as mp


@dataclasses.dataclass
class Args:
    backend: str = "local"
    """where workers run: local, docker or kubernetes"""
    workers: int = 2
    generations: int = 10
    population: int = 16
    """perturbed policies per generation (even: antithetic pairs)"""
    episodes: int = 2
    """episodes per evaluation"""
    sigma: float = 0.1
    """noise scale"""
    lr: float = 0.1
    """step size"""
    seed: int = 0
    env: str = "CartPole-v1"
    plot: str = ""
    """write a PNG of the returns per generation to this path (empty: none)"""


_ENVS: dict = {}


def episode_return(params: np.ndarray, env_id: str, seed: int, episodes: int) -> float:
    """Mean return of the linear policy ``params`` over ``episodes`` seeded episodes."""
    import gymnasium as gym

    env = _ENVS.get(env_id) or _ENVS.setdefault(env_id, gym.make(env_id))
    weights, bias = params[:-1], params[-1]
    total = 0.0
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        done = False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(int(obs @ weights + bias > 0))
            total += float(reward)
            done = terminated or truncated
    return total / episodes


def evaluate(job: tuple) -> float:
    return episode_return(*job)


def centred_ranks(values: np.ndarray) -> np.ndarray:
    ranks = np.empty(len(values))
    ranks[values.argsort()] = np.arange(len(values))
    return ranks / (len(values) - 1) - 0.5


def train(args: Args, pool) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    import gymnasium as gym

    size = gym.make(args.env).observation_space.shape[0] + 1
    params, history = np.zeros(size), []
    half = max(1, args.population // 2)
    for generation in range(args.generations):
        noise = rng.standard_normal((half, size))
        noise = np.concatenate([noise, -noise])
        seed = args.seed * 1_000_003 + generation * args.episodes
        jobs = [(params + args.sigma * eps, args.env, seed, args.episodes) for eps in noise]
        returns = np.array(pool.map(evaluate, jobs))
        params = params + args.lr / (len(noise) * args.sigma) * centred_ranks(returns) @ noise
        current = pool.apply(episode_return, (params, args.env, seed + 10_000, args.episodes))
        history.append({"generation": generation, "mean": float(returns.mean()),
                        "max": float(returns.max()), "policy": current})
        print(f"generation {generation:3d}: population mean {returns.mean():6.1f} "
              f"max {returns.max():6.1f}  policy {current:6.1f}")
    return history


def plot(history: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    generations = [h["generation"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for key, label in (("policy", "current policy"), ("mean", "population mean"),
                       ("max", "population best")):
        ax.plot(generations, [h[key] for h in history], label=label)
    ax.set_xlabel("generation")
    ax.set_ylabel("episode return")
    ax.set_title(title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args: Args) -> list[dict]:
    mp.init(backend=args.backend)
    started = time.perf_counter()
    with mp.Pool(args.workers) as pool:
        history = train(args, pool)
    elapsed = time.perf_counter() - started
    print(f"{args.generations} generations x {args.population} policies on {args.workers} "
          f"{args.backend} workers in {elapsed:.1f} s")
    if args.plot:
        plot(history, args.plot, f"ES on {args.env}, population {args.population}, "
                                 f"{args.workers} {args.backend} workers")
        print(f"plot written to {args.plot}")
    return history


def parse(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main(parse())
