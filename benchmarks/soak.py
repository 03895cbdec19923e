"""Soak run: kills and freezes of fibrl processes under mixed load, with exact accounting.

Run it as ``python benchmarks/soak.py --seconds 120 [--seed N]``. The first line
printed is ``seed N``; the same seed replays the same sequence of faults (kinds,
moments, durations, which target in pid order), so a failing run can be rerun.

Load, all on the local backend over loopback, for ``--seconds``:

* a ``fibrl.Pool(4)`` running ``map_async`` and ``imap_unordered`` batches of a pure
  task ``x -> (x, x * x)``; every input must come back once, with its value;
* a ``fibrl.Queue`` fed numbered items by a thread of this process and drained by 3
  consumer processes, which journal each item to a file of their own as soon as
  ``get()`` returns it and then report it on a results queue; a consumer that dies
  is replaced;
* a ``SyncManager`` list and dict updated by one process (checked at the end);
* a ``fibrl.rl.ReplayStore`` written by 2 processes and sampled by this one (every
  sampled row must be one that was written; the count must match at the end).

Faults, one every 1-3 s, drawn from the seeded RNG, each applied to a live target:

* ``kill_pool_worker``: SIGKILL of a pool worker;
* ``freeze_pool_worker_short`` / ``freeze_pool_worker_long``: SIGSTOP, then SIGCONT
  after less / more than ``parent_timeout`` (a long-frozen worker is declared lost,
  its tasks run again, and it exits by itself once resumed);
* ``kill_consumer``: SIGKILL of a Queue consumer;
* ``freeze_consumer``: SIGSTOP of a Queue consumer while the queue's consumers hold
  pushed-ahead items, for 0.5-8 s, then SIGCONT.

Every frozen process is resumed (in a ``finally``) before the next fault. Network
partitions are not injected: fibrl has no transport fault seam to cut or delay a
connection yet, so only kills and freezes are mixed here.

Accounting of the queue, from fibrl's delivery contract (docs/queues.md): no item is
lost, and an item is returned by two ``get()`` calls only when the process whose
``get()`` returned it died before its acknowledgement reached the queue's owner. So:

* lost: an item put that no consumer reported and that no consumer which then died
  had journaled (an item a consumer took and journaled but died before reporting
  was handed to the application: fibrl's part was done; it is counted apart);
* duplicated: an item reported twice by the same consumer, or by two consumers that
  both lived on (at most one copy may come from a consumer that stayed alive).

At the end the load stops, the consumers drain the queue up to a stop marker each
(bounded by ``--drain`` seconds), and a summary is printed: operations per kind,
faults per kind, items lost, results duplicated. Exit status 0 only when nothing was
lost or duplicated and every check held; 1 otherwise, with the items named. A
watchdog ends the run (exit 2, with every thread's stack) if it outlives
``--seconds`` plus the start and drain bounds.
"""
from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import queue
import random
import signal
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

import fibrl
from fibrl.rl import ReplayStore

HEARTBEAT_S = 0.5
PARENT_TIMEOUT_S = 5.0
START_BOUND_S = 120      # starting the pool, manager, store and consumers
WAIT_S = 90              # any single wait for a result: only a hang reaches it
CONSUMERS = 3
QUEUE_BACKLOG = 2000     # the producer waits while more items than this are queued
FAULTS = ("kill_pool_worker", "freeze_pool_worker_short", "freeze_pool_worker_long",
          "kill_consumer", "freeze_consumer")


# -- what the processes run ------------------------------------------------------------

def square(x):
    """A pool task: pure, deterministic, a little slow."""
    time.sleep(0.001 * (x % 4))
    return (x, x * x)


def consume(q, results, journal, cid):
    """Take items until a None; journal each one, then report it on ``results``."""
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    reported = 0
    while True:
        try:
            item = q.get(timeout=1.0)
        except queue.Empty:
            continue
        if item is None:
            # what it put, and the connection its puts counted on (the owner keeps a
            # count per connection): a loss is located in this process, on the way, or
            # in the owner
            from fibrl.hosting.mailbox.producer import Ledger
            binding = Ledger.of(results._address, results._oid).binding
            token, sent = (binding.token, binding.sent + 1) if binding else (None, 0)
            results.put(("done", (cid, reported, token, sent)))
            return
        os.write(fd, b"%d\n" % item)
        results.put((cid, item))
        reported += 1


