"""Managers: SyncManager's proxy types, custom managers, AsyncManager. Runs on every backend.

The stdlib's ``multiprocessing.managers`` is the spec (nested proxies,
``exposed``, ``method_to_typeid``, errors with their own type). Classes and
worker functions are made by ``_defs()`` so they travel by value: a worker
container has no pytest, so it could not import this module.
"""
import multiprocessing
import multiprocessing.pool
import gc
import os
import pickle
import queue
import socket
import threading
import time
import types

import pytest

from conftest import join_all, run_process, wait_until
import fibrl
from fibrl.errors import RemoteObjectError, RemoteTraceback, SerializationError
from fibrl.managers import AsyncManager, BaseManager, HandleTimeout, SyncManager

TIMEOUT = 60


def _defs():
    class Calc:
        def __init__(self, start=0):
            self.total = start

        def add(self, a, b):
            return a + b

        def accumulate(self, x):
            self.total += x
            return self.total

        def sleep(self, seconds):
            time.sleep(seconds)
            return seconds

        def meet(self, arrived, go):
            """Say it is here, then wait in the server until ``go`` is set."""
            arrived.put(os.getpid())   # one server each
            return go.wait(TIMEOUT)

        def fail(self):
            raise KeyError("remote failure")

        def unpicklable(self):
            return threading.Lock()

        def _private(self):
            return "hidden"

    class Store:
        def __init__(self):
            self.calcs = {}

        def calc(self, name):
            return self.calcs.setdefault(name, Calc())

        def names(self):
            return sorted(self.calcs)

    class Exclusive:
        """Records the most calls that ran in it at once."""

        def __init__(self):
            self.inside = self.most = 0
            self.lock = threading.Lock()

        def work(self, seconds):
            with self.lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
            time.sleep(seconds)
            with self.lock:
                self.inside -= 1
            return self.most

    class Recorder:
        """Objects of one name share a log and a gate."""
        logs = {}
        gates = {}

        def __init__(self, name):
            self.log = type(self).logs.setdefault(name, [])
            self.gate = type(self).gates.setdefault(name, threading.Event())

        def hold(self):
            return self.gate.wait(TIMEOUT)

        def open(self):
            self.gate.set()
            return True

        def add(self, item):
            self.log.append(item)
            return len(self.log)

        def seen(self):
            return list(self.log)

        def echo(self, data):
            return data

    def call_exclusive(obj, out):
        """A child's own proxy: its async calls on its own line to the object."""
        out.put([obj.work(0.02).get(TIMEOUT) for _ in range(5)])

    class Gate:
        """Objects of one name share an event (each object has its own lane)."""
        events = {}

        def __init__(self, name):
            self.event = type(self).events.setdefault(name, threading.Event())

        def wait(self, timeout):
            return self.event.wait(timeout)

        def open(self):
            self.event.set()
            return True

    def append_to(lst, item):
        lst.append(item)

    def nested_append(dct, key, item):
        dct[key].append(item)

    def contend(lock, out):
        out.put(lock.acquire(timeout=0.2))

    def release_it(lock):
        lock.release()

    def notify(cond, ns):
        with cond:
            ns.ready = True
            cond.notify_all()

    def set_event(event):
        event.set()

    def barrier_party(barrier, out):
        out.put(barrier.wait(TIMEOUT))

    def consume(q):
        for _ in range(3):
            q.get(timeout=TIMEOUT)
            q.task_done()

    def use_calc(calc, out):
        out.put(calc.add(2, 3))

    def connect_and_use(address, authkey, out):
        manager = SyncManager(address=address, authkey=authkey)
        manager.connect()
        dct = manager.dict(who="child")
        out.put(dct._getvalue())

    def serve(address, authkey):
        SyncManager(address=address, authkey=authkey).get_server().serve_forever()

    def initialize(out):
        out.put("initialized")

    return types.SimpleNamespace(**locals())


D = _defs()


class CalcManager(BaseManager):
    pass


CalcManager.register("Calc", D.Calc)
CalcManager.register("Store", D.Store, method_to_typeid={"calc": "CalcRef"})
CalcManager.register("CalcRef", create_method=False)  # no callable: wraps what calc() returns
CalcManager.register("Adder", D.Calc, exposed=("add",))
CalcManager.register("Hidden", D.Calc, create_method=False)


