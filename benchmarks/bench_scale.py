"""Pools at scale: fibrl against multiprocessing (spawn) and the bare pynng floor,
measured in one run.

For each pool size and task length (sleep tasks at chunksize=1) this reports:

- start: seconds from ``Pool()`` until every worker has run a task;
- efficiency: ideal time (tasks x task length / workers) over the measured time of a
  ``map`` on the warm pool, the median of ``--maps`` maps one after another (a map of
  20 tasks per worker lasts 20-200 ms, and one alone swings by up to a quarter from run
  to run; the first after the 0.2 s start-up tasks is the slowest, for fibrl and mp
  alike, and fibrl's pool sizes its first batches by those tasks' length);
- parent CPU per task (user + system of the parent process alone, its children not
  counted) of those maps and of an ``imap_unordered`` of as many tasks, and worker
  CPU per task (user + system, from /proc); CPU time is what to compare on a shared
  machine, where other load stretches wall time far more;
- threads and PSS per idle worker, its share of the library's helper process
  included (fibrl's fork server; multiprocessing's resource tracker), measured on a
  fresh pool in a process of its own (``--footprint``): PSS splits a shared page among
  all the processes that map it, and each library's helper lives as long as the
  process that started it, so in this one it would lower the PSS of every library
  measured after it.

The floor (``pynng``) is the least any pool on pynng pays for the same layout: spawned
workers pull pickled ``(index, function, argument)`` tasks from one Push0 socket and push
pickled results to one Pull0 socket over TCP loopback, with two tasks in flight per
worker and no heartbeats, no recovery and no accounting.

    python benchmarks/bench_scale.py                      # 2 8 32 128 512, 10 ms and 1 ms
    python benchmarks/bench_scale.py --sizes 2 8 32 --plot docs/img/scale.png
    python benchmarks/bench_scale.py --backend docker --sizes 64 --tasks-ms 1 --libs fibrl

Run it from the repository root with PYTHONPATH=. so that workers import this checkout.
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fibrl  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


# which process ran a task: a container's pid is its own, often the same in every one
_process = (0, "")


def nap(seconds: float) -> tuple:
    global _process
    time.sleep(seconds)
    if _process[0] != os.getpid():   # a process forked after this module was imported
        _process = (os.getpid(), os.urandom(8).hex())
    return _process


def _floor_worker(tasks: str, results: str) -> None:
    import pickle

    import pynng
    with pynng.Pull0(dial=tasks, recv_buffer_size=1) as pull, \
            pynng.Push0(dial=results) as push:
        while True:
            index, func, arg = pickle.loads(pull.recv())
            if func is None:
                return
            push.send(pickle.dumps((index, func(arg)), pickle.HIGHEST_PROTOCOL))


class FloorPool:
    """The bare pynng floor of a pool (see the module docstring): map and
    imap_unordered of a one-argument function at chunksize 1, nothing else."""

    AHEAD = 2   # tasks in flight per worker

    def __init__(self, workers: int) -> None:
        import pynng
        self._pickle = __import__("pickle")
        self._push = pynng.Push0(listen="tcp://127.0.0.1:0", send_buffer_size=1)
        self._pull = pynng.Pull0(listen="tcp://127.0.0.1:0")
        addr = ["tcp://" + str(s.listeners[0].local_address)
                for s in (self._push, self._pull)]
        ctx = multiprocessing.get_context("spawn")
        self._procs = [ctx.Process(target=_floor_worker, args=tuple(addr), daemon=True)
                       for _ in range(workers)]
        for proc in self._procs:
            proc.start()

    def imap_unordered(self, func, args, chunksize: int = 1):
        dumps, loads = self._pickle.dumps, self._pickle.loads
        todo = list(args)
        sent = done = 0
        while sent < min(len(todo), len(self._procs) * self.AHEAD):
            self._push.send(dumps((sent, func, todo[sent])))
            sent += 1
        while done < len(todo):
            yield loads(self._pull.recv())
            done += 1
            if sent < len(todo):
                self._push.send(dumps((sent, func, todo[sent])))
                sent += 1

    def map(self, func, args, chunksize: int = 1) -> list:
        out = dict(self.imap_unordered(func, args, chunksize))
        return [out[i] for i in range(len(out))]

    def terminate(self) -> None:
        for proc in self._procs:
            proc.terminate()

    def join(self) -> None:
        for proc in self._procs:
            proc.join(10)
        self._push.close()
        self._pull.close()


def _cpu(pid: int) -> float:
    """User + system CPU seconds of one process, or 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


