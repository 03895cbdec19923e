"""Ctrl-C in a program whose Pool workers are busy: it ends as Python ends on an
uncaught KeyboardInterrupt (killed by SIGINT: exit status 130 in a shell), with
the main script's traceback only, and leaves no process or container behind.

The program runs in a session of its own and gets SIGINT as a terminal's Ctrl-C
sends it: to its whole process group (local workers and the fork server
included; docker containers are not in it)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import checkout_env, interruptible, session_pids, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUSY_POOL = """
    import sys, time
    import fibrl

    def work(busy, x):
        busy.put(x)
        time.sleep(600)

    if __name__ == "__main__":
        fibrl.init(backend=sys.argv[1])
        busy = fibrl.Queue()
        with fibrl.Pool(2) as pool:
            result = pool.starmap_async(work, [(busy, x) for x in range(4)], chunksize=1)
            for _ in range(2):
                busy.get(timeout=300)
            print("busy", flush=True)
            result.get(timeout=900)
"""


STARTING_POOL = """
    import sys, time
    import fibrl

    if __name__ == "__main__":
        fibrl.init(backend=sys.argv[1])
        print("starting", flush=True)
        with fibrl.Pool(2) as pool:
            pool.map(time.sleep, [600] * 2, chunksize=1)
"""


def _interrupt_when_busy(tmp_path, backend, program=BUSY_POOL, ready="busy\n", after=0.0):
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(program))
    env = checkout_env()
    proc = subprocess.Popen([sys.executable, str(script), backend], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=interruptible)
    try:
        assert proc.stdout.readline() == ready   # the script's own get() is bounded
        time.sleep(after)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    return proc, err


def _assert_ended_as_python_does(proc, err):
    assert proc.returncode == -signal.SIGINT, err[-5000:]   # a shell shows 130
    assert err.count("Traceback (most recent call last)") == 1, err[-5000:]
    assert err.rstrip().endswith("KeyboardInterrupt"), err[-5000:]
    assert "_zygote" not in err and "fork server exited" not in err, err[-5000:]


def test_ctrl_c_with_local_workers(tmp_path):
    proc, err = _interrupt_when_busy(tmp_path, "local")
    _assert_ended_as_python_does(proc, err)
    wait_until(lambda: not session_pids(proc.pid), "the fork server and workers to end", 30)


@pytest.mark.docker
def test_ctrl_c_with_docker_workers(tmp_path, docker_engine):
    from fibrl.backends import docker

    proc, err = _interrupt_when_busy(tmp_path, "docker")
    _assert_ended_as_python_does(proc, err)
    wait_until(lambda: not session_pids(proc.pid), "the program's processes to end", 30)
    wait_until(lambda: not docker.list_containers(parent=proc.pid, client=docker_engine),
               "the worker containers to be removed", 60, interval=0.5)


@pytest.mark.docker
def test_ctrl_c_while_docker_workers_start(tmp_path, docker_engine):
    """During the first start of the image (its probe runs beside the first worker):
    the exit does not wait the starts out (tests/unit/test_docker_backend.py)."""
    from fibrl.backends import docker

    proc, err = _interrupt_when_busy(tmp_path, "docker", STARTING_POOL, "starting\n", 1.0)
    _assert_ended_as_python_does(proc, err)
    wait_until(lambda: not session_pids(proc.pid), "the program's processes to end", 30)
    wait_until(lambda: not docker.list_containers(parent=proc.pid, client=docker_engine),
               "the worker and probe containers to be removed", 60, interval=0.5)
