"""The runtime's helper threads: deadlines, wake-up pipes, the manager's thread set."""
import os
import queue
import threading
import time
import weakref

import pytest

from conftest import wait_until
from fibrl.connection import _Waker
from fibrl.managers.server import _Workers
from fibrl.timers import Timers


def test_a_blocking_deadline_does_not_hold_up_the_others():
    timers = Timers()
    release, fired = threading.Event(), threading.Event()
    now = time.monotonic()
    timers.call_at(now, lambda: release.wait(30), blocking=True)  # a slow backend call
    timers.call_at(now + 0.05, fired.set)
    try:
        assert fired.wait(5), "a deadline waited behind a blocking callback"
    finally:
        release.set()
        timers.close()


def test_a_deadline_further_than_one_wait_can_reach_delays_nothing():
    """1e12 s ahead is more than a condition can wait for in one call (OverflowError):
    the thread waits in steps, and the deadlines after it still fire."""
    timers = Timers()
    fired = threading.Event()
    try:
        timers.call_at(time.monotonic() + 1e12, lambda: None)
        time.sleep(0.05)   # (the thread waits for the far deadline alone first)
        timers.call_at(time.monotonic() + 0.05, fired.set)
        assert fired.wait(5), "a far deadline stopped the timer thread"
        with pytest.raises(ValueError, match="NaN"):
            timers.call_at(float("nan"), lambda: None)
    finally:
        timers.close()


def test_a_timer_thread_that_failed_is_replaced_by_the_next_deadline():
    """A callback that ends its thread (SystemExit is not an Exception) leaves no dead
    thread named as the timer thread: a later deadline still fires."""
    timers = Timers()

    ended = []

    def end_thread():
        ended.append(threading.current_thread())
        raise SystemExit

    try:
        timers.call_at(time.monotonic(), end_thread)
        wait_until(lambda: ended, "the callback to run")
        ended[0].join(5)
        assert not ended[0].is_alive()
        fired = threading.Event()
        timers.call_at(time.monotonic(), fired.set)
        assert fired.wait(5), "a deadline waited for a timer thread that had ended"
    finally:
        timers.close()


def test_a_cancelled_deadline_does_not_run():
    timers = Timers()
    ran, later = [], threading.Event()
    entry = timers.call_at(time.monotonic() + 0.05, lambda: ran.append(1), blocking=True)
    Timers.cancel(entry)
    timers.call_at(time.monotonic() + 0.1, later.set)
    assert later.wait(5)
    assert ran == []
    timers.close()


def test_close_ends_the_thread_and_drops_what_was_pending():
    timers = Timers()
    ran = []
    timers.call_at(time.monotonic() + 0.05, lambda: None)
    thread = timers._thread
    timers.call_at(time.monotonic() + 60, lambda: ran.append(1))
    timers.close()
    assert not thread.is_alive()
    again = threading.Event()   # a later deadline starts a new thread
    timers.call_at(time.monotonic(), again.set)
    assert again.wait(5)
    timers.close()
    assert ran == []


def test_a_callback_that_ran_is_not_kept_while_the_thread_waits():
    """What a callback refers to (a parked reply, its caller's frame) is freed once it has
    run, not kept until the next deadline."""
    timers = Timers()

    class Held:
        pass

    held, ran = Held(), threading.Event()
    gone = weakref.ref(held)
    timers.call_at(time.monotonic(), lambda held=held: ran.set())
    del held
    try:
        assert ran.wait(5)
        deadline = time.monotonic() + 5
        while gone() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gone() is None, "the timer thread keeps its last callback"
    finally:
        timers.close()


def test_a_poke_after_close_writes_nowhere():
    waker = _Waker()
    waker.poke()
    assert os.read(waker.read_fd, 10) == b"x"
    closed = (waker.read_fd, waker._write_fd)
    waker.close()
    r, w = os.pipe()  # likely reuses the numbers just closed
    try:
        waker.poke()  # a reply that crossed the end of wait()
        os.set_blocking(r, False)
        try:
            data = os.read(r, 10)
        except BlockingIOError:
            data = b""
        assert data == b"", f"a late poke wrote into a reused descriptor {closed}"
    finally:
        os.close(r)
        os.close(w)


def test_a_full_wake_up_pipe_does_not_block_the_poker():
    waker = _Waker()
    try:
        start = time.monotonic()
        for _ in range(200_000):  # far beyond a pipe's buffer: a blocking write would hang
            waker.poke()
        assert time.monotonic() - start < 30
        assert os.read(waker.read_fd, 1) == b"x"  # the wake-ups that fit are there
    finally:
        waker.close()


class _StolenTaskQueue(queue.SimpleQueue):
    """A task another idle thread takes between our timeout and our second look."""

    def get(self, block=True, timeout=None):
        raise queue.Empty

    def empty(self):
        return False

    def get_nowait(self):
        raise queue.Empty


def test_an_idle_thread_that_lost_its_task_retires_cleanly():
    workers = _Workers(idle_timeout=0.01)
    workers._tasks = _StolenTaskQueue()
    assert workers._next() is None
    assert workers._idle == 0  # else the next submit waits for a thread that is gone


def test_elastic_threads_run_every_task():
    workers = _Workers(idle_timeout=0.01)
    done = queue.SimpleQueue()
    for round_ in range(20):
        for i in range(5):
            workers.submit(lambda i=i: done.put(i))
        got = sorted(done.get(timeout=5) for _ in range(5))
        assert got == list(range(5)), round_


def test_a_clock_replaced_for_a_while_does_not_leave_deadlines_behind(monkeypatch):
    """A fake clock (a test's, freezegun's) set far behind while the thread computes its
    wait: once the real clock is back, the deadlines pushed since still fire."""
    timers = Timers()
    real = time.monotonic
    try:
        timers.call_at(real() + 0.2, lambda: None)   # the thread waits for this one
        woke = threading.Event()
        with monkeypatch.context() as patched:
            patched.setattr(time, "monotonic", lambda: 100.0)   # hours behind
            timers.call_at(0.0, woke.set)   # due at once by any clock: wakes the thread
            assert woke.wait(5)
            time.sleep(0.05)   # the thread computed its next wait by the fake clock
        fired = threading.Event()
        timers.call_at(real() + 0.3, fired.set)   # not the first of the heap: no notify
        assert fired.wait(10), "the timer thread slept by a clock that had been replaced"
    finally:
        timers.close()