_HELPER = {"fibrl": b"fibrl.backends._zygote", "mp": b"multiprocessing.resource_tracker"}


def _helpers(lib: str) -> list[int]:
    """Pids of the library's helper processes that are not workers: fibrl's fork server
    (its zygote), multiprocessing's resource tracker (a spawn Pool's locks start it)."""
    if lib not in _HELPER:
        return []
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == me and _HELPER[lib] in cmd:
            found.append(int(entry))
    return found


def _containers(parent: int) -> int:
    """Containers, running or not, that this process started on the docker backend."""
    out = subprocess.run(["docker", "ps", "-aq", "--filter", "label=fibrl.backend=docker",
                          "--filter", f"label=fibrl.parent={parent}"],
                         capture_output=True, text=True, timeout=60)
    return len(out.stdout.split())


def _pool(lib: str, workers: int):
    return {"fibrl": fibrl.Pool, "mp": multiprocessing.get_context("spawn").Pool,
            "pynng": FloorPool}[lib](workers)


def _every_worker_ran_a_task(pool, lib: str, workers: int, t0: float) -> set:
    """The ``(pid, tag)`` of each worker, once each has run a task (tasks long enough
    that no worker takes two)."""
    seen: set[tuple] = set()
    while len(seen) < workers:
        seen.update(pool.map(nap, [0.2] * workers, chunksize=1))
        if time.perf_counter() - t0 > 600:
            raise RuntimeError(f"{lib} Pool({workers}): only {len(seen)} workers ran a "
                               f"task within 600 s")
    return seen


def _idle_footprint(lib: str, pids: list) -> dict:
    """Threads and PSS (MB) per idle worker, the library's helper process counted in."""
    time.sleep(0.5)   # idle
    helpers = _helpers(lib)
    return {"threads": sum(_threads(p) for p in pids) / len(pids),
            "pss_mb": sum(_pss_kb(p) for p in pids + helpers) / len(pids) / 1024}


def footprint_here(lib: str, workers: int) -> dict:
    """``--footprint``: a fresh ``Pool(workers)`` of ``lib`` in this process, idle."""
    pool = _pool(lib, workers)
    try:
        seen = _every_worker_ran_a_task(pool, lib, workers, time.perf_counter())
        return _idle_footprint(lib, sorted(pid for pid, _ in seen))
    finally:
        pool.terminate()
        pool.join()


