"""Pools at scale on the local backend: hundreds of workers start cleanly (no handshake
dropped, nothing logged, every worker runs a task), and a pool that can start only
some of its workers (the parent runs out of file descriptors) says so and still
finishes.

Semantics only; speed at scale is measured by benchmarks/bench_scale.py.
"""
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

import fibrl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _square(x):
    return x * x


def _hold(folder, n, limit):
    """One task per worker: none returns before ``n`` workers each took one."""
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + limit
    while len(os.listdir(folder)) < n:
        if time.monotonic() > deadline:
            return -1
        time.sleep(0.1)
    return os.getpid()


# What a clean start prints nowhere, the workers' output included: a listener's drop or
# refusal, a failed handshake, a worker replaced or lost, a warning of the pool.
_UNCLEAN = ("dropped peer", "handshake", "did not connect", "could not start",
            "ended before it connected back", "Traceback", "WARNING", "ERROR")
START_LIMIT_S = 300   # every worker of Pool(256) ran a task by then (2 loaded cores)


@pytest.mark.alone   # 256 processes at once
@pytest.mark.slow
@pytest.mark.timeout(START_LIMIT_S + 200)
def test_pool_256_starts_cleanly_and_map_returns_exact_results(tmp_path, caplog, capfd):
    folder = tmp_path / "ran"
    folder.mkdir()
    begun = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fibrl"):
        with fibrl.Pool(256) as pool:
            pids = pool.starmap(_hold, [(str(folder), 256, START_LIMIT_S)] * 256,
                                chunksize=1)
            started = time.monotonic() - begun
            assert -1 not in pids and len(set(pids)) == 256, (
                f"{len(os.listdir(folder))} of 256 workers ran a task within "
                f"{START_LIMIT_S} s")
            assert len(os.listdir(folder)) == 256   # no worker was replaced on the way
            assert pool.map(_square, range(2000), chunksize=1) == [x * x for x in range(2000)]
            assert pool.map(_square, range(5000)) == [x * x for x in range(5000)]
    warned = [f"{r.name}: {r.getMessage()}" for r in caplog.records
              if r.levelno >= logging.WARNING]
    assert not warned, warned[:10]
    out, err = capfd.readouterr()   # (the workers write to this process's stderr)
    unclean = [line for line in (out + err).splitlines()
               if any(word in line for word in _UNCLEAN)]
    assert not unclean, unclean[:20]
    print(f"Pool(256): every worker ran a task {started:.1f} s after Pool()")


_SHORT_OF_FILES = textwrap.dedent("""
    import logging, resource, sys, threading
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    import fibrl

    short = threading.Event()

    class Short(logging.Handler):
        def emit(self, record):
            if "could not start another worker" in record.getMessage():
                short.set()

    def square(x):
        return x * x

    if __name__ == "__main__":
        logging.getLogger("fibrl.pool.service").addHandler(Short())
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
        with fibrl.Pool(64) as pool:
            assert pool.map(square, range(300), chunksize=1) == [x * x for x in range(300)]
            # the pool goes on starting workers until it runs out of descriptors
            assert short.wait(120), "the pool never said it could not start a worker"
            assert pool.map(square, range(300)) == [x * x for x in range(300)]
        print("DONE", flush=True)
""")


@pytest.mark.alone   # starts 64 processes at once
@pytest.mark.slow
# 100: some workers connect before the descriptors run out. 70: the first 32 starts
# hold so many of them that, started together, none of them could connect, and the pool
# waited forever for a first worker (it starts only as many as it has descriptors for).
@pytest.mark.parametrize("limit", [100, 70])
def test_pool_short_of_descriptors_says_so_once_and_completes(tmp_path, limit):
    script = tmp_path / "short_of_files.py"
    script.write_text(_SHORT_OF_FILES.replace("FD_LIMIT", str(limit)))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FIBRL_BACKEND", None)
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "DONE" in done.stdout
    said = [line for line in done.stderr.splitlines()
            if line.startswith("fibrl.pool.service: pool: could not start another worker")]
    assert said, done.stderr[-4000:]
    assert len(said) == len(set(said)), said              # each cause once
    # the cause is named: the parent's EMFILE, or the connections it refused for want of
    # descriptors (the worker itself only saw its connection shut)
    assert any("Too many open files" in line or "file descriptors are left (ulimit -n)" in line
               for line in said), said
    early = [line for line in done.stderr.splitlines()
             if "ended before it connected back" in line]
    assert len(early) <= 1, early                          # workers failing alike: once


def test_bad_nng_thread_counts_are_refused_with_the_fix():
    env = dict(os.environ, PYTHONPATH=REPO, FIBRL_NNG_THREADS="2,1")
    done = subprocess.run(
        [sys.executable, "-c", "import fibrl.wire.transport as t; t.set_nng_threads()"],
        env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "FIBRL_NNG_THREADS='2,1' is not four positive counts" in done.stderr


def test_nng_thread_counts_from_the_environment_reach_parent_and_workers():
    """FIBRL_NNG_THREADS is not a config key: a program runs with it set, and a worker
    started with it runs nng with those counts (2 task threads, nng's least)."""
    code = textwrap.dedent("""
        import os, time
        import fibrl

        def report(q):
            names = [open(f"/proc/self/task/{t}/comm").read().strip()
                     for t in os.listdir("/proc/self/task")]
            q.put(sorted(n for n in names if n.startswith("nng:")))

        if __name__ == "__main__":
            q = fibrl.Queue()
            p = fibrl.Process(target=report, args=(q,))
            p.start()
            print("NNG", q.get(timeout=60))
            p.join(60)
            print("EXIT", p.exitcode)
    """)
    env = dict(os.environ, PYTHONPATH=REPO, FIBRL_NNG_THREADS="2,1,1,1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "EXIT 0" in done.stdout, done.stdout
    nng = [line for line in done.stdout.splitlines() if line.startswith("NNG")][0]
    assert nng.count("nng:task") == 2 and nng.count("nng:aio:expire") == 1, nng


def test_nng_thread_counts_are_too_late_once_nng_started():
    code = textwrap.dedent("""
        import fibrl.wire.transport as t
        assert t.set_nng_threads({"task": 2}) is True
        import pynng  # nng starts with the first socket
        t._make(pynng.Pair1, b"k" * 32, False, True).close()
        assert t.set_nng_threads({"task": 2}) is False
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("FIBRL_NNG_THREADS", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr
