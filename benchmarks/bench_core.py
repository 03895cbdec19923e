"""Core benchmark: fibrl against stdlib ``multiprocessing`` (spawn), same machine, one run.

Run::

    python benchmarks/bench_core.py           # full, about 1 minute (under 2)
    python benchmarks/bench_core.py --quick   # about 15 seconds (under 30)

Measures, for both libraries:

- Queue of 100-byte messages (msgs/s) and of 1 MB messages (MB/s), in both
  directions: the child produces and the parent consumes, then the parent
  produces and the child consumes. Timed from the parent's "go" until the
  parent has the last item (child produces) or the child's acknowledgement
  that it got them all (parent produces). Higher is better.
- Pipe round trip (µs): ping-pong of 100-byte messages, the child echoes.
  Lower is better.
- Process start+join (ms): ``Process(target=noop).start(); join()`` once
  the library is warm (its first process already started). Lower is better.
- Process first start+join (ms): the same in a fresh interpreter, so it
  includes what the first process of a program pays (fibrl: the hub's
  listener and the local fork server). Lower is better; informational.

Each library's workers are started and warmed up first (the warm-up also
sizes each timed run to last about ``--target`` seconds); then every repeat
runs mp and fibrl in turn, so load from elsewhere weighs on both alike, and
each number is the median of the repeats. The table gives fibrl/mp with the
direction that is better and the target from the performance issue; the
spread column is the range of the repeats around the median (mp / fibrl),
as a hint of how noisy the machine was. Numbers to read, not assertions:
nothing here fails on a slow machine.

Neither library is imported at module level: spawn children and fibrl
workers re-import this file as ``__mp_main__``, and each side should pay
only for its own library there.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

SMALL = 100
LARGE = 1 << 20
MB = 1e6
LIBS = ("mp", "fibrl")


# -- child side (runs in the workers) -------------------------------------------------
def noop() -> None:
    pass


def queue_worker(ctl, data, ack) -> None:
    """Serve commands from ``ctl``: ("produce", n, size), ("consume", n) or ("stop",)."""
    ack.put("ready")
    while True:
        cmd = ctl.get()
        if cmd[0] == "stop":
            return
        if cmd[0] == "produce":
            _, n, size = cmd
            msg = b"x" * size
            for _ in range(n):
                data.put(msg)
        else:
            for _ in range(cmd[1]):
                data.get()
            ack.put("done")


def pipe_worker(conn) -> None:
    """Say "ready", then echo every message until ``None`` arrives."""
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(msg)


# -- the libraries under test -----------------------------------------------------------
def context(name: str):
    """The factories of one library: mp's spawn context, or fibrl itself."""
    if name == "mp":
        import multiprocessing

        return multiprocessing.get_context("spawn")
    import fibrl

    return fibrl


NOTES: list = []  # what went wrong along the way, printed under the table


def start_worker(lib: str, target: Callable, args: tuple, ready: Callable[[float], bool],
                 tries: int = 3):
    """Start a worker and wait until ``ready(timeout)`` says it serves.

    A worker that dies while starting is noted and started again, so that one
    failed start does not stop (or hang) the whole run.
    """
    ctx = context(lib)
    for _ in range(tries):
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if ready(1.0):
                return proc
            if proc.exitcode is not None:
                NOTES.append(f"a {lib} {target.__name__} exited with {proc.exitcode} while "
                             f"starting; started again")
                break
        else:
            raise RuntimeError(f"the {target.__name__} worker did not start within 120 s")
    raise RuntimeError(f"the {target.__name__} worker failed to start {tries} times")


class QueueBench:
    """One worker serving ``queue_worker`` over three queues of one library."""

    def __init__(self, lib: str) -> None:
        import queue

        ctx = context(lib)
        self.ctl, self.data, self.ack = ctx.Queue(), ctx.Queue(), ctx.Queue()

        def ready(timeout: float) -> bool:
            try:
                return self.ack.get(timeout=timeout) == "ready"
            except queue.Empty:
                return False

        self.proc = start_worker(lib, queue_worker, (self.ctl, self.data, self.ack), ready)

    def child_produces(self, n: int, size: int) -> float:
        start = time.perf_counter()
        self.ctl.put(("produce", n, size))
        for _ in range(n):
            self.data.get(timeout=120)
        return time.perf_counter() - start

    def parent_produces(self, n: int, size: int) -> float:
        msg = b"x" * size
        start = time.perf_counter()
        self.ctl.put(("consume", n))
        for _ in range(n):
            self.data.put(msg)
        assert self.ack.get(timeout=300) == "done"
        return time.perf_counter() - start

    def close(self) -> None:
        self.ctl.put(("stop",))
        self.proc.join(60)


