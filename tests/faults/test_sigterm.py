"""SIGTERM to a parent whose Pool is busy and whose Queue has a consumer.

What must hold, whether the program leaves SIGTERM to its default action (the
process dies at once: status -15 as ``subprocess`` reports it, 143 in a shell) or
handles it with ``sys.exit(143)`` (Python's exit sequence runs):

* the parent ends with that status within a bounded time (not when its tasks or the
  consumer's ``get()`` would end: both wait for minutes);
* every process it started (pool workers, the consumer, the local fork server) is
  gone soon after, checked by pid;
* with the handler, the exit is clean: the pool and the queue's owner side close
  without a traceback or an "Exception ignored" on stderr, and the consumer, which
  waits in ``get()`` on the queue, ends by itself.
"""
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from conftest import checkout_env

TIMEOUT = 120   # only reached on a hang
pytestmark = pytest.mark.timeout(300)

PARENT = textwrap.dedent("""
    import os, signal, sys, time
    import fibrl

    def busy(started, x):
        started.put(os.getpid())
        time.sleep(600)

    def consume(q, got):
        while True:
            got.put(q.get(timeout=600))

    if __name__ == "__main__":
        fibrl.init(backend=sys.argv[1])
        if sys.argv[2] == "handled":
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        q, got, started = fibrl.Queue(), fibrl.Queue(), fibrl.Queue()
        consumer = fibrl.Process(target=consume, args=(q, got), daemon=True)
        consumer.start()
        q.put("first")
        assert got.get(timeout=300) == "first"      # the consumer takes items
        pool = fibrl.Pool(2)
        result = pool.starmap_async(busy, [(started, x) for x in range(4)], chunksize=1)
        workers = {started.get(timeout=300) for _ in range(2)}   # both inside a task
        print(consumer.pid, *sorted(workers), flush=True)
        result.get(timeout=900)
""")


def _start(tmp_path, mode):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = checkout_env()
    # stderr to a file: the children inherit it, and a pipe would stay open while they live
    with open(tmp_path / "stderr", "w") as err:
        return subprocess.Popen([sys.executable, str(script), "local", mode], cwd=tmp_path,
                                env=env, stdout=subprocess.PIPE, stderr=err, text=True)


@pytest.mark.parametrize("mode,status", [("default", -signal.SIGTERM), ("handled", 143)])
def test_sigterm_to_a_parent_with_a_busy_pool_and_a_queue(tmp_path, mode, status):
    proc = _start(tmp_path, mode)
    try:
        line = proc.stdout.readline()
        named = [int(pid) for pid in line.split()]
        assert len(named) == 3, (line, (tmp_path / "stderr").read_text())
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert set(named) <= {p.pid for p in descendants}, (named, descendants)
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdout.close()
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == status, err[-5000:]
    _, alive = psutil.wait_procs(descendants, timeout=TIMEOUT)
    for left in alive:
        left.kill()
    assert not alive, f"processes of the SIGTERMed parent left running: {alive}"
    if mode == "handled":
        for bad in ("Traceback", "Exception ignored", "Error", "Fatal"):
            assert bad not in err, err[-5000:]
