"""Network partitions and frame faults, made with the transport's test seam
(``fibrl.wire.faults``: each process holds, drops, duplicates or cuts what it sends).

A partition between the parent and one pool worker is both sides holding their
frames to each other: the worker installs its half from inside its task, once it
reported its end of the connection, and the parent installs the other half on the
connection with that end. Both heal at the same moment (the same clock: the worker
reports when). What must hold:

* shorter than ``parent_timeout``: nothing happens: the map's results are exact,
  no worker is lost, requeued or replaced;
* longer: the parent declares the worker lost and its task runs elsewhere, the map
  is exact, and once the partition heals the stale worker's late result is dropped
  (each result delivered once) and the worker exits by itself (nobody kills it);
* a Queue whose owner and consumer are different processes, with one frame between
  them dropped, duplicated or the connection cut: what the queue's protocol promises
  holds. A consumer's acknowledgements count what ``get()`` returned so far, so one
  lost or repeated on its way to the owner changes nothing: every item is returned
  once. A cut connection fails the call in flight with a clear error or lets it
  succeed, the consumer goes on over a new connection, no item is lost, and the only
  items returned twice are ones ``get()`` returned just before the cut (their
  acknowledgement was lost with the connection, as when a consumer dies): what the
  consumer's window still held is dropped there, since the owner puts it back. What
  the protocol does not need: a frame the owner pushes to a consumer's window, lost or
  repeated inside a live connection, would be an item lost or repeated, but the
  transport (TCP under nng) never does that to a connection it keeps (xfail tests
  show what would happen);
* a producer whose connection to the queue's owner (its parent) is cut: the items
  lost with it are counted by the owner, and ``join_thread()`` raises naming how many,
  or the producer exits with status 1 saying so.

Each fault starts once the process it concerns is known to be where it matters (a
task reported from inside), and each test checks that the seam acted (its counts).
"""
import contextlib
import functools
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
from conftest import deliveries_of, kills_of, wait_until

import fibrl
from fibrl.errors import RemoteObjectError
from fibrl.hosting import hub
from fibrl.hosting.hub import get_hub
from fibrl.hosting.mailbox.consumer import Window
from fibrl.wire import faults, transport

TIMEOUT = 120   # only reached on a hang
pytestmark = pytest.mark.timeout(300)
HEARTBEAT, LIMIT = 0.25, 3.0   # heartbeat_interval, parent_timeout


@pytest.fixture
def seam():
    """This process's fault seam, cleared (every hold healed) after the test."""
    faults.clear()
    yield faults
    faults.clear()


@pytest.fixture
def quick_heartbeats(ctx, configure):
    """The backend under test with heartbeats that find a silent peer in seconds."""
    return configure(heartbeat_interval=HEARTBEAT, parent_timeout=LIMIT)


def _parent_end() -> str:
    """This pool worker's end (``host:port``) of its connection to the parent."""
    clients = list(get_hub()._clients.values())
    assert len(clients) == 1, f"a pool worker here talks to its parent only: {clients}"
    return faults.endpoints(clients[0]._channel).split()[1]


def partition_probe(x, token, started, runs, seconds):
    """``x * x``, and which worker computed it (its end of the connection to the
    parent: unique, where pids in containers are not). The run that takes the token
    is cut off from the parent: it reports its end of the connection and when the
    partition ends, holds what it sends for ``seconds`` (its half of the partition),
    works through most of it, and reports (late, through the partition) what it held."""
    pid, end = os.getpid(), _parent_end()
    runs.put(("ran", x, pid))
    try:
        token.get_nowait()
    except queue.Empty:
        return x * x, end, None
    started.put((x, pid, end, time.monotonic() + seconds))
    started.qsize()   # a round trip: both puts reached the parent before the partition
    faults.install(faults.Rule("hold", side="channel", seconds=seconds))
    time.sleep(seconds * 0.6)
    held = faults.counts()["held"]
    runs.put(("finished", x, pid, held))
    return x * x, end, held


