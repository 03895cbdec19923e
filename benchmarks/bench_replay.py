"""Replay benchmark: a shared fibrl ReplayStore against in-process prioritized buffers.

Run::

    python benchmarks/bench_replay.py            # about 90 seconds
    python benchmarks/bench_replay.py --quick    # about a minute

Items are CartPole-sized transitions (obs and next_obs 4 x float32, action
int64, reward float32, done bool: 49 bytes). Measured in one run:

- fibrl, shared: 8 writer processes insert batches of 64 into a prioritized
  ``ReplayStore`` while the learner (this process) samples batches of 256 and
  updates their priorities: inserted transitions/s (all writers), sampled
  transitions/s, p50/p99 latency of one learner step (``sample`` with the
  previous step's priority update carried in the same call);
- the learner loop with no writers: the update as its own call, carried by
  the next sample, and carried by ``sample_async`` requests with two batches
  pending (the next batches are drawn while the learner handles this one);
  and the writers with no learner;
- the snapshot stall: ``--snapshots`` (3) ``snapshot()`` calls during the
  shared run; the time the server held its lock (``stall_s``), and the
  slowest and p99 learner step and insert call overlapping a snapshot,
  against those in a window as long just before each snapshot (on a loaded
  machine calls stall without any snapshot too);
- peers, driven by one process (no sharing): cpprb's
  ``PrioritizedReplayBuffer`` and torchrl's ``PrioritizedReplayBuffer``
  (``LazyTensorStorage``) doing the same inserts and the same sample+update
  loop. A peer that is not importable is skipped, saying so. The peers'
  sample+update loops take turns with the fibrl learner-alone loops (4 rounds
  of slices), so that the ratios compare runs under the same machine load.

Ratios are fibrl / peer (higher is better for rates). Numbers to read, not
assertions.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

import fibrl
from fibrl.rl import ReplayStore
from fibrl.rl.replay import Prioritized

INSERT_BATCH, SAMPLE_BATCH = 64, 256
LEARNER_MODES = ("2 calls", "1 call", "prefetch 2")
ROUNDS = 4  # turns the learner modes and the peers take in the learner-alone phase


def transitions(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((n, 4)).astype(np.float32),
            "action": rng.integers(0, 2, n).astype(np.int64),
            "reward": np.ones(n, np.float32),
            "next_obs": rng.standard_normal((n, 4)).astype(np.float32),
            "done": np.zeros(n, bool)}


def writer(store: ReplayStore, index: int, ready, go, stop, timings) -> None:
    batch = transitions(INSERT_BATCH, index)
    prios = np.random.default_rng(index).random(INSERT_BATCH) + 0.1
    ready.put(index)
    go.wait(120)
    starts, lasted = [], []
    while not stop.is_set():
        t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across local processes
        store.insert(batch, prios, timeout=60)
        starts.append(t0)
        lasted.append(time.perf_counter() - t0)
    timings.put((np.asarray(starts), np.asarray(lasted)))


def learner_loop(store: Any, seconds: float, latencies: list, mode: str) -> int:
    """Sample + update for ``seconds``; returns the transitions sampled.

    ``mode``: "2 calls" (sample, then update_priorities), "1 call" (each update
    carried by the next sample call: one round trip per step) or "prefetch N"
    (``sample_async`` with N requests pending, each carrying the update of the
    batch taken just before it was sent).
    """
    rng = np.random.default_rng(1)
    end = time.perf_counter() + seconds
    sampled = 0
    update = None
    pending: collections.deque = collections.deque()
    if mode.startswith("prefetch"):
        for _ in range(int(mode.split()[1])):
            pending.append(store.sample_async(SAMPLE_BATCH, timeout=60))
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        if pending:
            batch = pending.popleft().get()
            pending.append(store.sample_async(SAMPLE_BATCH, timeout=60, update=update))
            update = (batch.ids, rng.random(SAMPLE_BATCH) + 0.1)
        elif mode == "1 call":
            batch = store.sample(SAMPLE_BATCH, timeout=60, update=update)
            update = (batch.ids, rng.random(SAMPLE_BATCH) + 0.1)
        else:
            batch = store.sample(SAMPLE_BATCH, timeout=60)
            store.update_priorities(batch.ids, rng.random(SAMPLE_BATCH) + 0.1)
        t1 = time.perf_counter()
        latencies.append((t0, t1 - t0))
        sampled += SAMPLE_BATCH
    for left in pending:  # drawn already; not counted
        left.get()
    return sampled


def pct(values: list, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class Writers:
    """N writer processes that start together and stop on an event."""

    def __init__(self, store: ReplayStore, n: int) -> None:
        self.ready, self.go, self.stop = fibrl.Queue(), fibrl.Event(), fibrl.Event()
        self.timings = fibrl.Queue()
        self.procs = [fibrl.Process(target=writer, args=(store, i, self.ready, self.go,
                                                         self.stop, self.timings))
                      for i in range(n)]
        for proc in self.procs:
            proc.start()
        for _ in self.procs:
            self.ready.get(timeout=120)

    def start(self) -> None:
        self.go.set()

    def close(self) -> list:
        """Stop the writers; each insert call's (start, duration), all writers together."""
        self.stop.set()
        calls = [self.timings.get(timeout=120) for _ in self.procs]
        for proc in self.procs:
            proc.join(60)
        return [(t, d) for starts, lasted in calls for t, d in zip(starts.tolist(),
                                                                    lasted.tolist())]


