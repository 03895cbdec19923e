"""Pool faults: crash cases, workers killed in the middle of work, scale. Every backend.

The crash table follows loky's: each way a task can go wrong, the error the
caller gets, and a pool that still works afterwards.
"""
import contextlib
import ctypes
import multiprocessing
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import interruptible, parent_env, wait_until, workers_of_run

import fibrl
import fibrl.pool
from fibrl.errors import SerializationError, TaskFailedError, WorkerLostError
from fibrl.pool.protocol import LOADING, Kind, Report, pack
from fibrl.pool.service import PoolService

TIMEOUT = 240
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def square(x):
    return x * x


def triple_after(x, seconds=0.0005):
    time.sleep(seconds)
    return 3 * x


def raise_error():
    raise ValueError("task raised")


def exit_sys():
    sys.exit(3)


def exit_os():
    os._exit(7)


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def segfault():
    ctypes.string_at(0)


def return_unpicklable():
    return threading.Lock()


_initialized = None


def remember(value):
    global _initialized
    _initialized = (value, fibrl.current_process().name)


def initialized():
    return _initialized


def kill_on(x, bad=7):
    if x == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def kill_once(x, token):
    """Kill the worker the first time item 15 runs (it takes the only token); square."""
    if x == 15:
        try:
            token.get_nowait()
        except queue.Empty:
            pass
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    return x * x


CRASH_CASES = [
    # (name, function, args, expected error, message pattern)
    ("raise", raise_error, (), ValueError, "task raised"),
    ("sys.exit", exit_sys, (), SystemExit, "3"),
    ("os._exit", exit_os, (), TaskFailedError, r"exit_os\(\).*exit code 7"),
    ("sigkill", kill_self, (), TaskFailedError, r"kill_self\(\).*SIGKILL \(exit code -9\)"),
    ("segfault", segfault, (), TaskFailedError, r"segfault\(\).*SIGSEGV"),
    ("unpicklable-arg", square, (threading.Lock(),), SerializationError, "cannot pickle"),
    ("unpicklable-result", return_unpicklable, (), SerializationError,
     "could not be sent back"),
]


@pytest.mark.parametrize("name,func,args,error,pattern", CRASH_CASES,
                         ids=[case[0] for case in CRASH_CASES])
def test_crash_case(ctx, name, func, args, error, pattern):
    with ctx.Pool(2, max_task_retries=1) as pool:
        with pytest.raises(error, match=pattern):
            pool.apply_async(func, args).get(TIMEOUT)
        assert pool.map(square, range(20)) == [x * x for x in range(20)]
        assert pool.apply_async(square, (5,)).get(TIMEOUT) == 25


def test_killer_task_fails_alone(ctx):
    with ctx.Pool(2, max_task_retries=2) as pool:
        with pytest.raises(TaskFailedError,
                           match=r"task 7 of kill_on\(7\).*3 times.*SIGKILL"):
            pool.map(kill_on, range(20), chunksize=5)
        outcomes = []
        it = pool.imap(kill_on, range(20), chunksize=5)
        for _ in range(20):
            try:
                outcomes.append(next(it))
            except TaskFailedError:
                outcomes.append("failed")
        assert outcomes == [x if x != 7 else "failed" for x in range(20)]


def _exit_unless_in(pid):
    if os.getpid() != pid:
        os._exit(1)
    return "rebuilt in the parent"


class DiesWhenUnpickled:
    """Unpickling it in a worker ends the worker (a native object that crashes on load)."""

    def __reduce__(self):
        return _exit_unless_in, (os.getpid(),)

    def __call__(self, x):
        return x


def test_argument_that_kills_its_worker_while_unpickled_fails_alone(ctx):
    items = [1, 2, DiesWhenUnpickled(), 4, 5]
    with ctx.Pool(2, max_task_retries=1) as pool:
        with pytest.raises(TaskFailedError, match=r"task 2 of square.*unpickl"):
            pool.map_async(square, items, chunksize=1).get(60)
        outcomes = []
        it = pool.imap(square, items)
        for _ in items:
            try:
                outcomes.append(it.next(60))
            except TaskFailedError:
                outcomes.append("failed")
        assert outcomes == [1, 4, "failed", 16, 25]


