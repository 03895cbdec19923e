"""Estimate pi with a Pool: each task throws darts at the unit square.

The classic ``multiprocessing`` example with one import changed. Every task
draws ``samples`` random points with its own seed and counts those inside the
quarter circle; the parent adds the counts up.

    python examples/pi_estimation.py                      # local processes
    python examples/pi_estimation.py --backend docker     # containers (image fibrl:latest)
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import time

import fibrl as mp


@dataclasses.dataclass
class Args:
    backend: str = "local"
    """where workers run: local, docker or kubernetes"""
    workers: int = 2
    """Pool size"""
    tasks: int = 16
    """number of tasks (each with its own seed)"""
    samples: int = 200_000
    """points per task"""


def inside(seed_and_samples: tuple[int, int]) -> int:
    """How many of ``samples`` random points fall inside the quarter circle."""
    seed, samples = seed_and_samples
    rng = random.Random(seed)
    return sum(rng.random() ** 2 + rng.random() ** 2 <= 1.0 for _ in range(samples))


def estimate(args: Args) -> float:
    with mp.Pool(args.workers) as pool:
        hits = pool.map(inside, [(seed, args.samples) for seed in range(args.tasks)])
    return 4.0 * sum(hits) / (args.tasks * args.samples)


def main(args: Args) -> float:
    mp.init(backend=args.backend)
    started = time.perf_counter()
    pi = estimate(args)
    print(f"pi ~ {pi:.5f} from {args.tasks * args.samples:,} points on {args.workers} "
          f"{args.backend} workers in {time.perf_counter() - started:.2f} s")
    return pi


def parse(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main(parse())
