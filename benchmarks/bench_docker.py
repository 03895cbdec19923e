"""Docker backend benchmark: container workers next to local processes, same machine, one run.

Run from the repository root (its directory is what containers mount)::

    python benchmarks/bench_docker.py            # about a minute
    python benchmarks/bench_docker.py --quick    # about 20 seconds

Measures, for the ``local`` and ``docker`` backends:

- Pool(4) time to first result (s): from ``Pool(4)`` until ``apply`` returns, the
  first pool of the run (cold: for docker it includes the one-time image check).
- Pool(4) no-op ``map`` throughput at chunksize=1 (tasks/s), median of repeats.
- Process start+join (ms): median of 10 ``Process(target=noop).start(); join()``.

Both backends' pools stay up side by side and the timed runs alternate between
them (after a warm-up each), so a change of load on the machine hits both alike.

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


def map_rate(pool, tasks: int) -> float:
    t0 = time.perf_counter()
    out = pool.map(noop, range(tasks), chunksize=1)
    rate = tasks / (time.perf_counter() - t0)
    assert out == list(range(tasks))
    return rate


def start_join(ctx) -> float:
    t0 = time.perf_counter()
    p = ctx.Process(target=noop)
    p.start()
    p.join(120)
    assert p.exitcode == 0, p.exitcode
    return (time.perf_counter() - t0) * 1e3


def alternate(measure, args: dict, repeats: int) -> dict:
    """Median of ``repeats`` runs per backend, interleaved so load changes hit both alike."""
    samples: dict = {name: [] for name in args}
    for arg in args.values():
        measure(arg)  # warm-up
    for _ in range(repeats):
        for name, arg in args.items():
            samples[name].append(measure(arg))
    return {name: statistics.median(values) for name, values in samples.items()}


def run(tasks: int, repeats: int) -> dict:
    contexts = {name: fibrl.get_context(name) for name in BACKENDS}
    pools, results = {}, {name: {} for name in BACKENDS}
    try:
        for name, ctx in contexts.items():  # cold: the first pool of the run
            pools[name], results[name]["first"] = first_result(ctx)
        rates = alternate(lambda pool: map_rate(pool, tasks), pools, repeats)
    finally:
        for pool in pools.values():
            pool.close()
            pool.join()
    starts = alternate(start_join, contexts, 10)
    for name in BACKENDS:
        results[name].update(rate=rates[name], start=starts[name])
    return results


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
    results = run(tasks, repeats)
    print(f"fibrl {fibrl.__version__}, Python {platform.python_version()}, "
          f"{platform.machine()}, {fibrl.get_context('docker').cpu_count()} CPUs (engine); "
          f"{tasks} tasks x {repeats} repeats")
    print(table(results))


if __name__ == "__main__":
    main()
