"""Environments hosted by a manager, stepped asynchronously (the seed snippet of fibrl.rl).

Ten CartPole environments live in one manager process (a local process, a
docker container or a kubernetes pod, per ``--backend``); every ``reset`` and
``step`` returns a handle at once, so the ten steps overlap.

    python examples/remote_envs.py --steps 1000 [--backend docker]
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import gymnasium

import fibrl
import fibrl.rl


@dataclasses.dataclass
class Args:
    backend: str = "local"
    envs: int = 10
    steps: int = 1000


class RemoteEnvManager(fibrl.rl.RemoteEnvManager):
    pass


RemoteEnvManager.register("Env", lambda: gymnasium.make("CartPole-v1"))


def policy(obs):
    """Push the cart toward the side the pole leans to (a passable CartPole policy)."""
    return [int(o[0][2] > 0) for o in obs]


def run(args: Args) -> float:
    fibrl.init(backend=args.backend)
    manager = RemoteEnvManager()
    manager.start()
    try:
        envs = [manager.Env() for _ in range(args.envs)]
        obs = [h.get(timeout=60) for h in [e.reset() for e in envs]]
        start = time.perf_counter()
        for _ in range(args.steps):
            handles = [e.step(a) for e, a in zip(envs, policy(obs))]
            results = [h.get(timeout=60) for h in handles]
            obs = [(o, i) if not (term or trunc) else e.reset().get(timeout=60)
                   for e, (o, _r, term, trunc, i) in zip(envs, results)]
        return time.perf_counter() - start
    finally:
        manager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument("--" + field.name, type=type(field.default), default=field.default)
    args = Args(**vars(parser.parse_args()))
    seconds = run(args)
    print(f"{args.envs} envs x {args.steps} steps on {args.backend}: {seconds:.2f} s "
          f"({args.envs * args.steps / seconds:.0f} env steps/s)")


if __name__ == "__main__":
    main()
