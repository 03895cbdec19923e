"""Docker backend benchmark: container workers next to local processes, same machine, one run.

Run from the repository root (its directory is what containers mount)::

    PYTHONPATH=. python benchmarks/bench_docker.py            # pools of 2 to 64 workers
    PYTHONPATH=. python benchmarks/bench_docker.py --quick    # pools of 2 to 16, faster
    PYTHONPATH=. python benchmarks/bench_docker.py --plot docs/img/docker_workers.png

Measures, for the ``local`` and ``docker`` backends:

- Pool(4) time to first result (s): from ``Pool(4)`` until ``apply`` returns, the
  first pool of the run (cold: for docker it includes the one-time image check).
- Pool(4) no-op ``map`` throughput at chunksize=1 (tasks/s), median of repeats.
- Process start+join (ms): median of 10 ``Process(target=noop).start(); join()``.

Then a sweep of pool sizes N (2, 4, 8, 16, 32, 64; ``--quick``: up to 16), a
fresh pool per backend and N:

- start (s): from ``Pool(N)`` until every worker has run a task. Workers are
  told apart by a token each process draws on its first task (a container's
  pid is its own, often the same in every container), as ``bench_scale`` does.
- efficiency: ideal time over measured time of a ``map`` of 20 x N sleep
  tasks of 10 ms at chunksize=1 on the warm pool (ideal: tasks x 10 ms / N),
  median of 3 maps; and its docker/local ratio.
- close (s): ``close()`` + ``join()`` of the warm pool.
- parent CPU per task (us): user + system CPU of this process over the timed
  maps, divided by the tasks.

Both backends run side by side and alternate (the timed Pool(4) runs after a
warm-up each; in the sweep, which backend goes first flips at each N), so a
change of load on the machine hits both alike.

Targets: Pool(4) first result <= 2 s on docker; docker throughput at
chunksize=1 >= 0.8x local; docker efficiency >= 0.9x local at N = 8, 16, 32, 64;
Pool(32) docker close <= 1 s. The tables give docker/local ratios and say which
way is better. These are numbers to read, not assertions.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Optional

import fibrl
from bench_scale import nap   # workers import it from the script's folder, as this one

BACKENDS = ("local", "docker")
SIZES = (2, 4, 8, 16, 32, 64)
QUICK_SIZES = (2, 4, 8, 16)
TASK_S = 0.010       # the sweep's sleep task
ROUNDS = 20          # tasks per worker in one timed map
MAPS = 3             # timed maps per pool; efficiency is their median
START_LIMIT_S = 600.0
JOIN_LIMIT_S = 120.0


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


# -- the sweep of pool sizes -------------------------------------------------------------
def all_ran(pool, workers: int, t0: float) -> None:
    """Return once each of the pool's ``workers`` processes has run a task."""
    seen: set = set()
    while len(seen) < workers:   # 0.2 s tasks: long enough that no worker takes two
        seen.update(pool.map(nap, [0.2] * workers, chunksize=1))
        if time.perf_counter() - t0 > START_LIMIT_S:
            raise TimeoutError(f"only {len(seen)} of {workers} workers ran a task within "
                               f"{START_LIMIT_S:.0f} s")


def sized(ctx, workers: int) -> dict:
    """Start, efficiency, close time and parent CPU per task of one ``Pool(workers)``."""
    tasks = ROUNDS * workers
    t0 = time.perf_counter()
    pool = ctx.Pool(workers)
    try:
        all_ran(pool, workers, t0)
        start = time.perf_counter() - t0
        efficiencies, cpu = [], 0.0
        for _ in range(MAPS):
            cpu0, t1 = time.process_time(), time.perf_counter()
            pool.map(nap, [TASK_S] * tasks, chunksize=1)
            elapsed = time.perf_counter() - t1
            cpu += time.process_time() - cpu0
            efficiencies.append(tasks * TASK_S / workers / elapsed)
        t2 = time.perf_counter()
        pool.close()
        pool.join(timeout=JOIN_LIMIT_S)
        close = time.perf_counter() - t2
    except BaseException:
        pool.terminate()
        pool.join(timeout=JOIN_LIMIT_S)
        raise
    return {"start": start, "efficiency": statistics.median(efficiencies), "close": close,
            "parent_us": cpu / (tasks * MAPS) * 1e6}


def sweep(sizes: tuple) -> dict:
    """``{(backend, N): row}``; a pool that failed is reported and left out."""
    contexts = {name: fibrl.get_context(name) for name in BACKENDS}
    rows: dict = {}
    for i, workers in enumerate(sizes):
        order = BACKENDS if i % 2 == 0 else BACKENDS[::-1]
        for name in order:
            try:
                rows[name, workers] = row = sized(contexts[name], workers)
            except Exception as exc:   # a size one backend cannot reach: say so, go on
                print(f"{name} Pool({workers}): failed: {type(exc).__name__}: {exc}",
                      flush=True)
                continue
            print(f"{name:6} Pool({workers:2}): start {row['start']:6.2f} s  "
                  f"efficiency {row['efficiency']:.2f}  close {row['close']:5.2f} s  "
                  f"parent {row['parent_us']:5.0f} us/task", flush=True)
    return rows