class AsyncCalcManager(AsyncManager):
    pass


AsyncCalcManager.register("Calc", D.Calc)
AsyncCalcManager.register("Store", D.Store, method_to_typeid={"calc": "CalcRef"})
AsyncCalcManager.register("CalcRef", create_method=False)
AsyncCalcManager.register("Gate", D.Gate)
AsyncCalcManager.register("Exclusive", D.Exclusive)
AsyncCalcManager.register("Recorder", D.Recorder)


@pytest.fixture
def manager(ctx):
    with ctx.Manager() as m:
        yield m


@pytest.fixture
def calcs(ctx):
    with CalcManager(ctx=ctx) as m:
        yield m


# -- SyncManager proxy types -----------------------------------------------------------------------
def test_list_proxy_behaves_like_a_list(manager):
    lst = manager.list([3, 1, 2])
    lst.append(4)
    lst.extend([5])
    lst += [6]
    lst.insert(0, 0)
    assert lst[:] == [0, 3, 1, 2, 4, 5, 6] and len(lst) == 7 and lst[-1] == 6
    lst.sort()
    lst.reverse()
    assert lst.pop() == 0 and lst.index(5) == 1 and lst.count(6) == 1 and 4 in lst
    lst.remove(4)
    del lst[0]
    lst[0] = 9
    assert list(lst) == [9, 3, 2, 1] and lst + [7] == [9, 3, 2, 1, 7]
    lst *= 2
    assert len(lst) == 8 and str(lst) == str([9, 3, 2, 1] * 2)
    assert repr(lst).startswith("<ListProxy object, typeid 'list'")
    with pytest.raises(IndexError):
        lst[100]


def test_dict_proxy_behaves_like_a_dict(manager):
    dct = manager.dict({"a": 1}, b=2)
    dct["c"] = 3
    dct.update(d=4)
    assert dct.keys() == ["a", "b", "c", "d"] and dct.values() == [1, 2, 3, 4]
    assert dct.items()[0] == ("a", 1) and sorted(dct) == ["a", "b", "c", "d"]
    assert dct.get("zz", 0) == 0 and dct.setdefault("e", 5) == 5 and "e" in dct
    assert dct.pop("e") == 5 and len(dct) == 4 and dct.copy() == {"a": 1, "b": 2, "c": 3, "d": 4}
    del dct["d"]
    assert dct.popitem() == ("c", 3)
    with pytest.raises(KeyError):
        dct["missing"]
    dct.clear()
    assert dct._getvalue() == {}


def test_namespace_value_and_array_proxies(manager):
    ns = manager.Namespace(x=1)
    ns.y = 2
    assert (ns.x, ns.y) == (1, 2)
    del ns.x
    with pytest.raises(AttributeError):
        _ = ns.x
    assert str(ns) == "Namespace(y=2)"
    value = manager.Value("i", 3)
    value.value += 1
    assert value.get() == 4 and value.value == 4
    array = manager.Array("i", [1, 2, 3])
    array[0] = 7
    assert len(array) == 3 and array[0] == 7


def test_queue_and_joinable_queue_proxies(ctx, manager):
    q = manager.Queue()
    q.put("x")
    assert q.qsize() == 1 and q.get(timeout=5) == "x" and q.empty()
    with pytest.raises(queue.Empty) as info:
        q.get(timeout=0.1)
    assert type(info.value.__cause__) is multiprocessing.pool.RemoteTraceback
    jq = manager.JoinableQueue()
    p = run_process(ctx, D.consume, jq)
    for i in range(3):
        jq.put(i)
    jq.join()
    join_all(p)


def test_lock_proxies_across_processes(ctx, manager):
    out = ctx.Queue()
    for lock in (manager.Lock(), manager.RLock(), manager.Semaphore(1),
                 manager.BoundedSemaphore(1)):
        assert lock.acquire()
        join_all(run_process(ctx, D.contend, lock, out))
        assert out.get(timeout=TIMEOUT) is False
        lock.release()
        with lock:
            pass
    lock = manager.Lock()
    lock.acquire()
    join_all(run_process(ctx, D.release_it, lock))
    assert lock.acquire(timeout=5)