@functools.lru_cache(maxsize=None)
def footprint(lib: str, workers: int) -> dict:
    """What :func:`footprint_here` measures, in a process of its own (see the module's
    docstring); the same for every task length."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--footprint", lib,
                          str(workers)], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{lib} Pool({workers}) footprint failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def measure(lib: str, workers: int, task: float, rounds: int, backend: str = "local",
            maps: int = 5) -> dict:
    local = lib != "fibrl" or backend == "local"
    t0 = time.perf_counter()
    pool = _pool(lib, workers)
    try:
        seen = _every_worker_ran_a_task(pool, lib, workers, t0)
        start = time.perf_counter() - t0
        # a container's pids are its own: its processes cannot be read from here
        pids = sorted(pid for pid, _ in seen) if local else []
        helpers = _helpers(lib)
        size = footprint(lib, workers) if pids else {"threads": float("nan"),
                                                      "pss_mb": float("nan")}
        n = workers * rounds
        cpu_w0 = sum(_cpu(p) for p in pids + helpers)
        cpu_p0 = time.process_time()
        lasted = []
        for _ in range(maps):
            t1 = time.perf_counter()
            pool.map(nap, [task] * n, chunksize=1)
            lasted.append(time.perf_counter() - t1)
        cpu_p = (time.process_time() - cpu_p0) / maps
        cpu_w = (sum(_cpu(p) for p in pids + helpers) - cpu_w0) / maps if pids \
            else float("nan")
        elapsed = sorted(lasted)[maps // 2]
        cpu_u0 = time.process_time()
        got = sum(1 for _ in pool.imap_unordered(nap, [task] * n, chunksize=1))
        cpu_u = time.process_time() - cpu_u0
        assert got == n, (got, n)
    finally:
        pool.terminate()
        pool.join()
    row = {"lib": lib, "workers": workers, "task_ms": task * 1e3, "start_s": start,
           "efficiency": n * task / workers / elapsed, "parent_us": cpu_p / n * 1e6,
           "unordered_us": cpu_u / n * 1e6,
           "worker_us": cpu_w / n * 1e6, **size}
    if not local:
        deadline = time.monotonic() + 60   # containers are removed as they stop
        while (left := _containers(os.getpid())) and time.monotonic() < deadline:
            time.sleep(1.0)
        row["leftover"] = left
    return row


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for lib, style in (("fibrl", "-o"), ("mp", "--s"), ("pynng", ":^")):
        for task in sorted({r["task_ms"] for r in rows}):
            pts = [r for r in rows if r["lib"] == lib and r["task_ms"] == task]
            if not pts:
                continue
            xs = [r["workers"] for r in pts]
            label = f"{lib}, {task:g} ms tasks"
            axes[0].plot(xs, [r["efficiency"] for r in pts], style, label=label)
            axes[1].plot(xs, [r["parent_us"] for r in pts], style, label=label)
    for ax, title in ((axes[0], "efficiency"), (axes[1], "parent CPU per task (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("Pool at scale: sleep tasks, chunksize=1 (2 cores, Python 3.11)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 32, 128, 512])
    parser.add_argument("--tasks-ms", type=float, nargs="+", default=[10.0, 1.0])
    parser.add_argument("--rounds", type=int, default=20,
                        help="tasks per worker in the timed map (default 20)")
    parser.add_argument("--maps", type=int, default=5,
                        help="timed maps per point; efficiency is their median (default 5)")
    parser.add_argument("--libs", nargs="+", default=["fibrl", "mp", "pynng"],
                        choices=["fibrl", "mp", "pynng"])
    parser.add_argument("--plot", help="write a PNG of efficiency and parent CPU per task")
    parser.add_argument("--footprint", nargs=2, metavar=("LIB", "WORKERS"),
                        help="print the idle footprint of one fresh pool as JSON, and exit")
    parser.add_argument("--backend", default="local", choices=["local", "docker"],
                        help="fibrl's backend (docker: worker CPU, threads and PSS are not "
                             "measured; containers left after join are counted)")
    opts = parser.parse_args(argv)
    if opts.footprint:
        print(json.dumps(footprint_here(opts.footprint[0], int(opts.footprint[1]))))
        return 0
    if opts.backend != "local":
        fibrl.init(backend=opts.backend)
    print(f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows = []
    for workers in opts.sizes:
        for task_ms in opts.tasks_ms:
            for lib in opts.libs:
                try:
                    row = measure(lib, workers, task_ms / 1e3, opts.rounds, opts.backend,
                                  opts.maps)
                except Exception as exc:   # a size one library cannot reach: say so, go on
                    print(f"{lib} Pool({workers}) {task_ms:g} ms: failed: "
                          f"{type(exc).__name__}: {exc}", flush=True)
                    continue
                rows.append(row)
                print(f"{lib:5} workers={workers:4} task={task_ms:4g} ms  "
                      f"start={row['start_s']:6.2f} s  eff={row['efficiency']:.2f}  "
                      f"parent={row['parent_us']:7.0f} us/task  "
                      f"(imap_unordered {row['unordered_us']:7.0f})  "
                      f"worker={row['worker_us']:7.0f} us/task  "
                      f"threads={row['threads']:.1f}  pss={row['pss_mb']:.1f} MB"
                      + (f"  leftover containers={row['leftover']}" if "leftover" in row
                         else ""), flush=True)
    print("\n| workers | task | lib | start s | efficiency | fibrl/mp | fibrl/pynng floor "
          "| parent us/task | parent us/task imap_unordered | worker us/task | threads "
          "| PSS MB |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def versus(r: dict, lib: str) -> str:
        peer = [m for m in rows if m["lib"] == lib and m["workers"] == r["workers"]
                and m["task_ms"] == r["task_ms"]]
        return (f"{r['efficiency'] / peer[0]['efficiency']:.2f}x"
                if r["lib"] == "fibrl" and peer else "")

    for r in rows:
        print(f"| {r['workers']} | {r['task_ms']:g} ms | {r['lib']} | {r['start_s']:.2f} | "
              f"{r['efficiency']:.2f} | {versus(r, 'mp')} | {versus(r, 'pynng')} | "
              f"{r['parent_us']:.0f} | {r['unordered_us']:.0f} | {r['worker_us']:.0f} | "
              f"{r['threads']:.1f} | {r['pss_mb']:.1f} |")
    if opts.plot and rows:
        plot(rows, opts.plot)
        print(f"\nplot: {opts.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
