"""Hundreds of workers starting at once: each connects back to one listener.

Defect: a listener full of pending connections (64, ``max_pending``) closed the oldest
for each new one, whether it was idle or only queued behind the others. In a burst of
connects the peers that were queued lost their handshake connection ("Connection
shutdown"), or, once authenticated, the connection to their data port; the listener
then logged "dropped peer (none): the authenticated peer did not connect to its data
socket within auth_timeout" and the pool replaced the worker. Now a full listener is a
queue: new connections wait until a pending one finishes or is idle, and a data
port's connection never counts against the limit.

Also: an idle worker runs nng's threads and at most three of fibrl's.
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import fibrl
import fibrl.channel as channel

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What no clean start may print: a listener's drop or refusal, a failed handshake, a
# worker replaced or lost.
_BAD = ("dropped peer", "handshake", "did not connect", "could not start",
        "ended before it connected back", "Traceback")

_POOL_BURST = textwrap.dedent("""
    import logging, os, sys, time
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    import fibrl

    def hold(folder, n, limit):
        # one task per worker: none returns before n workers have each taken one
        open(os.path.join(folder, str(os.getpid())), "w").close()
        deadline = time.monotonic() + limit
        while len(os.listdir(folder)) < n:
            if time.monotonic() > deadline:
                return -1
            time.sleep(0.2)
        return os.getpid()

    if __name__ == "__main__":
        n, folder, limit = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
        start = time.monotonic()
        with fibrl.Pool(n) as pool:
            pids = pool.starmap(hold, [(folder, n, limit)] * n, chunksize=1)
        print("PIDS", len(set(pids)), -1 in pids, flush=True)
        print("SECONDS", round(time.monotonic() - start, 1), flush=True)
""")

WORKERS = 256
HOLD_S = 400   # a task waits this long at most for the others (a loaded 2-core machine)


@pytest.mark.alone   # 256 processes at once
@pytest.mark.slow
@pytest.mark.timeout(HOLD_S + 150)
def test_pool_of_256_starts_every_worker_cleanly(tmp_path):
    script = tmp_path / "burst.py"
    script.write_text(_POOL_BURST)
    folder = tmp_path / "ran"
    folder.mkdir()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FIBRL_BACKEND", None)
    done = subprocess.run([sys.executable, str(script), str(WORKERS), str(folder),
                           str(HOLD_S)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=HOLD_S + 120)
    err = done.stderr
    assert done.returncode == 0, err[-4000:]
    assert f"PIDS {WORKERS} False" in done.stdout, (done.stdout, err[-4000:])
    assert len(os.listdir(folder)) == WORKERS   # no worker was replaced on the way
    bad = [line for line in err.splitlines() if any(word in line for word in _BAD)]
    assert not bad, "\n".join(bad[:20])


PROCESSES, THREADS = 6, 50   # 300 connects

_CONNECTS = textwrap.dedent("""
    import sys, threading, time
    import fibrl.channel as channel

    address, at, count = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    authkey = bytes.fromhex(sys.stdin.readline().strip())   # (not on the command line)
    results = []

    def one():
        time.sleep(max(0.0, at - time.time()))
        try:
            ch = channel.connect(address, timeout=120, authkey=authkey)
            ch.send(b"hi")
            results.append("ok" if ch.recv(timeout=60) == b"hi" else "wrong echo")
            ch.close()
        except Exception as exc:
            results.append(f"{type(exc).__name__}: {exc}".replace("\\n", " "))

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(200)
    print("\\n".join(results), flush=True)
""")


@pytest.mark.alone   # 300 connects at one instant
@pytest.mark.timeout(280)
def test_a_burst_of_300_connects_is_served_whole(caplog):
    """300 authenticated connects at one instant, from 6 processes, to one listener that
    holds 64 pending connections at most: every one gets in, none is dropped."""
    listener = channel.listen(lambda peer, frame: peer.send(frame))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    at = time.time() + 8   # (once every process has started its threads)
    procs = []
    try:
        with caplog.at_level("WARNING", logger="fibrl.wire"):
            for _ in range(PROCESSES):
                proc = subprocess.Popen(
                    [sys.executable, "-c", _CONNECTS, listener.address, str(at), str(THREADS)],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                proc.stdin.write(fibrl.current_process().authkey.hex() + "\n")
                proc.stdin.close()
                procs.append(proc)
            # (each ends within 200 s: its threads' joins are bounded)
            results = [line for proc in procs for line in proc.stdout.read().splitlines()]
        assert results == ["ok"] * PROCESSES * THREADS, sorted(set(results))[:5]
        drops = [r.getMessage() for r in caplog.records if "dropped peer" in r.getMessage()]
        assert not drops, drops[:5]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            proc.stdout.close()
        listener.close(join=1.0)


# -- threads of an idle worker ------------------------------------------------------------
FIBRL_THREADS = ("fibrl-client-", "fibrl-feeder-", "fibrl-timers")   # name prefixes


def _threads_here(_=None):
    """(pid, {native thread id: Python name}) of the process that runs this."""
    return os.getpid(), {t.native_id: t.name for t in threading.enumerate()}


def _os_threads(pid: int) -> dict:
    names = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[int(tid)] = f.read().strip()
        except OSError:
            pass   # ended meanwhile
    return names


def _check_idle_threads(pid: int, python: dict) -> None:
    """Every thread of ``pid``: its main thread, nng's, and at most three of fibrl's,
    each named (Python names from inside it, OS names from /proc)."""
    threads = _os_threads(pid)
    nng = [n for n in threads.values() if n.startswith("nng:")]
    others = {tid: python.get(tid, f"unknown thread {name!r}")
              for tid, name in threads.items() if not name.startswith("nng:") and tid != pid}
    fibrl_threads = sorted(others.values())
    assert all(name.startswith(FIBRL_THREADS) for name in fibrl_threads), fibrl_threads
    assert len(fibrl_threads) <= 3, fibrl_threads
    if "FIBRL_NNG_THREADS" not in os.environ:
        assert len(nng) == 6, sorted(nng)   # 2 task, expire, poller, resolver, reaper
    assert len(threads) == 1 + len(nng) + len(fibrl_threads)


def test_an_idle_pool_worker_runs_nngs_threads_and_three_of_fibrls():
    with fibrl.Pool(1) as pool:
        pool.map(_threads_here, range(3))
        time.sleep(1.5)   # idle, past its first liveness beat
        pid, python = pool.apply(_threads_here)
        time.sleep(1.5)   # idle again
        _check_idle_threads(pid, python)


def _report_threads_then_idle(queue, stop):
    queue.put(_threads_here())
    stop.wait(60)


@pytest.mark.timeout(180)   # 15-60 s measured on a loaded two-core machine
def test_an_idle_process_runs_nngs_threads_and_three_of_fibrls(configure):
    configure(heartbeat_interval=0.5)   # a heartbeat or two while it idles
    queue, stop = fibrl.Queue(), fibrl.Event()
    proc = fibrl.Process(target=_report_threads_then_idle, args=(queue, stop))
    proc.start()
    try:
        pid, python = queue.get(timeout=60)
        time.sleep(1.5)
        _check_idle_threads(pid, python)
    finally:
        stop.set()
        proc.join(30)
    assert proc.exitcode == 0
