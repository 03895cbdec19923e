"""The docker daemon restarted (stopped, then started again) while a run uses it.

What fibrl guarantees across a restart of dockerd:

* Running workers either keep working (the daemon runs with ``live-restore``: its
  containers outlive it) or, without it (the daemon stops its containers as it goes),
  are reported lost, with their real exit code, and a pool replaces them once the
  daemon is back.
* A start issued while the daemon does not answer waits for it, and fails with a clear
  :class:`~fibrl.errors.BackendUnavailableError` once ``start_timeout`` has passed.
* A pool's map returns exactly its results; no container of the run is left running.

These tests stop the real daemon, which disturbs every other docker test running at the
same time: they are marked ``docker_restart``, left out of the main (parallel) CI run and
run alone in a stage of their own, and run only with ``TEST_RESTART_DOCKERD=1``. They
restart a local dockerd (``DOCKER_HOST`` unset, run as root) with the command line it
was started with, so its configuration (live-restore or not) stays as it was.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Optional

import pytest

import fibrl
from conftest import REQUIRE_DOCKER, skip_or_fail, wait_until
from fibrl.backends import docker as dockerbackend
from fibrl.backends.base import run_id
from fibrl.errors import BackendUnavailableError

pytestmark = [pytest.mark.docker, pytest.mark.docker_restart, pytest.mark.slow]

OPT_IN = "TEST_RESTART_DOCKERD"
PID_FILE = "/var/run/docker.pid"
STOP_WAIT = 60.0    # s: dockerd gives its containers 15 s to stop, then kills them
START_WAIT = 60.0   # s for a started dockerd to answer
DOWN_S = 15.0       # s down: more than exit_report_s, after which the pool calls a
                    # worker whose connection ended lost and starts its replacement
TIMEOUT = 120


class Dockerd:
    """The machine's dockerd: stop it, start it again with the same command line."""

    def __init__(self, pid: int, argv: list) -> None:
        self.pid: Optional[int] = pid
        self.argv = argv
        self.log = os.environ.get("DOCKERD_LOG", "/tmp/fibrl-dockerd.log")

    def stop(self) -> None:
        """SIGTERM, then wait until the process is gone (its shutdown stops containers)."""
        assert self.pid is not None, "dockerd is not running"
        os.kill(self.pid, signal.SIGTERM)
        wait_until(lambda: not _alive(self.pid), f"dockerd (pid {self.pid}) to exit",
                   STOP_WAIT, interval=0.1)
        self.pid = None

    def start(self) -> None:
        """Start it as it was started before, then wait until it answers."""
        if self.pid is not None:
            return
        if os.path.exists(PID_FILE) and not _alive(_read_pid()):
            os.unlink(PID_FILE)   # a stale pid file makes dockerd refuse to start
        with open(self.log, "ab") as log:   # through a shell that exits at once: dockerd
            subprocess.run(["sh", "-c", '"$@" & exit 0', "sh", *self.argv],   # is no child of
                           stdin=subprocess.DEVNULL, stdout=log, stderr=log,   # this session
                           start_new_session=True, check=True, timeout=30)
        wait_until(_engine_answers, "the restarted dockerd to answer", START_WAIT, interval=0.2)
        self.pid = _read_pid()


def _read_pid() -> int:
    with open(PID_FILE) as handle:
        return int(handle.read().strip() or 0)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ", 1)[1][0] != "Z"   # a zombie is gone
    except (OSError, IndexError):
        return False


def _engine_answers() -> bool:
    try:
        dockerbackend.connect(timeout=5).ping()
        return True
    except Exception:   # noqa: BLE001 - not up yet, in any of the SDK's ways
        return False


def _local_dockerd() -> tuple:
    """(pid, argv) of the dockerd this test may restart, or a reason it may not."""
    if os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock") != "unix:///var/run/docker.sock":
        return None, "DOCKER_HOST names a remote engine, which this test cannot restart"
    if os.geteuid() != 0:
        return None, "restarting dockerd needs root"
    try:
        pid = _read_pid()
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = [part.decode() for part in handle.read().split(b"\0") if part]
    except (OSError, ValueError) as exc:
        return None, f"no running dockerd found through {PID_FILE} ({exc})"
    if not argv or os.path.basename(argv[0]) != "dockerd":
        return None, f"{PID_FILE} names pid {pid}, which is not dockerd ({argv[:1]})"
    return (pid, argv), ""


