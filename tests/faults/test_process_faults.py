"""Workers never outlive their parent: SIGKILLed parent, normal exit with daemons."""
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from conftest import freeze, frozen, parent_env, wait_until, workers_of_run

TIMEOUT = 60

PARENT = textwrap.dedent("""
    import sys, time, fibrl
    def sleep():
        time.sleep(3600)
    if __name__ == "__main__":
        fibrl.init(backend=sys.argv[1], heartbeat_interval=0.5, parent_timeout=3)
        kids = [fibrl.Process(target=sleep, daemon=d) for d in (True, False)]
        for k in kids:
            k.start()
        print(" ".join(str(k.pid) for k in kids), flush=True)
        if sys.argv[2] == "exit":
            for k in kids:
                if not k.daemon:
                    k.terminate()
            sys.exit(0)          # the daemonic child must be ended at exit
        time.sleep(3600)
""")


def _start_parent(tmp_path, mode):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script), "local", mode],
                            stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    line = proc.stdout.readline()
    pids = [int(x) for x in line.split()]
    assert len(pids) == 2, line
    return proc, pids


def _gone_within(pids, seconds):
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=seconds)
    for p in alive:
        p.kill()
    return not alive


def test_workers_exit_when_parent_is_sigkilled(tmp_path):
    proc, pids = _start_parent(tmp_path, "sleep")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert _gone_within(pids, 10), "workers outlived their SIGKILLed parent"


def test_daemonic_children_end_when_parent_exits(ctx, tmp_path, request):
    run = f"exit{os.getpid()}x{time.monotonic_ns() % 10**6}"
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script), ctx.config.backend, "exit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=parent_env(ctx, run))
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
    assert len(out.split()) == 2, err       # both children started
    # 0, not a SIGABRT while the interpreter finalizes: a watcher still deleting its pod
    # over HTTP woke in a dying interpreter (the exit sequence now waits for watchers)
    assert proc.returncode == 0, err
    wait_until(lambda: not workers_of_run(ctx, run, request),
               f"the children of the exited parent (run {run}) to end", 15)


def host_a_queue(carrier, stop):
    import fibrl

    queue = fibrl.Queue()   # (kept: an owner that drops its queue ends it)
    carrier.put(queue)
    stop.get(timeout=120)


@pytest.fixture
def hosted_queue(ctx, configure, request):
    """A queue hosted by a child process (its owner) on the backend under test, and a
    function that freezes the owner as a vanished node would (no socket closes, nothing
    answers; see conftest.frozen)."""
    import fibrl

    configure(heartbeat_interval=0.5, parent_timeout=2.0)
    carrier, stop = fibrl.Queue(), fibrl.Queue()
    owner = fibrl.Process(target=host_a_queue, args=(carrier, stop))
    owner.start()
    with contextlib.ExitStack() as stack:
        stack.callback(owner.join, 30)
        stack.callback(owner.kill)
        hosted = carrier.get(timeout=60)
        assert hosted.qsize() == 0  # connected while the owner still answers
        yield hosted, lambda: stack.enter_context(frozen(owner, request))


def test_a_get_on_a_queue_whose_owner_vanished_raises(hosted_queue):
    """A frozen owner fails a blocked get() within parent_timeout instead of hanging."""
    from fibrl.errors import RemoteObjectError

    hosted, freeze = hosted_queue
    freeze()
    start = time.monotonic()
    with pytest.raises(RemoteObjectError, match="did not answer"):
        hosted.get(timeout=60)
    assert time.monotonic() - start < 10


def test_join_thread_with_a_frozen_queue_owner_returns(hosted_queue):
    """join_thread() waits for the owner to confirm the puts; a frozen owner answers
    nothing, so the wait ends after parent_timeout instead of never."""
    hosted, freeze = hosted_queue
    freeze()
    hosted.put("late")
    hosted.close()
    joiner = threading.Thread(target=hosted.join_thread, daemon=True)
    joiner.start()
    joiner.join(20)
    assert not joiner.is_alive(), "join_thread() still waits for a frozen owner"


def put_when_told(hosted, ready, go, count):
    hosted.qsize()   # connected to the owner while it still answers
    ready.put(True)
    go.get(timeout=TIMEOUT)
    for i in range(count):
        hosted.put(bytes([i % 256]) * 100_000)


@pytest.mark.timeout(180)   # 15-60 s measured on a loaded two-core machine
def test_a_producer_ends_only_once_a_slow_owner_processed_its_puts(configure):
    """A queue owner that is alive but slow (here: stopped for 20 s, within
    parent_timeout) gets every put of a producer before the producer is seen to exit,
    even when more was put than the connection buffers (30 MB): what the parent does
    after join() (put the consumers' sentinels, count) comes after the producer's items,
    and none is dropped."""
    import fibrl

    configure(heartbeat_interval=0.5, parent_timeout=60.0)
    carrier, stop, ready, go = (fibrl.Queue() for _ in range(4))
    owner = fibrl.Process(target=host_a_queue, args=(carrier, stop))
    owner.start()
    try:
        hosted = carrier.get(timeout=TIMEOUT)
        producer = fibrl.Process(target=put_when_told, args=(hosted, ready, go, 300))
        producer.start()
        assert ready.get(timeout=TIMEOUT)
        freeze(owner.pid)
        try:
            go.put(True)
            producer.join(20)
            assert producer.exitcode is None, "the producer ended with its puts unprocessed"
        finally:
            os.kill(owner.pid, signal.SIGCONT)
        producer.join(TIMEOUT)
        assert producer.exitcode == 0
        assert hosted.qsize() == 300
        assert sorted(hosted.get(timeout=TIMEOUT)[0] for _ in range(300)) == \
            sorted(i % 256 for i in range(300))
    finally:
        stop.put(None)
        owner.join(TIMEOUT)
        owner.kill()