class _Partition:
    """A map on a pool of two whose first task cuts its worker off for ``seconds``."""

    def __init__(self, pool, seam, seconds, items=12):
        self.pool, self.seam = pool, seam
        self.token, self.started, self.runs = fibrl.Queue(), fibrl.Queue(), fibrl.Queue()
        self.token.put("cut off")
        self.items = items
        # (closures over lists only: a cycle through self would keep the queues alive)
        self.kills = kills_of(pool)
        supervisor = pool._engine.supervisor
        probe = functools.partial(partition_probe, token=self.token, started=self.started,
                                  runs=self.runs, seconds=seconds)
        self.result = pool.map_async(probe, range(items), chunksize=1)
        self.deliveries = deliveries_of(self.result)
        # the worker is inside its task: the parent's half of the partition starts
        self.x, self.pid, self.end, self.heals = self.started.get(timeout=TIMEOUT)
        rule = faults.Rule("hold", side="peer", address=self.end,
                           seconds=max(0.0, self.heals - time.monotonic()))
        peers = list(get_hub()._listener._peers.values())
        assert sum(rule.aims_at(peer) for peer in peers) == 1, [
            faults.endpoints(peer) for peer in peers]   # the worker's connection, alone
        seam.install(rule)
        self.workers = wait_until(lambda: _both(supervisor.processes()), "both workers")
        self.pids = [p.pid for p in self.workers]   # (a process reaped later is closed)

    def check_exact(self, out):
        assert [value for value, _, _ in out] == [x * x for x in range(self.items)]
        assert sorted(self.deliveries) == sorted(set(self.deliveries)), "a result came twice"

    def runs_until_finished(self):
        """What the runs reported, until the cut-off run reported that it finished and
        there were as many runs as items (in any order: on a busy machine the other
        worker may still be running the rest when the partition heals)."""
        seen = []
        while not (any(kind == "finished" for kind, *_ in seen)
                   and sum(kind == "ran" for kind, *_ in seen) >= self.items):
            seen.append(self.runs.get(timeout=TIMEOUT))
        return seen


def _ended(process):
    try:
        return process.exitcode is not None
    except ValueError:   # closed: the supervisor reaped it
        return True


def _both(processes):
    return processes if len(processes) == 2 and all(p.pid for p in processes) else None


def test_partition_shorter_than_parent_timeout_changes_nothing(quick_heartbeats, seam):
    with fibrl.Pool(2) as pool:
        cut = _Partition(pool, seam, seconds=1.0)
        out = cut.result.get(TIMEOUT)
        cut.check_exact(out)
        value, end, held = out[cut.x]
        service = pool._engine.service
        assert service.stats == {"lost": 0, "requeued": 0, "failed": 0}
        assert end == cut.end, "the cut-off task ran again elsewhere"
        assert held >= 1, "the worker held nothing back: there was no partition"
        assert sorted(p.pid for p in pool._engine.supervisor.processes()) == \
            sorted(cut.pids), "a worker was replaced"
        runs = cut.runs_until_finished()
        assert sorted(x for kind, x, *_ in runs if kind == "ran") == list(range(cut.items))
        assert cut.kills == []


def test_partition_past_parent_timeout_loses_the_worker_once(quick_heartbeats, seam):
    with fibrl.Pool(2, max_task_retries=1) as pool:
        service = pool._engine.service
        # past the parent's limit, healed before the stale worker, which gives up its
        # parent at LIMIT too, exits (3 s later): its late result reaches the parent
        cut = _Partition(pool, seam, seconds=LIMIT + 1.5)
        out = cut.result.get(TIMEOUT)
        cut.check_exact(out)
        # the order of events, not the clock: had the map waited for the partition to
        # heal, the cut-off worker's result (sent when it heals) would have been taken,
        # and the worker, heard again, not lost
        value, end, held = out[cut.x]
        assert end != cut.end and held is None, "the cut-off worker's result was taken"
        assert service.stats["lost"] == 1 and service.stats["requeued"] >= 1
        # healed: the stale run's late messages arrive, its result is dropped
        runs = cut.runs_until_finished()
        _, x, pid, held = next(run for run in runs if run[0] == "finished")
        assert (x, pid) == (cut.x, cut.pid) and held >= 1, "the worker held nothing"
        # it ends by itself (told to stop, or its parent lost), well before the pool
        # would kill it (30 s after the loss)
        wait_until(lambda: any(_ended(p) for p in cut.workers), "the stale worker's exit",
                   timeout=20)
        ended = [pid for p, pid in zip(cut.workers, cut.pids) if _ended(p)]
        assert ended == [cut.pid], "another worker than the stale one ended"
        assert cut.kills == [], "the stale worker was killed rather than left to exit"
        assert sorted(cut.deliveries) == list(range(cut.items))
        assert cut.result.get(0) == out
        assert pool.map(abs, range(-5, 5)) == [abs(x) for x in range(-5, 5)]