def test_condition_event_and_barrier_proxies(ctx, manager):
    cond, ns = manager.Condition(), manager.Namespace(ready=False)
    with cond:
        p = run_process(ctx, D.notify, cond, ns)
        assert cond.wait_for(lambda: ns.ready, TIMEOUT)
    join_all(p)
    event = manager.Event()
    assert event.wait(0.05) is False
    join_all(run_process(ctx, D.set_event, event))
    assert event.wait(TIMEOUT) and event.is_set()
    barrier, out = manager.Barrier(2), ctx.Queue()
    assert barrier.parties == 2 and not barrier.broken
    p = run_process(ctx, D.barrier_party, barrier, out)
    assert {barrier.wait(TIMEOUT), out.get(timeout=TIMEOUT)} == {0, 1}
    assert barrier.n_waiting == 0
    join_all(p)


def _connects(client) -> bool:
    try:
        client.connect()
    except RemoteObjectError:   # not listening yet
        return False
    return True


def test_pool_proxy(manager):
    with manager.Pool(2) as pool:
        assert pool.map(abs, [-1, -2, 3]) == [1, 2, 3]
        assert pool.apply_async(divmod, (7, 2)).get(TIMEOUT) == (3, 1)
        assert list(pool.imap(abs, [-4, 5])) == [4, 5]


def test_an_object_the_server_cannot_create_raises_its_own_error(manager):
    """(The stdlib wraps it in managers.RemoteError; a failing method raises its own type
    there too, and fibrl treats both alike: docs/differences.md.)"""
    with pytest.raises(ValueError, match="at least 1") as raised:
        manager.Pool(0)
    assert "Traceback" in str(raised.value.__cause__)
    with pytest.raises(TypeError):
        manager.dict(1, 2, 3)
    assert manager.list([1])[:] == [1]   # the server goes on


# -- nesting, pickling, threads ------------------------------------------------------------------
def test_nested_proxies_behave_as_in_the_stdlib(ctx, manager):
    dct = manager.dict()
    dct["inner"] = manager.list([1])  # the creating proxy is dropped at once
    dct["inner"].append(2)
    join_all(run_process(ctx, D.nested_append, dct, "inner", 3))
    assert dct["inner"][:] == [1, 2, 3]
    outer = manager.list([manager.dict(a=1)])
    outer[0]["b"] = 2
    assert outer[0]._getvalue() == {"a": 1, "b": 2}


def test_proxies_travel_as_arguments_and_through_queues(ctx, manager):
    lst, out = manager.list(), ctx.Queue()
    join_all(run_process(ctx, D.append_to, lst, "from args"))
    q = ctx.Queue()
    q.put(lst)
    received = q.get(timeout=TIMEOUT)
    received.append("via queue")
    assert lst[:] == ["from args", "via queue"]
    with CalcManager(ctx=ctx) as m:
        p = run_process(ctx, D.use_calc, m.Calc(), out)
        assert out.get(timeout=TIMEOUT) == 5
        join_all(p)


def test_blocking_calls_block_only_their_thread(manager):
    barrier, q, got = manager.Barrier(2, timeout=TIMEOUT), manager.Queue(), []
    t = threading.Thread(target=lambda: got.append(barrier.wait()))
    t.start()
    # the server counts the waiter: the thread's call arrived and blocks there
    wait_until(lambda: barrier.n_waiting == 1, "the thread's wait() to block in the server",
               TIMEOUT)
    q.put("item")                   # meanwhile this thread's calls go through
    assert q.get(timeout=TIMEOUT) == "item"
    assert t.is_alive() and not got
    barrier.wait()
    t.join(TIMEOUT)
    assert len(got) == 1 and got[0] in (0, 1)


def test_reference_counting_frees_objects(manager):
    base = manager._number_of_objects()
    lists = [manager.list() for _ in range(5)]
    assert manager._number_of_objects() == base + 5
    del lists
    assert manager._number_of_objects() == base