def update_manager(shared_list, shared_dict, stop):
    """Append 0, 1, 2... to the list; the dict holds the count and the last i per i % 8."""
    i = 0
    while not stop.is_set():
        shared_list.append(i)
        shared_dict[i % 8] = i
        shared_dict["count"] = i + 1
        i += 1
        time.sleep(0.002)


def write_replay(store, wid, stop, counts):
    """Insert batches of 16 rows (``w == 3 * v``, ``v`` numbered per writer) until stopped."""
    n = 0
    while not stop.is_set():
        v = np.arange(n, n + 16, dtype=np.int64) + wid * 10**9
        store.insert({"v": v, "w": 3 * v}, timeout=WAIT_S)
        n += 16
        time.sleep(0.01)
    counts.put((wid, n))


# -- the run ---------------------------------------------------------------------------

class Soak:
    """The load, the fault injector and the ledgers of one run."""

    def __init__(self, rng: random.Random, seconds: float) -> None:
        self.rng, self.seconds = rng, seconds
        self.stop = threading.Event()        # stops the load and the injector
        self.lock = threading.Lock()
        self.ops: collections.Counter = collections.Counter()
        self.faults: collections.Counter = collections.Counter()
        self.errors: list[str] = []
        # pool
        self.pool_sent: set[int] = set()
        self.pool_got: collections.Counter = collections.Counter()
        # queue
        self.produced = 0
        self.reported: dict[int, list[int]] = collections.defaultdict(list)
        self.done: set[int] = set()
        self.sent_by: dict[int, int] = {}            # cid -> reports it put (at its end)
        self.tokens: dict[int, tuple] = {}           # cid -> (its connection's token, puts on it)
        self.got_from: collections.Counter = collections.Counter()   # cid -> reports got
        self.consumers: list = [None] * CONSUMERS   # (cid, Process) per slot
        self.next_cid = 0
        self.died: dict[int, int] = {}               # cid -> exit code
        self.journals = tempfile.mkdtemp(prefix="fibrl-soak-")
        self.freezes_held = 0
        self.started = time.monotonic()

    def error(self, text: str) -> None:
        with self.lock:
            self.errors.append(text)
        print(f"ERROR {text}", flush=True)

    # -- pool --------------------------------------------------------------------------
    def pool_load(self, pool) -> None:
        base = 0
        while not self.stop.is_set():
            xs = list(range(base, base + 200))
            base += 200
            self.pool_sent.update(xs)
            try:
                if (base // 200) % 2:
                    got = pool.map_async(square, xs, chunksize=4).get(WAIT_S)
                    self.ops["pool_map_tasks"] += len(xs)
                else:
                    it = pool.imap_unordered(square, xs, chunksize=2)
                    got = [it.next(WAIT_S) for _ in xs]
                    self.ops["pool_imap_unordered_tasks"] += len(xs)
            except Exception as exc:
                self.error(f"pool batch {xs[0]}..{xs[-1]}: {type(exc).__name__}: {exc}")
                return
            for x, value in got:
                self.pool_got[x] += 1
                if value != x * x:
                    self.error(f"pool task {x} returned {value}, not {x * x}")

    # -- queue -------------------------------------------------------------------------
    def start_consumer(self, slot: int, q, results) -> None:
        cid, self.next_cid = self.next_cid, self.next_cid + 1
        p = fibrl.Process(target=consume, name=f"consumer-{cid}",
                          args=(q, results, os.path.join(self.journals, f"{cid}.log"), cid))
        p.start()
        self.consumers[slot] = (cid, p)

    def replace_dead_consumers(self, q, results, draining: bool = False) -> None:
        """Start a consumer in the place of each one that died; while ``draining``, not
        of one that ended with status 0 (it took its stop marker: ``consume`` returns only
        then)."""
        for slot, (cid, p) in enumerate(list(self.consumers)):
            if p.is_alive() or (draining and p.exitcode == 0):
                continue
            p.join(10)
            with self.lock:
                self.died[cid] = p.exitcode
            self.ops["consumer_restarts"] += 1
            self.start_consumer(slot, q, results)
            if draining:
                q.put(None)   # (the dead one may have taken its marker: one more; a
                              # marker left over at the end is not work left undone)

    def watch_consumers(self, q, results) -> None:
        while not self.stop.wait(0.2):
            self.replace_dead_consumers(q, results)

    def produce(self, q) -> None:
        while not self.stop.is_set():
            if q.qsize() > QUEUE_BACKLOG:
                self.stop.wait(0.05)
                continue
            for _ in range(50):
                q.put(self.produced)
                self.produced += 1
            self.ops["queue_puts"] += 50
            self.stop.wait(0.02)

    def collect(self, results, until: threading.Event) -> None:
        while not until.is_set():
            try:
                who, item = results.get(timeout=0.5)
            except queue.Empty:
                continue
            except Exception as exc:   # reported, and collecting goes on
                self.error(f"results.get() raised {type(exc).__name__}: {exc}")
                traceback.print_exc()
                continue
            with self.lock:
                if who == "done":
                    cid, sent, token, on_token = item
                    self.done.add(cid)
                    self.sent_by[cid] = sent
                    self.tokens[cid] = (token, on_token)
                else:
                    self.reported[item].append(who)
                    self.got_from[who] += 1
                    self.ops["queue_items_reported"] += 1

    # -- faults ------------------------------------------------------------------------
    def inject(self, pool, q) -> None:
        while not self.stop.wait(self.rng.uniform(1.0, 3.0)):
            kind = self.rng.choice(FAULTS)
            if "pool_worker" in kind:
                pids = sorted(p.pid for p in pool._engine.supervisor.processes()
                              if p.pid is not None and p.is_alive())
            else:
                pids = sorted(p.pid for _, p in self.consumers if p.is_alive())
            if not pids:
                continue
            pid = pids[int(self.rng.random() * len(pids))]   # one draw, whatever the count
            print(f"{time.monotonic() - self.started:7.1f} s  ({kind} pid {pid} ...)",
                  flush=True)
            if kind.startswith("kill"):
                self.signal(pid, signal.SIGKILL)
            elif kind == "freeze_pool_worker_short":
                self.freeze(pid, self.rng.uniform(0.5, PARENT_TIMEOUT_S - 1.0))
            elif kind == "freeze_pool_worker_long":
                self.freeze(pid, self.rng.uniform(PARENT_TIMEOUT_S + 1.0, 8.0))
            else:
                self.freezes_held += held_in_windows(q) > 0
                self.freeze(pid, self.rng.uniform(0.5, 8.0))
            with self.lock:
                self.faults[kind] += 1
            print(f"{time.monotonic() - self.started:7.1f} s  {kind} pid {pid}", flush=True)

    def signal(self, pid: int, sig: int) -> bool:
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False

    def freeze(self, pid: int, seconds: float) -> None:
        if not self.signal(pid, signal.SIGSTOP):
            return
        try:
            time.sleep(seconds)
        finally:
            self.signal(pid, signal.SIGCONT)


def held_in_windows(q) -> int:
    """Items the owner pushed ahead to consumers and has not had acknowledged."""
    from fibrl.hosting.hub import get_hub
    return get_hub().service(q._oid)._held


# -- the checks ------------------------------------------------------------------------

def queue_verdict(soak: Soak) -> tuple[list[int], list[tuple[int, list[int]]], int, int]:
    """(lost items, bad duplicates, allowed duplicates, items a dead consumer took)."""
    journaled_by_dead: set[int] = set()
    for cid in soak.died:
        path = os.path.join(soak.journals, f"{cid}.log")
        if os.path.exists(path):
            with open(path) as f:
                journaled_by_dead.update(int(line) for line in f if line.strip())
    taken_unreported = journaled_by_dead - set(soak.reported)
    lost = [i for i in range(soak.produced)
            if i not in soak.reported and i not in taken_unreported]
    bad, allowed = [], 0
    for item, cids in sorted(soak.reported.items()):
        if len(cids) == 1:
            continue
        living = [c for c in cids if c not in soak.died]
        if len(living) > 1 or len(set(cids)) < len(cids):
            bad.append((item, cids))
        else:
            allowed += 1
    return lost, bad, allowed, len(taken_unreported)


def journaled_by(soak: Soak, item: int) -> list[int]:
    """The consumers whose journal holds ``item`` (they took it from the queue)."""
    holders = []
    for name in sorted(os.listdir(soak.journals)):
        with open(os.path.join(soak.journals, name)) as f:
            if any(line.strip() == str(item) for line in f):
                holders.append(int(name.split(".")[0]))
    return holders


def pool_verdict(soak: Soak) -> tuple[list[int], list[int]]:
    missing = sorted(x for x in soak.pool_sent if soak.pool_got[x] == 0)
    doubled = sorted(x for x, n in soak.pool_got.items() if n > 1)
    return missing, doubled


def drain(soak: Soak, q, results, bound: float) -> None:
    """Resume the consumers' work to the end: each takes a stop marker after the items."""
    soak.replace_dead_consumers(q, results)
    for _ in range(CONSUMERS):
        q.put(None)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        # (a consumer frozen near the end of the load may be cut off by the queue's owner
        # only now: the one that takes its place takes its stop marker)
        soak.replace_dead_consumers(q, results, draining=True)
        with soak.lock:
            cids = {cid for cid, _ in soak.consumers}
            if cids <= soak.done:
                break
        time.sleep(0.1)
    else:
        soak.error(f"consumers {sorted(cids - soak.done)} did not reach their stop marker "
                   f"within {bound:.0f} s")
    for _, p in soak.consumers:
        p.join(10)
        if p.is_alive():
            soak.error(f"consumer {p.name} still alive after its stop marker")
            p.kill()
        elif p.exitcode != 0:   # (1: it found items it put undelivered, and said so)
            soak.error(f"consumer {p.name} reached its stop marker but exited with "
                       f"{p.exitcode}")
    leftover = []
    while True:
        try:
            item = q.get(timeout=1.0)
        except queue.Empty:
            break
        if item is not None:
            leftover.append(item)
    if leftover:
        soak.error(f"{len(leftover)} items still in the queue after every stop marker was "
                   f"taken: {leftover[:10]}")


def thread(target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True, name=target.__name__)
    t.start()
    return t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="how long the load runs")
    parser.add_argument("--seed", type=int, default=None, help="the fault RNG's seed")
    parser.add_argument("--drain", type=float, default=90.0, help="bound of the final drain, s")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"seed {seed}", flush=True)
    bound = args.seconds + START_BOUND_S + args.drain + WAIT_S
    print(f"load {args.seconds:.0f} s; drain bound {args.drain:.0f} s; "
          f"whole run bound {bound:.0f} s", flush=True)
    watchdog = threading.Timer(bound, hang, args=(bound,))
    watchdog.daemon = True
    watchdog.start()
    fibrl.init(backend="local", heartbeat_interval=HEARTBEAT_S, parent_timeout=PARENT_TIMEOUT_S)
    # (never cancelled: it also bounds the exit, which waits for the child processes)
    return run(Soak(random.Random(seed), args.seconds), args.drain)


