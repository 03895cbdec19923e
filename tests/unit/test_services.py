"""The hosted state machines alone: mailbox, lock, barrier and pool services.

No process, no socket: each service is driven through ``dispatch`` with fake
reply sinks standing for callers (local, or a peer connection), on a stand-in
hub that has only what services use (timers, unregister). Fast, and a failure
names the state machine, not the transport.
"""
from __future__ import annotations

import pickle
import queue
import threading
import time
from types import SimpleNamespace

import pytest

import fibrl.pool
from fibrl.hosting.hub import ReplySink
from fibrl.hosting.mailbox import EMPTY, Mailbox
from fibrl.pool.protocol import Kind, Report, ResultSink, pack, unpack
from fibrl.pool.service import PoolService
from fibrl.synchronize.services import BarrierService, BarrierTurn, LockService
from fibrl.timers import Timers

WAIT = 10.0


class Peer:
    """A connected process, as services see it."""

    _ids = iter(range(1, 1 << 30))

    def __init__(self) -> None:
        self.id = next(Peer._ids)
        self.closed = False
        self.frames: list = []   # what was pushed to it (a window's items)

    def send(self, frame) -> None:
        self.frames.append(frame)


class Reply(ReplySink):
    """One caller's reply: records what it was answered; ``gone`` callers refuse it."""

    __slots__ = ("rid", "values", "errors", "event", "gone")

    def __init__(self, peer: Peer | None = None, rid: int = 1, gone: bool = False) -> None:
        self.peer, self.rid, self.gone = peer, rid, gone
        self.values: list = []
        self.errors: list = []
        self.event = threading.Event()

    def __call__(self, value=None) -> bool:
        if self.gone:
            return False
        self.values.append(value)
        self.event.set()
        return True

    def fail(self, exc: BaseException) -> bool:
        self.errors.append(exc)
        self.event.set()
        return not self.gone

    @property
    def answered(self) -> bool:
        return self.event.is_set()

    def value(self, timeout: float = WAIT):
        assert self.event.wait(timeout), "no answer"
        assert not self.errors, self.errors
        return self.values[-1]

    def error(self, timeout: float = WAIT) -> BaseException:
        assert self.event.wait(timeout), "no answer"
        assert self.errors, self.values
        return self.errors[-1]


@pytest.fixture
def host():
    timers = Timers()
    services = []
    yield SimpleNamespace(timers=timers, unregister=lambda oid: None, services=services)
    for service in services:   # as the hub does when it closes: their threads end
        service.closed()
    timers.close()


def hosted(service, host):
    service.hub, service.oid = host, f"{type(service).__name__.lower()}-1"
    host.services.append(service)
    return service


# -- mailbox ---------------------------------------------------------------------------------
def test_mailbox_answers_the_oldest_parked_getter_first(host):
    box = hosted(Mailbox(), host)
    first, second = Reply(Peer()), Reply(Peer())
    box.dispatch("get", (None,), first)
    box.dispatch("get", (None,), second)
    assert not first.answered and not second.answered
    box.dispatch("put", (b"a",), Reply())
    assert first.value() == b"a" and not second.answered


def test_mailbox_get_times_out_with_empty_from_the_owner_side(host):
    box = hosted(Mailbox(), host)
    getter = Reply(Peer())
    box.dispatch("get", (0.05,), getter)
    assert isinstance(getter.error(), queue.Empty)
    box.dispatch("put", (b"late",), Reply())
    assert box.take_nowait() == b"late"  # not handed to the getter that gave up


def test_mailbox_requeues_unacknowledged_items_of_a_lost_peer_in_front(host):
    box = hosted(Mailbox(), host)
    for item in (b"1", b"2", b"3"):
        box.dispatch("put", (item,), Reply())
    dead = Peer()
    box.dispatch("get", (0,), Reply(dead, rid=7))
    box.dispatch("get", (0,), Reply(dead, rid=8))
    box.dispatch("ack", (7,), Reply(dead))  # b"1" arrived; b"2" did not
    box.peer_lost(dead)
    assert [box.take_nowait(), box.take_nowait()] == [b"2", b"3"]


