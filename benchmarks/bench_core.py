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
- Peak memory of a large transfer (``--only rss``, MB above each process's
  baseline): one 512 MB ``bytes`` through a Pipe and through a Queue, from a
  sender process to a receiver process; fibrl also shows the owner of the
  pipe or queue (the process that created it, which relays the item).

The transport's floor is measured in the same run (``floor.py``): a bare
pynng ``Pair0`` round trip between two processes for the Pipe row, a bare
pynng stream of 1 MB frames for the 1 MB Queue rows. The Pipe row also
measures that round trip with the object pickled and unpickled on each side
(a note under the table): what any Python library that sends objects pays
before it adds anything of its own. Uber Fiber, where a
Python with it installed is given (``--fiber-python``, or ``FIBER_PYTHON``;
``benchmarks/install_fiber.sh`` makes one), is measured in that interpreter,
driven line by line from this run so that its repeats interleave with the
others.

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
FLOOR = "nng"       # the bare pynng floor (floor.py)
PICKLED = "nng+pickle"   # the same round trip with pickle on each side (Pipe row only)
FIBER = "fiber"     # Uber Fiber, run in its own interpreter


# -- child side (runs in the workers) -------------------------------------------------
def noop() -> None:
    pass


def queue_worker(ctl, up, down, ack) -> None:
    """Serve commands from ``ctl``: ("produce", n, size) onto ``up``, ("consume", n) from
    ``down``, ("drain",): take from ``down`` until a None, or ("stop",). Each
    consume or drain ends with "done" on ``ack``. One queue per direction: Fiber's
    queues push each item to any process that ever read from them, reading now or not."""
    ack.put("ready")
    while True:
        cmd = ctl.get()
        if cmd[0] == "stop":
            return
        if cmd[0] == "produce":
            _, n, size = cmd
            msg = b"x" * size
            for _ in range(n):
                up.put(msg)
        elif cmd[0] == "drain":
            while down.get() is not None:
                pass
            ack.put("done")
        else:
            for _ in range(cmd[1]):
                down.get()
            ack.put("done")


def pipe_worker(conn) -> None:
    """Say "ready", then echo every message until ``None`` arrives."""
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(msg)


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def rss_sender(chan, size: int, out: str) -> None:
    """Send one ``size``-byte object over ``chan`` (Pipe end or Queue); write the peak."""
    base = _peak_mb()
    data = b"x" * size
    (chan.send if hasattr(chan, "send") else chan.put)(data)
    del data
    _write(out, _peak_mb() - base)


def rss_receiver(chan, size: int, out: str) -> None:
    """Receive one object of ``size`` bytes; write the peak above this process's baseline."""
    base = _peak_mb()
    data = chan.recv() if hasattr(chan, "recv") else chan.get(timeout=600)
    assert len(data) == size
    del data
    _write(out, _peak_mb() - base)


def _write(path: str, value: float) -> None:
    with open(path, "w") as f:
        f.write(f"{value:.1f}")