def test_function_that_kills_its_worker_while_unpickled_fails_alone(ctx):
    with ctx.Pool(2, max_task_retries=1) as pool:
        with pytest.raises(TaskFailedError, match=r"DiesWhenUnpickled.*unpickl"):
            pool.apply_async(DiesWhenUnpickled(), (3,)).get(60)
        assert pool.map(square, range(10)) == [x * x for x in range(10)]


def test_replacement_of_a_killed_worker_runs_the_initializer(ctx):
    with ctx.Pool(1, initializer=remember, initargs=("ready",)) as pool:
        value, first = pool.apply(initialized)
        assert value == "ready"
        pool._pool[0].kill()
        value, second = pool.apply_async(initialized).get(TIMEOUT)
        assert value == "ready" and second != first


def test_max_task_retries_zero_fails_on_first_loss(ctx):
    with ctx.Pool(1, max_task_retries=0) as pool:
        with pytest.raises(TaskFailedError, match="1 times"):
            pool.apply(kill_self)


def test_worker_dying_half_way_through_a_chunk_loses_nothing(ctx):
    token = ctx.Queue()
    token.put("kill")
    with ctx.Pool(2) as pool:
        args = [(x, token) for x in range(40)]
        assert pool.starmap(kill_once, args, chunksize=10) == [x * x for x in range(40)]
        assert token.empty()
        assert pool._engine.service.stats["requeued"] >= 1


class Answer:
    """Stands for a worker's parked ``next`` call: keeps the batch it is answered with."""

    peer = None

    def __init__(self):
        self.batch = None

    def __call__(self, batch):
        self.batch = batch
        return True


class Sink:
    def __init__(self):
        self.outcomes = {}

    def sink_claim(self):
        return True

    def sink_deliver(self, index, outcomes, clean=False):
        self.outcomes.update(enumerate(outcomes, index))


def _report(spec, seconds=0.001):
    """What a worker sends back after running every item of ``spec``."""
    items = list(range(spec.n))
    return Report(spec.tid, spec.lo, spec.n - spec.lo, pack(items[spec.lo:]), seconds, True)


def _ask(service, wid, reports=()):
    answer = Answer()
    service.op_next(answer, wid, list(reports))
    return answer


def test_retried_task_goes_before_fresh_work():
    # Policy only (no processes): worker b keeps asking for more while it holds fast
    # tasks; once a task of lost worker a waits, b must drain and take it, not more
    # fresh work (else it waits for a's replacement to start: minutes for a pod).
    service = PoolService(processes=2, max_retries=3, maxtasks=None)
    a, b = service.reserve_workers()
    service.submit(Sink(), pack(square), "square", Kind.MAP, fibrl.pool.chunked(range(400), 1))
    lost = _ask(service, a).batch.tasks
    first = _ask(service, b).batch.tasks
    held = _ask(service, b, [_report(t) for t in first]).batch.tasks  # cost known: prefetch
    assert len(held) > 1
    service.lose(a, -9)
    asked = _ask(service, b, [_report(held[0])])  # still holds the rest
    assert asked.batch is None  # parked until it drained, rather than given fresh work
    service.op_report(Answer(), b, [_report(t) for t in held[1:]])
    assert [(t.tid, t.careful) for t in asked.batch.tasks] == [(lost[0].tid, True)]


def test_meta_sets_the_limits_of_pool_workers(ctx, request):
    """A Pool's meta reaches every worker's job; docker and kubernetes enforce it as
    container limits (local processes have none: their job spec carries it)."""
    backend = ctx.config.backend
    with ctx.Pool(2, meta={"cpu": 1, "memory": "256m"}) as pool:
        assert pool.map(square, range(10), chunksize=1) == [x * x for x in range(10)]
        assert pool._pool
        for proc in pool._pool:
            job = proc._popen.job
            assert (job.spec.cpu, job.spec.memory) == (1, "256m")
            if backend == "docker":
                engine = request.getfixturevalue("docker_engine")
                host = engine.containers.get(job.id).attrs["HostConfig"]
                assert host["NanoCpus"] == 1_000_000_000
                assert host["Memory"] == host["MemorySwap"] == 256 * 1024 * 1024
            elif backend == "kubernetes":
                assert _pod_limits(request.getfixturevalue("kube_cluster"), job.id) == {
                    "cpu": "1", "memory": "256Mi"}