# -- a Queue between two processes ---------------------------------------------------------

ITEMS = 200


def own_a_queue(handover, done, rules):
    """Own a queue of ``ITEMS`` items (handed to the parent through ``handover``) until
    ``done``; ``rules``: faults for what this owner sends; then hand over what the seam did."""
    q = fibrl.Queue()
    for i in range(ITEMS):
        q.put(i)
    faults.install(*(faults.Rule(**rule) for rule in rules))
    handover.put(q)
    done.wait(TIMEOUT)
    handover.put(faults.counts())


class _Owner:
    """A queue owned by a worker: the parent is its one consumer."""

    def __init__(self, rules=()):
        self.handover, self.done = fibrl.Queue(), fibrl.Event()
        self.process = fibrl.Process(target=own_a_queue,
                                     args=(self.handover, self.done, list(rules)))
        self.process.start()
        self.queue = self.handover.get(timeout=TIMEOUT)
        self.largest = 1   # (see drain)

    def drain(self, seam, timeout=3.0, seen=None):
        """Every item ``get()`` returns until none comes for ``timeout`` s (given
        ``seen``, the items returned before: once every item was returned, a missing
        one is waited for up to ``TIMEOUT``, since a late item is not a lost one), how
        many of them came before the seam cut a connection (counting the one whose
        call the cut happened in), and the errors raised meanwhile. ``self.largest``:
        the largest size the window asked for up to the cut."""
        got, before_cut, errors = [], None, []
        deadline = time.monotonic() + TIMEOUT
        while len(got) < 2 * ITEMS:
            try:
                got.append(self.queue.get(timeout=timeout))
            except queue.Empty:
                if seen is None or set(seen) | set(got) == set(range(ITEMS)) or \
                        time.monotonic() > deadline:
                    break
                continue
            except RemoteObjectError as exc:   # (the call the cut caught)
                errors.append(exc)
                assert len(errors) == 1, errors
            if before_cut is None:
                self.largest = max(self.largest, self.window().size)
                if seam.counts()["cut"]:
                    before_cut = len(got)
        return got, before_cut, errors

    def window(self):
        """This process's window on the queue (the items pushed to it, not returned)."""
        return Window.find(self.queue._address, self.queue._oid)

    def finish(self):
        """What the seam did in the owner, once it ended."""
        self.done.set()
        counts = self.handover.get(timeout=TIMEOUT)
        self.process.join(TIMEOUT)
        assert self.process.exitcode == 0
        return counts

    def end(self):
        """Make sure the owner ended (after a test that failed half way, too)."""
        self.done.set()
        self.process.join(TIMEOUT)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(TIMEOUT)


@pytest.fixture
def owner(configure):
    """A queue of ``ITEMS`` owned by a local worker: ``owner(rules)`` starts it."""
    configure(backend="local")
    made = []

    def start(rules=()):
        made.append(_Owner(rules))
        return made[-1]

    yield start
    for each in made:
        each.end()


def _once_each(got):
    assert sorted(got) == list(range(ITEMS)), (
        f"missing {sorted(set(range(ITEMS)) - set(got))[:10]}, "
        f"twice {sorted(x for x in set(got) if got.count(x) > 1)[:10]}")


@pytest.mark.parametrize("action", ["drop", "duplicate"])
def test_a_consumers_message_lost_or_repeated_changes_nothing(owner, seam, action):
    owner = owner()
    first = [owner.queue.get(timeout=TIMEOUT) for _ in range(3)]   # its window is open
    seam.install(faults.Rule(action, side="channel", after=2, count=1))
    got, _, errors = owner.drain(seam, seen=first)
    assert seam.counts()[{"drop": "dropped", "duplicate": "duplicated"}[action]] == 1
    assert errors == []
    _once_each(first + got)
    owner.finish()