def test_items_given_back_by_windows_keep_their_place_in_the_queue(host):
    """Two consumers' windows give back out of order: what comes back is merged by
    the order items were first pushed, so the first window's items do not go behind
    the second's (a sentinel put after them, say)."""
    box = hosted(Mailbox(), host)
    for item in (b"0", b"1", b"2", b"S"):
        box.dispatch("put", (item,), Reply())
    first, second = Peer(), Peer()
    box.dispatch("window", (2,), Reply(first, rid=5))    # holds 0, 1
    box.dispatch("window", (2,), Reply(second, rid=6))   # holds 2, S
    assert box._held == 4 and not box._items
    box.dispatch("want", (1, 2, 0), Reply(second))       # its get() returned 2
    box.dispatch("returned", (0, 0, 0), Reply(first))    # recalled: 0, 1 go back
    box.dispatch("returned", (1, 0, 0), Reply(second))   # stops: S goes back
    assert [box.take_nowait() for _ in range(3)] == [b"0", b"1", b"S"]
    assert box.take_nowait() is EMPTY and box._held == 0


def test_an_item_given_back_is_not_pushed_behind_newer_ones(host):
    """Windows stay in queue order: an item given back waits until a window holds
    nothing newer (else its consumer could take the sentinel behind it first)."""
    box = hosted(Mailbox(), host)
    for item in (b"0", b"1", b"2", b"S"):
        box.dispatch("put", (item,), Reply())
    slow, fast = Peer(), Peer()
    box.dispatch("window", (1,), Reply(slow, rid=5))    # holds 0
    box.dispatch("window", (4,), Reply(fast, rid=6))    # holds 1, 2, S
    held = lambda peer: [p for _, p in box._windows[peer.id].held]  # noqa: E731
    assert held(slow) == [b"0"] and held(fast) == [b"1", b"2", b"S"]
    box.dispatch("returned", (0, 0, 0), Reply(slow))    # recalled: 0 goes back
    assert held(fast) == [b"1", b"2", b"S"] and list(box._items) == [b"0"]
    box.dispatch("want", (3, 4, 1), Reply(fast))        # fast returned all 3, waits
    assert held(fast) == [b"0"] and not box._items


def test_an_item_given_back_does_not_go_to_a_consumer_that_returned_a_newer_one(host):
    """A window that holds nothing is no place for an item given back when its consumer
    already returned a newer one (a sentinel, say: it may have stopped there), unless
    that consumer waits in get() now. A consumer that thawed after a freeze gives its
    window back late; its items wait for a consumer still taking items."""
    box = hosted(Mailbox(), host)
    for item in (b"0", b"1", b"2", b"S"):
        box.dispatch("put", (item,), Reply())
    frozen, done = Peer(), Peer()
    box.dispatch("window", (2,), Reply(frozen, rid=5))   # holds 0, 1
    box.dispatch("window", (2,), Reply(done, rid=6))     # holds 2, S
    held = lambda peer: [p for _, p in box._windows[peer.id].held]  # noqa: E731
    assert held(frozen) == [b"0", b"1"] and held(done) == [b"2", b"S"]
    box.dispatch("want", (2, 2, 0), Reply(done))         # returned 2 and S, stopped
    box.dispatch("returned", (0, 0, 0), Reply(frozen))   # thawed, recalled: 0, 1 back
    assert held(done) == [] and list(box._items) == [b"0", b"1"]
    box.dispatch("want", (0, 1, 1), Reply(frozen))       # the thawed consumer waits
    assert held(frozen) == [b"0"] and held(done) == []
    box.dispatch("want", (2, 2, 1), Reply(done))         # a consumer in get() takes one
    assert held(done) == [b"1"] and not box._items


def test_small_items_pushed_in_a_row_travel_as_one_run_and_come_back_in_order():
    """A run of small pickles is one buffer plus lengths; anything with an out-of-band
    buffer makes the items travel one by one, as before."""
    import numpy as np

    from fibrl.wire import serialization
    from fibrl.hosting.mailbox.protocol import Run

    small = [serialization.encode(v) for v in (b"x" * 100, "abc", 7, (1, "two"), None)]
    small[3] = serialization.Encoded(memoryview(bytes(small[3].data)))  # a received view
    run = Run.of(small)
    assert type(run) is Run
    back = pickle.loads(pickle.dumps(run, protocol=5)).items()
    assert [serialization.loads(e) for e in back] == [b"x" * 100, "abc", 7, (1, "two"), None]
    big = serialization.encode(np.arange(1 << 16))   # its buffer goes out of band
    mixed = Run.of([small[0], big])
    assert type(mixed) is list and len(mixed) == 2
    assert Run.of([small[1]]) is small[1]
    long_pickle = serialization.encode(list(range(40_000)))   # no buffer, over 64 KiB
    assert type(Run.of([small[0], long_pickle])) is list
    # a long run of small items travels out of band, and comes back whole
    many = [serialization.encode(b"%05d" % i * 200) for i in range(100)]
    frame = serialization.dumps_parts(Run.of(many))
    assert len(frame) > 1   # the run's bytes are a part of their own
    joined = b"".join(bytes(p) for p in frame)
    assert [serialization.loads(e) for e in serialization.loads(joined).items()] == \
        [b"%05d" % i * 200 for i in range(100)]


