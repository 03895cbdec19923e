"""Docker workers under fire: killed containers, OOM kills, a SIGKILLed parent, leaks.

Worker targets are defined inside the tests, so they travel by value: the worker
image has no pytest, so it could not import this module to find them by name.
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import fibrl
from conftest import docker_available, wait_until
from fibrl.backends import docker as dockerbackend

pytestmark = pytest.mark.docker
TIMEOUT = 60
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session", autouse=True)
def no_container_left_running():
    """At the end of the session: no worker container of ours (or of a dead parent) runs."""
    yield
    if docker_available():
        return
    client = dockerbackend.connect()
    wait_until(lambda: not _ours_running(client),
               "no worker container of this session (or of a dead parent) to run", 15)


def _ours_running(client):
    return [c.name for c in dockerbackend.list_containers(running_only=True, client=client)
            if _is_ours_or_orphan(c.labels.get("fibrl.parent", ""))]


def _is_ours_or_orphan(parent: str) -> bool:
    if not parent.isdigit():
        return True
    if int(parent) == os.getpid():
        return True
    try:
        os.kill(int(parent), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


@pytest.fixture
def dctx(docker_engine, configure):
    """The fibrl context with the docker backend, restored afterwards."""
    configure(backend="docker")
    return fibrl.get_context()


def _container(docker_engine, process):
    return docker_engine.containers.get(process._popen.job.id)


# -- a killed container ------------------------------------------------------------------

def test_docker_kill_gives_sigkill_exit_code_and_keeps_logs(dctx, docker_engine):
    def speak_then_wait(q):
        print("worker says hi", flush=True)
        q.get(timeout=120)

    q = dctx.Queue()
    p = dctx.Process(target=speak_then_wait, args=(q,))
    p.start()
    container = _container(docker_engine, p)
    wait_until(lambda: "worker says hi" in p._popen.job.logs(), "the worker's output", TIMEOUT)
    container.kill()
    p.join(TIMEOUT)
    assert p.exitcode == -9
    assert "worker says hi" in p._popen.job.logs()  # kept after removal too
    wait_until(lambda: not dockerbackend.list_containers(
        parent=os.getpid(), client=docker_engine), "the container's removal", 15)


def test_worker_output_reaches_the_parents_terminal(dctx, capfd):
    def speak():
        print("to stdout from a container", flush=True)
        print("to stderr from a container", file=sys.stderr, flush=True)

    p = dctx.Process(target=speak)
    p.start()
    p.join(TIMEOUT)
    assert p.exitcode == 0
    out, err = capfd.readouterr()
    assert "to stdout from a container" in out
    assert "to stderr from a container" in err


def test_pool_map_survives_docker_kill_of_a_worker(dctx, docker_engine):
    def slow_square(x):
        import time as t

        t.sleep(0.002)
        return x * x

    with dctx.Pool(2) as pool:
        results = pool.imap(slow_square, range(2000), chunksize=1)
        head = [next(results) for _ in range(100)]
        workers = dockerbackend.list_containers(parent=os.getpid(), running_only=True,
                                                client=docker_engine)
        assert workers, "no running worker container to kill"
        victim = workers[0]
        assert victim.id[:12] in _worker_ids(pool), "the container is no worker of this pool"
        victim.kill()
        rest = list(results)
        # the fault happened: the killed worker left the pool and was replaced
        wait_until(lambda: victim.id[:12] not in _worker_ids(pool) and len(pool._pool) == 2,
                   "the killed worker to be replaced", TIMEOUT)
    assert head + rest == [x * x for x in range(2000)]


def _worker_ids(pool) -> set:
    return {proc._popen.job.id[:12] for proc in pool._pool}


# -- limits and OOM ------------------------------------------------------------------------

def test_meta_sets_cpu_and_memory_limits(dctx, docker_engine):
    @fibrl.meta(cpu=1, memory="256m")
    def wait_for(q):
        q.get(timeout=120)

    q = dctx.Queue()
    p = dctx.Process(target=wait_for, args=(q,))
    p.start()
    try:
        container = _container(docker_engine, p)
        wait_until(lambda: container.reload() or container.status == "running",
                   "the container to run", TIMEOUT)
        host = container.attrs["HostConfig"]
        assert host["NanoCpus"] == 1_000_000_000
        assert host["Memory"] == host["MemorySwap"] == 256 * 1024 * 1024
        assert container.labels["fibrl.backend"] == "docker"
        assert container.labels["fibrl.parent"] == str(os.getpid())
    finally:
        q.put("done")
        p.join(TIMEOUT)
    assert p.exitcode == 0


def test_oom_killed_container_is_reported_as_such(dctx, caplog):
    @fibrl.meta(memory="64m")
    def hog():
        data = bytearray(b"x") * (512 * 1024 * 1024)
        return len(data)

    p = dctx.Process(target=hog)
    p.start()
    p.join(TIMEOUT)
    assert p.exitcode == -9
    assert p._popen.job.failure_reason() == "OOMKilled"
    assert any("OOM" in r.getMessage() and "64m" in r.getMessage() for r in caplog.records)


# -- a SIGKILLed parent ----------------------------------------------------------------------

PARENT = textwrap.dedent("""
    import os, sys, time, fibrl
    from fibrl.popen import run_id
    fibrl.init(backend="docker")
    q = fibrl.Queue()
    kids = [fibrl.Process(target=lambda q: (q.put(os.getpid()), time.sleep(3600)), args=(q,))
            for _ in range(2)]
    for k in kids:
        k.start()
    for _ in kids:
        q.get(timeout=60)           # both workers are connected and running
    print(run_id(), flush=True)
    time.sleep(3600)
""")


@pytest.fixture
def killed_parent_run(docker_engine):
    """Start a parent program with two docker workers; yields (process, run id)."""
    proc = subprocess.Popen([sys.executable, "-c", PARENT], cwd=REPO, text=True,
                            stdout=subprocess.PIPE)
    runs = []
    try:
        line = proc.stdout.readline().strip()
        assert line, f"the parent program failed (exit {proc.wait(TIMEOUT)})"
        runs.append(line)
        yield proc, line
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
        proc.stdout.close()
        for run in runs:  # what a failing test left (the parent's reaper removes the rest)
            dockerbackend.remove_containers(run, force=True, client=docker_engine)


def test_no_container_is_left_15s_after_the_parent_is_sigkilled(killed_parent_run, docker_engine):
    proc, run = killed_parent_run
    running = dockerbackend.list_containers(run, running_only=True, client=docker_engine)
    assert len(running) == 2
    assert all(c.labels["fibrl.pidns"] == dockerbackend.pid_namespace() for c in running)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(TIMEOUT)
    # the workers exit by themselves; the parent's reaper removes their containers
    wait_until(lambda: not dockerbackend.list_containers(run, client=docker_engine),
               "the containers of the SIGKILLed parent to be removed", 15)


def test_cleanup_removes_everything_of_a_run(killed_parent_run, docker_engine):
    _, run = killed_parent_run
    assert len(dockerbackend.list_containers(run, client=docker_engine)) == 2
    removed = dockerbackend.remove_containers(run, client=docker_engine)  # running ones stay
    assert removed == []
    removed = dockerbackend.remove_containers(run, force=True, client=docker_engine)
    assert len(removed) == 2
    assert not dockerbackend.list_containers(run, client=docker_engine)
