"""Policy benchmark: a PolicyStore publishing to reader processes, against bare pynng,
a manager dict and (where installed) Ray's object store.

Run::

    python benchmarks/bench_policy.py            # 100 MB of float32 to 8 readers
    python benchmarks/bench_policy.py --quick    # 10 MB to 8 readers, fewer rounds

Measured in one run, each row against its peer:

- *distribution*: the learner publishes ``--mb`` MB of float32 (one array, changed
  in place before each round) and 8 reader processes, each waiting in
  ``latest(newer_than=v, timeout=...)``, hold it: seconds from the publish call to
  the last reader holding the params (median of ``--rounds``). Peers: 8 bare
  pynng ``Pair0`` streams sending the same bytes from 8 threads (the transport's
  floor: no authentication, no pickling, no versions); a fibrl manager dict
  (what the examples did before: ``d["weights"] = params``, then each reader
  ``d["weights"]``); Ray's ``put`` and 8 tasks that ``get`` it (skipped when
  ``import ray`` fails);
- *the publish call* alone (the learner's stall), against the manager dict's set;
- *publisher memory*: the peak of the learner's resident memory above what it
  held before the first publish, while it publishes and the readers fetch, as a
  multiple of the params' size (keep=1: the version being sent and the next one);
- *nothing new*: ``latest(newer_than=latest)`` in a reader process, one round trip
  of a few dozen bytes, against a pickled bare pynng round trip (``floor.PickledEcho``),
  in alternating rounds (the ratio is the median of the rounds' ratios), and a manager
  dict lookup of the version number.

Numbers to read, not assertions; ratios are fibrl / peer (lower is better for
times).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

import fibrl
from fibrl.rl import PolicyStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from floor import ACK, NngStream, PickledEcho  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


class PeakRss:
    """The peak resident memory of this process while the block runs (sampled)."""

    def __enter__(self) -> "PeakRss":
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


# -- readers ---------------------------------------------------------------------------
def store_reader(store: PolicyStore, rounds: int, ready, done) -> None:
    """Hold each of ``rounds`` versions as soon as it is published."""
    version = 0
    ready.put(os.getpid())
    for _ in range(rounds):
        version, params = store.latest(newer_than=version, timeout=300)
        done.put((time.perf_counter(), float(params["w"][0])))


def polling_reader(store: PolicyStore, asks, done) -> None:
    """For each ``n`` asked (0: stop), time ``n`` checks that find nothing new."""
    version = store.latest()[0]
    while True:
        n = asks.get(timeout=300)
        if not n:
            return
        start = time.perf_counter()
        for _ in range(n):
            assert store.latest(newer_than=version) is None
        done.put((time.perf_counter() - start) / n)


def dict_reader(shared, go, rounds: int, polls: int, ready, done) -> None:
    ready.put(os.getpid())
    for _ in range(rounds):
        go.get(timeout=300)
        params = shared["weights"]
        done.put((time.perf_counter(), float(params["w"][0])))
    if polls:
        start = time.perf_counter()
        for _ in range(polls):
            shared["version"]
        done.put((time.perf_counter() - start) / polls)


# -- fibrl ------------------------------------------------------------------------------
def resident_params(mb: int) -> dict:
    """``mb`` MB of float32 params whose pages are resident already (np.zeros' are not
    until written), so that a memory baseline taken now includes them."""
    return {"w": np.ones(mb * MB // 4, np.float32)}


def start_readers(procs: list, ready) -> None:
    """Start the reader processes and wait until each says it is ready."""
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=300)


def bench_store(args, results: dict) -> None:
    params = resident_params(args.mb)
    ready, done = fibrl.Queue(), fibrl.Queue()
    with PolicyStore() as store:
        procs = [fibrl.Process(target=store_reader,
                               args=(store, args.rounds, ready, done))
                 for i in range(args.readers)]
        start_readers(procs, ready)
        spans, calls = [], []
        base = rss()
        with PeakRss() as peak:
            for r in range(args.rounds):
                params["w"] += 1
                t0 = time.perf_counter()
                store.publish(params)
                calls.append(time.perf_counter() - t0)
                got = [done.get(timeout=300) for _ in procs]
                assert all(value == r + 2 for _, value in got), got
                spans.append(max(t for t, _ in got) - t0)
        results["fibrl PolicyStore: all readers hold it, s"] = statistics.median(spans)
        results["fibrl PolicyStore: publish call, s"] = statistics.median(calls)
        results["fibrl PolicyStore: publisher peak RSS / params"] = \
            (peak.peak - base) / (args.mb * MB)
        for proc in procs:
            proc.join(60)


def bench_manager_dict(args, results: dict) -> None:
    params = resident_params(args.mb)
    ready, done = fibrl.Queue(), fibrl.Queue()
    with fibrl.Manager() as manager:
        shared = manager.dict(version=0)
        gos = [fibrl.Queue() for _ in range(args.readers)]
        procs = [fibrl.Process(target=dict_reader,
                               args=(shared, gos[i], args.rounds,
                                     args.polls if i == 0 else 0, ready, done))
                 for i in range(args.readers)]
        start_readers(procs, ready)
        spans, calls = [], []
        for r in range(args.rounds):
            params["w"] += 1
            t0 = time.perf_counter()
            shared["weights"] = params
            shared["version"] = r + 1
            calls.append(time.perf_counter() - t0)
            for go in gos:
                go.put(r)
            got = [done.get(timeout=300) for _ in procs]
            assert all(value == r + 2 for _, value in got), got
            spans.append(max(t for t, _ in got) - t0)
        results["manager dict: all readers hold it, s"] = statistics.median(spans)
        results["manager dict: publish (set), s"] = statistics.median(calls)
        results["manager dict: version lookup, us"] = done.get(timeout=300) * 1e6
        for proc in procs:
            proc.join(60)


# -- peers -------------------------------------------------------------------------------
def bench_nng(args, results: dict) -> None:
    """The same bytes to ``readers`` bare pynng streams, one thread per stream."""
    frame = np.zeros(args.mb * MB // 4, np.float32).tobytes()
    workers = [NngStream() for _ in range(args.readers)]
    spans = []
    try:
        for _ in range(args.rounds):
            threads = [threading.Thread(target=_stream_one, args=(w, frame)) for w in workers]
            t0 = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            spans.append(time.perf_counter() - t0)
    finally:
        for worker in workers:
            worker.close()
    results["bare pynng x readers: all hold it, s"] = statistics.median(spans)


def bench_nothing_new(args, results: dict) -> None:
    """``latest(newer_than=latest)`` in a reader process against a pickled bare pynng
    round trip, in alternating rounds of ``polls`` each (a burst of load from elsewhere
    hits both alike); medians, and the median of the rounds' ratios."""
    asks, done = fibrl.Queue(), fibrl.Queue()
    echo = PickledEcho()
    with PolicyStore() as store:
        store.publish({"w": np.ones(1000, np.float32)})
        reader = fibrl.Process(target=polling_reader, args=(store, asks, done))
        reader.start()
        try:
            asks.put(100)
            done.get(timeout=300)
            echo.rounds(100, 24)
            ours, floor = [], []
            for _ in range(args.nothing_rounds):
                asks.put(args.polls)
                ours.append(done.get(timeout=300))
                floor.append(echo.rounds(args.polls, 24) / args.polls)
        finally:
            asks.put(0)
            reader.join(60)
            echo.close()
    results["fibrl PolicyStore: nothing new, us"] = statistics.median(ours) * 1e6
    results["pickled bare pynng round trip, us"] = statistics.median(floor) * 1e6
    results["nothing new / pickled round trip, median of rounds"] = statistics.median(
        a / b for a, b in zip(ours, floor))


