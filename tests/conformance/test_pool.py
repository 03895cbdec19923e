"""Pool conformance: ``multiprocessing.pool.Pool``'s behaviour is the spec. Every backend.

Crash cases and killed workers are in ``tests/faults/test_pool_faults.py``.
"""
import itertools
import multiprocessing
import multiprocessing.pool
import os
import pickle
import re
import sys
import threading
import time
import types

import pytest

import fibrl
import fibrl.pool
from fibrl.errors import RemoteTraceback, SerializationError, WorkerLostError

TIMEOUT = 120


def square(x):
    return x * x


def add(a, b):
    return a + b


def worker_name(_=None):
    """Unique per worker process on every backend (pids repeat across containers)."""
    return fibrl.current_process().name


def sleep_then(seconds, value=None):
    time.sleep(seconds)
    return value


def signal_then_sleep(started, seconds, value=None):
    started.set()
    time.sleep(seconds)
    return value


def sleep_item(x):
    time.sleep(x[0])
    return x[1]


def fail_on(x, bad=3):
    if x == bad:
        raise ValueError(f"bad item {x}")
    return x


def return_lock_on(x):
    return threading.Lock() if x == 2 else x


def kwargs_echo(*args, **kwargs):
    return args, kwargs


_initialized = None


def remember(value):
    global _initialized
    _initialized = (value, fibrl.current_process().name)


def initialized(_=None):
    return _initialized


def init_raises():
    raise RuntimeError("cannot initialize")


class Counting:
    """An iterable that counts how many items were read from it."""

    def __init__(self, n=None):
        self.read = 0
        self.n = n

    def __iter__(self):
        for i in (itertools.count() if self.n is None else range(self.n)):
            self.read += 1
            yield i


def raising_after(n):
    yield from range(n)
    raise KeyError("input broke")


# -- construction ------------------------------------------------------------------------

def test_processes_default_to_cpu_count(ctx):
    with ctx.Pool() as pool:
        assert pool._processes == ctx.cpu_count()
        assert pool.apply(square, (3,)) == 9


def test_bad_arguments_are_refused(ctx):
    with pytest.raises(ValueError):
        ctx.Pool(0)
    with pytest.raises(TypeError):
        ctx.Pool(1, initializer=3)
    with pytest.raises(ValueError):
        ctx.Pool(1, maxtasksperchild=0)


def test_context_manager_terminates(ctx):
    with ctx.Pool(2) as pool:
        assert pool.map(square, range(5)) == [0, 1, 4, 9, 16]
    with pytest.raises(ValueError, match="Pool not running"):
        pool.apply(square, (1,))


def test_pool_cannot_be_pickled(ctx):
    with ctx.Pool(1) as pool:
        with pytest.raises(NotImplementedError):
            pickle.dumps(pool)


def test_stdlib_context_is_mapped():
    """A stdlib context given to a fibrl Pool runs its workers on the local backend."""
    with fibrl.pool.Pool(1, context=multiprocessing.get_context("spawn")) as pool:
        assert pool.apply(square, (4,)) == 16


# -- apply / map / starmap ------------------------------------------------------------------

def test_apply_and_apply_async(ctx):
    with ctx.Pool(2) as pool:
        assert pool.apply(add, (2, 3)) == 5
        assert pool.apply(kwargs_echo, (1,), {"k": 2}) == ((1,), {"k": 2})
        got = []
        result = pool.apply_async(square, (7,), callback=got.append)
        assert result.get(TIMEOUT) == 49
        assert result.ready() and result.successful() and got == [49]


@pytest.mark.parametrize("chunksize", [None, 1, 7, 1000])
def test_map_keeps_order(ctx, chunksize):
    with ctx.Pool(2) as pool:
        assert pool.map(square, range(100), chunksize) == [x * x for x in range(100)]
        assert pool.map(square, iter(range(10)), chunksize) == [x * x for x in range(10)]


def test_map_of_nothing(ctx):
    with ctx.Pool(1) as pool:
        assert pool.map(square, []) == []
        result = pool.map_async(square, [])
        assert result.ready() and result.get(0) == []


def test_starmap(ctx):
    with ctx.Pool(2) as pool:
        assert pool.starmap(add, [(1, 2), (3, 4)]) == [3, 7]
        assert pool.starmap_async(add, zip(range(5), range(5)), 2).get(TIMEOUT) == \
            [0, 2, 4, 6, 8]


def test_map_async_callbacks(ctx):
    done, errors = threading.Event(), []
    with ctx.Pool(2) as pool:
        values = []
        result = pool.map_async(square, range(10), callback=lambda v: (values.append(v),
                                                                        done.set()))
        assert result.get(TIMEOUT) == [x * x for x in range(10)]
        assert done.wait(TIMEOUT) and values == [[x * x for x in range(10)]]
        failed = pool.map_async(fail_on, range(6), error_callback=errors.append)
        with pytest.raises(ValueError, match="bad item 3"):
            failed.get(TIMEOUT)
        assert not failed.successful() and isinstance(errors[0], ValueError)


def test_result_not_ready(ctx):
    with ctx.Pool(1) as pool:
        result = pool.apply_async(sleep_then, (2, "late"))
        assert not result.ready()
        with pytest.raises(ValueError):
            result.successful()
        with pytest.raises(multiprocessing.TimeoutError):
            result.get(0.05)
        result.wait(0.05)
        assert result.get(TIMEOUT) == "late"


# -- errors ---------------------------------------------------------------------------------

def test_task_exception_keeps_type_and_remote_traceback(ctx):
    with ctx.Pool(1) as pool:
        before = pool.apply(worker_name)
        with pytest.raises(ValueError, match="bad item 3") as info:
            pool.apply(fail_on, (3,))
        assert isinstance(info.value.__cause__, RemoteTraceback)
        # the stdlib's own class, as its tests check: type(cause) is RemoteTraceback
        assert type(info.value.__cause__) is multiprocessing.pool.RemoteTraceback
        assert "fail_on" in str(info.value.__cause__) and "fail_on" in info.value.__cause__.tb
        assert pool.apply(worker_name) == before  # the worker lived on


def test_one_failing_item_fails_map_but_not_the_rest(ctx):
    with ctx.Pool(2) as pool:
        with pytest.raises(ValueError, match="bad item 3"):
            pool.map(fail_on, range(10), chunksize=4)
        results = []
        for i in range(10):
            try:
                results.append(pool.apply_async(fail_on, (i,)).get(TIMEOUT))
            except ValueError:
                results.append("error")
        assert results == [0, 1, 2, "error", 4, 5, 6, 7, 8, 9]


def test_unpicklable_argument_fails_at_submit(ctx):
    with ctx.Pool(1) as pool:
        with pytest.raises(SerializationError, match="lock"):
            pool.apply_async(square, (threading.Lock(),))
        with pytest.raises(TypeError):
            pool.map(square, [1, threading.Lock()])
        assert pool.map(square, [1, 2]) == [1, 4]


def test_unpicklable_result_fails_only_that_item(ctx):
    with ctx.Pool(1) as pool:
        it = pool.imap(return_lock_on, range(5))
        assert [next(it), next(it)] == [0, 1]
        with pytest.raises(SerializationError, match="could not be sent back"):
            next(it)
        assert list(it) == [3, 4]


def _rebuilt_only_in(pid):
    if os.getpid() != pid:
        raise RuntimeError("this object can only be rebuilt in the worker that made it")
    return "rebuilt"


class OnlyInWorker:
    def __reduce__(self):
        return _rebuilt_only_in, (os.getpid(),)


def rebuilt_only_in_worker_on(x):
    return OnlyInWorker() if x == 2 else x


def of_a_class_only_the_worker_has_on(x):
    if x != 2:
        return x
    module = types.ModuleType("fibrl_test_only_in_worker")
    exec("class Thing:\n    pass\n", module.__dict__)
    sys.modules[module.__name__] = module
    return [x, {"inner": module.Thing()}]


