"""Freezes of the RL roles: a RemoteVectorEnv worker stopped inside a step and a replay
store server stopped while a writer and a learner call it, each resumed before
``parent_timeout`` (SIGSTOP, then SIGCONT, on the local backend).

A frozen process answers nothing and closes nothing. What must hold once it resumes:
the step it was in returns the results a SyncVectorEnv gives for the same seeds and
actions (no restart, the same worker); every insert made to the store is there once
and the calls made meanwhile succeed. Each freeze is injected only once the process is
where it matters (the env reported that it is inside the step; the server's pid is
known and a call is pending), and the test checks that the process was stopped.
"""
import functools
import os
import threading
import time

import gymnasium
import numpy as np
import psutil
import pytest
from conftest import freeze, thaw, wait_until

import fibrl
from fibrl.rl import RemoteVectorEnv, ReplayStore
from fibrl.rl.replay import Fifo

pytestmark = pytest.mark.timeout(180)
FROZEN_S = 3.0


class SaysWhenInside(gymnasium.Wrapper):
    """CartPole whose 5th step writes the worker's pid to ``inside`` and then waits for
    ``go`` to exist (at most a minute) before stepping: the test freezes the worker
    in between. Its results are CartPole's."""

    def __init__(self, inside, go):
        super().__init__(gymnasium.make("CartPole-v1"))
        self.inside, self.go, self.steps = inside, go, 0

    def step(self, action):
        self.steps += 1
        if self.steps == 5:
            with open(self.inside + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(self.inside + ".tmp", self.inside)
            deadline = time.monotonic() + 60
            while not os.path.exists(self.go) and time.monotonic() < deadline:
                time.sleep(0.01)
        return self.env.step(action)


def cartpole():
    return gymnasium.make("CartPole-v1")


def test_an_env_worker_frozen_inside_a_step_gives_the_same_results_once_resumed(
        configure, tmp_path):
    configure(backend="local", heartbeat_interval=0.5, parent_timeout=30.0)
    inside, go = str(tmp_path / "inside"), str(tmp_path / "go")
    fns = [cartpole, functools.partial(SaysWhenInside, inside, go)]
    reference = gymnasium.vector.SyncVectorEnv([cartpole] * 2)
    envs = RemoteVectorEnv(fns, envs_per_worker=1)
    try:
        actions = np.array([[i % 2, (i // 2) % 2] for i in range(8)], np.int64)
        want = [reference.reset(seed=7)[0]] + [reference.step(a)[:4] for a in actions]
        got = [envs.reset(seed=7)[0]]
        for a in actions[:4]:
            got.append(envs.step(a)[:4])
        envs.step_async(actions[4])
        wait_until(lambda: os.path.exists(inside), "the env to be inside its 5th step")
        pid = int(open(inside).read())
        freeze(pid)
        assert psutil.Process(pid).status() == psutil.STATUS_STOPPED
        open(go, "w").close()
        threading.Timer(FROZEN_S, thaw, (pid,)).start()
        got.append(envs.step_wait(timeout=60)[:4])
        for a in actions[5:]:
            got.append(envs.step(a)[:4])
        np.testing.assert_array_equal(got[0], want[0])
        for g, w in zip(got[1:], want[1:]):
            for field_got, field_want in zip(g, w):
                np.testing.assert_array_equal(field_got, field_want)
        assert list(envs.restart_counts) == [0, 0]
        assert psutil.pid_exists(pid) and pid in [p.pid for p in psutil.Process().children(
            recursive=True)]
    finally:
        if "pid" in locals():
            thaw(pid)
        envs.close()
        reference.close()


def _insert_rows(store, first, n, done):
    for i in range(first, first + n):
        store.insert({"x": np.array([float(i)])}, timeout=60)
    done.put(n)


def test_a_replay_server_frozen_under_writers_and_a_learner_loses_nothing(configure):
    configure(backend="local", heartbeat_interval=0.5, parent_timeout=30.0)
    with ReplayStore(10_000, sampler=Fifo()) as store:
        store.insert({"x": np.array([-1.0])})
        server = store.server_pids()[0]
        done = fibrl.Queue()
        writers = [fibrl.Process(target=_insert_rows, args=(store, 1000 * k, 300, done))
                   for k in range(2)]
        for w in writers:
            w.start()
        wait_until(lambda: len(store) > 50, "the writers to be inserting")
        freeze(server)
        assert psutil.Process(server).status() == psutil.STATUS_STOPPED
        threading.Timer(FROZEN_S, thaw, (server,)).start()
        batch = store.sample(16, timeout=60)     # made while the server is stopped
        assert len(batch["x"]) == 16
        assert sorted(done.get(timeout=120) for _ in writers) == [300, 300]
        for w in writers:
            w.join(60)
            assert w.exitcode == 0
        assert len(store) == 601
        stored = store.sample(601, timeout=60)["x"]   # every item, oldest first (FIFO)
        want = [-1.0] + [float(i) for k in range(2) for i in range(1000 * k, 1000 * k + 300)]
        assert sorted(stored.tolist()) == sorted(want)
        assert store.server_pids() == [server]
