"""Lock, RLock, Semaphore, BoundedSemaphore, Condition, Event and Barrier across processes.

The stdlib's behaviour is the spec. Runs on every backend. Worker functions are
made by ``_workers()`` so they travel by value: a worker container has no
pytest, so it could not import this module to find them by name.
"""
import queue
import threading
import time
import types

import pytest

from conftest import join_all, run_process, wait_until
from fibrl.hosting.hub import get_hub

TIMEOUT = 60


def _workers():
    def hold(lock, holding, release):
        lock.acquire()
        holding.set()
        release.wait(TIMEOUT)
        lock.release()

    def release_it(lock):
        lock.release()

    def count(lock, value, times):
        for _ in range(times):
            with lock:
                current = value.value
                value.value = current + 1

    def try_acquire(lock, out):
        out.put(lock.acquire(timeout=0.2))

    def set_and_notify(cond, flag):
        with cond:
            flag.value = 1
            cond.notify()

    def wait_notified(cond, ready, out):
        with cond:
            ready.put(True)
            out.put(cond.wait(TIMEOUT))

    def own_condition(lock, out):
        cond = type(lock).__module__ and __import__("fibrl").Condition(lock)
        with cond:
            out.put(cond.wait(0.1))
        out.put(cond)

    def set_event(event):
        event.set()

    def wait_event(event, out):
        out.put(event.wait(TIMEOUT))

    def barrier_party(barrier, out):
        out.put(barrier.wait(TIMEOUT))

    def barrier_broken(barrier, out):
        try:
            barrier.wait(TIMEOUT)
            out.put("passed")
        except threading.BrokenBarrierError:
            out.put("broken")

    def make_action(out):
        def action():
            out.put("action")
        return action

    def from_queue(q, out):
        lock = q.get(timeout=TIMEOUT)
        out.put(lock.acquire(timeout=TIMEOUT))
        lock.release()

    def use_orphan(lock, out):
        with lock:
            out.put("used")

    return types.SimpleNamespace(**locals())


W = _workers()


# -- Lock --------------------------------------------------------------------------------------
def test_lock_excludes_another_process_with_timeouts(ctx):
    lock, holding, release = ctx.Lock(), ctx.Event(), ctx.Event()
    p = run_process(ctx, W.hold, lock, holding, release)
    assert holding.wait(TIMEOUT)
    assert lock.acquire(False) is False
    start = time.monotonic()
    assert lock.acquire(timeout=0.3) is False
    assert 0.25 <= time.monotonic() - start < 30   # waited its timeout, and not forever
    release.set()
    assert lock.acquire(timeout=TIMEOUT) is True
    lock.release()
    join_all(p)


def test_a_timeout_too_long_to_wait_at_once_waits_and_breaks_no_other_timeout(ctx):
    """1e12 s is more than any lock or condition can wait for in one call (the stdlib's
    raises OverflowError): it waits without limit, and every other timed wait of the
    process still ends at its timeout; NaN is refused, as the stdlib refuses it."""
    lock, holding, release = ctx.Lock(), ctx.Event(), ctx.Event()
    p = run_process(ctx, W.hold, lock, holding, release)
    assert holding.wait(TIMEOUT)
    got = []
    waiter = threading.Thread(target=lambda: got.append(lock.acquire(timeout=1e12)))
    waiter.start()
    service = get_hub()._services[lock._oid]   # (hosted here, by the parent)
    wait_until(lambda: len(service.waiters) == 1, "the long wait to park")
    event = ctx.Event()
    assert event.wait(0.2) is False   # a timed wait of this process still ends
    assert got == []
    for call in (lambda: lock.acquire(timeout=float("nan")),
                 lambda: event.wait(float("nan"))):
        with pytest.raises(ValueError, match="NaN"):
            call()
    release.set()   # the long wait ends by being granted
    waiter.join(TIMEOUT)
    assert got == [True]
    lock.release()
    join_all(p)


def test_lock_release_semantics(ctx):
    lock = ctx.Lock()
    with pytest.raises(ValueError):
        lock.release()
    lock.acquire()
    join_all(run_process(ctx, W.release_it, lock))  # any process may release a Lock, as in mp
    assert lock.acquire(False) is True
    lock.release()


def test_lock_mutual_exclusion(ctx):
    lock, value = ctx.Lock(), ctx.RawValue("i", 0)
    procs = [run_process(ctx, W.count, lock, value, 40) for _ in range(3)]
    W.count(lock, value, 40)
    join_all(*procs)
    assert value.value == 160