def test_a_cut_connection_loses_nothing_and_repeats_only_what_get_returned_before(
        owner, seam):
    owner = owner()
    first = [owner.queue.get(timeout=TIMEOUT) for _ in range(3)]
    seam.install(faults.Rule("cut", side="channel", after=5, count=1))
    got, before_cut, errors = owner.drain(seam, seen=first)
    assert seam.counts()["cut"] == 1 and before_cut is not None
    assert all("connection dropped" in str(exc) for exc in errors), errors
    # returned by get() before the cut, and over the new connection after it
    before, after = first + got[:before_cut], got[before_cut:]
    assert sorted(set(before + after)) == list(range(ITEMS)), "an item was lost"
    assert len(set(before)) == len(before), "returned twice before the cut"
    assert len(set(after)) == len(after), "returned twice after the cut"
    # what the window held was dropped and put back; the only items that come again
    # are the last ones get() returned before the cut, whose acknowledgement the cut
    # lost: those since the last acknowledgement sent before the cut (one goes every
    # quarter of the size the window asks for, or sooner), and those get() took from
    # the window after it, before the consumer saw the connection gone (on a loaded
    # machine, up to what the window held). The size doubles each time get() finds
    # the window empty, so under load a 200-item drain reaches 128 and more.
    again = set(before) & set(after)
    assert again == set(before[len(before) - len(again):]), (
        f"returned again, not the last ones before the cut: {sorted(again)}; the last: "
        f"{before[-len(again) - 2:]}")
    assert len(again) <= max(1, owner.largest // 4) + owner.largest, (
        sorted(again), owner.largest)
    owner.finish()


def test_a_cut_connection_repeats_nothing_get_returned_after_it(owner, seam):
    owner = owner()
    first = [owner.queue.get(timeout=TIMEOUT) for _ in range(8)]   # the window grows
    window = owner.window()
    wait_until(lambda: len(window.items) >= 2, "items pushed ahead to the window")
    seam.install(faults.Rule("cut", side="channel", count=1))
    with contextlib.suppress(RemoteObjectError):   # (the call the cut caught, if it did)
        owner.queue.qsize()   # a frame to the owner: the cut takes it
    assert seam.counts()["cut"] == 1
    got, _, errors = owner.drain(seam, seen=first)
    assert errors == []
    after = [x for x in got if x not in first]   # (those came back: acks lost in the cut)
    assert sorted(set(first + got)) == list(range(ITEMS))
    assert len(set(after)) == len(after), "an item get() returned after the cut came twice"
    owner.finish()


def test_a_cut_seen_here_before_the_reader_sees_it_repeats_nothing_after_it(
        owner, seam, monkeypatch):
    """The cut closes the connection in the thread that sends; the client's reader
    thread learns of it a moment later (under load: many ``get()`` calls later). The
    window must not serve what it holds meanwhile: the owner puts those items back.
    Here the reader is held until the next ``get()`` after the cut has returned."""
    owner = owner()
    address = owner.queue._address
    gate = threading.Event()

    def held(real):
        def until_released(conn):
            if conn.address == address and threading.current_thread() is not \
                    threading.main_thread():
                gate.wait(TIMEOUT)
            real(conn)
        return until_released

    # the two ways a closed connection is reported from another thread: the client's
    # reader ends, nng's callback for the removed pipe; both wait until released
    monkeypatch.setattr(hub.Client, "_on_lost", held(hub.Client._on_lost))
    monkeypatch.setattr(transport.Channel, "_lost", held(transport.Channel._lost))
    try:
        first = [owner.queue.get(timeout=TIMEOUT) for _ in range(8)]   # the window grows
        window = owner.window()
        wait_until(lambda: len(window.items) >= 2, "items pushed ahead to the window")
        window.sync()   # (no acknowledgement left to send ahead of the next frame)
        seam.install(faults.Rule("cut", side="channel", count=1))
        get_hub().send(address, owner.queue._oid, "ack", 0, inline=True)   # (a no-op's frame)
        assert seam.counts()["cut"] == 1
        assert window.items, "the reader saw the cut already: no test"
        next_one = owner.queue.get(timeout=TIMEOUT)
    finally:
        gate.set()
    got, _, errors = owner.drain(seam, seen=first + [next_one])
    after = [next_one] + got
    assert errors == []
    assert sorted(set(first + after)) == list(range(ITEMS)), "an item was lost"
    assert len(set(after)) == len(after), (
        f"returned twice after the cut: {sorted(x for x in set(after) if after.count(x) > 1)}")
    owner.finish()


