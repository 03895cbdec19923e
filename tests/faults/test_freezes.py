"""Freezes: a process stopped (SIGSTOP) and later resumed (SIGCONT), on the local backend.

A frozen process closes no socket and answers nothing: it looks like a machine or a
network gone, until it comes back. What must hold:

* a pool worker frozen inside a task, past ``parent_timeout``, is declared lost: its
  task runs on another worker and its result is delivered once; resumed, the stale
  worker's late result is dropped and the worker exits by itself (nobody kills it);
* a Queue consumer frozen while it holds a window of pushed-ahead items: the others
  go on with the rest, and after it resumes every one of 3,000 items was taken
  exactly once; frozen past ``parent_timeout`` while the others wait, its window's
  items go to them (its connection is cut, as if its process were gone), and once
  resumed it exits by itself;
* a manager server frozen for less than ``parent_timeout``: a call made meanwhile
  waits, then succeeds, and so does a call that was inside the server;
* the parent itself frozen for less than ``parent_timeout``: its pool workers carry
  on (same processes, exact results); for longer: they exit by themselves, and once
  resumed the parent finishes its map with new workers, each result delivered once.

Each fault is injected once the process is known to be where it matters (a task
reported that it started, the owner shows a window held), and the test checks that
the fault did happen (the process was stopped, the loss was counted).
"""
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from conftest import checkout_env, deliveries_of, freeze, kills_of, thaw, wait_until

import fibrl.hosting.hub
from fibrl.managers import SyncManager

TIMEOUT = 120   # only reached on a hang
pytestmark = pytest.mark.timeout(300)


def _stopped(pid):
    return psutil.Process(pid).status() == psutil.STATUS_STOPPED


# -- a pool worker -----------------------------------------------------------------------

def stall_first_run(token, started, release, finished):
    """The first run (it takes the token) reports its pid, then waits for ``release``;
    a rerun returns at once. Each says which run it was."""
    try:
        token.get_nowait()
    except queue.Empty:
        return ("rerun", os.getpid())
    started.put(os.getpid())
    while not release.wait(0.05):
        pass
    finished.put(os.getpid())
    return ("first", os.getpid())


def square(x):
    return x * x


@pytest.fixture
def local(configure):
    """The local backend with short heartbeats: a frozen process is found in seconds."""
    return configure(backend="local", heartbeat_interval=0.5, parent_timeout=5.0)


def test_frozen_pool_worker_is_replaced_and_its_late_result_dropped(local):
    token, started, finished = fibrl.Queue(), fibrl.Queue(), fibrl.Queue()
    release = fibrl.Event()
    token.put("first")
    with fibrl.Pool(2, max_task_retries=1) as pool:
        service = pool._engine.service
        kills = kills_of(pool)
        result = pool.apply_async(stall_first_run, (token, started, release, finished))
        deliveries = deliveries_of(result)
        frozen = started.get(timeout=TIMEOUT)        # the first run is inside the task
        freeze(frozen)
        try:
            run, pid = result.get(TIMEOUT)
            assert (run, pid != frozen) == ("rerun", True)
            assert _stopped(frozen), "the worker was not frozen all along"
            assert service.stats["lost"] == 1 and service.stats["requeued"] == 1
            release.set()
        finally:
            thaw(frozen)
        assert finished.get(timeout=TIMEOUT) == frozen   # the stale run went on to its end
        try:
            gone, alive = psutil.wait_procs([psutil.Process(frozen)], timeout=TIMEOUT)
        except psutil.NoSuchProcess:
            alive = []   # it exited, and was reaped, already
        assert not alive, "the stale worker did not exit by itself"
        assert kills == [], "the stale worker was killed rather than left to exit"
        assert len(deliveries) == 1, deliveries      # its late result was dropped
        assert result.get(0) == (run, pid)
        assert pool.map(square, range(20), chunksize=1) == [x * x for x in range(20)]


# -- a Queue consumer ----------------------------------------------------------------------

def consume_until_none(q, results, started):
    """Take items until a None; report them all at the end (so nothing is reported twice
    by a consumer that stalls between a get() and its report). A consumer that starts
    late may find a None first."""
    got = []
    item = q.get(timeout=TIMEOUT)
    started.put(os.getpid())
    while item is not None:
        got.append(item)
        item = q.get(timeout=TIMEOUT)
    results.put(got)