@pytest.mark.parametrize("func,pattern", [
    (rebuilt_only_in_worker_on, "can only be rebuilt in the worker"),
    (of_a_class_only_the_worker_has_on, "fibrl_test_only_in_worker"),
], ids=["rebuild-raises", "class-missing"])
def test_result_the_parent_cannot_unpickle_fails_only_that_item(ctx, func, pattern):
    with ctx.Pool(1) as pool:
        it = pool.imap(func, range(5), chunksize=5)  # one chunk: its results share a report
        outcomes = []
        for _ in range(5):
            try:
                outcomes.append(it.next(TIMEOUT))
            except SerializationError as exc:
                assert re.search(pattern, str(exc)), exc
                outcomes.append("failed")
        assert outcomes == [0, 1, "failed", 3, 4]
        with pytest.raises(SerializationError, match=pattern):
            pool.map(func, range(5), chunksize=5)


# -- imap ---------------------------------------------------------------------------------

@pytest.mark.parametrize("chunksize", [1, 3])
def test_imap_in_order(ctx, chunksize):
    with ctx.Pool(2) as pool:
        assert list(pool.imap(square, range(50), chunksize)) == [x * x for x in range(50)]
        assert sorted(pool.imap_unordered(square, range(50), chunksize)) == \
            [x * x for x in range(50)]


def test_imap_streams_results_as_they_complete(ctx):
    with ctx.Pool(2) as pool:
        pool.apply(square, (1,))  # workers are up
        items = [(0.05, "fast")] + [(3.0, "slow")]
        it = pool.imap(sleep_item, items)
        assert it.next(TIMEOUT) == "fast"
        # streamed: the slow item (3 s) is still running when the fast one arrives
        with pytest.raises(multiprocessing.TimeoutError):
            it.next(0)
        assert it.next(TIMEOUT) == "slow"


def test_imap_unordered_gives_completion_order(ctx):
    with ctx.Pool(2) as pool:
        pool.apply(square, (1,))
        # "slow" outlasts the start of the second worker even on a loaded machine
        items = [(8.0, "slow"), (0.05, "fast")]
        assert list(pool.imap_unordered(sleep_item, items)) == ["fast", "slow"]


def test_imap_next_timeout(ctx):
    with ctx.Pool(1) as pool:
        it = pool.imap(sleep_then, [3])
        with pytest.raises(multiprocessing.TimeoutError):
            it.next(timeout=0.1)
        assert it.next(TIMEOUT) is None
        with pytest.raises(StopIteration):
            it.next(TIMEOUT)


def test_imap_reads_its_input_lazily(ctx):
    source = Counting()  # endless
    with ctx.Pool(2) as pool:
        it = pool.imap(square, source)
        assert [next(it) for _ in range(1000)] == [x * x for x in range(1000)]
        time.sleep(0.5)
        ahead = source.read - 1000
        assert 0 <= ahead <= 256 + 64, f"read {ahead} items ahead of the caller"


def test_imap_input_that_raises(ctx):
    with ctx.Pool(2) as pool:
        it = pool.imap(square, raising_after(3))
        assert [next(it) for _ in range(3)] == [0, 1, 4]
        with pytest.raises(KeyError, match="input broke"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)


def test_imap_unpicklable_item_fails_its_position(ctx):
    with ctx.Pool(1) as pool:
        it = pool.imap(square, [1, threading.Lock(), 3])
        assert next(it) == 1
        with pytest.raises(SerializationError):
            next(it)
        assert next(it) == 9


class BrokenState:
    """Pickling raises something other than a pickling error (a bug in __getstate__)."""

    def __getstate__(self):
        raise RuntimeError("state is broken")


def test_imap_item_whose_pickling_raises_anything_fails_its_position(ctx):
    pool = ctx.Pool(1)
    try:
        it = pool.imap(square, [1, BrokenState(), 3])
        assert it.next(30) == 1
        with pytest.raises(SerializationError, match="state is broken"):
            it.next(30)
        assert it.next(30) == 9
        assert pool.map(square, range(5)) == [0, 1, 4, 9, 16]  # the pool still works
        pool.close()
        pool.join(timeout=30)
    finally:
        pool.terminate()


