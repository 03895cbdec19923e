"""Pool benchmark: ``fibrl.Pool`` against multiprocessing, loky and Ray, one run.

Run::

    python benchmarks/bench_pool.py            # full, about 4 minutes (more with Ray)
    python benchmarks/bench_pool.py --quick    # about 1 minute
    python benchmarks/bench_pool.py --quick --plot docs/img/pool_workers.png

Peers: stdlib ``multiprocessing`` spawn and fork always; loky
(``get_reusable_executor``) and Ray (``ray.util.multiprocessing.Pool``) when
they are installed (``pip install loky ray``: benchmark peers, never fibrl
dependencies); an absent peer is named in the output. A peer without a
default chunksize (loky) gets the stdlib's rule (``ceil(n / (4 x workers))``).

Measures, on ``--workers`` workers (2), for each library:

- no-op ``map`` at ``chunksize=1`` (tasks/s);
- no-op ``map`` over 200,000 items at the default chunksize (tasks/s);
- ``map`` of 1 ms and 10 ms ``time.sleep`` tasks at ``chunksize=1``: efficiency,
  the ideal time (total sleep / workers) over the measured time. ``sleep``
  overshoots, so the ceiling is below 1 (about 0.94 for 1 ms here);
- Fiber's methodology: rounds of 5 ``apply_async`` then ``get`` all 5, with
  tasks of 1 s, 100 ms, 10 ms, 1 ms: seconds per round.

The pools are started and warmed up before timing; each repeat of a
measurement runs on every pool in turn (load from elsewhere weighs on all
alike), and each number is the median of ``--repeat`` runs. The table gives
the ratio fibrl / peer with the direction that is better, and the machine's
load average before and after. Numbers to read, not assertions.

Then, against the number of workers (``--sweep``, default 1 2 4 8; 1 2 4 with
``--quick``), for each library: no-op ``map`` throughput at ``chunksize=1``
and the efficiency of 1 ms sleep tasks; ``--plot`` draws both (matplotlib).

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


BASE_LIBS = ("fibrl", "mp spawn", "mp fork")
PEERS = {"loky": "loky", "ray": "ray"}   # library -> module that must be importable
RAY_CPUS = [1]   # CPUs Ray is told it has: the largest pool of the run (set by main)


def available_peers() -> tuple:
    """(present, absent): the optional peers that can be measured here."""
    import importlib.util

    present = tuple(lib for lib, module in PEERS.items() if importlib.util.find_spec(module))
    return present, tuple(lib for lib in PEERS if lib not in present)


class LokyPool:
    """loky's reusable executor behind the few Pool methods measured here."""

    def __init__(self, workers: int) -> None:
        from loky import get_reusable_executor

        self.workers = workers
        self.executor = get_reusable_executor(max_workers=workers, timeout=600)

    def map(self, func, iterable, chunksize=None):
        items = list(iterable)
        if chunksize is None:   # the stdlib's default rule; loky's own default is 1
            chunksize = max(1, -(-len(items) // (4 * self.workers)))
        return list(self.executor.map(func, items, chunksize=chunksize))

    def apply_async(self, func, args=()):
        future = self.executor.submit(func, *args)
        future.get = future.result
        return future

    def terminate(self) -> None:
        self.executor.shutdown(wait=True, kill_workers=True)

    def join(self) -> None:
        pass


def make_pool(lib: str, workers: int):
    if lib == "fibrl":
        import fibrl

        return fibrl.Pool(workers)
    if lib == "loky":
        return LokyPool(workers)
    if lib == "ray":
        import ray
        from ray.util.multiprocessing import Pool as RayPool

        if not ray.is_initialized():   # one Ray instance for every pool size of the run
            ray.init(num_cpus=max(workers, RAY_CPUS[0], os.cpu_count() or 1),
                     include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        return RayPool(processes=workers)
    import multiprocessing

    return multiprocessing.get_context(lib.split()[1]).Pool(workers)


def open_pools(libs: tuple, workers: int) -> dict:
    """Every library's pool, warm. mp's fork pool first: forking a process whose nng
    (or Ray) threads run is not safe."""
    order = sorted(libs, key=lambda lib: lib != "mp fork")
    pools = {}
    try:
        for lib in order:
            pools[lib] = make_pool(lib, workers)
            pools[lib].map(noop, range(1000), 1)  # workers up and warm
    except BaseException:
        close_pools(pools)
        raise
    return {lib: pools[lib] for lib in libs}


def close_pools(pools: dict) -> None:
    for pool in pools.values():
        pool.terminate()
        pool.join()


def measure_all(libs: tuple, workers: int, rows: list, repeat: int) -> dict:
    """Interleaved: each repeat of a row runs on every library in turn, so that load
    from elsewhere on the machine weighs on all of them alike."""
    pools = open_pools(libs, workers)
    try:
        results: dict = {lib: [] for lib in libs}
        for row, fn in rows:
            runs = {lib: [] for lib in libs}
            for _ in range(repeat if row.unit != "s/round" else 1):
                for lib in libs:
                    runs[lib].append(fn(pools[lib], workers))
            for lib in libs:
                results[lib].append(statistics.median(runs[lib]))
                print(f"  {lib:9s} {row.name}: {results[lib][-1]:.4g} {row.unit}",
                      file=sys.stderr)
        return results
    finally:
        close_pools(pools)


def sweep(libs: tuple, sizes: list, n_noop: int, n_nap: int, repeat: int) -> dict:
    """``{lib: [(workers, no-op tasks/s, 1 ms efficiency), ...]}``: one set of pools
    per size, every library measured in turn at each repeat."""
    out: dict = {lib: [] for lib in libs}
    for workers in sizes:
        pools = open_pools(libs, workers)
        try:
            runs = {lib: ([], []) for lib in libs}
            for _ in range(repeat):
                for lib in libs:
                    runs[lib][0].append(tasks_per_s(pools[lib], n_noop, 1))
                    runs[lib][1].append(efficiency(pools[lib], 0.001, n_nap * workers,
                                                   workers))
        finally:
            close_pools(pools)
        for lib in libs:
            point = (workers, statistics.median(runs[lib][0]),
                     statistics.median(runs[lib][1]))
            out[lib].append(point)
            print(f"  {lib:9s} {workers} workers: {point[1]:,.0f} tasks/s, "
                  f"1 ms efficiency {point[2]:.3f}", file=sys.stderr)
    return out


def sweep_table(points: dict) -> str:
    libs = list(points)
    lines = ["| workers | " + " | ".join(f"{lib} tasks/s" for lib in libs) + " | "
             + " | ".join(f"{lib} 1 ms eff." for lib in libs) + " |",
             "|" + "---:|" * (1 + 2 * len(libs))]
    for i, (workers, _, _) in enumerate(points[libs[0]]):
        lines.append(f"| {workers} | "
                     + " | ".join(_fmt(points[lib][i][1]) for lib in libs) + " | "
                     + " | ".join(f"{points[lib][i][2]:.3f}" for lib in libs) + " |")
    return "\n".join(lines)


def plot(points: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for lib, rows in points.items():
        sizes = [r[0] for r in rows]
        axes[0].plot(sizes, [r[1] for r in rows], marker="o", label=lib)
        axes[1].plot(sizes, [r[2] for r in rows], marker="o", label=lib)
    axes[0].set(title="no-op map, chunksize=1", xlabel="workers", ylabel="tasks/s")
    axes[1].set(title="1 ms sleep tasks, chunksize=1", xlabel="workers",
                ylabel="efficiency (ideal / measured time)", ylim=(0, 1.05))
    sizes = sorted({r[0] for rows in points.values() for r in rows})
    axes[0].set_yscale("log")   # peers differ by orders of magnitude
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def table(rows: list, results: dict) -> str:
    libs = list(results)
    peers = [lib for lib in libs if lib != "fibrl"]
    head = ("| measurement | " + " | ".join(libs) + " | "
            + " | ".join(f"fibrl/{peer.replace('mp ', '')}" for peer in peers) + " | better |")
    lines = [head, "|" + "---|" * (len(libs) + len(peers) + 2)]
    for i, (row, _) in enumerate(rows):
        cells = [_fmt(results[lib][i]) for lib in libs]
        ratios = [_ratio(results["fibrl"][i] / results[peer][i]) for peer in peers]
        unit = f" ({row.unit})" if row.unit else ""
        lines.append(f"| {row.name}{unit} | " + " | ".join(cells) + " | "
                     + " | ".join(ratios) + f" | {'higher' if row.higher_is_better else 'lower'} |")
    return "\n".join(lines)


def _ratio(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:,.0f}x"


def _fmt(value: float, digits: int = 3) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.{digits}g}"


def main(argv: list) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sweep", type=int, nargs="*", default=None,
                        help="worker counts of the sweep (default 1 2 4 8; none: skip it)")
    parser.add_argument("--without", choices=list(PEERS), action="append", default=[],
                        help="leave an installed peer out")
    parser.add_argument("--plot", help="write the sweep's PNG here")
    args = parser.parse_args(argv)
    present, absent = available_peers()
    libs = BASE_LIBS + tuple(lib for lib in present if lib not in args.without)
    rows = plan(args.quick)
    sizes = args.sweep if args.sweep is not None else ([1, 2, 4] if args.quick else [1, 2, 4, 8])
    RAY_CPUS[0] = max([args.workers, *sizes])
    load_before = os.getloadavg()[0]
    results = measure_all(libs, args.workers, rows, args.repeat)
    points = sweep(libs, sizes, 2500 if args.quick else 10000, 100 if args.quick else 400,
                   args.repeat) if sizes else {}
    ceilings = [sleep_ceiling(0.001, 1000), sleep_ceiling(0.010, 100)]
    print(f"\n{platform.python_implementation()} {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, {args.workers} workers, load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    for lib in absent:
        print(f"peer {lib} not measured: not installed (pip install {PEERS[lib]})")
    for lib in args.without:
        print(f"peer {lib} left out (--without {lib})")
    print()
    print(table(rows, results))
    print(f"\nSleep ceiling (back-to-back sleeps in one process, same run): "
          f"1 ms {ceilings[0]:.3f}, 10 ms {ceilings[1]:.3f}")
    if points:
        print("\nAgainst the number of workers (no-op map at chunksize=1; 1 ms sleep tasks, "
              "efficiency):\n")
        print(sweep_table(points))
    if points and args.plot:
        plot(points, args.plot, f"Pool against the number of workers ({os.cpu_count()} cores, "
             f"Python {platform.python_version()})")
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main(sys.argv[1:])