@pytest.fixture
def dockerd(docker_engine):
    """The local dockerd, to stop and start; it runs again after the test, whatever
    happened (a test that leaves it stopped would break every later docker test)."""
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"restarts the docker daemon: runs only with {OPT_IN}=1 (.ci/run runs "
                    f"it alone, after the other tests)")
    found, reason = _local_dockerd()
    if found is None:
        skip_or_fail(reason, REQUIRE_DOCKER)
    daemon = Dockerd(*found)
    try:
        yield daemon
    finally:
        daemon.start()


@pytest.fixture
def dctx(docker_engine, configure):
    configure(backend="docker")
    return fibrl.get_context()


def _worker_ids(pool) -> set:
    return {proc._popen.job.id for proc in pool._pool}


def _running_of_this_run() -> list:
    client = dockerbackend.connect(timeout=10)
    return [c.name for c in dockerbackend.list_containers(run_id(), running_only=True,
                                                          client=client)]


# Worker targets are defined in the tests, so they travel by value (a worker imports
# neither this module nor conftest to find them).

def test_pool_map_is_exact_across_a_daemon_restart(dctx, dockerd, caplog):
    def slow_square(x):
        import time as t

        t.sleep(0.02)
        return x * x

    def wait_for_word(q):
        return q.get(timeout=300)

    live_restore = bool(dockerbackend.connect(timeout=10).info().get("LiveRestoreEnabled"))
    n = 1500
    q = dctx.Queue()
    waiter = dctx.Process(target=wait_for_word, args=(q,))   # a long-running Process
    waiter.start()
    with dctx.Pool(2) as pool:
        results = pool.imap(slow_square, range(n), chunksize=1)
        head = [next(results) for _ in range(50)]
        before = _worker_ids(pool)
        assert len(before) == 2
        dockerd.stop()
        time.sleep(DOWN_S)   # (no live-restore) the replacements start meanwhile, and wait
        dockerd.start()
        rest = list(results)
        assert head + rest == [x * x for x in range(n)]
        after = _worker_ids(pool)
        if live_restore:   # the containers outlived the daemon: same workers
            assert after == before
        else:              # stopped with the daemon: lost, and replaced once it was back
            wait_until(lambda: len(pool._pool) == 2 and not (_worker_ids(pool) & before),
                       "both workers to be replaced", TIMEOUT)
            assert any("does not answer" in r.getMessage() for r in caplog.records), \
                "no start waited for the daemon: the fault under test did not happen"
    if live_restore:
        q.put("done")
        waiter.join(TIMEOUT)
        assert waiter.exitcode == 0
    else:   # reported lost with the signal the daemon's shutdown stopped it with
        waiter.join(TIMEOUT)
        assert waiter.exitcode in (-signal.SIGTERM, -signal.SIGKILL), waiter.exitcode
    wait_until(lambda: not _running_of_this_run(),
               "no container of this run to run after the pool closed", 30)


def test_a_start_while_the_daemon_is_down_waits_for_it_or_fails_at_start_timeout(
        dctx, configure, dockerd):
    def wait_for_word(q):
        return q.get(timeout=300)

    # two configs, each with its backend connected before the daemon goes
    configure(start_timeout=120.0)
    patient = fibrl.get_context()
    assert patient.cpu_count() > 0
    queue = patient.Queue()
    configure(start_timeout=5.0)
    hasty = fibrl.get_context()
    assert hasty.cpu_count() > 0
    done: dict = {}

    def start_patiently() -> None:
        try:
            proc = patient.Process(target=wait_for_word, args=(queue,))
            proc.start()
            done["process"] = proc
        except BaseException as exc:   # noqa: BLE001 - the main thread reports it
            done["error"] = exc

    dockerd.stop()
    try:
        p = hasty.Process(target=abs, args=(-3,))
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailableError) as info:
            p.start()
        took = time.monotonic() - t0
        configure(start_timeout=120.0)   # the patient config: its start waits
        starter = threading.Thread(target=start_patiently)
        starter.start()
        time.sleep(2.0)
        assert starter.is_alive() and not done, done
    finally:
        dockerd.start()
    message = str(info.value)
    assert "did not answer for 5 s (start_timeout)" in message, message
    assert "dockerd" in message and "docker info" in message, message
    assert 4.5 <= took < 5.0 + 30, took

    starter.join(TIMEOUT)
    assert not starter.is_alive(), "the waiting start did not return once the daemon was back"
    assert "error" not in done, done.get("error")
    queue.put("done")
    done["process"].join(TIMEOUT)
    assert done["process"].exitcode == 0
    wait_until(lambda: not _running_of_this_run(), "no container of this run to run", 30)
