"""``fibrl.futures.ProcessPoolExecutor`` conformance: the stdlib executor is the spec,
plus the Pool's recovery from lost workers. Every backend."""
import concurrent.futures as cf
import multiprocessing.pool
import os
import signal
import threading
import time

import pytest

import fibrl
from fibrl.errors import RemoteTraceback, SerializationError, TaskFailedError
from fibrl.futures import Executor, ProcessPoolExecutor

TIMEOUT = 120


def square(x):
    return x * x


def add(a, b=0):
    return a + b


def fail(message):
    raise KeyError(message)


def sleep_then(seconds, value=None):
    time.sleep(seconds)
    return value


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def worker_name(_=None):
    return fibrl.current_process().name


_state = None


def init(value):
    global _state
    _state = value


def state():
    return _state


@pytest.fixture
def executor(ctx):
    with ProcessPoolExecutor(2, mp_context=ctx) as ex:
        yield ex


def test_is_a_concurrent_futures_executor():
    assert issubclass(ProcessPoolExecutor, cf.Executor)
    assert Executor is ProcessPoolExecutor


def test_submit_and_result(executor):
    future = executor.submit(add, 2, b=3)
    assert isinstance(future, cf.Future)
    assert future.result(TIMEOUT) == 5
    assert future.done() and not future.cancelled()


def test_exception_keeps_type_and_traceback(executor):
    future = executor.submit(fail, "nope")
    with pytest.raises(KeyError, match="nope") as info:
        future.result(TIMEOUT)
    assert type(info.value.__cause__) is RemoteTraceback is multiprocessing.pool.RemoteTraceback
    assert isinstance(future.exception(TIMEOUT), KeyError)
    assert executor.submit(square, 4).result(TIMEOUT) == 16


def test_unpicklable_argument_fails_at_submit(executor):
    with pytest.raises(SerializationError):
        executor.submit(square, threading.Lock())


def test_as_completed_and_wait(executor):
    futures = [executor.submit(sleep_then, 0.01 * (5 - i), i) for i in range(5)]
    assert sorted(f.result() for f in cf.as_completed(futures, timeout=TIMEOUT)) == \
        list(range(5))
    done, not_done = cf.wait(futures, timeout=TIMEOUT)
    assert len(done) == 5 and not not_done


def test_done_callback_runs(executor):
    got = threading.Event()
    executor.submit(square, 3).add_done_callback(
        lambda f: got.set() if f.result() == 9 else None)
    assert got.wait(TIMEOUT)


@pytest.mark.parametrize("chunksize", [1, 4])
def test_map_in_order(executor, chunksize):
    assert list(executor.map(add, range(20), range(20), chunksize=chunksize)) == \
        [2 * x for x in range(20)]
    assert list(executor.map(square, [])) == []


def fail_on(bad, x):
    if x == bad:
        raise KeyError(f"item {x}")
    return x


def test_map_raises_at_the_failing_position(executor):
    results = executor.map(fail_on, [3] * 6, range(6))
    assert [next(results) for _ in range(3)] == [0, 1, 2]   # the items before it come first
    with pytest.raises(KeyError, match="item 3"):
        next(results)


def test_map_timeout(executor):
    results = executor.map(sleep_then, [3, 3], timeout=0.2)
    with pytest.raises(TimeoutError):
        list(results)


def test_map_refuses_bad_chunksize(executor):
    with pytest.raises(ValueError):
        executor.map(square, [1], chunksize=0)


def test_cancel_before_start(ctx):
    with ProcessPoolExecutor(1, mp_context=ctx) as executor:
        blocker = executor.submit(sleep_then, 1.0, "first")
        queued = executor.submit(square, 2)
        assert queued.cancel()
        assert queued.cancelled()
        assert blocker.result(TIMEOUT) == "first"
        assert executor.submit(square, 3).result(TIMEOUT) == 9


def test_shutdown_cancel_futures(ctx):
    executor = ProcessPoolExecutor(1, mp_context=ctx)
    assert executor.submit(square, 1).result(TIMEOUT) == 1  # the worker is up and idle
    running = executor.submit(sleep_then, 1.0, "ran")
    assert running.running()  # handed to the idle worker at once
    queued = [executor.submit(square, i) for i in range(5)]
    executor.shutdown(wait=True, cancel_futures=True)
    assert running.result(0) == "ran"
    assert all(f.cancelled() for f in queued)
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(square, 1)


def test_shutdown_waits_for_pending_work(ctx):
    executor = ProcessPoolExecutor(2, mp_context=ctx)
    futures = [executor.submit(sleep_then, 0.1, i) for i in range(6)]
    executor.shutdown(wait=True)
    assert [f.result(0) for f in futures] == list(range(6))


def test_initializer_and_max_tasks_per_child(ctx):
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=init, initargs=("set",),
                             max_tasks_per_child=1) as executor:
        assert executor.submit(state).result(TIMEOUT) == "set"
        names = {executor.submit(worker_name).result(TIMEOUT) for _ in range(3)}
        assert len(names) == 3


@fibrl.meta(memory="256m")
def init_with_meta():
    pass


def test_meta_reaches_every_worker_process(ctx):
    with ProcessPoolExecutor(2, mp_context=ctx, initializer=init_with_meta,
                             meta={"cpu": 1}) as executor:
        assert executor.submit(square, 3).result(TIMEOUT) == 9
        procs = executor._engine.supervisor.processes()
        assert procs
        assert [p._fibrl_meta for p in procs] == [{"cpu": 1, "memory": "256m"}] * len(procs)
    with pytest.raises(ValueError, match="ProcessPoolExecutor.*unknown keys"):
        ProcessPoolExecutor(1, meta={"mem": "1g"})


def test_lost_worker_is_recovered_not_broken(ctx):
    with ProcessPoolExecutor(2, mp_context=ctx, max_task_retries=1) as executor:
        others = [executor.submit(sleep_then, 0.05, i) for i in range(10)]
        killer = executor.submit(kill_self)
        with pytest.raises(TaskFailedError, match=r"kill_self\(\).*SIGKILL"):
            killer.result(TIMEOUT)
        assert [f.result(TIMEOUT) for f in others] == list(range(10))
        assert executor.submit(square, 5).result(TIMEOUT) == 25


def test_bad_arguments():
    with pytest.raises(ValueError):
        ProcessPoolExecutor(0)
    with pytest.raises(TypeError):
        ProcessPoolExecutor(1, initializer=5)
    with pytest.raises(ValueError):
        ProcessPoolExecutor(1, max_tasks_per_child=0)