# -- custom managers -------------------------------------------------------------------------------
def test_custom_manager_registry_options(calcs):
    calc = calcs.Calc(10)
    assert calc.add(1, 2) == 3 and calc.accumulate(5) == 15
    with pytest.raises(AttributeError):
        _ = calc._private
    store = calcs.Store()
    child = store.calc("a")  # method_to_typeid: a proxy, not a copy
    assert child.accumulate(2) == 2 and store.calc("a").accumulate(1) == 3
    assert store.names() == ["a"]
    adder = calcs.Adder()
    assert adder.add(2, 2) == 4
    with pytest.raises(AttributeError, match="not in exposed"):
        adder._callmethod("accumulate", (1,))
    assert not hasattr(calcs, "Hidden") and "Hidden" in CalcManager._registry


def test_remote_errors_keep_their_type_and_traceback(calcs):
    calc = calcs.Calc()
    with pytest.raises(KeyError, match="remote failure") as info:
        calc.fail()
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "def fail" in str(info.value.__cause__) or "in fail" in str(info.value.__cause__)
    with pytest.raises(SerializationError):
        calc.unpicklable()
    assert calc.add(1, 1) == 2  # the line survived both errors


def test_lifecycle_and_initializer(ctx):
    out = ctx.Queue()
    m = CalcManager(ctx=ctx)
    m.start(D.initialize, (out,))
    assert out.get(timeout=TIMEOUT) == "initialized"
    assert m.address.startswith("tcp://")
    assert m._process._popen.job.spec.labels["fibrl.role"] == "manager"
    with pytest.raises(multiprocessing.ProcessError):
        m.start()
    calc = m.Calc()
    m.shutdown()
    assert not m._process.is_alive()
    with pytest.raises(RemoteObjectError):
        calc.add(1, 2)
    with pytest.raises(multiprocessing.ProcessError):
        m.start()
    with pytest.raises(TypeError):
        CalcManager(ctx=ctx).start(initializer=42)


def test_connect_with_authkey_from_another_process(ctx):
    out = ctx.Queue()
    with SyncManager(authkey=b"shared secret", ctx=ctx) as m:
        lst = m.list([1])
        lst.append(2)
        p = run_process(ctx, D.connect_and_use, m.address, b"shared secret", out)
        assert out.get(timeout=TIMEOUT) == {"who": "child"}
        join_all(p)
        assert lst[:] == [1, 2]
        with pytest.raises(fibrl.AuthenticationError):
            SyncManager(address=m.address, authkey=b"wrong").connect()
        with pytest.raises(multiprocessing.AuthenticationError):
            SyncManager(address=m.address, authkey=b"wrong").connect()


def test_connect_by_address_with_tls(ctx, configure):
    """With ``tls=True`` a manager's address is a ``tls+tcp://`` URL; connecting with it,
    or with its ``(host, port)`` or ``"host:port"``, speaks TLS."""
    configure(tls=True)
    with SyncManager(authkey=b"shared secret", ctx=ctx) as m:
        assert m.address.startswith("tls+tcp://")
        shared = m.dict(x=1)
        hostport = m.address.split("://", 1)[1]
        host, port = hostport.rsplit(":", 1)
        for address in (m.address, hostport, (host, int(port))):
            client = SyncManager(address=address, authkey=b"shared secret")
            client.connect()
            assert client.address == m.address
        assert shared["x"] == 1


def test_serve_forever_at_a_fixed_address(ctx):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = run_process(ctx, D.serve, ("127.0.0.1", port), b"fixed")
    try:
        client = SyncManager(address=f"localhost:{port}", authkey=b"fixed")  # another spelling
        wait_until(lambda: _connects(client), f"the manager server on port {port}", TIMEOUT)
        dct = client.dict(x=1)
        dct["inner"] = client.list([1])  # the server knows its own proxy under any address
        dct["inner"].append(2)
        assert dct["x"] == 1 and dct["inner"][:] == [1, 2]
    finally:
        p.terminate()
        p.join(TIMEOUT)


# -- AsyncManager ----------------------------------------------------------------------------------
def test_async_manager_seed_example(ctx):
    m = AsyncCalcManager(ctx=ctx)
    m.start()
    try:
        c = m.Calc()
        assert c.add(1, 2).get() == 3
    finally:
        m.shutdown()


def test_async_handles_in_any_order(ctx):
    with AsyncCalcManager(ctx=ctx) as m:
        fast, slow = m.Calc(), m.Calc()
        h_slow = slow.sleep(0.5)
        handles = [fast.add(i, i) for i in range(20)]
        assert not h_slow.ready()
        assert [h.get(TIMEOUT) for h in reversed(handles)] == [2 * i for i in reversed(range(20))]
        assert h_slow.wait(TIMEOUT) and h_slow.successful() and h_slow.get() == 0.5