def efficiency_ratio(rows: dict, workers: int) -> Optional[float]:
    local, docker = rows.get(("local", workers)), rows.get(("docker", workers))
    return docker["efficiency"] / local["efficiency"] if local and docker else None


# -- output --------------------------------------------------------------------------------
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


def sweep_table(rows: dict, sizes: tuple) -> str:
    """A markdown table, one line per N, local and docker side by side."""
    def cell(name: str, workers: int, key: str, fmt: str) -> str:
        row = rows.get((name, workers))
        return fmt.format(row[key]) if row else "failed"

    lines = ["| workers | start s local | start s docker | efficiency local "
             "| efficiency docker | docker/local efficiency | close s local | close s docker "
             "| parent us/task local | parent us/task docker |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sizes:
        r = efficiency_ratio(rows, n)
        lines.append(
            f"| {n} | {cell('local', n, 'start', '{:.2f}')} | "
            f"{cell('docker', n, 'start', '{:.2f}')} | "
            f"{cell('local', n, 'efficiency', '{:.2f}')} | "
            f"{cell('docker', n, 'efficiency', '{:.2f}')} | "
            f"{'—' if r is None else f'{r:.2f}x'} | "
            f"{cell('local', n, 'close', '{:.2f}')} | {cell('docker', n, 'close', '{:.2f}')} | "
            f"{cell('local', n, 'parent_us', '{:.0f}')} | "
            f"{cell('docker', n, 'parent_us', '{:.0f}')} |")
    return "\n".join(lines)


def sweep_targets(rows: dict, sizes: tuple) -> list:
    lines = []
    for n in (8, 16, 32, 64):
        if n not in sizes:
            continue
        r = efficiency_ratio(rows, n)
        said = ("not measured (a pool failed)" if r is None
                else f"{'met' if r >= 0.9 else 'MISSED'} ({r:.2f}x)")
        lines.append(f"target docker efficiency >= 0.9x local, Pool({n}): {said}")
    docker32 = rows.get(("docker", 32))
    if docker32:
        ok = "met" if docker32["close"] <= 1.0 else "MISSED"
        said = f"{ok} ({docker32['close']:.2f} s)"
    else:
        said = ("not measured (sizes up to " f"{max(sizes)})" if 32 not in sizes
                else "not measured (the pool failed)")
    lines.append(f"target Pool(32) docker close() + join() <= 1 s: {said}")
    return lines


def plot(rows: dict, sizes: tuple, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("local", "--s"), ("docker", "-o")):
        xs = [n for n in sizes if (name, n) in rows]
        axes[0].plot(xs, [rows[name, n]["efficiency"] for n in xs], style, label=name)
        axes[1].plot(xs, [rows[name, n]["close"] for n in xs], style, label=name)
    titles = (f"efficiency, {ROUNDS} x N tasks of {TASK_S * 1e3:g} ms", "close() + join() (s)")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(sizes), [str(n) for n in sizes])
        ax.set_xlabel("workers (N)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylim(bottom=0)
    fig.suptitle(f"Pool(N) on the docker and local backends, one machine "
                 f"({fibrl.get_context('local').cpu_count()} CPUs, "
                 f"Python {platform.python_version()})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer tasks and repeats; pools of up to 16 workers")
    parser.add_argument("--sizes", type=int, nargs="+", metavar="N",
                        help="pool sizes of the sweep (default 2 4 8 16 32 64; "
                             "--quick: up to 16)")
    parser.add_argument("--plot", metavar="PNG",
                        help="write a plot of the sweep's efficiency and close time")
    args = parser.parse_args()
    if args.sizes and min(args.sizes) < 1:
        parser.error(f"--sizes: a pool needs at least 1 worker, not {min(args.sizes)}")
    sizes = tuple(sorted(set(args.sizes))) if args.sizes else (
        QUICK_SIZES if args.quick else SIZES)
    tasks, repeats = (1000, 3) if args.quick else (5000, 5)
    print(f"fibrl {fibrl.__version__}, Python {platform.python_version()}, "
          f"{platform.machine()}, {fibrl.get_context('docker').cpu_count()} CPUs (engine); "
          f"{tasks} tasks x {repeats} repeats", flush=True)
    results = run(tasks, repeats)
    print(table(results), flush=True)
    print(f"\nPool(N) sweep: {ROUNDS} x N sleep tasks of {TASK_S * 1e3:g} ms at chunksize=1, "
          f"median of {MAPS} maps; a fresh pool per backend and N", flush=True)
    rows = sweep(sizes)
    print()
    print(sweep_table(rows, sizes))
    print()
    print("\n".join(sweep_targets(rows, sizes)))
    if args.plot and rows:
        plot(rows, sizes, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
