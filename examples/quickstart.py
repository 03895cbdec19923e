"""fibrl quickstart: the multiprocessing program you already have, one import changed.

Runs a Process, a Queue, a Pipe and a Pool on the local backend by default;
choose another with ``--backend docker`` (needs the worker image, see
docs/docker.md) or ``FIBRL_BACKEND=...``.

    python examples/quickstart.py --tasks 20
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import fibrl as mp


@dataclasses.dataclass
class Args:
    backend: str = "local"
    tasks: int = 20
    workers: int = 2


def square(x: int) -> int:
    return x * x


def greet(q, name: str) -> None:
    q.put(f"hello {name} from pid {os.getpid()} ({mp.current_process().name})")


def pong(conn) -> None:
    while (msg := conn.recv()) != "bye":
        conn.send(msg.upper())


def main(args: Args) -> None:
    mp.init(backend=args.backend)

    q = mp.Queue()
    p = mp.Process(target=greet, args=(q, "world"))
    p.start()
    print(q.get(timeout=60))
    p.join()

    here, there = mp.Pipe()
    p = mp.Process(target=pong, args=(there,))
    p.start()
    here.send("ping")
    print("pipe answered", here.recv())
    here.send("bye")
    p.join()

    with mp.Pool(args.workers) as pool:
        results = pool.map(square, range(args.tasks))
    print(f"sum of squares below {args.tasks}: {sum(results)}")


def parse() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":
    main(parse())
