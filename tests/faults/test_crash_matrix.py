"""loky's crash matrix, for ``Pool`` and ``ProcessPoolExecutor`` alike.

Each way the round trip of a task can break: its arguments fail to pickle in the
parent or to unpickle in the worker, its result fails to pickle in the worker or to
unpickle in the parent, its worker dies in a finalizer run by the garbage collector.
For each, what must hold:

* the caller gets a clear error of the type docs/pool.md promises
  (:class:`~fibrl.errors.SerializationError` for what cannot cross,
  :class:`~fibrl.errors.TaskFailedError` for a task that kills every worker that
  runs it; never the stdlib executor's ``BrokenProcessPool``: fibrl's executor
  recovers from a lost worker instead of breaking), for that task only;
* a worker killed by a finalizer after its task is done with it (an argument freed,
  garbage collected later) costs no failure: the task's result is delivered once,
  the interrupted work runs again;
* it comes within a bounded time (every wait below has a deadline; none is reached
  unless something hangs);
* the pool or executor works afterwards: a following ``map`` returns exact results.
"""
import ctypes
import functools
import gc
import os
import re
import threading
from concurrent.futures.process import BrokenProcessPool

import pytest

from fibrl.errors import SerializationError, TaskFailedError
from fibrl.futures import ProcessPoolExecutor

TIMEOUT = 120   # only reached on a hang
pytestmark = pytest.mark.timeout(300)


# -- objects that break one leg of the round trip -------------------------------------------

def _rebuild_only_in(pid, value):
    """Unpickled in process ``pid``: ``value``; anywhere else it raises."""
    if os.getpid() != pid:
        raise RuntimeError(f"this object refuses to be rebuilt outside process {pid}")
    return value


class BreaksInWorker:
    """Pickles in the parent; unpickling it anywhere else raises (say, a class that
    needs a module or a file only the parent has)."""

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _rebuild_only_in, (os.getpid(), self.value)


class BreaksInParent:
    """A task's result that cannot be rebuilt in the process that receives it."""

    def __reduce__(self):
        return _rebuild_only_in, (os.getpid(), "unreachable")


class RefusesPickling:
    """Pickling raises an error that is not a TypeError (as a C extension may)."""

    def __reduce__(self):
        raise RuntimeError("this object refuses to be pickled")


def _crash(how):
    if how == "os._exit":
        os._exit(13)
    ctypes.string_at(0)   # segfault


class CrashAtGC:
    """Its finalizer ends the process that collects it."""

    def __init__(self, how):
        self.how = how
        self.cycle = self   # only the cyclic garbage collector frees it

    def __del__(self):
        _crash(self.how)


class CrashAtGCInWorker:
    """An argument whose finalizer ends any process but the one that made it (loky's
    ``CrashAtGCInWorker``): the worker dies once the task is done with it."""

    def __init__(self, how):
        self.how, self.maker = how, os.getpid()

    def __del__(self):
        if os.getpid() != self.maker:
            _crash(self.how)


# -- tasks ---------------------------------------------------------------------------------

def ignore(obj):
    return "done"


def identity(x):
    return x


def value_of(obj):
    return obj.value


def square(x):
    return x * x


def result_refusing_pickle():
    return RefusesPickling()


def result_unpicklable():
    return threading.Lock()


def result_breaking_in_parent():
    return BreaksInParent()


def crash_in_finalizer(how):
    """The task's own garbage is collected while it runs; the finalizer kills the worker."""
    CrashAtGC(how)
    gc.collect()
    return "finished"


def leave_crashing_garbage(how):
    """Finish, leaving garbage whose finalizer will kill this worker at a later collection."""
    CrashAtGC(how)
    return os.getpid()


def collect_then_square(x):
    """Runs a collection first: a worker that holds crashing garbage dies here."""
    gc.collect()
    return x * x


# -- the two APIs, behind one face ---------------------------------------------------------

class PoolFace:
    name = "Pool"

    def __init__(self, ctx, processes, retries):
        self.pool = ctx.Pool(processes, max_task_retries=retries)

    def call(self, func, *args):
        return self.pool.apply_async(func, args).get(TIMEOUT)

    def map(self, func, items):
        return self.pool.map_async(func, items, chunksize=1).get(TIMEOUT)

    def map_outcomes(self, func, items):
        """Each item's result, or the exception it raised, in order (``imap``)."""
        it = self.pool.imap(func, items)
        return [_outcome(lambda: it.next(TIMEOUT)) for _ in items]

    def lost(self):
        return self.pool._engine.service.stats["lost"]

    def close(self):
        self.pool.terminate()
        self.pool.join(timeout=TIMEOUT)


class ExecutorFace:
    name = "ProcessPoolExecutor"

    def __init__(self, ctx, processes, retries):
        self.executor = ProcessPoolExecutor(processes, mp_context=ctx,
                                            max_task_retries=retries)

    def call(self, func, *args):
        return self.executor.submit(func, *args).result(TIMEOUT)

    def map(self, func, items):
        return list(self.executor.map(func, items, timeout=TIMEOUT))

    def map_outcomes(self, func, items):
        futures = [self.executor.submit(func, x) for x in items]
        return [_outcome(lambda f=f: f.result(TIMEOUT)) for f in futures]

    def lost(self):
        return self.executor._engine.service.stats["lost"]

    def close(self):
        self.executor.shutdown(wait=True, cancel_futures=True)


def _outcome(get):
    try:
        return get()
    except Exception as exc:
        return exc


@pytest.fixture(params=[PoolFace, ExecutorFace], ids=["pool", "executor"])
def face(request, ctx):
    faces = []

    def make(processes=2, retries=1):
        faces.append(request.param(ctx, processes, retries))
        return faces[-1]

    yield make
    for made in faces:
        made.close()