def _pod_limits(cluster, name: str) -> dict:
    from kubernetes import client

    with cluster.client() as api:
        pod = client.CoreV1Api(api).read_namespaced_pod(name, cluster.namespace,
                                                        _request_timeout=10)
    (container,) = pod.spec.containers
    return container.resources.limits


def test_a_chunk_that_loaded_once_is_not_blamed_for_unpickling():
    # A worker lost while unpickling a careful chunk charges all of it; once a worker
    # ran part of it, its payload is known to load: a later killer item is the item's.
    service = PoolService(processes=1, max_retries=2, maxtasks=None)
    sink = Sink()
    service.submit(sink, pack(square), "square", Kind.MAP, fibrl.pool.chunked(range(3), 3))
    (first,) = service.reserve_workers()
    _ask(service, first)
    service.lose(first, -9)                       # charged once, now careful
    (second,) = service.reserve_workers()
    (spec,) = _ask(service, second).batch.tasks
    service.op_report(Answer(), second, [], (spec.tid, LOADING))
    service.lose(second, -9)                      # died unpickling: charged twice
    (third,) = service.reserve_workers()
    _ask(service, third)
    service.op_report(Answer(), third, [], (spec.tid, LOADING))
    service.op_report(Answer(), third, [Report(spec.tid, 0, 1, pack([0]), 0.001, True)],
                      (spec.tid, 1))
    service.lose(third, -9)                       # item 1 killed it: its third charge
    failure = sink.outcomes[1]
    assert isinstance(failure.exc, TaskFailedError)
    assert "square(1)" in str(failure.exc) and "kills the process" in str(failure.exc)


def connected_workers(pool):
    """Workers that connected back (so may hold tasks): a kill during a container's or
    pod's slow start is a failed start, which the pool bounds separately."""
    service = pool._engine.service
    with service._lock:
        ready = {wid for wid, w in service._workers.items() if w.connected}
    return [p for p in pool._pool if _wid(p) in ready]


def _wid(proc) -> int:
    return int(proc.name.rsplit("-", 1)[1])


def _loading_workers(pool) -> set:
    """Workers unpickling a task they took over from a lost worker."""
    service = pool._engine.service
    with service._lock:
        return {task.holder for task in service._tasks.values() if task.running == LOADING}


def _chaos_every(ctx):
    # 0.5 s on local workers (the rate); a container or pod takes about as
    # long just to start, so there a kill every 0.5 s would make every task hit
    # its retry budget (TaskFailedError, the contract) rather than test recovery.
    return 0.5 if ctx.get_start_method() == "local" else 1.0


@contextlib.contextmanager
def chaos(pool, every=0.5, most=10):
    """Kill a random connected worker every ``every`` seconds (SIGKILL / backend kill), at
    most ``most`` times (each replacement spends seconds importing the tests' module on a
    2-core machine: unbounded kills would leave the pool mostly restarting).

    A worker is a victim only from the round after it was first seen connected, and
    not while it unpickles a task it took over: a worker that dies then is charged to
    the task (the pool's contract, tested on its own above), and on a loaded machine
    importing the tests' module takes seconds, so random kills would land there at
    every retry until the task's budget runs out."""
    stop = threading.Event()
    kills = []
    seen: set = set()

    def run():
        rng = random.Random(1234)
        while len(kills) < most and not stop.wait(every):
            connected = connected_workers(pool)
            loading = _loading_workers(pool)
            workers = [p for p in connected if p.name in seen and _wid(p) not in loading]
            seen.update(p.name for p in connected)
            if workers:
                victim = rng.choice(workers)
                with contextlib.suppress(ValueError):  # reaped meanwhile
                    victim.kill()
                    kills.append(victim.name)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield kills
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.slow
@pytest.mark.parametrize("chunksize", [None, 1])
def test_chaos_map_exact_and_in_order(ctx, chunksize):
    with ctx.Pool(2) as pool:
        pool.map(square, range(4))
        with chaos(pool, _chaos_every(ctx)) as kills:
            result = pool.map_async(triple_after, range(10_000), chunksize).get(TIMEOUT)
        assert result == [3 * x for x in range(10_000)]
        assert len(kills) >= 2
        assert pool._engine.service.stats["lost"] >= 1