@pytest.mark.xfail(strict=True, reason="cannot happen: a push lost or repeated inside a live "
                   "connection would be an item lost or repeated, and TCP under nng never "
                   "loses, repeats or reorders a frame of a connection it keeps (a broken pipe "
                   "closes the connection: it is never redialled under the same one)")
@pytest.mark.parametrize("action", ["drop", "duplicate"])
def test_an_owners_push_lost_or_repeated(owner, seam, action):
    owner = owner([dict(action=action, side="peer", kind="reply", after=5, count=1)])
    got, _, errors = owner.drain(seam)
    counts = owner.finish()
    assert counts[{"drop": "dropped", "duplicate": "duplicated"}[action]] == 1
    assert errors == []
    _once_each(got)


# -- a producer cut off from the queue's owner (its parent) -------------------------------

def put_through_a_cut(q, report, join):
    """Put ``ITEMS`` items, the connection to the owner cut after the first 10 arrived;
    ``join``: report what ``join_thread()`` raised (else exit without it)."""
    for i in range(10):
        q.put(i)
    q.qsize()   # a round trip: those 10 arrived
    faults.install(faults.Rule("cut", side="channel", count=1))
    for i in range(10, ITEMS):
        q.put(i)
    if not join:
        return
    q.close()
    try:
        q.join_thread()
    except RemoteObjectError as exc:
        report.put(str(exc))
        report.close()
        report.join_thread()   # (over a new connection: the owner lives)
        raise
    report.put("join_thread() raised nothing")


def _drained(q):
    got = []
    with contextlib.suppress(queue.Empty):
        while True:
            got.append(q.get(timeout=5))
    return got


@pytest.mark.parametrize("join", [True, False], ids=["join_thread", "exit"])
def test_a_producer_cut_off_from_its_owner_loses_nothing_silently(configure, join):
    configure(backend="local")
    q, report = fibrl.Queue(), fibrl.Queue()
    p = fibrl.Process(target=put_through_a_cut, args=(q, report, join))
    p.start()
    p.join(TIMEOUT)   # (its puts never wait: an unbounded queue) then what arrived
    got = _drained(q)
    assert got[:10] == list(range(10)) and len(set(got)) == len(got), got
    lost = ITEMS - len(got)
    assert lost > 0, "the cut lost nothing: no test"
    # Not 0: it did not do all it was asked. 1: it said how many items were not
    # delivered. The queue's owner is its parent, so the cut also lost it its parent,
    # and a child that lost its parent ends PARENT_LOST_GRACE (3 s) later, saying so,
    # with 255: that is what a machine too busy to finish the puts in 3 s gives.
    assert p.exitcode in (1, 255), p.exitcode
    if join and p.exitcode == 1:
        says = report.get(timeout=TIMEOUT)
        assert f"{lost} item(s) put on queue" in says and "not delivered" in says, says


# -- the seam's switch for workers ---------------------------------------------------------

def put_twice_and_count(q):
    """Two puts, each flushed by a round trip; then what the seam did here."""
    for item in ("first", "second"):
        q.put(item)
        q.qsize()
    q.put(faults.counts())


def test_a_worker_takes_its_faults_from_the_environment(configure, monkeypatch):
    configure(backend="local", local_fork_server=False)   # (a fork server has its own env)
    monkeypatch.setenv(faults.ENV, '[{"action": "duplicate", "kind": "put", "count": 1}]')
    q = fibrl.Queue()
    p = fibrl.Process(target=put_twice_and_count, args=(q,))
    p.start()
    got = [q.get(timeout=TIMEOUT) for _ in range(4)]
    p.join(TIMEOUT)
    assert p.exitcode == 0
    assert got[:3] == ["first", "first", "second"]
    assert got[3]["duplicated"] == 1 and got[3]["matched"] >= 2


@pytest.mark.parametrize("spec, says", [
    ('[{"action": "explode"}]', "'explode' is not one of"),
    ('{"action": "drop", "peer": "x"}', "unknown fault rule keys ['peer']"),
    ("drop everything", "is not JSON"),
])
def test_a_bad_fault_spec_is_refused_clearly(spec, says):
    env = {**os.environ, faults.ENV: spec}
    done = subprocess.run([sys.executable, "-c", "import fibrl.wire.transport"], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode != 0 and says in done.stderr, done.stderr[-2000:]
