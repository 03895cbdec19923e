"""Shared state through a Manager: a dict of counters, a list of events, one lock.

Workers increment counters in a managed dict under a fibrl ``Lock`` and append
to a managed list; the parent reads the totals. The manager's server is itself
a fibrl process, so it runs on the chosen backend like the workers.

    python examples/shared_state.py --workers 4 --increments 50
    python examples/shared_state.py --backend docker
"""
from __future__ import annotations

import argparse
import dataclasses

import fibrl as mp


@dataclasses.dataclass
class Args:
    backend: str = "local"
    """where workers run: local, docker or kubernetes"""
    workers: int = 3
    increments: int = 20
    """increments of the shared counter per worker"""
    timeout: float = 120.0


def work(worker: int, counters, log, lock, increments: int) -> None:
    for _ in range(increments):
        with lock:                      # read-modify-write of a managed dict is not atomic
            counters["total"] += 1
    counters[f"worker-{worker}"] = increments
    log.append(f"worker {worker} done")


def run(args: Args) -> dict:
    with mp.Manager() as manager:
        counters, log, lock = manager.dict(total=0), manager.list(), mp.Lock()
        workers = [mp.Process(target=work, args=(w, counters, log, lock, args.increments))
                   for w in range(args.workers)]
        for process in workers:
            process.start()
        for process in workers:
            process.join(args.timeout)
        result = {"counters": dict(counters), "log": sorted(log)}
    print(f"total {result['counters']['total']} (expected {args.workers * args.increments}); "
          f"{len(result['log'])} workers reported")
    return result


def main(args: Args) -> dict:
    mp.init(backend=args.backend)
    return run(args)


def parse(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main(parse())