# -- the libraries under test -----------------------------------------------------------
def context(name: str):
    """The factories of one library: mp's spawn context, or fibrl itself."""
    if name == "mp":
        import multiprocessing

        return multiprocessing.get_context("spawn")
    if name == FIBER:
        import fiber

        return fiber
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
        # Fiber has only SimpleQueue, whose get() takes no timeout
        make = ctx.SimpleQueue if lib == FIBER else ctx.Queue
        self.ctl, self.up, self.down, self.ack = make(), make(), make(), make()
        self.timeout = {} if lib == FIBER else {"timeout": 120}

        def ready(timeout: float) -> bool:
            try:
                return self.ack.get(**({} if lib == FIBER else {"timeout": timeout})) == "ready"
            except queue.Empty:
                return False

        self.proc = start_worker(lib, queue_worker, (self.ctl, self.up, self.down, self.ack),
                                 ready)
        self.ready, self.lib = ready, lib
        self.consumers = [(self.ctl, self.proc)]   # more share ``down``: see consumers_take

    def _consumers(self, k: int) -> list:
        """``k`` workers serving ``queue_worker`` on the same ``down``, each with its
        own ``ctl`` (started on first use)."""
        while len(self.consumers) < k:
            ctl = context(self.lib).Queue()
            proc = start_worker(self.lib, queue_worker, (ctl, self.up, self.down, self.ack),
                                self.ready)
            self.consumers.append((ctl, proc))
        return self.consumers[:k]

    def consumers_take(self, n: int, size: int, k: int) -> float:
        """The parent puts ``n`` items, then one None per child; ``k`` children share
        them as a work queue: each takes what it gets until its None. (A fixed share per
        child would time the child the scheduler served last, not the queue: on a machine
        with fewer cores than children, that alone moved both libraries by 2x.)"""
        consumers = self._consumers(k)
        msg = b"x" * size
        start = time.perf_counter()
        for ctl, _ in consumers:
            ctl.put(("drain",))
        for _ in range(n):
            self.down.put(msg)
        for _ in consumers:
            self.down.put(None)
        for _ in consumers:
            assert self.ack.get(**self.timeout) == "done"
        return time.perf_counter() - start

    def child_produces(self, n: int, size: int) -> float:
        get, timeout = self.up.get, self.timeout
        start = time.perf_counter()
        self.ctl.put(("produce", n, size))
        for _ in range(n):
            get(**timeout)
        return time.perf_counter() - start

    def parent_produces(self, n: int, size: int) -> float:
        msg = b"x" * size
        start = time.perf_counter()
        self.ctl.put(("consume", n))
        for _ in range(n):
            self.down.put(msg)
        assert self.ack.get(**self.timeout) == "done"
        return time.perf_counter() - start

    def close(self) -> None:
        for ctl, _ in self.consumers:
            ctl.put(("stop",))
        for _, proc in self.consumers:
            proc.join(60)


class PipeBench:
    """One worker echoing on a Pipe of one library."""

    def __init__(self, lib: str) -> None:
        self.here, there = context(lib).Pipe()
        if lib == FIBER:    # its connections cannot poll
            def ready(timeout: float) -> bool:
                return self.here.recv() == "ready"
        else:
            def ready(timeout: float) -> bool:
                return self.here.poll(timeout) and self.here.recv() == "ready"
        self.proc = start_worker(lib, pipe_worker, (there,), ready)
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


class FiberBench:
    """A :class:`QueueBench` or :class:`PipeBench` of Uber Fiber, living in Fiber's own
    interpreter (``--serve``) and driven over its stdin/stdout, one command a line."""

    TIMEOUT = 30    # a timed run lasts seconds; one that never ends lost a message (Fiber
                    # drops frames over nanomsg's 1 MiB receive limit without a word)

    def __init__(self, python: str, kind: str) -> None:
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--serve", kind],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.broken = ""
        self._ask()   # its workers are up

    def _ask(self, *words) -> float:
        import select

        if self.broken:
            raise SampleFailed(self.broken)
        if words:
            self.proc.stdin.write(" ".join(map(str, words)) + "\n")
            self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], self.TIMEOUT)[0]:
            self.broken = f"no answer within {self.TIMEOUT} s (items lost)"
            self.proc.kill()
            raise SampleFailed(self.broken)
        line = self.proc.stdout.readline()
        if not line.strip() or line.startswith("error"):
            raise SampleFailed(line.strip() or f"exited with {self.proc.poll()}")
        return float(line)

    def child_produces(self, n: int, size: int) -> float:
        return self._ask("child_produces", n, size)

    def parent_produces(self, n: int, size: int) -> float:
        return self._ask("parent_produces", n, size)

    def rounds(self, n: int) -> float:
        return self._ask("rounds", n)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()