def learners_alone(store: ReplayStore, peers: list, args, results: dict) -> None:
    """Each learner mode and each peer's sample+update loop, taking turns in
    ``ROUNDS`` slices, so that all see the same load on a shared machine."""
    span = args.seconds / ROUNDS
    sampled = collections.Counter()
    lat: dict = {mode: [] for mode in LEARNER_MODES}
    for _ in range(ROUNDS):
        for mode in LEARNER_MODES:
            sampled[mode] += learner_loop(store, span, lat[mode], mode)
        for peer in peers:
            sampled[peer.name] += _calls(peer.step, span) * SAMPLE_BATCH
    for mode in LEARNER_MODES:
        label = f"fibrl learner alone, {mode}"
        results[f"{label}: sampled/s"] = sampled[mode] / (span * ROUNDS)
        results[f"{label}: p50 ms"] = pct([dt for _, dt in lat[mode]], 0.5) * 1e3
        results[f"{label}: p99 ms"] = pct([dt for _, dt in lat[mode]], 0.99) * 1e3
    for peer in peers:
        results[f"{peer.name} sampled/s"] = sampled[peer.name] / (span * ROUNDS)


def bench_fibrl(args, results: dict, peers: list) -> None:
    spec = Prioritized(alpha=0.6, beta=0.4)
    with ReplayStore(args.capacity, sampler=spec, num_shards=args.shards, seed=0) as store:
        fill = transitions(10_000)
        for _ in range(args.prefill // 10_000):
            store.insert(fill, np.random.default_rng(0).random(10_000) + 0.1)
        learners_alone(store, peers, args, results)

        writers = Writers(store, args.writers)
        before = store.stats()["inserts"]
        t0 = time.perf_counter()
        writers.start()
        time.sleep(args.seconds)  # the writers run meanwhile; nothing to wait on here
        results["fibrl writers alone: inserted/s"] = (store.stats()["inserts"] - before) \
            / (time.perf_counter() - t0)

        lat = []
        before = store.stats()["inserts"]
        folder = tempfile.mkdtemp()
        path = os.path.join(folder, "replay.snap")
        snaps: list = []

        def take() -> None:  # args.snapshots snapshots spread over the shared run
            for _ in range(args.snapshots):
                time.sleep(args.seconds / (args.snapshots + 1))
                start = time.perf_counter()
                snaps.append(dict(store.snapshot(path), start=start, end=time.perf_counter()))

        thread = threading.Thread(target=take)
        t0 = time.perf_counter()
        thread.start()
        sampled = learner_loop(store, args.seconds * 1.25, lat, "1 call")
        thread.join(120)
        elapsed = time.perf_counter() - t0
        inserted = store.stats()["inserts"] - before
        inserts = writers.close()
        results["fibrl shared: inserted/s"] = inserted / elapsed
        results["fibrl shared: sampled/s"] = sampled / elapsed
        results["fibrl shared: p50 ms"] = pct([dt for _, dt in lat], 0.5) * 1e3
        results["fibrl shared: p99 ms"] = pct([dt for _, dt in lat], 0.99) * 1e3
        results["fibrl shared: insert call p50 ms"] = pct([dt for _, dt in inserts], 0.5) * 1e3
        results["fibrl shared: insert call p99 ms"] = pct([dt for _, dt in inserts], 0.99) * 1e3

        def overlaps(windows: list) -> Any:
            return lambda t, lasted: any(lo <= t + lasted and t <= hi for lo, hi in windows)

        # each snapshot's window, and a control window as long just before it: the load
        # on a shared machine stalls calls too, snapshot or not
        during = overlaps([(s["start"], s["end"]) for s in snaps])
        control = overlaps([(2 * s["start"] - s["end"] - 0.05, s["start"] - 0.05)
                            for s in snaps])
        shutil.rmtree(folder)
        if not snaps:  # --snapshots 0
            return
        results["snapshot: items held at the first"] = snaps[0]["items"]
        results["snapshot: server lock held, best / worst ms"] = \
            f"{min(s['stall_s'] for s in snaps) * 1e3:.1f} / " \
            f"{max(s['stall_s'] for s in snaps) * 1e3:.1f}"
        results["snapshot: call lasted, worst ms"] = max(s["end"] - s["start"]
                                                          for s in snaps) * 1e3
        for side, calls in (("learner step", lat), ("insert call", inserts)):
            inside = [dt for t, dt in calls if during(t, dt)]
            before_ = [dt for t, dt in calls if control(t, dt) and not during(t, dt)]
            results[f"snapshot: slowest {side} during / just before snapshots ms"] = \
                f"{max(inside, default=float('nan')) * 1e3:.1f} / " \
                f"{max(before_, default=float('nan')) * 1e3:.1f}"
            results[f"snapshot: {side} p99 during / just before snapshots ms"] = \
                f"{pct(inside, 0.99) * 1e3:.1f} / {pct(before_, 0.99) * 1e3:.1f}"


@dataclasses.dataclass
class Peer:
    """An in-process buffer, prefilled: one insert call, one sample+update step."""

    name: str
    insert: Callable[[], Any]
    step: Callable[[], Any]


def cpprb_peer(args) -> Optional[Peer]:
    try:
        from cpprb import PrioritizedReplayBuffer
    except ImportError as exc:
        print(f"skipping cpprb: not importable ({exc}); pip install cpprb")
        return None
    env = {"obs": {"shape": 4, "dtype": np.float32}, "act": {"dtype": np.int64},
           "rew": {"dtype": np.float32}, "next_obs": {"shape": 4, "dtype": np.float32},
           "done": {"dtype": np.bool_}}
    rb = PrioritizedReplayBuffer(args.capacity, env, alpha=0.6)
    t = transitions(INSERT_BATCH)
    kw = dict(obs=t["obs"], act=t["action"], rew=t["reward"], next_obs=t["next_obs"],
              done=t["done"])
    prios = np.random.default_rng(0).random(INSERT_BATCH) + 0.1
    for _ in range(args.prefill // INSERT_BATCH):
        rb.add(**kw, priorities=prios)
    rng = np.random.default_rng(1)

    def step():
        batch = rb.sample(SAMPLE_BATCH, beta=0.4)
        rb.update_priorities(batch["indexes"], rng.random(SAMPLE_BATCH) + 0.1)

    return Peer("cpprb", lambda: rb.add(**kw, priorities=prios), step)


def torchrl_peer(args) -> Optional[Peer]:
    try:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer
    except Exception as exc:  # torchrl fails in many ways when its build mismatches torch
        print(f"skipping torchrl: not importable ({type(exc).__name__}: {exc}); "
              f"pip install --no-deps torchrl tensordict (versions matching your torch)")
        return None
    torch.set_num_threads(1)
    try:
        rb = PrioritizedReplayBuffer(alpha=0.6, beta=0.4,
                                     storage=LazyTensorStorage(args.capacity),
                                     batch_size=SAMPLE_BATCH)
    except RuntimeError as exc:  # its C++ sum tree is missing or built for another torch
        try:
            import torchrl._torchrl  # noqa: F401  the extension holding the sum tree
            why = ""
        except ImportError as cause:
            why = f"; importing its extension torchrl._torchrl fails: {cause}"
        import torchrl
        print(f"skipping torchrl {torchrl.__version__}: its PrioritizedReplayBuffer cannot be "
              f"built here ({exc}){why}. torchrl's compiled extension must be built for the "
              f"installed torch {torch.__version__}")
        return None
    t = {k: torch.from_numpy(v) for k, v in transitions(INSERT_BATCH).items()}
    td = TensorDict(t, batch_size=[INSERT_BATCH])
    prios = torch.rand(INSERT_BATCH) + 0.1
    for _ in range(args.prefill // INSERT_BATCH):
        rb.extend(td)

    def insert():
        idx = rb.extend(td)
        rb.update_priority(idx, prios)

    def step():
        batch, info = rb.sample(return_info=True)
        rb.update_priority(info["index"], torch.rand(SAMPLE_BATCH) + 0.1)

    return Peer("torchrl", insert, step)


def _calls(fn, seconds: float) -> int:
    """How many times ``fn`` ran in ``seconds``."""
    end = time.perf_counter() + seconds
    calls = 0
    while time.perf_counter() < end:
        fn()
        calls += 1
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--prefill", type=int, default=100_000)
    parser.add_argument("--snapshots", type=int, default=3,
                        help="snapshots taken during the shared run")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 4.0
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus, {platform.machine()}, "
          f"capacity {args.capacity}, {args.writers} writers x batches of {INSERT_BATCH}, "
          f"learner batches of {SAMPLE_BATCH}, shards {args.shards}", flush=True)
    results: dict = {}
    peers = [peer for peer in (cpprb_peer(args), torchrl_peer(args)) if peer is not None]
    bench_fibrl(args, results, peers)
    print("fibrl done", file=sys.stderr, flush=True)
    for peer in peers:
        results[f"{peer.name} inserted/s"] = _calls(peer.insert, args.seconds) \
            * INSERT_BATCH / args.seconds
        print(f"{peer.name} done", file=sys.stderr, flush=True)
    width = max(map(len, results))
    for key, value in results.items():
        shown = value if isinstance(value, str) else f"{value:,.1f}"
        print(f"{key:<{width}}  {shown:>14}")
    print()
    for peer in ("cpprb", "torchrl"):
        if f"{peer} sampled/s" not in results:
            continue
        for key in [f"fibrl learner alone, {mode}" for mode in LEARNER_MODES] + ["fibrl shared"]:
            print(f"{key} / {peer}, sampled/s: "
                  f"{results[f'{key}: sampled/s'] / results[f'{peer} sampled/s']:.2f}")
        print(f"fibrl shared / {peer}, inserted/s: "
              f"{results['fibrl shared: inserted/s'] / results[f'{peer} inserted/s']:.2f}")


if __name__ == "__main__":
    main()
