"""``fibrl.supervisor``: one mechanism starts, watches and replaces the workers of a Pool
and of a RemoteVectorEnv; the policy is the owner's."""
import os
import threading
import time

import pytest

import fibrl
from fibrl.supervisor import Policy, Supervisor, _kill


def _exit_with(code):
    os._exit(code)


def _sleep():
    time.sleep(120)


class Recorder(Policy):
    """Starts ``wanted`` workers at first; ``more()`` queues one more start."""

    def __init__(self, wanted: int, done_after: int):
        self.lock = threading.Lock()
        self.todo = list(range(wanted))
        self.next_id = wanted
        self.done_after = done_after
        self.started_ids, self.lost, self.failed = [], {}, {}
        self.changed = threading.Condition(self.lock)

    def more(self) -> None:
        with self.lock:
            self.todo.append(self.next_id)
            self.next_id += 1

    def reserve_workers(self):
        with self.lock:
            todo, self.todo = self.todo, []
        return todo

    def finished(self):
        with self.lock:
            return len(self.lost) + len(self.failed) >= self.done_after

    def started(self, wid, process):
        with self.lock:
            self.started_ids.append(wid)
            self.changed.notify_all()

    def lose(self, wid, exitcode, detail="", load_error=""):
        with self.lock:
            self.lost[wid] = exitcode
            self.changed.notify_all()

    def start_failed(self, wid, exc):
        with self.lock:
            self.failed[wid] = exc
            self.changed.notify_all()

    def wait_for(self, predicate, timeout=60.0):
        with self.lock:
            assert self.changed.wait_for(lambda: predicate(self), timeout), \
                f"started {self.started_ids}, lost {self.lost}, failed {self.failed}"


def test_each_worker_end_reaches_the_policy_with_its_exit_code():
    policy = Recorder(wanted=3, done_after=3)
    group = Supervisor(fibrl.get_context(), policy,
                       lambda wid: {"target": _exit_with, "args": (wid,)}, "test-group")
    group.start()
    assert group.join(120)
    assert policy.lost == {0: 0, 1: 1, 2: 2}
    assert sorted(policy.started_ids) == [0, 1, 2]


def test_a_killed_worker_is_reported_and_its_replacement_starts_when_asked():
    policy = Recorder(wanted=2, done_after=4)
    group = Supervisor(fibrl.get_context(), policy, lambda wid: {"target": _sleep}, "test-group")
    group.start()
    try:
        policy.wait_for(lambda p: len(p.started_ids) == 2)
        group.kill(0)
        policy.wait_for(lambda p: 0 in p.lost)
        assert policy.lost[0] == -9
        policy.more()
        group.wake()
        policy.wait_for(lambda p: 2 in p.started_ids)
        assert {p.is_alive() for p in group.processes()} == {True}
        assert len(group.processes()) == 2
    finally:
        group.terminate()
        assert group.join(60)
    assert policy.lost == {0: -9, 1: -9, 2: -9}


def test_a_refused_start_reaches_the_policy():
    policy = Recorder(wanted=1, done_after=1)
    group = Supervisor(fibrl.get_context(), policy,
                       lambda wid: {"target": _sleep, "backend": "no-such-backend"},
                       "test-group")
    group.start()
    assert group.join(60)
    assert list(policy.failed) == [0] and "no-such-backend" in str(policy.failed[0])
    assert policy.lost == {}


def test_a_start_the_policy_no_longer_wants_is_not_made():
    class Fewer(Recorder):
        def still_wanted(self, wid):
            return wid < 2

    policy = Fewer(wanted=4, done_after=2)
    group = Supervisor(fibrl.get_context(), policy,
                       lambda wid: {"target": _exit_with, "args": (0,)}, "test-group")
    group.start()
    assert group.join(120)
    assert sorted(policy.started_ids) == [0, 1] and policy.lost == {0: 0, 1: 0}


def test_pool_and_remote_vector_env_share_the_supervisor():
    pytest.importorskip("gymnasium")
    from fibrl.rl.envs import RemoteVectorEnv

    with fibrl.Pool(1) as pool:
        assert type(pool._engine.supervisor) is Supervisor
    envs = RemoteVectorEnv("CartPole-v1", 2, envs_per_worker=1, seed=0)
    try:
        assert type(envs._supervisor) is Supervisor
        envs.reset(seed=0)
        # a worker killed through its process: the supervisor reports it, the env's
        # policy replaces it, and the step that follows says so
        victim = envs.processes[1]
        victim.kill()
        deadline = time.monotonic() + 60
        restarted = False
        while not restarted and time.monotonic() < deadline:
            *_, infos = envs.step(envs.action_space.sample())
            restarted = bool(infos.get("fibrl_restarted", [False, False])[1])
        assert restarted
        # the process handed out stays usable after its end was handled
        victim.join(10)
        assert victim.exitcode == -9 and envs.processes[1] is not victim
    finally:
        envs.close()


def test_killing_a_worker_while_it_is_being_closed_elsewhere_is_not_an_error():
    """terminate() kills the workers on the caller's thread while the supervisor thread
    reaps and closes those that ended; BaseProcess.close() sets ``_popen`` to None
    before it marks the process closed, and a kill in between raised AttributeError
    out of terminate() (seen with Pool(512))."""
    proc = fibrl.Process(target=_exit_with, args=(0,))
    proc.start()
    proc.join(60)
    popen = proc._popen
    proc._popen = None   # the moment inside close(): _popen cleared, not yet closed
    try:
        _kill(proc)      # nothing to kill: it ended
    finally:
        proc._popen = popen
    proc.close()
    _kill(proc)          # closed: ValueError, swallowed as before

    class Broken:
        _popen = object()

        def kill(self):
            raise AttributeError("a real bug in kill()")
    with pytest.raises(AttributeError, match="a real bug"):
        _kill(Broken())