def _victim_and_others(total: int, victim_target) -> tuple:
    """A queue of ``total`` items; the victim consumer started on it, and two others to
    start later; ``(queue, results, started, victim, others)``."""
    q, results, started = fibrl.Queue(), fibrl.Queue(), fibrl.Queue()
    for i in range(total):
        q.put(i)
    victim = fibrl.Process(target=victim_target, args=(q, results, started))
    victim.start()
    others = [fibrl.Process(target=consume_until_none, args=(q, results, started))
              for _ in range(2)]
    return q, results, started, victim, others


def _held_in_windows(q) -> int:
    return fibrl.hosting.hub.get_hub().service(q._oid)._held


def test_frozen_queue_consumer_holding_a_window_loses_and_repeats_nothing(configure):
    # parent_timeout well above the freeze: the consumer must come back, not give up
    configure(backend="local", heartbeat_interval=0.5, parent_timeout=120.0)
    total = 3000
    q, results, started, victim, others = _victim_and_others(total, consume_until_none)
    try:
        assert started.get(timeout=TIMEOUT) == victim.pid
        wait_until(lambda: _held_in_windows(q) >= 1, "items pushed ahead to the consumer")
        freeze(victim.pid)
        try:
            held = _held_in_windows(q)
            assert held >= 1, "the consumer held no window when it froze"
            for p in others:
                p.start()
            # the others take everything the frozen one does not hold
            wait_until(lambda: q.qsize() == _held_in_windows(q),
                       "the others to drain all but the frozen consumer's window", TIMEOUT)
            assert _stopped(victim.pid)
        finally:
            thaw(victim.pid)
        for _ in range(3):
            q.put(None)
        got = [item for _ in range(3) for item in results.get(timeout=TIMEOUT)]
        for p in [victim] + others:
            p.join(TIMEOUT)
            assert p.exitcode == 0
    finally:
        for p in [victim] + others:
            if p.is_alive():
                p.kill()
                p.join(TIMEOUT)
    assert len(got) == total, f"{len(got) - len(set(got))} duplicates, " \
                              f"{total - len(set(got))} missing"
    assert sorted(got) == list(range(total))
    assert q.qsize() == 0


def take_one_then_hold(q, results, started):
    """Take one item, report it, then hold the window pushed ahead to this consumer
    without taking more (until the process ends)."""
    results.put([q.get(timeout=TIMEOUT)])
    started.put(os.getpid())
    time.sleep(TIMEOUT)


def test_queue_consumer_frozen_past_parent_timeout_hands_its_window_to_the_others(configure):
    limit = 3.0
    configure(backend="local", heartbeat_interval=0.5, parent_timeout=limit)
    total = 500
    q, results, started, victim, others = _victim_and_others(total, take_one_then_hold)
    try:
        assert started.get(timeout=TIMEOUT) == victim.pid
        (first,) = results.get(timeout=TIMEOUT)   # what the victim took
        wait_until(lambda: _held_in_windows(q) >= 1, "items pushed ahead to the consumer")
        freeze(victim.pid)
        try:
            assert _stopped(victim.pid)
            held = _held_in_windows(q)
            assert held >= 1, "the consumer held no window when it froze"
            for p in others:
                p.start()
            # Everything, the frozen consumer's window included, is taken by the others
            # once its recall stays unanswered for parent_timeout; without the cut this
            # waits until the freeze ends.
            wait_until(lambda: q.qsize() == 0 and _held_in_windows(q) == 0,
                       "the frozen consumer's window to go to the others", 15 * limit)
            assert _stopped(victim.pid), "the consumer was resumed before the check"
        finally:
            thaw(victim.pid)
        victim.join(TIMEOUT)   # its connection to its parent was cut: it ends by itself
        assert victim.exitcode == 255
        for _ in others:
            q.put(None)
        got = [first] + [item for _ in others for item in results.get(timeout=TIMEOUT)]
        for p in others:
            p.join(TIMEOUT)
            assert p.exitcode == 0
    finally:
        for p in [victim] + others:
            if p.is_alive():
                p.kill()
                p.join(TIMEOUT)
    assert sorted(set(got)) == list(range(total)), f"{total - len(set(got))} missing"
    twice = sorted(item for item in set(got) if got.count(item) > 1)
    # only what the frozen consumer returned from get() may come again (its
    # acknowledgement may not have reached the owner before the cut)
    assert set(twice) <= {first} and all(got.count(item) <= 2 for item in twice), twice


# -- a manager server ----------------------------------------------------------------------

class Gate:
    """A method that waits in the server until released (so a freeze can find it inside)."""

    def pass_through(self, arrived, release, value):
        arrived.set()
        release.wait(TIMEOUT)
        return value


class GateManager(SyncManager):
    pass


GateManager.register("Gate", Gate)