def _stream_one(worker: NngStream, frame: bytes) -> None:
    worker.sock.send(b"consume 1")
    worker.sock.send(frame)
    assert worker.sock.recv() == ACK


def bench_ray(args, results: dict) -> Optional[str]:
    try:
        import ray
    except Exception as exc:  # not installed, or broken
        return f"skipping Ray: not importable ({type(exc).__name__}: {exc}); pip install ray"
    ray.init(num_cpus=args.readers, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote
        def hold(box: list) -> float:
            return float(ray.get(box[0])["w"][0])   # (a list: ray passes the ref as is)

        params = {"w": np.ones(args.mb * MB // 4, np.float32)}
        ray.get([hold.remote([ray.put({"w": np.ones(4)})]) for _ in range(args.readers)])
        spans = []
        for _ in range(args.rounds):
            params["w"] += 1
            t0 = time.perf_counter()
            ref = ray.put(params)
            ray.get([hold.remote([ref]) for _ in range(args.readers)])
            spans.append(time.perf_counter() - t0)
        results["Ray put + get in tasks: all hold it, s"] = statistics.median(spans)
    finally:
        ray.shutdown()
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 MB, 3 rounds")
    parser.add_argument("--mb", type=int, default=100, help="size of the params, MB")
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--polls", type=int, default=2000,
                        help="nothing-new checks per round")
    parser.add_argument("--nothing-rounds", type=int, default=9,
                        help="alternating rounds of nothing-new checks and pickled round trips")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.rounds, args.polls, args.nothing_rounds = 10, 3, 500, 5
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus, {platform.machine()}, "
          f"{args.mb} MB of float32 to {args.readers} reader processes, median of "
          f"{args.rounds} rounds", flush=True)
    results: dict = {}
    for bench in (bench_store, bench_nng, bench_nothing_new, bench_manager_dict):
        bench(args, results)
        print(f"{bench.__name__} done", file=sys.stderr, flush=True)
    skipped = bench_ray(args, results)
    if skipped:
        print(skipped)
    print()
    print("| measure | value |")
    print("|---|---|")
    for key, value in results.items():
        print(f"| {key} | {value:,.4g} |")
    print()
    store = "fibrl PolicyStore: all readers hold it, s"
    rows = [("distribution, all readers hold it (s)", store,
             "bare pynng x readers: all hold it, s", "the nng floor"),
            ("distribution, all readers hold it (s)", store,
             "manager dict: all readers hold it, s", "manager dict"),
            ("distribution, all readers hold it (s)", store,
             "Ray put + get in tasks: all hold it, s", "Ray"),
            ("publish call (s)", "fibrl PolicyStore: publish call, s",
             "manager dict: publish (set), s", "manager dict"),
            ("nothing new, one check (us)", "fibrl PolicyStore: nothing new, us",
             "pickled bare pynng round trip, us", "the nng floor (pickled)",
             "nothing new / pickled round trip, median of rounds"),
            ("nothing new, one check (us)", "fibrl PolicyStore: nothing new, us",
             "manager dict: version lookup, us", "manager dict")]
    print("| measure | fibrl | peer | peer's | fibrl/peer | better |")
    print("|---|---|---|---|---|---|")
    for measure, ours, theirs, peer, *paired in rows:
        if theirs in results:
            # alternating rounds: the median of the rounds' ratios
            ratio = results[paired[0]] if paired else results[ours] / results[theirs]
            print(f"| {measure} | {results[ours]:,.4g} | {peer} | {results[theirs]:,.4g} | "
                  f"{ratio:.2f}x | lower |")


if __name__ == "__main__":
    main()