class PipeBench:
    """One worker echoing on a Pipe of one library."""

    def __init__(self, lib: str) -> None:
        self.here, there = context(lib).Pipe()
        self.proc = start_worker(lib, pipe_worker, (there,),
                                 lambda t: self.here.poll(t) and self.here.recv() == "ready")
        self.msg = b"x" * SMALL

    def rounds(self, n: int) -> float:
        here, msg = self.here, self.msg
        start = time.perf_counter()
        for _ in range(n):
            here.send(msg)
            here.recv()
        return time.perf_counter() - start

    def close(self) -> None:
        self.here.send(None)
        self.proc.join(60)


def start_join(ctx) -> float:
    start = time.perf_counter()
    proc = ctx.Process(target=noop)
    proc.start()
    proc.join(120)
    elapsed = time.perf_counter() - start
    if proc.exitcode != 0:
        raise SampleFailed(f"worker exited with {proc.exitcode}")
    return elapsed


def first_start_join(lib: str) -> float:
    """Seconds of the first start+join in a fresh interpreter (see ``--first-start``)."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--first-start", lib],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SampleFailed(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                           else f"exit code {done.returncode}")
    return float(done.stdout.split()[-1])


class SampleFailed(Exception):
    """One timed run failed; the row reports it instead of the whole run stopping."""


# -- measuring ---------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the table: a measurement, its unit and its target (fibrl/mp)."""

    name: str
    unit: str
    higher_is_better: bool
    target: str
    samples: dict = field(default_factory=lambda: {lib: [] for lib in LIBS})
    failures: dict = field(default_factory=lambda: {lib: [] for lib in LIBS})

    def value(self, lib: str) -> float:
        return statistics.median(self.samples[lib]) if self.samples[lib] else float("nan")

    def spread(self, lib: str) -> float:
        """Half the range of the samples, relative to their median."""
        vals = self.samples[lib]
        return (max(vals) - min(vals)) / 2 / statistics.median(vals) if vals else float("nan")


def sized(run_n: Callable[[int], float], warmup_n: int, target: float, lo: int, hi: int) -> int:
    """Run ``run_n(warmup_n)`` as warm-up; return the count that lasts about ``target`` s."""
    elapsed = run_n(warmup_n)
    return max(lo, min(hi, int(warmup_n * target / max(elapsed, 1e-6))))


def interleaved(row: Row, runs: dict, repeats: int, convert: Callable[[float], float]) -> None:
    """Run each library's ``runs[lib]()`` in turn ``repeats`` times; keep converted samples."""
    for _ in range(repeats):
        for lib in LIBS:
            try:
                row.samples[lib].append(convert(runs[lib]()))
            except SampleFailed as exc:
                row.failures[lib].append(str(exc))


def bench_queues(opts) -> list:
    benches = {lib: QueueBench(lib) for lib in LIBS}
    rows = []
    try:
        for direction in ("child->parent", "parent->child"):
            for size, warm, lo, hi in ((SMALL, 2000, 500, 400_000), (LARGE, 20, 10, 300)):
                small = size == SMALL
                row = Row(f"Queue {'100 B' if small else '1 MB'} {direction}",
                          "msgs/s" if small else "MB/s", True, ">= 1.0")
                runs = {}
                for lib, bench in benches.items():
                    method = bench.child_produces if direction == "child->parent" \
                        else bench.parent_produces
                    n = sized(lambda k, m=method: m(k, size), warm, opts.target, lo, hi)
                    runs[lib] = lambda m=method, n=n: (n, m(n, size))
                rate = (lambda r: r[0] / r[1]) if small else (lambda r: r[0] * size / MB / r[1])
                interleaved(row, runs, opts.repeats, rate)
                rows.append(row)
                _progress(row)
    finally:
        for bench in benches.values():
            bench.close()
    return rows


