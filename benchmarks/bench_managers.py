"""Managers benchmark: fibrl against stdlib ``multiprocessing`` managers, same machine, one run.

Run::

    python benchmarks/bench_managers.py           # full, about a minute
    python benchmarks/bench_managers.py --quick   # about 20 seconds

Measures, for both libraries, with the server in its own process and calls
made from this one:

- sync round trip (µs): ``len(managed_list)``, one call answered at once;
- sync round trip with a 10 KB argument (µs): ``managed_dict["k"] = payload``;
- sync calls/s from 4 threads at once;
- async calls/s: fibrl ``AsyncManager`` proxies issue 1000 calls before
  waiting for any (handles resolved in any order), against the stdlib issuing
  the same calls one after the other (it has no async proxies) and from a
  4-thread pool;
- overlap (s): four managers each running a 1 s call; fibrl waits on four
  handles, the stdlib makes the calls one by one;
- the transport's floor (µs): a bare round trip of one small frame over
  fibrl's authenticated pynng channel to an echo in another process (no
  pickling, no dispatch), against the same over ``multiprocessing.connection``.

Every measurement runs a warm-up first (which also sizes the timed runs to
about ``--target`` seconds), then repeats and reports the median. The table
gives the ratio fibrl/mp and says whether higher or lower is better. Numbers
to read, not assertions.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.managers import BaseManager

PAYLOAD = b"x" * 10_000


class Calc:
    """The object both libraries serve."""

    def add(self, a: int, b: int) -> int:
        return a + b

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


class MpCalcManager(BaseManager):
    """The stdlib manager serving Calc (module level: its spawn child imports it)."""


MpCalcManager.register("Calc", Calc)


def _timed(fn, target: float, repeats: int) -> list:
    """Seconds per operation of ``fn(n)``, sized so a run lasts about ``target`` s."""
    n, spent = 16, 0.0
    while spent < target / 4:
        start = time.perf_counter()
        fn(n)
        spent = time.perf_counter() - start
        if spent < target / 4:
            n *= 4
    n = max(16, int(n * target / max(spent, 1e-6)))
    per_op = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(n)
        per_op.append((time.perf_counter() - start) / n)
    return per_op


def _sync_rows(make_manager, target: float, repeats: int) -> dict:
    manager = make_manager()
    try:
        lst, dct = manager.list(range(10)), manager.dict()

        def length(n: int) -> None:
            for _ in range(n):
                len(lst)

        def store(n: int) -> None:
            for _ in range(n):
                dct["k"] = PAYLOAD

        def threaded(n: int) -> None:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda _i: length(max(n // 4, 1)), range(4)))

        return {
            "rtt": statistics.median(_timed(length, target, repeats)) * 1e6,
            "rtt10k": statistics.median(_timed(store, target, repeats)) * 1e6,
            "threads": 1 / statistics.median(_timed(threaded, target, repeats)),
        }
    finally:
        manager.shutdown()


def echo_server(ready, stop) -> None:
    """Child side of the floor measurement: echo every frame of one channel."""
    from fibrl.hosting.hub import get_hub
    from fibrl.wire.transport import Listener

    listener = Listener("127.0.0.1", get_hub().secret, on_frame=lambda peer, data: peer.send(data))
    ready.put(listener.address)
    stop.wait(120)
    listener.close()


def mp_echo_server(conn) -> None:
    """Child side of the stdlib floor measurement."""
    while True:
        data = conn.recv_bytes()
        if not data:
            return
        conn.send_bytes(data)


def _floor(target: float, repeats: int) -> tuple:
    import multiprocessing

    import fibrl
    from fibrl.hosting.hub import get_hub
    from fibrl.wire.transport import Channel

    ready, stop = fibrl.Queue(), fibrl.Event()
    proc = fibrl.Process(target=echo_server, args=(ready, stop))
    proc.start()
    channel = Channel.connect(ready.get(timeout=60), get_hub().secret)

    def ping(n: int) -> None:
        for _ in range(n):
            channel.send(b"x" * 64)
            channel.recv()

    fib = statistics.median(_timed(ping, target, repeats)) * 1e6
    channel.close()
    stop.set()
    proc.join(30)
    here, there = multiprocessing.Pipe()
    child = multiprocessing.Process(target=mp_echo_server, args=(there,))
    child.start()

    def mp_ping(n: int) -> None:
        for _ in range(n):
            here.send_bytes(b"x" * 64)
            here.recv_bytes()

    std = statistics.median(_timed(mp_ping, target, repeats)) * 1e6
    here.send_bytes(b"")
    child.join(30)
    return fib, std


def _async_fibrl(target: float, repeats: int) -> dict:
    from fibrl.managers import AsyncManager

    mgr = type("FibrlCalcManager", (AsyncManager,), {})
    mgr.register("Calc", Calc)
    managers = [mgr() for _ in range(4)]
    for m in managers:
        m.start()
    try:
        calc = managers[0].Calc()

        def burst(n: int) -> None:
            handles = [calc.add(i, 1) for i in range(n)]
            for h in reversed(handles):
                h.get(60)

        rate = 1 / statistics.median(_timed(burst, target, repeats))
        calcs = [m.Calc() for m in managers]
        start = time.perf_counter()
        handles = [c.sleep(1.0) for c in calcs]
        for h in handles:
            h.get(30)
        return {"async": rate, "overlap": time.perf_counter() - start}
    finally:
        for m in managers:
            m.shutdown()


def _async_mp(target: float, repeats: int) -> dict:
    managers = [MpCalcManager() for _ in range(4)]
    for m in managers:
        m.start()
    try:
        calc = managers[0].Calc()

        def sequential(n: int) -> None:
            for i in range(n):
                calc.add(i, 1)

        def threaded(n: int) -> None:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: calc.add(i, 1), range(n)))

        seq = 1 / statistics.median(_timed(sequential, target, repeats))
        thr = 1 / statistics.median(_timed(threaded, target, repeats))
        calcs = [m.Calc() for m in managers]
        start = time.perf_counter()
        for c in calcs:
            c.sleep(1.0)
        return {"async": seq, "async_threads": thr, "overlap": time.perf_counter() - start}
    finally:
        for m in managers:
            m.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--target", type=float, default=None, help="seconds per timed run")
    args = parser.parse_args()
    target = args.target or (0.3 if args.quick else 1.0)
    repeats = 3 if args.quick else 5

    import multiprocessing

    import fibrl

    multiprocessing.set_start_method("spawn", force=True)
    fib = _sync_rows(fibrl.Manager, target, repeats)
    std = _sync_rows(multiprocessing.Manager, target, repeats)
    fib.update(_async_fibrl(target, repeats))
    std.update(_async_mp(target, repeats))
    fib["floor"], std["floor"] = _floor(target, repeats)
    rows = [
        ("sync round trip, len(list) (µs)", fib["rtt"], std["rtt"], "lower"),
        ("sync round trip, 10 KB arg (µs)", fib["rtt10k"], std["rtt10k"], "lower"),
        ("sync calls/s, 4 threads", fib["threads"], std["threads"], "higher"),
        ("async calls/s vs mp sequential", fib["async"], std["async"], "higher"),
        ("async calls/s vs mp 4 threads", fib["async"], std["async_threads"], "higher"),
        ("4 managers x 1 s call (s)", fib["overlap"], std["overlap"], "lower"),
        ("transport floor: bare round trip (µs)", fib["floor"], std["floor"], "lower"),
    ]
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus, {platform.machine()}")
    print(f"| {'measure':37} | {'fibrl':>10} | {'mp':>10} | {'fibrl/mp':>8} | better |")
    print(f"|{'-' * 39}|{'-' * 12}|{'-' * 12}|{'-' * 10}|--------|")
    for name, a, b, better in rows:
        print(f"| {name:37} | {a:10.1f} | {b:10.1f} | {a / b:8.2f} | {better:6} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