def test_one_way_puts_in_a_row_merge_into_one_call_and_the_queue_takes_them_in_order(host):
    """A connection's feeder sends consecutive one-way puts to one queue as one
    ``put_run`` call; a call between them, another queue, a reply wanted or an item
    with an out-of-band buffer keeps calls apart. The owner stores the run in order."""
    import numpy as np

    from fibrl.wire import serialization
    from fibrl.hosting.hub import _merged
    from fibrl.hosting.mailbox import merge_puts
    from fibrl.wire.messages import Call

    def put(oid, value, rid=0):
        return Call(rid, oid, "put", (serialization.encode(value), None))

    big = put("q", np.arange(1 << 16))
    calls = [put("q", 1), put("q", 2), Call(5, "q", "qsize", ()), put("q", 3), put("q", 4),
             put("r", 5), put("q", 6, rid=7), big, put("q", 8)]
    out = _merged(calls, {"put": merge_puts})
    assert [c.method for c in out] == ["put_run", "qsize", "put_run", "put", "put", "put",
                                       "put"]
    assert out[3:] == calls[5:]
    # a pipe end's put carries the payload alone; a put with a timeout may wait: alone
    sends = [Call(0, "p", "put", (serialization.encode(i),)) for i in range(3)]
    assert [c.method for c in _merged(sends, {"put": merge_puts})] == ["put_run"]
    timed = Call(0, "q", "put", (serialization.encode(9), 1.0))
    assert [c.method for c in _merged([put("q", 1), timed], {"put": merge_puts})] == ["put", "put"]
    box, producer = hosted(Mailbox(), host), Peer()
    for call in _merged([put("q", i) for i in range(50)], {"put": merge_puts}):
        answer = Reply(producer, rid=0)
        box.dispatch(call.method, pickle.loads(pickle.dumps(call.args, protocol=5)), answer)
        assert not answer.errors
    assert [serialization.loads(box.take_nowait()) for _ in range(50)] == list(range(50))
    assert box.take_nowait() is EMPTY


def test_mailbox_keeps_an_item_a_gone_getter_could_not_take(host):
    box = hosted(Mailbox(), host)
    box.dispatch("get", (None,), Reply(Peer(), gone=True))
    taker = Reply(Peer())
    box.dispatch("get", (None,), taker)
    box.dispatch("put", (b"x",), Reply())
    assert taker.value() == b"x"


def test_bounded_mailbox_parks_a_putter_until_there_is_room(host):
    box = hosted(Mailbox(maxsize=1), host)
    box.dispatch("put", (b"a",), Reply())
    waiting = Reply(Peer())
    box.dispatch("put", (b"b", None), waiting)
    assert not waiting.answered
    box.dispatch("get", (0,), Reply())
    assert waiting.value() is None and box.take_nowait() == b"b"


def test_mailbox_closed_fails_what_is_parked(host):
    box = hosted(Mailbox(), host)
    getter = Reply(Peer())
    box.dispatch("get", (None,), getter)
    box.closed()
    assert "no longer exists" in str(getter.error())


# -- lock ------------------------------------------------------------------------------------
def test_lock_grants_waiters_in_arrival_order(host):
    lock = hosted(LockService("lock"), host)
    holder, a, b = Reply(Peer()), Reply(Peer()), Reply(Peer())
    lock.dispatch("acquire", (1, None), holder)
    lock.dispatch("acquire", (1, None), a)
    lock.dispatch("acquire", (1, None), b)
    assert holder.value() is True and not a.answered
    lock.dispatch("release", (1,), Reply(holder.peer))
    assert a.value() is True and not b.answered


def test_lock_acquire_times_out_false_and_releasing_unlocked_raises(host):
    lock = hosted(LockService("lock"), host)
    lock.dispatch("acquire", (1, None), Reply(Peer()))
    late = Reply(Peer())
    lock.dispatch("acquire", (2, 0.05), late)
    assert late.value() is False
    free = hosted(LockService("lock"), host)
    assert isinstance(_fail(free, "release", 1), ValueError)