def hang(bound: float) -> None:
    """The run outlived its bound: show where every thread is, and end (status 2)."""
    print(f"HANG: the run did not end within {bound:.0f} s; every thread's stack:", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    os._exit(2)


def run(soak: Soak, drain_bound: float) -> int:
    q, results = fibrl.Queue(), fibrl.Queue()
    manager = fibrl.Manager()
    shared_list, shared_dict, mstop = manager.list(), manager.dict(), fibrl.Event()
    updater = fibrl.Process(target=update_manager, args=(shared_list, shared_dict, mstop))
    store = ReplayStore(10**6, seed=0)
    rstop, rcounts = fibrl.Event(), fibrl.Queue()
    writers = [fibrl.Process(target=write_replay, args=(store, w, rstop, rcounts))
               for w in range(2)]
    pool = fibrl.Pool(4, max_task_retries=50)
    try:
        for p in [updater, *writers]:
            p.start()
        for slot in range(CONSUMERS):
            soak.start_consumer(slot, q, results)
        collecting = threading.Event()
        load = [thread(soak.pool_load, pool), thread(soak.produce, q),
                thread(soak.watch_consumers, q, results)]
        collector = thread(soak.collect, results, collecting)
        injector = thread(soak.inject, pool, q)
        print("pool workers", sorted(p.pid for p in pool._engine.supervisor.processes()),
              "consumers", [p.pid for _, p in soak.consumers], flush=True)
        sample_replay(soak, store, time.monotonic() + soak.seconds)
        soak.stop.set()
        injector.join(15)                 # a freeze in progress ends within 8 s
        for t in load:
            t.join(WAIT_S + 10)
        mstop.set()
        rstop.set()
        drain(soak, q, results, drain_bound)
        collecting.set()
        collector.join(5)
        check_late_reports(soak, results)
        check_manager(soak, updater, shared_list, shared_dict)
        check_replay(soak, store, writers, rcounts)
    finally:
        pool.terminate()
        pool.join()
        store.close()
        manager.shutdown()
    return summary(soak)


def sample_replay(soak: Soak, store, until: float) -> None:
    """Sample the store every 50 ms until ``until``; every row must be one written."""
    while time.monotonic() < until:
        time.sleep(0.05)
        if len(store) < 32:
            continue
        batch = store.sample(32, timeout=WAIT_S)
        v, w = batch["v"], batch["w"]
        if not (np.array_equal(w, 3 * v) and np.all((v // 10**9 == 0) | (v // 10**9 == 1))):
            soak.error(f"replay sample holds rows never written: {v.tolist()}")
        soak.ops["replay_samples"] += 1


def check_late_reports(soak: Soak, results) -> None:
    """Reports still queued once every consumer's stop marker arrived: each consumer put
    its reports before its marker, on the same connection, so they are late (out of
    order), not lost; counted as reported, and named as an error."""
    late = []
    while True:
        try:
            who, item = results.get_nowait()
        except queue.Empty:
            break
        if who != "done":
            late.append((who, item))
            soak.reported[item].append(who)
            soak.got_from[who] += 1
    if late:
        soak.error(f"{len(late)} report(s) arrived after their consumer's stop marker "
                   f"(out of order): {late[:10]}")
    for cid, sent in sorted(soak.sent_by.items()):
        if soak.got_from[cid] != sent:
            token, on_token = soak.tokens.get(cid, (None, 0))
            soak.error(f"consumer {cid} put {sent} reports on the results queue; "
                       f"{soak.got_from[cid]} arrived; of the {on_token} puts its last "
                       f"connection carried, the queue's owner counted "
                       f"{received_on(results, token)}")


def received_on(q, token) -> "int | None":
    """How many puts the owner of ``q`` (this process) counted on the connection named
    ``token`` (None: unknown)."""
    from fibrl.hosting.hub import get_hub
    mailbox = get_hub().service(q._oid)
    with mailbox._lock:
        if token in mailbox._delivered:
            return mailbox._delivered[token]
        return next((n for t, n in mailbox._tallies.values() if t == token), None)


def check_manager(soak: Soak, updater, shared_list, shared_dict) -> None:
    updater.join(WAIT_S)
    values, d = list(shared_list), dict(shared_dict)
    count = d.get("count", 0)
    soak.ops["manager_updates"] += count
    if values != list(range(count)):
        soak.error(f"manager list holds {len(values)} values, not 0..{count - 1}")
    expected = {i % 8: i for i in range(max(0, count - 8), count)}
    if {k: v for k, v in d.items() if k != "count"} != expected:
        soak.error(f"manager dict {d} differs from {expected}")


def check_replay(soak: Soak, store, writers, rcounts) -> None:
    for p in writers:
        p.join(WAIT_S)
    written = sum(rcounts.get(timeout=WAIT_S)[1] for _ in writers)
    soak.ops["replay_rows_inserted"] += written
    if len(store) != written or store.stats()["inserts"] != written:
        soak.error(f"the replay store holds {len(store)} rows (inserts "
                   f"{store.stats()['inserts']}); the writers wrote {written}")


def summary(soak: Soak) -> int:
    lost, bad_dups, allowed_dups, taken_unreported = queue_verdict(soak)
    pool_missing, pool_doubled = pool_verdict(soak)
    print("operations:", dict(sorted(soak.ops.items())))
    print("faults injected:", dict(sorted(soak.faults.items())),
          f"(consumer freezes while windows held items: {soak.freezes_held})")
    print(f"consumers died: {len(soak.died)} "
          f"(exit codes {sorted(collections.Counter(soak.died.values()).items())})")
    print(f"queue: {soak.produced} put; duplicates allowed by the contract (a copy from "
          f"a consumer that died): {allowed_dups}; taken by a consumer that died before "
          f"reporting: {taken_unreported}")
    items_lost = len(lost) + len(pool_missing)
    duplicated = len(bad_dups) + len(pool_doubled)
    print(f"items lost: {items_lost}")
    print(f"results duplicated: {duplicated}")
    if lost:
        print("  queue items lost:", lost[:50])
        for item in lost[:10]:   # where each went: a consumer took it, or none did
            holders = journaled_by(soak, item)
            print(f"    {item}: journaled by consumer(s) {holders or 'none'}"
                  + "".join(f" ({cid} {'died' if cid in soak.died else 'alive to the end'})"
                            for cid in holders))
    if bad_dups:
        print("  queue items reported twice (item, consumer ids):", bad_dups[:50])
    if pool_missing:
        print("  pool inputs without a result:", pool_missing[:50])
    if pool_doubled:
        print("  pool inputs with more than one result:", pool_doubled[:50])
    for text in soak.errors:
        print("  error:", text)
    ok = items_lost == 0 and duplicated == 0 and not soak.errors
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