def test_async_calls_to_one_object_run_in_order(ctx):
    with AsyncCalcManager(ctx=ctx) as m:
        calc = m.Calc()
        handles = [calc.accumulate(1) for _ in range(50)]
        assert [h.get(TIMEOUT) for h in handles] == list(range(1, 51))
        child = m.Store().calc("x").get(TIMEOUT)
        assert child.add(1, 1).get(TIMEOUT) == 2


def test_async_calls_to_one_object_run_one_at_a_time_whichever_way_they_come(ctx):
    """Calls on the object's own line (this process's and a child's) and calls through
    the hub's connection never overlap in the object."""
    with AsyncCalcManager(ctx=ctx) as m:
        obj = m.Exclusive()
        out = ctx.Queue()
        child = ctx.Process(target=D.call_exclusive, args=(obj, out))
        child.start()
        handles = []
        for _ in range(5):
            handles += [obj.work(0.02), obj._call_async("work", (0.02,))]
        assert max(h.get(TIMEOUT) for h in handles) == 1
        assert max(out.get(timeout=TIMEOUT)) == 1
        child.join(TIMEOUT)
        assert child.exitcode == 0
        assert obj.work(0).get(TIMEOUT) == 1


def test_proxies_of_one_object_share_its_line_and_keep_their_order(ctx):
    with AsyncCalcManager(ctx=ctx) as m:
        calc = m.Calc()
        twin = pickle.loads(pickle.dumps(calc))   # a second proxy of the same object
        handles = [p.accumulate(1) for _ in range(25) for p in (calc, twin)]
        assert [h.get(TIMEOUT) for h in handles] == list(range(1, 51))
        assert twin._object_line is calc._object_line is not None


def test_objects_past_the_line_limit_go_through_the_hub(ctx, monkeypatch):
    from fibrl.managers import proxies

    monkeypatch.setattr(proxies, "OBJECT_LINES", 2)
    with AsyncCalcManager(ctx=ctx) as m:
        calcs = [m.Calc() for _ in range(3)]
        assert [c.add(i, 1).get(TIMEOUT) for i, c in enumerate(calcs)] == [1, 2, 3]
        assert [c._object_line is not None for c in calcs] == [True, True, False]
        assert calcs[2]._on_hub is not None
        assert [h.get(TIMEOUT) for h in [c.accumulate(2) for c in calcs]] == [2, 2, 2]


def _first_calls_at_once(calcs: list) -> list:
    """``add(1, 1)`` on each proxy, each from a thread of its own, all let go at once."""
    start = threading.Barrier(len(calcs))

    def first_call(calc):
        start.wait(TIMEOUT)
        return calc.add(1, 1).get(TIMEOUT)

    with multiprocessing.pool.ThreadPool(len(calcs)) as threads:
        return threads.map(first_call, calcs)


def test_the_line_limit_holds_when_threads_connect_at_once(ctx, monkeypatch):
    from fibrl.managers import proxies

    monkeypatch.setattr(proxies, "OBJECT_LINES", 2)
    with AsyncCalcManager(ctx=ctx) as m:
        calcs = [m.Calc() for _ in range(8)]
        assert _first_calls_at_once(calcs) == [2] * len(calcs)
        assert sum(c._object_line is not None for c in calcs) == 2


def test_twin_proxies_connecting_at_once_below_the_limit_share_one_line(ctx, monkeypatch):
    from fibrl.managers import proxies

    monkeypatch.setattr(proxies, "OBJECT_LINES", 2)
    with AsyncCalcManager(ctx=ctx) as m:
        other = m.Calc()
        assert other.add(1, 1).get(TIMEOUT) == 2          # one of the two lines
        calc = m.Calc()
        twins = [calc] + [pickle.loads(pickle.dumps(calc)) for _ in range(3)]
        assert _first_calls_at_once(twins) == [2] * len(twins)
        assert all(p._on_hub is None for p in twins)
        assert len({id(p._object_line) for p in twins}) == 1


