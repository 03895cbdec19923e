"""Pool benchmark: ``fibrl.Pool`` against stdlib ``multiprocessing`` spawn and fork, one run.

Run::

    python benchmarks/bench_pool.py            # full, about 3 minutes
    python benchmarks/bench_pool.py --quick    # about 1 minute

Measures, on ``--workers`` workers (2), for each of fibrl, mp spawn and mp fork:

- no-op ``map`` at ``chunksize=1`` (tasks/s);
- no-op ``map`` over 200,000 items at the default chunksize (tasks/s);
- ``map`` of 1 ms and 10 ms ``time.sleep`` tasks at ``chunksize=1``: efficiency,
  the ideal time (total sleep / workers) over the measured time. ``sleep``
  overshoots, so the ceiling is below 1 (about 0.94 for 1 ms here);
- Fiber's methodology: rounds of 5 ``apply_async`` then ``get`` all 5, with
  tasks of 1 s, 100 ms, 10 ms, 1 ms: seconds per round.

The three pools are started and warmed up before timing; each repeat of a
measurement runs on the three in turn (load from elsewhere weighs on all
alike), and each number is the median of ``--repeat`` runs. The table gives
the ratio fibrl / peer with the direction that is better, and the machine's
load average before and after. Numbers to read, not assertions.

Neither library is imported at module level: spawn children and fibrl
workers re-import this file as ``__mp_main__``.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass


# -- tasks (run in the workers) -----------------------------------------------------
def noop(x):
    return x


def nap(seconds):
    time.sleep(seconds)


# -- measurements -------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One line of the table."""

    name: str
    unit: str
    higher_is_better: bool


def tasks_per_s(pool, n: int, chunksize) -> float:
    started = time.perf_counter()
    pool.map(noop, range(n), chunksize)
    return n / (time.perf_counter() - started)


def efficiency(pool, seconds: float, n: int, workers: int) -> float:
    started = time.perf_counter()
    pool.map(nap, [seconds] * n, 1)
    return seconds * n / workers / (time.perf_counter() - started)


def fiber_rounds(pool, seconds: float, rounds: int) -> float:
    started = time.perf_counter()
    for _ in range(rounds):
        results = [pool.apply_async(nap, (seconds,)) for _ in range(5)]
        for result in results:
            result.get()
    return (time.perf_counter() - started) / rounds


def sleep_ceiling(seconds: float, n: int) -> float:
    """Efficiency of back-to-back sleeps in this process: what sleep overshoot allows."""
    started = time.perf_counter()
    for _ in range(n):
        time.sleep(seconds)
    return seconds * n / (time.perf_counter() - started)


def plan(quick: bool) -> list:
    """(Row, measure(pool, workers) -> value) pairs."""
    scale = 0.25 if quick else 1.0
    n_small = int(40_000 * scale)
    return [
        (Row("no-op map, chunksize=1", "tasks/s", True),
         lambda p, w: tasks_per_s(p, n_small, 1)),
        (Row("no-op map of 200,000, default chunksize", "tasks/s", True),
         lambda p, w: tasks_per_s(p, 200_000, None)),
        (Row("1 ms sleep map, chunksize=1: efficiency", "", True),
         lambda p, w: efficiency(p, 0.001, int(4000 * scale), w)),
        (Row("10 ms sleep map, chunksize=1: efficiency", "", True),
         lambda p, w: efficiency(p, 0.010, int(400 * scale), w)),
        (Row("Fiber rounds of 5 x 1 s", "s/round", False),
         lambda p, w: fiber_rounds(p, 1.0, 1 if quick else 2)),
        (Row("Fiber rounds of 5 x 100 ms", "s/round", False),
         lambda p, w: fiber_rounds(p, 0.1, 3 if quick else 10)),
        (Row("Fiber rounds of 5 x 10 ms", "s/round", False),
         lambda p, w: fiber_rounds(p, 0.01, 20 if quick else 50)),
        (Row("Fiber rounds of 5 x 1 ms", "s/round", False),
         lambda p, w: fiber_rounds(p, 0.001, 100 if quick else 300)),
    ]


def make_pool(lib: str, workers: int):
    if lib == "fibrl":
        import fibrl

        return fibrl.Pool(workers)
    import multiprocessing

    return multiprocessing.get_context(lib.split()[1]).Pool(workers)


LIBS = ("fibrl", "mp spawn", "mp fork")


def measure_all(workers: int, rows: list, repeat: int) -> dict:
    """Interleaved: each repeat of a row runs on every library in turn, so that load
    from elsewhere on the machine weighs on all of them alike."""
    # mp's fork pool first: forking a process whose nng threads run is not safe.
    pools = {lib: make_pool(lib, workers) for lib in reversed(LIBS)}
    try:
        for pool in pools.values():
            pool.map(noop, range(1000), 1)  # workers up and warm
        results: dict = {lib: [] for lib in LIBS}
        for row, fn in rows:
            runs = {lib: [] for lib in LIBS}
            for _ in range(repeat if row.unit != "s/round" else 1):
                for lib in LIBS:
                    runs[lib].append(fn(pools[lib], workers))
            for lib in LIBS:
                results[lib].append(statistics.median(runs[lib]))
                print(f"  {lib:9s} {row.name}: {results[lib][-1]:.4g} {row.unit}",
                      file=sys.stderr)
        return results
    finally:
        for pool in pools.values():
            pool.terminate()
            pool.join()


def table(rows: list, results: dict) -> str:
    libs = list(results)
    head = "| measurement | " + " | ".join(libs) + " | fibrl/spawn | fibrl/fork | better |"
    lines = [head, "|" + "---|" * (len(libs) + 4)]
    for i, (row, _) in enumerate(rows):
        values = [results[lib][i] for lib in libs]
        cells = [_fmt(v) for v in values]
        ratios = [_fmt(results["fibrl"][i] / results[peer][i], 2)
                  for peer in ("mp spawn", "mp fork")]
        unit = f" ({row.unit})" if row.unit else ""
        lines.append(f"| {row.name}{unit} | " + " | ".join(cells) + " | "
                     + " | ".join(ratios) + f" | {'higher' if row.higher_is_better else 'lower'} |")
    return "\n".join(lines)


def _fmt(value: float, digits: int = 3) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.{digits}g}"


def main(argv: list) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    rows = plan(args.quick)
    load_before = os.getloadavg()[0]
    results = measure_all(args.workers, rows, args.repeat)
    ceilings = [sleep_ceiling(0.001, 1000), sleep_ceiling(0.010, 100)]
    print(f"\n{platform.python_implementation()} {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, {args.workers} workers, load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print(table(rows, results))
    print(f"\nSleep ceiling (back-to-back sleeps in one process, same run): "
          f"1 ms {ceilings[0]:.3f}, 10 ms {ceilings[1]:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