def _still_works(api):
    assert api.map(square, list(range(12))) == [x * x for x in range(12)]


def _is_clear(exc, error, pattern):
    """``exc`` is ``error`` and matches ``pattern``, and is no BrokenProcessPool."""
    assert isinstance(exc, error), repr(exc)
    assert not isinstance(exc, BrokenProcessPool), repr(exc)
    assert re.search(pattern, str(exc), re.S), str(exc)


# -- the matrix ----------------------------------------------------------------------------

def test_arguments_that_do_not_pickle_in_the_parent(face):
    """Refused at the call, in the caller's thread; nothing reaches a worker."""
    api = face()
    for bad, why in ((threading.Lock(), "_thread.lock"),
                     (RefusesPickling(), "refuses to be pickled")):
        with pytest.raises(SerializationError) as info:
            api.call(identity, bad)
        _is_clear(info.value, SerializationError, f"cannot pickle.*{why}")
    with pytest.raises(SerializationError) as info:   # the callable itself
        api.call(functools.partial(identity, threading.Lock()))
    _is_clear(info.value, SerializationError, "cannot pickle.*_thread.lock")
    _still_works(api)
    assert api.lost() == 0


def test_arguments_that_do_not_unpickle_in_the_worker(face):
    """That task fails with SerializationError naming the unpickling and its cause;
    the others of the same map go on; no worker is lost."""
    api = face()
    with pytest.raises(SerializationError) as info:
        api.call(value_of, BreaksInWorker(5))
    _is_clear(info.value, SerializationError, r"refuses to be rebuilt outside process.*in "
              r"the worker, unpickling the task's arguments")
    with pytest.raises(SerializationError) as info:   # the callable itself
        api.call(functools.partial(value_of, BreaksInWorker(5)))
    _is_clear(info.value, SerializationError, r"refuses to be rebuilt outside process.*in "
              r"the worker, unpickling the task's callable")
    items = [BreaksInWorker(1)] + [3, 4]
    outcomes = api.map_outcomes(identity, items)
    assert isinstance(outcomes[0], SerializationError), outcomes
    assert outcomes[1:] == [3, 4]
    _still_works(api)
    assert api.lost() == 0


@pytest.mark.parametrize("task,pattern", [
    (result_unpicklable, r"could not be sent back.*(lock|pickle)"),
    (result_refusing_pickle, r"could not be sent back.*refuses to be pickled"),
], ids=["lock", "raising-reduce"])
def test_result_that_does_not_pickle_in_the_worker(face, task, pattern):
    api = face()
    with pytest.raises(SerializationError) as info:
        api.call(task)
    _is_clear(info.value, SerializationError, pattern)
    _still_works(api)
    assert api.lost() == 0


def test_result_that_does_not_unpickle_in_the_parent(face):
    """Only that item fails (the block it came in is decoded item by item)."""
    api = face()
    with pytest.raises(SerializationError) as info:
        api.call(result_breaking_in_parent)
    _is_clear(info.value, SerializationError, r"cannot unpickle this item's result in the "
              r"parent.*refuses to be rebuilt outside process")
    _still_works(api)
    assert api.lost() == 0


def breaks_in_parent_on(x):
    return BreaksInParent() if x == 2 else x


def test_one_result_of_a_chunk_that_does_not_unpickle_fails_alone(ctx):
    with ctx.Pool(1) as pool:
        outcomes = []
        it = pool.imap(breaks_in_parent_on, range(5), chunksize=5)
        for _ in range(5):
            outcomes.append(_outcome(lambda: it.next(TIMEOUT)))
        assert [o for i, o in enumerate(outcomes) if i != 2] == [0, 1, 3, 4]
        assert isinstance(outcomes[2], SerializationError), outcomes
        assert pool.map(square, range(10)) == [x * x for x in range(10)]


@pytest.mark.parametrize("how", ["os._exit", "segfault"])
def test_worker_killed_by_a_finalizer_during_its_task(face, how):
    """A finalizer run by a collection inside the task kills the worker each time: the
    task fails alone with TaskFailedError naming it and how its workers ended."""
    api = face(retries=1)
    signal_name = "exit code 13" if how == "os._exit" else "SIGSEGV"
    with pytest.raises(TaskFailedError) as info:
        api.call(crash_in_finalizer, how)
    _is_clear(info.value, TaskFailedError,
              rf"crash_in_finalizer\('{how}'\).*2 times.*{signal_name}")
    assert api.lost() == 2
    _still_works(api)


@pytest.mark.parametrize("how", ["os._exit", "segfault"])
def test_worker_killed_by_an_argument_freed_after_its_task(face, how):
    """The argument's finalizer kills each worker once the task is done with it: the
    first worker dies before its result left, the rerun (careful: it reports the result
    before going on) delivers it, once; the pool goes on without a failure."""
    api = face(retries=1)
    assert api.call(ignore, CrashAtGCInWorker(how)) == "done"
    assert api.lost() >= 1, "the argument did not kill its worker"
    _still_works(api)


@pytest.mark.parametrize("how", ["os._exit", "segfault"])
def test_worker_killed_by_a_finalizer_after_its_task(face, how):
    """Garbage left by a finished task kills the worker at a later collection, in the
    middle of another task: that task runs again on a fresh worker (which has no such
    garbage), and every result is exact. The first task's result stands."""
    api = face(processes=1, retries=1)
    pid = api.call(leave_crashing_garbage, how)
    assert isinstance(pid, int)
    assert api.map(collect_then_square, list(range(8))) == [x * x for x in range(8)]
    assert api.lost() == 1, "the garbage did not kill its worker"
    _still_works(api)
