"""Cleanups of collected objects run on the janitor thread, never on the collecting one."""
import gc
import subprocess
import sys
import textwrap
import threading

from fibrl import janitor
from fibrl.janitor import Finalizer


class Res:
    pass


def test_explicit_call_runs_inline_and_once():
    ran = []
    res = Res()
    fin = Finalizer(res, lambda: ran.append(threading.current_thread().name))
    assert fin.alive
    fin()
    fin()
    assert ran == [threading.current_thread().name]
    assert not fin.alive
    del res
    gc.collect()
    assert janitor.flush(10)
    assert len(ran) == 1  # collecting it later runs nothing more


def test_detached_never_runs():
    ran = []
    res = Res()
    fin = Finalizer(res, ran.append, 1)
    assert fin.detach()
    assert not fin.detach()
    del res
    gc.collect()
    assert janitor.flush(10)
    assert ran == []


def test_collection_while_holding_the_lock_the_cleanup_needs():
    # Inline, this cleanup would wait for a lock its own thread holds: a deadlock
    # (the same shape as a handle resolved while a collected pipe end detaches).
    lock = threading.Lock()
    got = []

    def cleanup():
        got.append((threading.current_thread().name, lock.acquire(timeout=10)))
        lock.release()

    res = Res()
    res.cycle = res  # only a collection frees it
    Finalizer(res, cleanup)
    with lock:
        del res
        gc.collect()
        assert got == []  # not run here, while the lock is held
    assert janitor.flush(10)
    assert got == [("fibrl-janitor", True)]


def test_a_failing_cleanup_does_not_stop_the_next():
    ran = []
    first, second = Res(), Res()
    Finalizer(first, lambda: 1 / 0)
    Finalizer(second, ran.append, "second")
    del first, second
    gc.collect()
    assert janitor.flush(10)
    assert ran == ["second"]


def test_atexit_cleanup_runs_at_interpreter_exit():
    code = textwrap.dedent("""
        import sys
        from fibrl.janitor import Finalizer
        class Res: pass
        keep = Res()
        Finalizer(keep, lambda: sys.stdout.write("cleaned at exit\\n"), atexit=True)
        Finalizer(Res(), lambda: None)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "cleaned at exit\n"


CHURN = textwrap.dedent("""
    import gc, sys, threading, time
    import fibrl

    def churn(stop):
        # pipe ends in reference cycles: only the collector frees them, on whichever
        # thread happens to allocate, possibly inside a fibrl call
        while not stop.is_set():
            a, b = fibrl.Pipe()
            cycle = [a, b, None]
            cycle[2] = cycle
            del a, b, cycle

    if __name__ == "__main__":
        gc.set_threshold(5, 1, 1)
        stop = threading.Event()
        thread = threading.Thread(target=churn, args=(stop,), daemon=True)
        thread.start()
        r, w = fibrl.Pipe()
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < float(sys.argv[1]):
            w.send(n)
            assert r.poll(10) and r.recv() == n
            n += 1
        stop.set()
        thread.join(10)
        print("round trips", n)
""")


def test_pipes_collected_during_pipe_calls_do_not_deadlock(tmp_path):
    # Before cleanups were moved off the collecting thread this hung within a second:
    # a collection inside a handle's resolve ran a pipe end's detach, which resolves
    # another handle and waited on the lock its own thread held.
    script = tmp_path / "churn.py"
    script.write_text(CHURN)
    out = subprocess.run([sys.executable, str(script), "4"], capture_output=True, text=True,
                         timeout=90, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) > 100