def test_an_object_on_the_hub_keeps_all_its_proxies_there(ctx, monkeypatch):
    """A proxy that went through the hub (past the limit) keeps the object's other
    proxies there, even once a line is free: their calls stay in one order."""
    from fibrl.managers import proxies

    monkeypatch.setattr(proxies, "OBJECT_LINES", 1)
    with AsyncCalcManager(ctx=ctx) as m:
        first, calc = m.Calc(), m.Calc()
        assert first.add(1, 1).get(TIMEOUT) == 2          # the one line
        handles = [calc.accumulate(1) for _ in range(10)]  # through the hub
        assert calc._on_hub is not None
        del first
        gc.collect()
        wait_until(lambda: not any(line.usable
                                   for line in proxies._object_lines._lines.values()),
                   "the first object's line to close")
        twin = pickle.loads(pickle.dumps(calc))
        handles += [p.accumulate(1) for _ in range(10) for p in (twin, calc)]
        assert [h.get(TIMEOUT) for h in handles] == list(range(1, 31))
        assert twin._object_line is None and twin._on_hub is calc._on_hub


def test_a_hub_call_still_running_keeps_its_object_on_the_hub(ctx, monkeypatch):
    """The last proxy on the hub and its handles are dropped while its calls still wait
    in the server: a twin that calls then goes through the hub too, after them."""
    from fibrl.managers import proxies

    monkeypatch.setattr(proxies, "OBJECT_LINES", 1)
    with AsyncCalcManager(ctx=ctx) as m:
        first = m.Calc()
        assert first.add(1, 1).get(TIMEOUT) == 2          # the one line
        rec = m.Recorder("hub-held")
        twin = pickle.loads(pickle.dumps(rec))
        rec.hold()                                         # through the hub; blocks the object
        rec.add(1)
        assert rec._on_hub is not None
        del first, rec
        gc.collect()
        wait_until(lambda: not any(line.usable
                                   for line in proxies._object_lines._lines.values()),
                   "the first object's line to close")
        twin.add(2)
        assert twin._on_hub is not None and twin._object_line is None
        assert m.Recorder("hub-held").open().get(TIMEOUT) is True
        wait_until(lambda: twin.seen().get(TIMEOUT) == [1, 2], "both calls to run")


def test_an_async_call_carries_the_decrefs_of_dropped_proxies(ctx):
    with AsyncCalcManager(ctx=ctx) as m:
        keep, drop = m.Calc(), m.Calc()
        assert keep.add(1, 1).get(TIMEOUT) == 2
        base = m._number_of_objects()
        del drop
        gc.collect()
        assert keep.add(2, 2).get(TIMEOUT) == 4   # the decref rides on this call
        assert m._number_of_objects() == base - 1


def test_calls_sent_without_waiting_run_before_their_dropped_proxy_releases_the_object(ctx):
    """A proxy dropped with calls still queued behind a blocked one: they all run,
    and only then is the object released (its decref travels after them)."""
    with AsyncCalcManager(ctx=ctx) as m:
        base = m._number_of_objects()
        rec = m.Recorder("dropped")
        rec.hold()                    # blocks the object until opened
        for i in range(20):
            rec.add(i)                # handles dropped unread
        del rec
        gc.collect()
        assert m.Calc().add(1, 1).get(TIMEOUT) == 2   # pending decrefs ride on calls
        opener = m.Recorder("dropped")
        assert opener.open().get(TIMEOUT) is True
        wait_until(lambda: opener.seen().get(TIMEOUT) == list(range(20)),
                   "the dropped proxy's calls to run")
        wait_until(lambda: m._number_of_objects() == base + 1,   # (opener)
                   "the dropped proxy's object to be released")


def test_a_proxy_made_while_its_twin_is_released_keeps_the_order_of_calls(ctx):
    """A collected proxy's line is retiring (its decref queued behind its calls) when a
    second proxy of the same object calls: that call goes after them, on that line."""
    with AsyncCalcManager(ctx=ctx) as m:
        rec = m.Recorder("order")
        twin = pickle.loads(pickle.dumps(rec))
        rec.hold()                    # blocks the object until opened
        rec.add(1)
        line = rec._object_line
        del rec
        gc.collect()
        wait_until(lambda: line.retiring, "the collected proxy's line to retire")
        twin.add(2)
        assert m.Recorder("order").open().get(TIMEOUT) is True
        wait_until(lambda: twin.seen().get(TIMEOUT) == [1, 2], "both calls, in order")
        assert twin._object_line is line and not line.closed


