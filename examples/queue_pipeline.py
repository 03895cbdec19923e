"""A producer/consumer pipeline on two Queues.

Producers put work items on one queue; consumers take them, transform them and
put results on another; the parent collects every result. Each consumer stops
when it takes a ``None`` (one per consumer), the usual way to end a pipeline.

    python examples/queue_pipeline.py --producers 2 --consumers 3 --items 100
    python examples/queue_pipeline.py --backend docker
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib

import fibrl as mp


@dataclasses.dataclass
class Args:
    backend: str = "local"
    """where workers run: local, docker or kubernetes"""
    producers: int = 2
    consumers: int = 2
    items: int = 200
    """items per producer"""
    timeout: float = 120.0
    """seconds to wait for any one result"""


def produce(work, producer: int, items: int) -> None:
    for i in range(items):
        work.put((producer, i, f"item {producer}-{i}"))


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def consume(work, results) -> None:
    name = mp.current_process().name
    while (item := work.get()) is not None:
        producer, i, text = item
        results.put((producer, i, digest(text), name))


def run(args: Args) -> dict[tuple[int, int], str]:
    work, results = mp.Queue(), mp.Queue()
    consumers = [mp.Process(target=consume, args=(work, results)) for _ in range(args.consumers)]
    producers = [mp.Process(target=produce, args=(work, p, args.items))
                 for p in range(args.producers)]
    for process in consumers + producers:
        process.start()
    collected, by_consumer = {}, {}
    for _ in range(args.producers * args.items):
        producer, i, value, name = results.get(timeout=args.timeout)
        collected[producer, i] = value
        by_consumer[name] = by_consumer.get(name, 0) + 1
    for process in producers:
        process.join(args.timeout)
    for _ in consumers:
        work.put(None)
    for process in consumers:
        process.join(args.timeout)
    print(f"{len(collected)} results; per consumer: "
          + ", ".join(f"{name} {count}" for name, count in sorted(by_consumer.items())))
    return collected


def main(args: Args) -> dict[tuple[int, int], str]:
    mp.init(backend=args.backend)
    return run(args)


def parse(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main(parse())