def serve(kind: str) -> int:
    """``--serve``: run one bench of Fiber here, timing the commands read from stdin."""
    bench = QueueBench(FIBER) if kind == "queue" else PipeBench(FIBER)
    print("0", flush=True)
    for line in sys.stdin:
        method, *numbers = line.split()
        try:
            print(f"{getattr(bench, method)(*map(int, numbers)):.9f}", flush=True)
        except Exception as exc:  # reported as a failed sample, the run goes on
            print(f"error {type(exc).__name__}: {exc}", flush=True)
    bench.close()
    return 0


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
    libs: tuple = LIBS
    samples: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.samples = {lib: [] for lib in self.libs}
        self.failures = {lib: [] for lib in self.libs}

    def value(self, lib: str) -> float:
        vals = self.samples.get(lib)
        return statistics.median(vals) if vals else float("nan")

    def spread(self, lib: str) -> float:
        """Half the range of the samples, relative to their median."""
        vals = self.samples.get(lib)
        return _div((max(vals) - min(vals)) / 2, statistics.median(vals)) if vals \
            else float("nan")


def sized(run_n: Callable[[int], float], warmup_n: int, target: float, lo: int, hi: int) -> int:
    """Run ``run_n(warmup_n)`` as warm-up; return the count that lasts about ``target`` s."""
    elapsed = run_n(warmup_n)
    return max(lo, min(hi, int(warmup_n * target / max(elapsed, 1e-6))))


def interleaved(row: Row, runs: dict, repeats: int, convert: Callable[[float], float]) -> None:
    """Run each library's ``runs[lib]()`` in turn ``repeats`` times; keep converted samples."""
    for _ in range(repeats):
        for lib in row.libs:
            try:
                row.samples[lib].append(convert(runs[lib]()))
            except SampleFailed as exc:
                row.failures[lib].append(str(exc))


def queue_benches(opts) -> dict:
    benches = {lib: QueueBench(lib) for lib in LIBS}
    if opts.fiber_python:
        benches[FIBER] = FiberBench(opts.fiber_python, "queue")
    return benches


def bench_queues(opts) -> list:
    import floor

    benches = queue_benches(opts)
    benches[FLOOR] = floor.NngStream()
    rows = []
    try:
        for direction in ("child->parent", "parent->child"):
            for size, warm, lo, hi in ((SMALL, 2000, 500, 400_000), (LARGE, 20, 10, 300)):
                if getattr(benches.get(FIBER), "broken", ""):   # a fresh one per row
                    benches[FIBER].close()
                    benches[FIBER] = FiberBench(opts.fiber_python, "queue")
                small = size == SMALL
                libs = tuple(lib for lib in benches if not (small and lib == FLOOR))
                row = Row(f"Queue {'100 B' if small else '1 MB'} {direction}",
                          "msgs/s" if small else "MB/s", True,
                          (">= 0.8" if direction == "parent->child" else ">= 1.0") if small
                          else ">= 1.0, >= 0.9 floor", libs)
                runs = {}
                for lib in libs:
                    bench = benches[lib]
                    method = bench.child_produces if direction == "child->parent" \
                        else bench.parent_produces
                    try:
                        n = sized(lambda k, m=method, s=size: m(k, s), warm, opts.target,
                                  lo, hi)
                    except SampleFailed as exc:
                        runs[lib] = _failing(str(exc))
                        continue
                    runs[lib] = lambda m=method, n=n, s=size: (n, m(n, s))
                rate = ((lambda r: r[0] / r[1]) if small
                        else (lambda r, s=size: r[0] * s / MB / r[1]))
                interleaved(row, runs, opts.repeats, rate)
                rows.append(row)
                _progress(row)
        for k in (2, 4):   # several children share one queue the parent fills
            row = Row(f"Queue 100 B parent->child, {k} consumers", "msgs/s", True, ">= 0.8",
                      LIBS)
            runs = {}
            for lib in LIBS:
                def take(n, b=benches[lib], k=k):
                    return b.consumers_take(n, SMALL, k)
                try:
                    n = sized(take, 2000, opts.target, 500, 400_000)
                except SampleFailed as exc:
                    runs[lib] = _failing(str(exc))
                    continue
                runs[lib] = lambda t=take, n=n: (n, t(n))
            interleaved(row, runs, opts.repeats, lambda r: r[0] / r[1])
            rows.append(row)
            _progress(row)
    finally:
        for bench in benches.values():
            bench.close()
    return rows