def test_lock_held_by_a_lost_peer_goes_to_the_next_waiter(host):
    lock = hosted(LockService("lock"), host)
    dead, next_ = Peer(), Reply(Peer())
    lock.dispatch("acquire", (1, None), Reply(dead))
    lock.dispatch("acquire", (1, None), next_)
    lock.peer_lost(dead)
    assert next_.value() is True


def test_a_grant_refused_by_a_gone_waiter_passes_to_the_next(host):
    lock = hosted(LockService("lock"), host)
    holder = Reply(Peer())
    lock.dispatch("acquire", (1, None), holder)
    lock.dispatch("acquire", (1, None), Reply(Peer(), gone=True))
    alive = Reply(Peer())
    lock.dispatch("acquire", (1, None), alive)
    lock.dispatch("release", (1,), Reply(holder.peer))
    assert alive.value() is True


def test_rlock_counts_levels_of_its_owner_thread(host):
    rlock = hosted(LockService("rlock"), host)
    peer = Peer()
    for _ in range(2):
        assert _call(rlock, "acquire", 5, None, peer=peer) is True
    other = Reply(Peer())
    rlock.dispatch("acquire", (5, None), other)
    _call(rlock, "release", 5, peer=peer)
    assert not other.answered
    _call(rlock, "release", 5, peer=peer)
    assert other.value() is True


def test_cancel_withdraws_a_parked_acquire(host):
    lock = hosted(LockService("lock"), host)
    lock.dispatch("acquire", (1, None), Reply(Peer()))
    peer = Peer()
    parked = Reply(peer)
    lock.dispatch("acquire", (9, None, 42), parked)
    _call(lock, "cancel", 9, 42, peer=peer)
    assert parked.value() is False and not lock.waiters


# -- barrier ---------------------------------------------------------------------------------
def test_barrier_releases_all_parties_when_the_last_arrives(host):
    barrier = hosted(BarrierService(3, has_action=False), host)
    replies = [Reply(Peer()) for _ in range(3)]
    for i, reply in enumerate(replies):
        barrier.dispatch("wait", (i, None), reply)
    assert sorted(r.value().index for r in replies) == [0, 1, 2]


def test_barrier_action_runs_once_then_the_round_is_released(host):
    barrier = hosted(BarrierService(2, has_action=True), host)
    first, last = Reply(Peer()), Reply(Peer())
    barrier.dispatch("wait", (1, None), first)
    barrier.dispatch("wait", (2, None), last)
    assert last.value() == BarrierTurn(1, True) and not first.answered
    barrier.dispatch("action_done", (True,), Reply(last.peer))
    assert first.value() == BarrierTurn(0)


def test_barrier_breaks_on_timeout_and_when_a_party_is_lost(host):
    barrier = hosted(BarrierService(3, has_action=False), host)
    waiting = Reply(Peer())
    barrier.dispatch("wait", (1, 0.05), waiting)
    assert isinstance(waiting.error(), threading.BrokenBarrierError)
    barrier.dispatch("reset", (), Reply())
    dead, alive = Peer(), Reply(Peer())
    barrier.dispatch("wait", (1, None), Reply(dead))
    barrier.dispatch("wait", (2, None), alive)
    barrier.peer_lost(dead)
    assert isinstance(alive.error(), threading.BrokenBarrierError)


# -- pool ------------------------------------------------------------------------------------
class Sink(ResultSink):
    def __init__(self) -> None:
        self.outcomes: dict = {}
        self.aborted = None

    def sink_deliver(self, index, outcomes, clean=False) -> None:
        self.outcomes.update(enumerate(outcomes, index))

    def sink_abort(self, exc) -> None:
        self.aborted = exc


def _next(service, wid, reports=()):
    reply = Reply()
    service.op_next(reply, wid, list(reports))
    return reply


def _run(batch) -> list:
    """What a worker reports after running every task of ``batch`` (square)."""
    out = []
    for spec in batch.tasks:
        items = unpack(spec.payload)   # plain pickle, or a fibrl frame under xdist
        squares = [x * x for (x,) in items] if items and isinstance(items[0], tuple) else \
            [x * x for x in items]
        out.append(Report(spec.tid, spec.lo, len(squares), pack(squares), 0.001, True))
    return out


def test_pool_service_hands_out_work_and_delivers_each_result_once():
    service = PoolService(processes=1, max_retries=1, maxtasks=None)
    sink = Sink()
    service.submit(sink, pack(abs), "abs", Kind.MAP, fibrl.pool.chunked(range(6), 2))
    (wid,) = service.reserve_workers()
    reports, seen = [], 0
    while seen < 3:
        batch = _next(service, wid, reports).value()
        assert batch is not None and batch.tasks
        reports, seen = _run(batch), seen + len(batch.tasks)
    service.op_report(Reply(), wid, reports)
    assert sink.outcomes == {i: i * i for i in range(6)}