def test_imap_of_a_non_iterable_raises_type_error_like_the_stdlib(ctx):
    pool = ctx.Pool(1)
    try:
        it = pool.imap(square, 5)  # as the stdlib: the error comes from the first next()
        with pytest.raises(TypeError, match="not iterable"):
            it.next(30)
        with pytest.raises(StopIteration):
            it.next(30)
        pool.close()
        pool.join(timeout=30)  # no job left open
    finally:
        pool.terminate()


def test_close_then_join_completes_unconsumed_imap(ctx):
    pool = ctx.Pool(2)
    source = Counting(2000)
    it = pool.imap(square, source)
    pool.close()
    pool.join(timeout=TIMEOUT)
    assert source.read == 2000
    assert list(it) == [x * x for x in range(2000)]


# -- workers ----------------------------------------------------------------------------------

def test_initializer_runs_in_every_worker(ctx):
    with ctx.Pool(2, initializer=remember, initargs=("ready",)) as pool:
        seen = pool.map(initialized, range(20), chunksize=1)
        assert all(value == "ready" for value, _ in seen)


def test_maxtasksperchild_recycles_workers_and_reinitializes(ctx):
    with ctx.Pool(1, initializer=remember, initargs=("again",), maxtasksperchild=2) as pool:
        seen = [pool.apply(initialized) for _ in range(6)]
        assert len({name for _, name in seen}) == 3, seen
        assert all(value == "again" for value, _ in seen)


def test_initializer_failure_breaks_the_pool(ctx):
    with ctx.Pool(1, initializer=init_raises) as pool:
        with pytest.raises(WorkerLostError, match="initializer raised RuntimeError") as info:
            pool.apply(square, (2,))
        assert isinstance(info.value.__cause__, RuntimeError)


@fibrl.meta(cpu=0.5, memory="256m")
def init_with_meta():
    pass


def test_meta_reaches_every_worker_process(ctx):
    # Keys given to the Pool win over the initializer's @fibrl.meta; the backend turns
    # them into container or pod limits (tests/faults checks docker's).
    with ctx.Pool(2, initializer=init_with_meta, meta={"cpu": 1}) as pool:
        assert pool.map(square, range(10), chunksize=1) == [x * x for x in range(10)]
        assert pool._pool
        assert [p._fibrl_meta for p in pool._pool] == [{"cpu": 1, "memory": "256m"}] * len(
            pool._pool)
    with ctx.Pool(1, initializer=init_with_meta) as pool:
        pool.apply(square, (1,))
        assert [p._fibrl_meta for p in pool._pool] == [{"cpu": 0.5, "memory": "256m"}]


def test_bad_meta_is_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"unknown keys \['cpus'\].*'cpu', 'gpu', 'memory'"):
        fibrl.Pool(1, meta={"cpus": 1})
    with pytest.raises(ValueError, match="cpu"):
        fibrl.Pool(1, meta={"cpu": 0})
    with pytest.raises(TypeError, match="must be a dict"):
        fibrl.Pool(1, meta=[("cpu", 1)])


class RecordingPool(fibrl.pool.Pool):
    names = []

    @staticmethod
    def Process(ctx, *args, **kwds):
        RecordingPool.names.append(kwds["name"])
        return ctx.Process(*args, **kwds)


def test_workers_are_made_by_the_process_staticmethod(ctx):
    assert fibrl.pool.Pool.Process(ctx, target=square).__class__ is ctx.Process().__class__
    RecordingPool.names.clear()
    with RecordingPool(2, context=ctx) as pool:
        assert pool.map(square, range(4)) == [0, 1, 4, 9]
        assert sorted(p.name for p in pool._pool) == sorted(RecordingPool.names)