def test_lock_travels_through_a_queue(ctx):
    q, out, lock = ctx.Queue(), ctx.Queue(), ctx.Lock()
    p = run_process(ctx, W.from_queue, q, out)
    q.put(lock)
    assert out.get(timeout=TIMEOUT) is True
    join_all(p)


def test_lock_lives_while_a_child_uses_it(ctx):
    out = ctx.Queue()
    p = run_process(ctx, W.use_orphan, ctx.Lock(), out)  # the parent keeps no reference
    assert out.get(timeout=TIMEOUT) == "used"
    join_all(p)


def test_lock_repr(ctx):
    lock = ctx.Lock()
    assert repr(lock) == "<Lock(owner=None)>"
    with lock:
        assert repr(lock) == "<Lock(owner=MainProcess)>"


# -- RLock -------------------------------------------------------------------------------------
def test_rlock_recursion_and_ownership(ctx):
    lock, out = ctx.RLock(), ctx.Queue()
    assert lock.acquire() and lock.acquire()
    assert repr(lock) == "<RLock(MainProcess, 2)>"
    errors = []
    t = threading.Thread(target=lambda: _capture(errors, lock.release))
    t.start()
    t.join(TIMEOUT)
    assert errors and isinstance(errors[0], AssertionError)
    p = run_process(ctx, W.try_acquire, lock, out)
    assert out.get(timeout=TIMEOUT) is False
    join_all(p)
    lock.release()
    lock.release()
    with pytest.raises(AssertionError):
        lock.release()
    assert repr(lock) == "<RLock(None, 0)>"


def _capture(errors, fn):
    try:
        fn()
    except BaseException as exc:
        errors.append(exc)


# -- Semaphore ---------------------------------------------------------------------------------
def test_semaphore_counts_permits_across_processes(ctx):
    sem = ctx.Semaphore(2)
    assert sem.acquire() and sem.acquire(timeout=1)
    assert sem.get_value() == 0
    assert sem.acquire(False) is False
    join_all(run_process(ctx, W.release_it, sem))
    assert sem.acquire(timeout=TIMEOUT) is True
    sem.release()
    sem.release()
    sem.release()
    assert sem.get_value() == 3  # an unbounded semaphore may go above its start
    assert repr(sem) == "<Semaphore(value=3)>"


def test_bounded_semaphore_and_bad_values(ctx):
    sem = ctx.BoundedSemaphore(1)
    with pytest.raises(ValueError):
        sem.release()
    assert sem.acquire()
    assert repr(sem) == "<BoundedSemaphore(value=0, maxvalue=1)>"
    sem.release()
    with pytest.raises(ValueError):
        ctx.Semaphore(-1)


# -- Condition ---------------------------------------------------------------------------------
def test_condition_wait_for_notify_from_another_process(ctx):
    cond, flag = ctx.Condition(), ctx.RawValue("i", 0)
    with cond:
        p = run_process(ctx, W.set_and_notify, cond, flag)
        assert cond.wait_for(lambda: flag.value == 1, TIMEOUT) is True
    join_all(p)


def test_condition_notify_all_wakes_every_waiter(ctx):
    cond, ready, out = ctx.Condition(ctx.Lock()), ctx.Queue(), ctx.Queue()
    procs = [run_process(ctx, W.wait_notified, cond, ready, out) for _ in range(3)]
    for _ in procs:
        ready.get(timeout=TIMEOUT)
    with cond:  # each child put "ready" holding the lock: it is now waiting
        cond.notify_all()
    assert [out.get(timeout=TIMEOUT) for _ in procs] == [True] * 3
    join_all(*procs)


def test_condition_notify_n(ctx):
    cond, ready, out = ctx.Condition(), ctx.Queue(), ctx.Queue()
    procs = [run_process(ctx, W.wait_notified, cond, ready, out) for _ in range(2)]
    for _ in procs:
        ready.get(timeout=TIMEOUT)
    with cond:
        cond.notify(1)
    assert out.get(timeout=TIMEOUT) is True
    with pytest.raises(queue.Empty):
        out.get(timeout=0.3)
    with cond:
        cond.notify()
    assert out.get(timeout=TIMEOUT) is True
    join_all(*procs)


def test_condition_wait_timeout_still_holds_the_lock(ctx):
    cond = ctx.Condition()
    with cond:
        start = time.monotonic()
        assert cond.wait(0.3) is False
        assert time.monotonic() - start >= 0.25
        cond.notify()  # would raise if the lock were not held again
    assert repr(cond).startswith("<Condition(<RLock(None, 0)>, 0)")