@pytest.mark.slow
def test_chaos_imap_unordered_exactly_once(ctx):
    with ctx.Pool(2) as pool:
        pool.map(square, range(4))
        with chaos(pool, _chaos_every(ctx)) as kills:
            seen = list(pool.imap_unordered(triple_after, range(10_000)))
        assert len(seen) == 10_000
        assert sorted(seen) == [3 * x for x in range(10_000)]
        assert len(kills) >= 2


@pytest.mark.slow
def test_pool_of_64_on_a_small_machine(ctx):
    started = time.monotonic()
    pool = ctx.Pool(64)
    try:
        assert pool.map(square, range(10_000)) == [x * x for x in range(10_000)]
        assert pool.map(square, range(10_000), chunksize=1) == [x * x for x in range(10_000)]
        pool.close()
        pool.join(timeout=TIMEOUT)
    finally:
        pool.terminate()
    assert pool._pool == []
    assert time.monotonic() - started < TIMEOUT


def test_terminate_during_chaos_never_hangs(ctx):
    pool = ctx.Pool(3)
    result = pool.map_async(triple_after, range(100_000), 1)
    with chaos(pool, every=0.2):
        time.sleep(1.0)
        started = time.monotonic()
        pool.terminate()
    pool.join(timeout=TIMEOUT)
    assert time.monotonic() - started < 30
    with pytest.raises(WorkerLostError, match="pool was terminated"):
        result.get(TIMEOUT)


# -- a hung worker, Ctrl-C in the parent ---------------------------------------------------------

def hang(started):
    started.set()
    time.sleep(3600)    # hung, not dead: its connection stays open, it answers nothing


def test_hung_worker_times_out_while_the_others_serve(ctx):
    pool = ctx.Pool(2)
    try:
        started = ctx.Event()
        hung = pool.apply_async(hang, (started,))
        assert started.wait(TIMEOUT), "the hanging task never started"
        with pytest.raises(multiprocessing.TimeoutError):
            hung.get(0.5)
        assert pool.map(square, range(20), chunksize=1) == [x * x for x in range(20)]
        assert not hung.ready()
        pool.close()
        with pytest.raises(TimeoutError):       # join(timeout) ends while a worker hangs
            pool.join(timeout=1.0)
        started_at = time.monotonic()
        pool.terminate()
        pool.join(timeout=TIMEOUT)
        # a worker stuck in a task for an hour ends now, not when the task would
        assert time.monotonic() - started_at < 30
        with pytest.raises(WorkerLostError, match="pool was terminated"):
            hung.get(TIMEOUT)
    finally:
        pool.terminate()


INTERRUPTED_PARENT = textwrap.dedent("""
    import time, fibrl

    def slow(x):
        time.sleep(0.05)
        return x

    if __name__ == "__main__":
        with fibrl.Pool(2) as pool:
            results = pool.imap(slow, range(100_000), chunksize=1)
            next(results)
            print("mapping", flush=True)       # the map is in flight
            try:
                list(results)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                raise
""")


def test_sigint_in_the_parent_during_map_leaves_no_worker(ctx, tmp_path, request):
    run = f"sigint{os.getpid()}x{time.monotonic_ns() % 10**6}"
    env = parent_env(ctx, run)
    script = tmp_path / "parent.py"
    script.write_text(INTERRUPTED_PARENT)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=interruptible)
    try:
        assert proc.stdout.readline().strip() == "mapping", proc.stderr.read()
        assert workers_of_run(ctx, run, request), "no worker of the parent is running"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
    # the KeyboardInterrupt reached the parent's map and ended the program (on docker
    # its exit code is 1, not -SIGINT: an error is reported during the exit)
    assert proc.returncode != 0, err
    assert "interrupted" in out and "KeyboardInterrupt" in err, err
    wait_until(lambda: not workers_of_run(ctx, run, request),
               f"no worker of the interrupted parent (run {run}) to be left", 30)