def test_one_handle_waited_by_several_threads_and_a_callback(ctx):
    with AsyncCalcManager(ctx=ctx) as m:
        calc = m.Calc()
        handle = calc.sleep(0.2)
        called = []
        handle.add_done_callback(lambda h: called.append(h.get(0)))
        results = []
        threads = [threading.Thread(target=lambda: results.append(handle.get(TIMEOUT)))
                   for _ in range(3)]
        for t in threads:
            t.start()
        assert handle.get(TIMEOUT) == 0.2
        for t in threads:
            t.join(TIMEOUT)
        assert results == [0.2] * 3
        wait_until(lambda: called == [0.2], "the callback to run")
        assert handle.successful() and handle.ready()


def test_polling_a_handle_with_no_timeout_sees_its_result(ctx):
    with AsyncCalcManager(ctx=ctx) as m:
        handle = m.Calc().add(1, 2)
        wait_until(lambda: handle.wait(0), "the result to be seen by wait(0)")
        assert handle.successful() and handle.get(0) == 3
        failing = m.Calc().fail()
        wait_until(failing.ready, "the failure to come back")
        assert not failing.successful()
        with pytest.raises(KeyError):
            failing.get(0)


def test_a_large_burst_sent_before_any_result_is_read_completes(ctx):
    """Calls and results of 512 KiB each, 64 of them in flight before the first is
    read (32 MiB each way: more than the connection holds): neither side's sends may
    wait forever for the other to read."""
    with AsyncCalcManager(ctx=ctx) as m:
        rec = m.Recorder("burst")
        data = [bytes([i]) * (512 * 1024) for i in range(64)]
        handles = [rec.echo(d) for d in data]
        assert all(h.get(TIMEOUT) == d for h, d in zip(handles, data))


def test_a_reply_read_by_another_thread_reaches_its_caller(ctx):
    """A thread that waits for a later call reads the object's line; a reply it reads
    for an earlier call is taken by that call's caller at once, not after the later
    call ends."""
    with AsyncCalcManager(ctx=ctx) as m:
        gate, opener = m.Gate("reader"), m.Gate("reader")
        quick = gate.wait(0)
        blocked = gate.wait(TIMEOUT)
        reader = threading.Thread(target=blocked.get, args=(TIMEOUT,))
        reader.start()
        wait_until(lambda: gate._object_line._reading.locked(), "the thread to read the line")
        assert quick.get(10) is False
        assert opener.open().get(10) is True
        reader.join(TIMEOUT)
        assert blocked.get(0) is True


def test_a_pipelined_reply_is_not_held_back_by_a_slow_call_behind_it(ctx):
    """Replies of a burst share frames, but one that is ready is never kept waiting for
    the slow call queued after it on the same object."""
    with AsyncCalcManager(ctx=ctx) as m:
        calc = m.Calc()
        quick = [calc.add(i, 1) for i in range(30)]
        slow = calc.sleep(3.0)
        assert [h.get(1.5) for h in quick] == [i + 1 for i in range(30)]
        assert not slow.ready()
        assert slow.get(TIMEOUT) == 3.0


def test_a_blocking_async_call_does_not_hold_up_the_calls_behind_it(ctx):
    """A lone call runs in the server thread that read it; once it has run for a moment,
    another thread reads that connection, so the call that unblocks it gets through."""
    with AsyncCalcManager(ctx=ctx) as m:
        waiting, opener = m.Gate("g"), m.Gate("g")
        blocked = waiting.wait(TIMEOUT)
        time.sleep(0.2)   # the wait has started: it holds the thread that read it
        assert opener.open().get(10) is True
        assert blocked.get(10) is True
        assert [waiting.wait(0).get(10) for _ in range(3)] == [True] * 3