def _failing(reason: str) -> Callable[[], tuple]:
    def run() -> tuple:
        raise SampleFailed(reason)
    return run


def bench_pipe(opts) -> list:
    import floor

    benches = {lib: PipeBench(lib) for lib in LIBS}
    benches[FLOOR] = floor.NngEcho()
    benches[PICKLED] = floor.PickledEcho()
    if opts.fiber_python:
        benches[FIBER] = FiberBench(opts.fiber_python, "pipe")
    row = Row("Pipe round trip 100 B", "µs", False, "<= 1.2 floor, <= fiber", tuple(benches))
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
    pickled = row.value(PICKLED)
    NOTES.append(
        f"{row.name}: the floor with pickle on both sides (the object pickled before each "
        f"send, unpickled after each receive, nothing else) took {_fmt(pickled)} µs, "
        f"{_ratio(_div(pickled, row.value(FLOOR)))} the floor; fibrl took "
        f"{_ratio(_div(row.value('fibrl'), pickled))} that.")
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


RSS_SIZE = 512 << 20


def rss_run(lib: str, kind: str, size: int) -> dict:
    """``--rss``: one ``size``-byte transfer through a Pipe or Queue of ``lib``, in this
    fresh interpreter; the peak MB above baseline of sender, receiver and owner."""
    import tempfile

    ctx = context(lib)
    base = _peak_mb()
    if kind == "pipe":
        recv_end, send_end = ctx.Pipe(duplex=False)
    else:
        recv_end = send_end = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        outs = {side: os.path.join(tmp, side) for side in ("sender", "receiver")}
        procs = [ctx.Process(target=rss_receiver, args=(recv_end, size, outs["receiver"])),
                 ctx.Process(target=rss_sender, args=(send_end, size, outs["sender"]))]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(600)
            if proc.exitcode != 0:
                raise RuntimeError(f"{proc.name} exited with {proc.exitcode}")
        result = {side: float(open(path).read()) for side, path in outs.items()}
    result["owner"] = _peak_mb() - base
    return result


def bench_rss(opts) -> list:
    import json

    rows = []
    for kind in ("pipe", "queue"):
        sides = {side: Row(f"{kind.capitalize()} {opts.rss_size / MB:,.0f} MB peak RSS, {side}",
                           "MB", False,
                           "<= 1.2" if side != "owner" else "(info)")
                 for side in ("sender", "receiver", "owner")}
        for _ in range(opts.rss_repeats):
            for lib in LIBS:
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss", lib,
                                       kind, str(opts.rss_size)],
                                      capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    for row in sides.values():
                        row.failures[lib].append(done.stderr.strip()[-200:])
                    continue
                for side, value in json.loads(done.stdout.splitlines()[-1]).items():
                    sides[side].samples[lib].append(value)
        for row in sides.values():
            _progress(row)
        rows += sides.values()
    return rows


def _progress(row: Row) -> None:
    values = ", ".join(f"{lib} {_fmt(row.value(lib))}" for lib in row.libs)
    print(f"  {row.name}: {values} {row.unit}", flush=True)