def test_frozen_manager_server_makes_calls_wait_then_succeed(configure):
    configure(backend="local", heartbeat_interval=0.5, parent_timeout=60.0)
    with GateManager() as m:
        d, gate = m.dict(), m.Gate()
        arrived, release = fibrl.Event(), fibrl.Event()
        d["before"] = 1             # connected while it answers
        box = {}
        inside = threading.Thread(target=lambda: box.update(
            inside=gate.pass_through(arrived, release, "inside")), daemon=True)
        inside.start()
        assert arrived.wait(TIMEOUT), "the call never reached the server"
        server = m._process.pid
        freeze(server)
        try:
            release.set()           # the method may return, but its server is stopped
            later = threading.Thread(target=lambda: box.update(later=d.setdefault("x", 7)),
                                     daemon=True)
            later.start()
            later.join(1.0)
            inside.join(0.1)
            assert later.is_alive() and inside.is_alive(), box  # both wait for the server
            assert _stopped(server)
        finally:
            thaw(server)
        later.join(TIMEOUT)
        inside.join(TIMEOUT)
        assert box == {"inside": "inside", "later": 7}
        assert d.copy() == {"before": 1, "x": 7}


# -- the parent ----------------------------------------------------------------------------

PARENT = textwrap.dedent("""
    import os, sys, time
    import fibrl

    def task(x, where):
        pid = os.getpid()
        with open(os.path.join(where, "log"), "a") as log:
            log.write(f"start {pid} {x}\\n")
        while not os.path.exists(os.path.join(where, "go")):
            time.sleep(0.02)
        with open(os.path.join(where, "log"), "a") as log:
            log.write(f"end {pid} {x}\\n")
        return x * x, pid

    if __name__ == "__main__":
        where = sys.argv[2]
        fibrl.init(backend="local", heartbeat_interval=0.5, parent_timeout=float(sys.argv[1]))
        with fibrl.Pool(2) as pool:
            outcomes = pool.starmap_async(task, [(x, where) for x in range(6)], 1).get(600)
        with open(os.path.join(where, "result"), "w") as out:
            out.write(repr(outcomes))
""")


def _log(where):
    try:
        with open(os.path.join(where, "log")) as log:
            return [line.split() for line in log.read().splitlines()]
    except FileNotFoundError:
        return []


def _run_parent(tmp_path, parent_timeout):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = checkout_env()
    with open(tmp_path / "stderr", "w") as err:
        return subprocess.Popen([sys.executable, str(script), str(parent_timeout),
                                 str(tmp_path)], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)


def _workers_inside_tasks(tmp_path):
    """The pids of the two workers, once each is inside a task."""
    def started():
        pids = {int(pid) for kind, pid, _ in _log(tmp_path) if kind == "start"}
        return pids if len(pids) == 2 else None
    return wait_until(started, "both workers to be inside a task", TIMEOUT)


def _finish(proc, tmp_path):
    try:
        proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            thaw(proc.pid)
            proc.kill()
            proc.wait(TIMEOUT)
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 0, err[-5000:]
    outcomes = eval((tmp_path / "result").read_text())
    assert [value for value, _ in outcomes] == [x * x for x in range(6)], outcomes
    return outcomes, err


def test_parent_frozen_shorter_than_parent_timeout_keeps_its_workers(tmp_path):
    proc = _run_parent(tmp_path, parent_timeout=30)
    try:
        workers = _workers_inside_tasks(tmp_path)
        freeze(proc.pid)
        frozen_at = time.monotonic()
        try:
            (tmp_path / "go").touch()
            # the workers go on with their tasks while the parent is stopped
            wait_until(lambda: {int(p) for k, p, _ in _log(tmp_path) if k == "end"} == workers,
                       "the workers to finish their tasks", TIMEOUT)
            # several heartbeats missed (0.5 s apart), far from parent_timeout (30 s)
            time.sleep(max(0.0, 3.0 - (time.monotonic() - frozen_at)))
            assert _stopped(proc.pid)
            assert all(psutil.pid_exists(pid) for pid in workers)
        finally:
            thaw(proc.pid)
        outcomes, err = _finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
    assert {pid for _, pid in outcomes} <= workers, (outcomes, workers)  # no replacement
    assert "did not answer" not in err, err[-5000:]