def test_condition_requires_the_lock(ctx):
    cond = ctx.Condition()
    with pytest.raises(AssertionError):
        cond.wait(0.1)
    with pytest.raises(AssertionError):
        cond.notify()


def test_condition_made_in_another_process_on_our_lock(ctx):
    lock, out = ctx.Lock(), ctx.Queue()
    p = run_process(ctx, W.own_condition, lock, out)
    assert out.get(timeout=TIMEOUT) is False
    cond = out.get(timeout=TIMEOUT)
    with cond:
        assert cond.wait(0.05) is False
    join_all(p)


def test_condition_rejects_foreign_locks(ctx):
    with pytest.raises(TypeError, match="fibrl Lock or RLock"):
        ctx.Condition(threading.Lock())


# -- Event -------------------------------------------------------------------------------------
def test_event_set_clear_wait(ctx):
    event, out = ctx.Event(), ctx.Queue()
    assert not event.is_set()
    start = time.monotonic()
    assert event.wait(0.2) is False
    assert time.monotonic() - start >= 0.15
    p = run_process(ctx, W.wait_event, event, out)
    join_all(run_process(ctx, W.set_event, event))
    assert out.get(timeout=TIMEOUT) is True
    assert event.is_set() and event.wait(0) is True
    event.clear()
    assert not event.is_set()
    assert repr(event).endswith("unset>")
    join_all(p)


# -- Barrier -----------------------------------------------------------------------------------
def test_barrier_releases_all_parties_and_runs_action_once(ctx):
    out, acted = ctx.Queue(), ctx.Queue()
    barrier = ctx.Barrier(4, action=W.make_action(acted), timeout=TIMEOUT)
    assert barrier.parties == 4
    procs = [run_process(ctx, W.barrier_party, barrier, out) for _ in range(3)]
    mine = barrier.wait()
    indices = sorted([mine] + [out.get(timeout=TIMEOUT) for _ in procs])
    assert indices == [0, 1, 2, 3]
    assert acted.get(timeout=TIMEOUT) == "action"
    with pytest.raises(queue.Empty):
        acted.get(timeout=0.2)
    join_all(*procs)
    assert not barrier.broken and barrier.n_waiting == 0


def test_barrier_is_reusable(ctx):
    barrier, out = ctx.Barrier(2), ctx.Queue()
    for _ in range(3):
        p = run_process(ctx, W.barrier_party, barrier, out)
        assert barrier.wait(TIMEOUT) in (0, 1)
        out.get(timeout=TIMEOUT)
        join_all(p)


def test_barrier_timeout_breaks_it_and_reset_repairs_it(ctx):
    barrier, out = ctx.Barrier(3), ctx.Queue()
    p = run_process(ctx, W.barrier_broken, barrier, out)
    wait_until(lambda: barrier.n_waiting == 1, "one party waiting at the barrier", TIMEOUT)
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait(0.2)
    assert out.get(timeout=TIMEOUT) == "broken"
    assert barrier.broken
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait(1)
    barrier.reset()
    assert not barrier.broken
    join_all(p)


def test_barrier_abort_wakes_waiters(ctx):
    barrier, out = ctx.Barrier(2), ctx.Queue()
    p = run_process(ctx, W.barrier_broken, barrier, out)
    wait_until(lambda: barrier.n_waiting == 1, "one party waiting at the barrier", TIMEOUT)
    barrier.abort()
    assert out.get(timeout=TIMEOUT) == "broken"
    assert barrier.broken
    join_all(p)


def test_barrier_failing_action_breaks_it(ctx):
    def bad_action():
        raise KeyError("action failed")

    barrier = ctx.Barrier(1, action=bad_action)
    with pytest.raises(KeyError):
        barrier.wait(5)
    assert barrier.broken
    with pytest.raises(ValueError):
        ctx.Barrier(0)


def test_interrupted_acquire_is_withdrawn(ctx, monkeypatch):
    import fibrl.hosting.hosted as hosted

    lock, holding, release = ctx.Lock(), ctx.Event(), ctx.Event()
    p = run_process(ctx, W.hold, lock, holding, release)
    assert holding.wait(TIMEOUT)
    real_wait = hosted.wait_reply
    interrupted = []

    def interrupt_once(handle, address, hub):
        if not interrupted:
            interrupted.append(handle.wait(0.2))
            raise KeyboardInterrupt
        return real_wait(handle, address, hub)

    monkeypatch.setattr(hosted, "wait_reply", interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        lock.acquire()
    assert interrupted == [False]
    release.set()
    join_all(p)
    assert lock.acquire(False) is True  # the withdrawn request did not take it
    lock.release()