# -- report ------------------------------------------------------------------------------
def environment() -> str:
    import pynng

    return (f"{os.cpu_count()} cores, Python {platform.python_version()}, pynng "
            f"{pynng.__version__}, {platform.system()} {platform.release()}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def table(rows: list) -> str:
    """Markdown: every library measured, then fibrl's ratio to mp, the floor and Fiber."""
    lines = ["| measurement | unit | better | mp (spawn) | fibrl | nng floor | fiber "
             "| fibrl/mp | fibrl/floor | fibrl/fiber | target | spread mp / fibrl |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        fb_value = row.value("fibrl")
        cells = [_fmt(row.value(lib)) if lib in row.libs else "—"
                 for lib in ("mp", "fibrl", FLOOR, FIBER)]
        ratios = [_ratio(_div(fb_value, row.value(lib))) if lib in row.libs else "—"
                  for lib in ("mp", FLOOR, FIBER)]
        lines.append(
            f"| {row.name} | {row.unit} | {'higher' if row.higher_is_better else 'lower'} | "
            f"{' | '.join(cells)} | {' | '.join(ratios)} | "
            f"{row.target} | ±{_pct(row.spread('mp'))} / ±{_pct(row.spread('fibrl'))} |")
    notes = [f"- {row.name}: {len(fails)} {lib} run(s) failed and are left out: "
             f"{'; '.join(sorted(set(fails)))}"
             for row in rows for lib, fails in row.failures.items() if fails]
    notes += [f"- {note}" for note in NOTES]
    return "\n".join(lines + ([""] + notes if notes else []))


def _div(a: float, b: float) -> float:
    return a / b if b else float("nan")


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
    parser.add_argument("--only", choices=("queue", "pipe", "start", "rss"), action="append",
                        help="run only these measurements (repeatable; rss runs only when "
                             "named: it moves GBs)")
    parser.add_argument("--fiber-python", default=os.environ.get("FIBER_PYTHON"),
                        help="a Python with Uber Fiber installed, measured alongside "
                             "(default: $FIBER_PYTHON; absent: Fiber is left out)")
    parser.add_argument("--rss-size", type=int, default=RSS_SIZE, help=argparse.SUPPRESS)
    parser.add_argument("--target", type=float, help="seconds per timed throughput run")
    parser.add_argument("--repeat", type=int, help="timed runs per measurement and library")
    parser.add_argument("--first-start", choices=LIBS, help=argparse.SUPPRESS)
    parser.add_argument("--serve", choices=("queue", "pipe"), help=argparse.SUPPRESS)
    parser.add_argument("--rss", nargs=3, metavar=("LIB", "KIND", "SIZE"), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    opts.target = opts.target or (0.12 if opts.quick else 0.4)
    opts.repeats = opts.repeat or (3 if opts.quick else 7)
    opts.starts = 5 if opts.quick else 15
    opts.first_starts = 2 if opts.quick else 5
    opts.rss_repeats = 1 if opts.quick else 2
    return opts


def main(argv: list) -> int:
    opts = parse(argv)
    if opts.first_start:  # child mode: one first start in this fresh interpreter
        ctx = context(opts.first_start)
        print(f"{start_join(ctx):.6f}")
        return 0
    if opts.serve:        # child mode: Fiber's side, in Fiber's interpreter
        return serve(opts.serve)
    if opts.rss:          # child mode: one large transfer in this fresh interpreter
        import json

        lib, kind, size = opts.rss
        print(json.dumps(rss_run(lib, kind, int(size))))
        return 0
    benches = {"queue": bench_queues, "pipe": bench_pipe, "start": bench_start,
               "rss": bench_rss}
    if opts.fiber_python and not os.path.exists(opts.fiber_python):
        NOTES.append(f"--fiber-python {opts.fiber_python} does not exist; Fiber left out")
        opts.fiber_python = None
    if not opts.fiber_python:
        NOTES.append("Fiber not measured: no --fiber-python / FIBER_PYTHON given "
                     "(benchmarks/install_fiber.sh makes one)")
    print(f"{environment()}\nload before: {load()}", flush=True)
    began = time.perf_counter()
    rows = []
    for name in opts.only or [name for name in benches if name != "rss"]:
        rows += benches[name](opts)
    print(f"load after: {load()}; took {time.perf_counter() - began:.0f} s\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
