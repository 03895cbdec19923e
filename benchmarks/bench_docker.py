"""Docker backend benchmark: container workers next to local processes, same machine, one run.

Run from the repository root (its directory is what containers mount)::

    python benchmarks/bench_docker.py            # about a minute
    python benchmarks/bench_docker.py --quick    # about 20 seconds

Measures, for the ``local`` and ``docker`` backends:

- Pool(4) time to first result (s): from ``Pool(4)`` until ``apply`` returns, the
  first pool of the run (cold: for docker it includes the one-time image check).
- Pool(4) no-op ``map`` throughput at chunksize=1 (tasks/s), median of repeats.
- Process start+join (ms): median of 10 ``Process(target=noop).start(); join()``.

Targets (issue 5): Pool(4) first result <= 2 s on docker; docker throughput at
chunksize=1 >= 0.8x local. The table gives docker/local ratios and says which
way is better. These are numbers to read, not assertions.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import fibrl

BACKENDS = ("local", "docker")


def noop(x=None):
    return x


def first_result(ctx) -> tuple:
    t0 = time.perf_counter()
    pool = ctx.Pool(4)
    pool.apply(noop, (1,))
    return pool, time.perf_counter() - t0


def throughput(pool, tasks: int, repeats: int) -> float:
    pool.map(noop, range(200), chunksize=1)  # warm-up: every worker connected and busy
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = pool.map(noop, range(tasks), chunksize=1)
        rates.append(tasks / (time.perf_counter() - t0))
        assert out == list(range(tasks))
    return statistics.median(rates)


def start_join(ctx, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        p = ctx.Process(target=noop)
        p.start()
        p.join(120)
        times.append(time.perf_counter() - t0)
        assert p.exitcode == 0, p.exitcode
    return statistics.median(times[1:]) * 1e3


def measure(backend: str, tasks: int, repeats: int) -> dict:
    fibrl.init(backend=backend)
    ctx = fibrl.get_context()
    pool, first = first_result(ctx)
    try:
        rate = throughput(pool, tasks, repeats)
    finally:
        pool.close()
        pool.join()
    return {"first": first, "rate": rate, "start": start_join(ctx, 10)}


ROWS = (
    ("Pool(4) time to first result (s)", "first", "lower", "{:.2f}"),
    ("Pool(4) map no-op, chunksize=1 (tasks/s)", "rate", "higher", "{:,.0f}"),
    ("Process start+join, median of 10 (ms)", "start", "lower", "{:.0f}"),
)


def table(results: dict) -> str:
    local, docker = results["local"], results["docker"]
    lines = [f"{'measure':44} {'local':>10} {'docker':>10} {'docker/local':>13}  better",
             "-" * 88]
    for label, key, better, fmt in ROWS:
        ratio = docker[key] / local[key]
        lines.append(f"{label:44} {fmt.format(local[key]):>10} {fmt.format(docker[key]):>10} "
                     f"{ratio:>12.2f}x  {better}")
    first_ok = "met" if docker["first"] <= 2.0 else "MISSED"
    rate_ok = "met" if docker["rate"] >= 0.8 * local["rate"] else "MISSED"
    lines += ["", f"target Pool(4) first result <= 2 s on docker: {first_ok}",
              f"target docker throughput >= 0.8x local at chunksize=1: {rate_ok}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tasks and repeats")
    args = parser.parse_args()
    tasks, repeats = (1000, 3) if args.quick else (5000, 5)
    results = {name: measure(name, tasks, repeats) for name in BACKENDS}
    print(f"fibrl {fibrl.__version__}, Python {platform.python_version()}, "
          f"{platform.machine()}, {fibrl.get_context('docker').cpu_count()} CPUs (engine); "
          f"{tasks} tasks x {repeats} repeats")
    print(table(results))


if __name__ == "__main__":
    main()