class SlowFirstWorker:
    """A context whose first worker takes seconds to start (a pod waiting for a node).

    ``release`` ends the delay early (the backend's start finally returns);
    :meth:`wait_slow_one` waits until that worker was started and has ended.
    """

    def __init__(self, ctx, delay):
        self._ctx, self._delay = ctx, delay
        self._starts = itertools.count()
        self.config = ctx.config
        self.release = threading.Event()
        self._returned = threading.Event()
        self._slow = None

    def cpu_count(self):
        return self._ctx.cpu_count()

    def Process(self, *args, **kwargs):
        proc = self._ctx.Process(*args, **kwargs)
        if next(self._starts) == 0:
            self._slow, start = proc, proc.start

            def slow_start():
                del proc.start  # the process is pickled to start it; this closure cannot be
                self.release.wait(self._delay)
                try:
                    start()
                finally:
                    self._returned.set()

            proc.start = slow_start
        return proc

    def wait_slow_one(self, timeout):
        self.release.set()
        assert self._returned.wait(timeout), "the slow start did not return"
        try:
            self._slow.join(timeout)
            ended = self._slow.exitcode is not None
        except ValueError:  # closed: the pool reaped it, so it had ended
            ended = True
        assert ended, "the slowly started worker was left running"


def test_a_slow_starting_worker_holds_nothing_up(ctx):
    slow = SlowFirstWorker(ctx, delay=100.0)     # released below, once the map is done
    with fibrl.pool.Pool(3, context=slow) as pool:
        assert pool.map(square, range(30), chunksize=1) == [x * x for x in range(30)]
        assert len(pool._pool) == 2  # the other two did all the work
        assert not slow._returned.is_set(), "the map waited for the slow start"
    slow.wait_slow_one(TIMEOUT)


def test_terminate_is_prompt_while_a_worker_is_slow_to_start(ctx):
    slow = SlowFirstWorker(ctx, delay=100.0)
    pool = fibrl.pool.Pool(2, context=slow)
    try:
        assert pool.apply_async(square, (3,)).get(TIMEOUT) == 9  # the other worker runs
        started = time.monotonic()
        pool.terminate()
        pool.join(timeout=TIMEOUT)
        # waiting for the slow start would take its 100 s
        assert time.monotonic() - started < 50
        assert pool._pool == []
    finally:
        slow.wait_slow_one(TIMEOUT)  # when its start returns, the pool kills it


def test_tasks_go_to_whichever_worker_is_ready(ctx):
    with ctx.Pool(2) as pool:
        pool.map(square, range(4))
        running = ctx.Event()
        busy = pool.apply_async(signal_then_sleep, (running, 3, "busy"))
        assert running.wait(TIMEOUT)
        assert pool.map(square, range(20), chunksize=1) == [x * x for x in range(20)]
        assert not busy.ready()   # the map was not queued behind the busy worker
        assert busy.get(TIMEOUT) == "busy"


# -- life cycle --------------------------------------------------------------------------------

def test_close_and_join(ctx):
    pool = ctx.Pool(2)
    result = pool.map_async(sleep_then, [0.2] * 4)
    with pytest.raises(ValueError, match="still running"):
        pool.join()
    pool.close()
    with pytest.raises(ValueError, match="Pool not running"):
        pool.apply_async(square, (1,))
    pool.join(timeout=TIMEOUT)
    assert result.get(0) == [None] * 4
    assert pool._pool == []


def test_terminate_fails_pending_results_and_is_quick(ctx):
    pool = ctx.Pool(2)
    running = ctx.Event()
    results = [pool.apply_async(signal_then_sleep, (running, 600)) for _ in range(4)]
    assert running.wait(TIMEOUT)
    started = time.monotonic()
    pool.terminate()
    pool.join(timeout=TIMEOUT)
    assert time.monotonic() - started < 60   # not when the tasks end (600 s)
    for result in results:
        with pytest.raises(WorkerLostError, match="terminated"):
            result.get(TIMEOUT)


def test_terminate_while_workers_start(ctx):
    started = time.monotonic()
    pool = ctx.Pool(4)
    pool.terminate()
    pool.join(timeout=TIMEOUT)
    assert time.monotonic() - started < 30