def test_pool_service_parks_an_idle_worker_and_terminate_aborts_open_jobs():
    service = PoolService(processes=1, max_retries=1, maxtasks=None)
    (wid,) = service.reserve_workers()
    idle = _next(service, wid)
    assert not idle.answered  # no work yet: parked, not polled
    sink = Sink()
    service.submit(sink, pack(abs), "abs", Kind.MAP, fibrl.pool.chunked(range(2), 2))
    assert idle.value().tasks
    service.terminate(RuntimeError("stop"))
    assert isinstance(sink.aborted, RuntimeError)


def test_pool_service_forgets_workers_not_started_once_closed_with_nothing_left():
    """A pool closed while its workers start: the starts that have not begun are not
    wanted any more (and forgotten, so the pool's end does not wait for them); while
    work is left, or before close(), they are."""
    service = PoolService(processes=3, max_retries=1, maxtasks=None)
    sink = Sink()
    service.submit(sink, pack(abs), "abs", Kind.MAP, fibrl.pool.chunked(range(2), 2))
    first, second, third = service.reserve_workers()
    service.close()
    assert service.still_wanted(second)      # a job is still open
    batch = _next(service, first).value()
    service.op_report(Reply(), first, _run(batch))
    assert sink.outcomes == {0: 0, 1: 1}
    assert not service.still_wanted(third)   # closed, nothing left
    assert third not in service._workers and first in service._workers
    assert not service.reserve_workers()


class SlowExitHooks:
    """A supervisor whose backend reports exits ``grace`` s late; records kills."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.killed: list = []
        self.asked = threading.Event()

    def wake(self) -> None:
        pass

    def kill(self, wid) -> None:
        self.killed.append(wid)

    def exit_grace(self, wid) -> float:
        self.asked.set()
        return self.grace


def test_pool_service_waits_for_an_exit_status_as_long_as_the_backend_asks(host):
    # a backend that reports exits late (a container engine under load) must not see its
    # workers written off as "exit status unknown" after the default 2 s
    service = hosted(PoolService(processes=2, max_retries=1, maxtasks=None), host)
    service.hooks = hooks = SlowExitHooks(grace=3.0)
    silent, reported = service.reserve_workers()
    peers = {wid: Peer() for wid in (silent, reported)}
    for wid, peer in peers.items():
        service.op_next(Reply(peer), wid, [])   # connected, parked
    lost_at = time.monotonic()
    for peer in peers.values():
        service.peer_lost(peer)
    assert hooks.asked.is_set()
    service.lose(reported, -9)   # its status came in time
    time.sleep(2.5)
    assert hooks.killed == []   # the other's may still come
    deadline = time.monotonic() + WAIT
    while not hooks.killed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hooks.killed == [silent] and time.monotonic() - lost_at >= 3.0


def _call(service, method, *args, peer=None):
    reply = Reply(peer)
    service.dispatch(method, args, reply)
    return reply.value()


def _fail(service, method, *args):
    reply = Reply()
    service.dispatch(method, args, reply)
    return reply.error()


def _report_hub_declarations(items, out):
    from fibrl.hosting.hub import get_hub

    before = (sorted(get_hub().mergers), len(get_hub()._before_send))
    items.put("from the child")
    items.get(timeout=60)   # opens this process's window on the queue
    hub = get_hub()
    out.put((before, (sorted(hub.mergers), len(hub._before_send))))


def test_how_calls_travel_is_declared_by_the_handles_that_send_them_not_by_imports():
    """A hub's merging of one-way calls and its before-send hooks are set where a queue
    is first used in a process, not filled into a global registry by importing a module:
    a fresh hub has none with every fibrl module imported."""
    import fibrl.connection  # noqa: F401  (every module that sends puts or opens windows)
    import fibrl.queues  # noqa: F401
    from fibrl.hosting.hub import Hub

    fresh = Hub(b"s" * 32)
    assert fresh.mergers == {} and fresh._before_send == ()
    items, out = fibrl.Queue(), fibrl.Queue()
    items.put("for the child")
    child = fibrl.Process(target=_report_hub_declarations, args=(items, out))
    child.start()
    try:
        before, after = out.get(timeout=120)
        assert items.get(timeout=60) == "from the child"
    finally:
        child.join(60)
    assert before == ([], 0)
    assert after == (["put"], 1)