def bench_pipe(opts) -> list:
    benches = {lib: PipeBench(lib) for lib in LIBS}
    row = Row("Pipe round trip 100 B", "µs", False, "<= 1.2")
    try:
        runs = {}
        for lib, bench in benches.items():
            n = sized(bench.rounds, 200, opts.target, 100, 100_000)
            runs[lib] = lambda b=bench, n=n: (n, b.rounds(n))
        interleaved(row, runs, opts.repeats, lambda r: r[1] / r[0] * 1e6)
    finally:
        for bench in benches.values():
            bench.close()
    _progress(row)
    return [row]


def bench_start(opts) -> list:
    contexts = {lib: context(lib) for lib in LIBS}
    for ctx in contexts.values():
        start_join(ctx)  # warm-up: imports, the hub's listener, the fork server
    warm = Row("Process start+join", "ms", False, "<= 1.0")
    interleaved(warm, {lib: lambda c=ctx: start_join(c) for lib, ctx in contexts.items()},
                opts.starts, lambda s: s * 1e3)
    _progress(warm)
    first = Row("Process first start+join, fresh parent", "ms", False, "(info)")
    interleaved(first, {lib: lambda lib=lib: first_start_join(lib) for lib in LIBS},
                opts.first_starts, lambda s: s * 1e3)
    _progress(first)
    return [warm, first]


def _progress(row: Row) -> None:
    values = ", ".join(f"{lib} {_fmt(row.value(lib))}" for lib in LIBS)
    print(f"  {row.name}: {values} {row.unit}", flush=True)


# -- report ------------------------------------------------------------------------------
def environment() -> str:
    import pynng

    return (f"{os.cpu_count()} cores, Python {platform.python_version()}, pynng "
            f"{pynng.__version__}, {platform.system()} {platform.release()}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def table(rows: list) -> str:
    lines = ["| measurement | unit | better | mp (spawn) | fibrl | fibrl/mp | target "
             "| spread mp / fibrl |",
             "|---|---|---|---:|---:|---:|---|---|"]
    for row in rows:
        mp_value, fb_value = row.value("mp"), row.value("fibrl")
        lines.append(
            f"| {row.name} | {row.unit} | {'higher' if row.higher_is_better else 'lower'} | "
            f"{_fmt(mp_value)} | {_fmt(fb_value)} | {_ratio(fb_value / mp_value)} | "
            f"{row.target} | ±{_pct(row.spread('mp'))} / ±{_pct(row.spread('fibrl'))} |")
    notes = [f"- {row.name}: {len(fails)} {lib} run(s) failed and are left out: "
             f"{'; '.join(sorted(set(fails)))}"
             for row in rows for lib, fails in row.failures.items() if fails]
    notes += [f"- {note}" for note in NOTES]
    return "\n".join(lines + ([""] + notes if notes else []))


def _ratio(value: float) -> str:
    return "—" if value != value else f"{value:.2f}x"


def _pct(value: float) -> str:
    return "—" if value != value else f"{value:.0%}"


def _fmt(value: float) -> str:
    if value != value:
        return "failed"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def parse(argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs (< 30 s)")
    parser.add_argument("--only", choices=("queue", "pipe", "start"), action="append",
                        help="run only these measurements (repeatable)")
    parser.add_argument("--target", type=float, help="seconds per timed throughput run")
    parser.add_argument("--repeat", type=int, help="timed runs per measurement and library")
    parser.add_argument("--first-start", choices=LIBS, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    opts.target = opts.target or (0.12 if opts.quick else 0.4)
    opts.repeats = opts.repeat or (3 if opts.quick else 7)
    opts.starts = 5 if opts.quick else 15
    opts.first_starts = 2 if opts.quick else 5
    return opts


def main(argv: list) -> int:
    opts = parse(argv)
    if opts.first_start:  # child mode: one first start in this fresh interpreter
        ctx = context(opts.first_start)
        print(f"{start_join(ctx):.6f}")
        return 0
    benches = {"queue": bench_queues, "pipe": bench_pipe, "start": bench_start}
    print(f"{environment()}\nload before: {load()}", flush=True)
    began = time.perf_counter()
    rows = []
    for name in opts.only or list(benches):
        rows += benches[name](opts)
    print(f"load after: {load()}; took {time.perf_counter() - began:.0f} s\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