def test_four_managers_overlap(ctx):
    """Calls to four managers are in their servers at the same time: each waits there
    until all four have arrived (one after the other, the first would wait forever)."""
    managers = [AsyncCalcManager(ctx=ctx) for _ in range(4)]
    try:
        for m in managers:
            m.start()
        calcs = [m.Calc() for m in managers]
        arrived, go = ctx.Queue(), ctx.Event()
        handles = [c.meet(arrived, go) for c in calcs]
        assert len({arrived.get(timeout=TIMEOUT) for _ in calcs}) == 4
        assert not any(h.ready() for h in handles)
        go.set()
        assert [h.get(TIMEOUT) for h in handles] == [True] * 4
    finally:
        for m in managers:
            m.shutdown()


@pytest.mark.timing
@pytest.mark.alone   # a timing: four 1 s calls in under 2 s
def test_four_managers_overlap_in_time(ctx):
    managers = [AsyncCalcManager(ctx=ctx) for _ in range(4)]
    try:
        for m in managers:
            m.start()
        calcs = [m.Calc() for m in managers]
        start = time.monotonic()
        assert calcs[0].sleep(1.0).get(TIMEOUT) == 1.0
        one = time.monotonic() - start     # one call alone, on this host, now
        start = time.monotonic()
        handles = [c.sleep(1.0) for c in calcs]
        assert [h.get(TIMEOUT) for h in handles] == [1.0] * 4
        # one after the other would take 4 x one
        assert time.monotonic() - start < 2 * one, (time.monotonic() - start, one)
    finally:
        for m in managers:
            m.shutdown()


def test_async_errors_and_timeouts(ctx):
    with AsyncCalcManager(ctx=ctx) as m:
        calc = m.Calc()
        with pytest.raises(KeyError, match="remote failure") as info:
            calc.fail().get(TIMEOUT)
        assert isinstance(info.value.__cause__, RemoteTraceback)
        handle = calc.sleep(0.5)
        with pytest.raises(HandleTimeout) as timeout:
            handle.get(0.05)
        assert isinstance(timeout.value, TimeoutError)
        assert isinstance(timeout.value, multiprocessing.TimeoutError)
        assert handle.get(TIMEOUT) == 0.5
        done = threading.Event()
        calc.add(1, 1).add_done_callback(lambda h: done.set())
        assert done.wait(TIMEOUT)


def test_failing_initializer_is_reported(ctx):
    def bad_initializer():
        raise ValueError("initializer failed")

    with pytest.raises(ValueError, match="initializer failed") as info:
        CalcManager(ctx=ctx).start(bad_initializer)
    assert isinstance(info.value.__cause__, RemoteTraceback)


def test_pipelined_calls_keep_each_reply_for_its_caller(calcs):
    """Calls in flight together on a proxy's own line: a reply read while waiting for
    another is kept for its caller, a dropped handle's is discarded, a timeout leaves
    the call pending, a remote error keeps its type."""
    calc = calcs.Calc()
    # long enough that it is still running after the timed-out get on a loaded machine
    slow, dropped = calc._call_pipelined("sleep", (3.0,)), calc._call_pipelined("add", (1, 2))
    last = calc._call_pipelined("add", (3, 4))
    with pytest.raises(HandleTimeout):
        slow.get(timeout=0.05)
    assert not slow.ready()
    del dropped
    assert last.get(timeout=TIMEOUT) == 7               # read past the other two
    assert slow.get(timeout=TIMEOUT) == 3.0 and slow.ready()
    with pytest.raises(KeyError, match="remote failure"):
        calc._call_pipelined("fail").get(timeout=TIMEOUT)
    assert calc.add(5, 6) == 11                         # the thread's own line is apart
    assert not calc._line._kept and not calc._line._awaited


def test_a_sync_proxy_call_is_one_request_and_one_reply(monkeypatch):
    """Nothing else rides on a sync call's path: one frame out and one back, on the
    caller's own line (no acknowledgement, no ping, no separate decref message)."""
    from fibrl.wire import transport

    counts = {"send": 0, "recv": 0}
    with fibrl.Manager() as manager:
        items = manager.list(range(5))
        assert len(items) == 5          # the line is connected; setup traffic is over
        for name in counts:
            orig = getattr(transport.Channel, name)

            def counted(self, *args, _orig=orig, _name=name, **kw):
                counts[_name] += 1
                return _orig(self, *args, **kw)
            monkeypatch.setattr(transport.Channel, name, counted)
        for _ in range(50):
            assert len(items) == 5
        monkeypatch.undo()
    assert counts == {"send": 50, "recv": 50}