def test_parent_frozen_past_parent_timeout_loses_its_workers_once(tmp_path):
    proc = _run_parent(tmp_path, parent_timeout=3)
    try:
        workers = _workers_inside_tasks(tmp_path)
        freeze(proc.pid)
        try:
            # they exit by themselves: nothing else could end them, their parent is stopped
            _, alive = psutil.wait_procs([psutil.Process(pid) for pid in workers],
                                         timeout=TIMEOUT)
            assert not alive, "workers outlived a parent frozen past parent_timeout"
            assert _stopped(proc.pid)
            (tmp_path / "go").touch()
        finally:
            thaw(proc.pid)
        outcomes, err = _finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
    assert "did not answer a heartbeat" in err, err[-5000:]
    ends = [(int(pid), int(x)) for kind, pid, x in _log(tmp_path) if kind == "end"]
    # each task ended once, never in a worker that had given its parent up
    assert sorted(x for _, x in ends) == list(range(6)), ends
    assert not {pid for pid, _ in ends} & workers, (ends, workers)
    assert not {pid for _, pid in outcomes} & workers, outcomes


# -- the parent's own stalls do not make its workers look frozen ----------------------------

class _Clock:
    """A clock the test moves. Given to the module under test as its ``time`` alone:
    patching ``time.monotonic`` itself would move the clock of every thread of this
    process, and its real timer thread, told that a deadline is hours away, would
    sleep through the deadlines of the tests that follow."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class _Timers:
    """Runs nothing by itself: the test fires the due entries, as a late timer thread would."""

    def __init__(self):
        self.entries = []

    def call_at(self, when, fn, blocking=False):
        entry = [when, fn]
        self.entries.append(entry)
        return entry

    @staticmethod
    def cancel(entry):
        entry[1] = None

    def fire(self, now):
        due = [e for e in self.entries if e[0] <= now and e[1] is not None]
        self.entries = [e for e in self.entries if e not in due]
        for _, fn in due:
            fn()


@pytest.mark.timeout(60)
def test_liveness_reports_a_silent_worker_but_not_after_its_own_stall(monkeypatch):
    """A worker silent past parent_timeout is reported once; a check that runs late
    (this process was stopped or starved) reports nobody: nothing could be heard."""
    from types import SimpleNamespace

    from fibrl.pool import liveness

    clock, timers, silent = _Clock(), _Timers(), []
    monkeypatch.setattr(liveness, "time", SimpleNamespace(monotonic=clock))   # (its clock alone)
    watch = liveness.Liveness(lambda wid, seconds: silent.append((wid, round(seconds))))
    watch.start(timers, SimpleNamespace(heartbeat_interval=1.0, parent_timeout=5.0))
    watch.watch(1)
    watch.watch(2)

    def run_until(end, beating):
        while clock.now < end:
            clock.now += 1.0
            for wid in beating:
                watch.heard(wid)
            timers.fire(clock.now)

    run_until(104, beating=(1, 2))
    clock.now += 30.0                 # the process stalls: no check, nothing heard
    timers.fire(clock.now)
    assert silent == []
    run_until(clock.now + 4, beating=(1,))
    assert silent == []               # worker 2 silent for 4 s only, counting from the stall
    run_until(clock.now + 3, beating=(1,))
    assert silent == [(2, 6)]         # reported once, then no longer watched
    run_until(clock.now + 10, beating=(1,))
    assert silent == [(2, 6)]
    watch.stop()
    assert all(fn is None for _, fn in timers.entries)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arriving, lost_at", [(0.0, 5.0), (20.0, 25.0)])
def test_a_worker_keeps_its_parent_while_a_large_frame_from_it_arrives(monkeypatch, arriving,
                                                                        lost_at):
    """The worker's heartbeat: a ping unanswered for parent_timeout loses the parent,
    unless bytes kept arriving on the connection (the answer waits behind a large frame);
    then the parent is lost parent_timeout after the last of them."""
    from types import SimpleNamespace

    from fibrl import bootstrap

    clock, timers, lost = _Clock(), _Timers(), []
    monkeypatch.setattr(bootstrap, "time", SimpleNamespace(monotonic=clock))   # (its clock alone)
    monkeypatch.setattr(bootstrap, "_parent_lost", lambda reason: lost.append(clock.now))
    start = clock.now
    channel = SimpleNamespace(silence=lambda: max(0.0, clock.now - (start + arriving)))
    client = SimpleNamespace(channel=channel,
                             call=lambda *a, **k: SimpleNamespace(ready=lambda: False))
    bootstrap._Heartbeat(timers, client, 1.0, 5.0, threading.Event())
    while not lost and clock.now < start + 60:
        clock.now += 0.5
        timers.fire(clock.now)
    assert lost and lost[0] - start == pytest.approx(1.0 + lost_at, abs=1.0)
