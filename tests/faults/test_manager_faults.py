"""Managers and sync primitives under fire: killed or frozen servers, dead holders, exit.

Every pending and later call to a lost server must raise a clear error within
a bounded time; a lock held by a dead process is released; a barrier party
that dies breaks the barrier; a program that exits without shutting its
managers down exits cleanly (no finalizer errors, no process left).
"""
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
import uuid

import pytest

from conftest import frozen, processes_of_run, wait_until

import fibrl
from fibrl.errors import AuthenticationError, RemoteObjectError
from fibrl.managers import AsyncManager, SyncManager

TIMEOUT = 60
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _defs():
    class Sleeper:
        def sleep(self, seconds, arrived=None):
            if arrived is not None:
                arrived.set()   # the call reached the server: it is now in flight
            time.sleep(seconds)
            return seconds

    class Gate:
        def block(self, arrived):
            arrived.set()       # the call reached the server: it is now in flight
            threading.Event().wait(TIMEOUT)

    def hold_forever(lock, holding):
        lock.acquire()
        holding.set()
        threading.Event().wait(TIMEOUT)

    def wait_forever(barrier):
        barrier.wait()

    return types.SimpleNamespace(**locals())


D = _defs()


class SleepManager(AsyncManager):
    pass


SleepManager.register("Sleeper", D.Sleeper)


class GateManager(SyncManager):
    pass


GateManager.register("Gate", D.Gate)


def _call_in_thread(fn):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def test_killed_server_fails_pending_and_later_calls(ctx):
    m = GateManager(ctx=ctx)
    m.start()
    gate, lst, arrived = m.Gate(), m.list(), ctx.Event()
    thread, box = _call_in_thread(lambda: gate.block(arrived))  # blocks in the server
    assert arrived.wait(TIMEOUT), "the call never reached the server"
    assert thread.is_alive(), box
    m._process.kill()
    thread.join(15)
    assert not thread.is_alive(), "the pending call hung after the server was killed"
    assert isinstance(box.get("error"), RemoteObjectError), box
    assert "while this call was in flight" in str(box["error"]), box
    start = time.monotonic()
    with pytest.raises(RemoteObjectError, match="manager server"):
        lst.append(1)
    with pytest.raises(RemoteObjectError):
        m.list()
    assert time.monotonic() - start < 15
    m.shutdown()  # clean, and quick, with the server already gone
    assert not m._process.is_alive()


def test_killed_server_fails_async_handles(ctx):
    m = SleepManager(ctx=ctx)
    m.start()
    sleeper, arrived = m.Sleeper(), ctx.Event()
    handle = sleeper.sleep(30, arrived)
    assert arrived.wait(TIMEOUT), "the call never reached the server"
    assert not handle.ready()
    m._process.kill()
    assert handle.wait(15), "the pending handle was not failed"
    with pytest.raises(RemoteObjectError, match="while this call was in flight"):
        handle.get()
    with pytest.raises(RemoteObjectError):
        sleeper.sleep(0).get(15)
    m.shutdown()


def test_frozen_server_is_detected_within_parent_timeout(ctx, configure, request):
    configure(heartbeat_interval=0.5, parent_timeout=3.0)
    m = fibrl.Manager()
    lst, lock = m.list(), fibrl.Lock()
    lst.append(0)   # connects this thread's line before the freeze
    start, error = None, None
    try:
        with frozen(m._process, request):
            start = time.monotonic()
            try:
                lst.append(1)
            except Exception as exc:
                error = exc
            elapsed = time.monotonic() - start
    finally:
        m.shutdown()
    assert isinstance(error, RemoteObjectError), (error, elapsed)
    assert "did not answer" in str(error), error
    assert elapsed < 15, elapsed
    with lock:
        pass


def test_dead_lock_holder_releases_the_lock(ctx):
    lock, holding = ctx.Lock(), ctx.Event()
    p = ctx.Process(target=D.hold_forever, args=(lock, holding))
    p.start()
    assert holding.wait(TIMEOUT)
    assert lock.acquire(timeout=0.1) is False
    p.kill()
    assert lock.acquire(timeout=TIMEOUT) is True
    p.join(TIMEOUT)


def test_dead_barrier_party_breaks_the_barrier(ctx):
    import threading as th

    barrier = ctx.Barrier(3)
    p = ctx.Process(target=D.wait_forever, args=(barrier,))
    p.start()
    wait_until(lambda: barrier.n_waiting >= 1, "the party to wait at the barrier", TIMEOUT)
    thread, box = _call_in_thread(lambda: barrier.wait(TIMEOUT))
    p.kill()
    thread.join(TIMEOUT)
    assert isinstance(box.get("error"), th.BrokenBarrierError), box
    p.join(TIMEOUT)


def test_wrong_authkey_is_refused_before_unpickling(ctx):
    from fibrl.wire.transport import Channel

    with fibrl.managers.SyncManager(authkey=b"right", ctx=ctx) as m:
        with pytest.raises(AuthenticationError):
            Channel.connect(m.address, b"wrong", 10)
        with pytest.raises(AuthenticationError):
            fibrl.managers.SyncManager(address=m.address, authkey=b"wrong").connect()
        assert m.dict(ok=True)["ok"] is True  # the server is unharmed


EXIT_SCRIPT = """
import sys
import fibrl
from fibrl.managers import AsyncManager, SyncManager

class Calc:
    def add(self, a, b):
        return a + b

class Mgr(AsyncManager):
    pass

Mgr.register("Calc", Calc)

if __name__ == "__main__":
    m = fibrl.Manager()
    d = m.dict()
    d["l"] = m.list([1])
    d["l"].append(2)
    other = SyncManager(authkey=b"another key")
    other.start()
    q = other.Queue()
    q.put(1)
    a = Mgr()
    a.start()
    h = a.Calc().add(1, 2)
    assert h.get(30) == 3
    lock, value = fibrl.Lock(), fibrl.Value("i", 1)
    lock.acquire()
    print("ready", flush=True)
    if sys.argv[1] == "raise":
        raise SystemExit(3)
"""


@pytest.mark.parametrize("how", ["return", "raise"])
def test_exit_without_shutdown_is_clean(tmp_path, how):
    script = tmp_path / "exit_script.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    marker = uuid.uuid4().hex
    env = dict(os.environ, FIBRL_RUN_ID=marker, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, cwd=str(tmp_path))
    assert proc.stdout.strip() == "ready", proc.stderr
    assert proc.returncode == (3 if how == "raise" else 0), proc.stderr
    for bad in ("Traceback", "Exception ignored", "Error", "Fatal"):
        assert bad not in proc.stderr, proc.stderr
    wait_until(lambda: not processes_of_run(marker), "no process of the run to be left", 15)
