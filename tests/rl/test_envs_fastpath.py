"""The full-batch step's fast receive path gives the same batches as the general path.

``RemoteVectorEnv.step_wait`` first tries ``fibrl.rl.envs.fastpath`` (one compact reply
per worker, written straight into the batch); anything unusual hands the replies
received so far to the general path. Each way through is driven here against
gymnasium's SyncVectorEnv, batch for batch, infos included.
"""
from __future__ import annotations

import functools
import multiprocessing

import pytest

from conftest import require_module

gymnasium = require_module("gymnasium", "CI_REQUIRE_DOCKER")
np = require_module("numpy", "CI_REQUIRE_DOCKER")

from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402

from fibrl.rl import RemoteVectorEnv  # noqa: E402
from fibrl.rl.envs import fastpath  # noqa: E402

import envs_helpers  # noqa: E402
from test_envs import run_both  # noqa: E402

STEPS = 40


def _count_fast(monkeypatch) -> list:
    used = [0]
    finish = fastpath._Batch.finish

    def counting(batch, env):
        used[0] += 1
        return finish(batch, env)

    monkeypatch.setattr(fastpath._Batch, "finish", counting)
    return used


@pytest.mark.parametrize("path", ["fast", "handed over", "general"])
@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP],
                         ids=lambda m: m.value)
def test_every_path_gives_sync_vector_envs_batches(mode, path, monkeypatch):
    """12-step episodes, so that episodes end (and SAME_STEP's final_obs/final_info
    infos arrive) within the run; 3 workers of 2 envs."""
    used = _count_fast(monkeypatch)
    if path == "handed over":   # the first reply taken, then the second one refused
        add = fastpath._Batch.add
        monkeypatch.setattr(fastpath._Batch, "add",
                            lambda batch, w, frame: w.index != 1 and add(batch, w, frame))
    elif path == "general":
        monkeypatch.setattr(fastpath, "_ready", lambda env: False)
    fn = functools.partial(gymnasium.make, "CartPole-v1", max_episode_steps=12)
    sync = SyncVectorEnv([fn] * 6, autoreset_mode=mode)
    remote = RemoteVectorEnv("CartPole-v1", 6, envs_per_worker=2, autoreset_mode=mode,
                             env_kwargs={"max_episode_steps": 12})
    try:
        ended = run_both(remote, sync, STEPS)
    finally:
        remote.close()
        sync.close()
    assert ended >= 6
    assert used[0] == (STEPS if path == "fast" else 0)


def test_a_restart_in_one_reply_hands_the_step_to_the_general_path(monkeypatch):
    """Env 3 raises on its 5th step: that step's replies go to the general path (which
    counts the restart); every other step takes the fast path."""
    used = _count_fast(monkeypatch)
    fns = [functools.partial(gymnasium.make, "CartPole-v1")] * 4
    fns[3] = functools.partial(envs_helpers.CrashAt, crash_at=5)
    envs = RemoteVectorEnv(fns, envs_per_worker=2)
    try:
        envs.reset(seed=3)
        truncated_at = []
        for t in range(10):
            _, _, _, truncs, _ = envs.step(np.zeros(4, dtype=np.int64))
            if truncs[3]:
                truncated_at.append(t)
        assert envs.restart_counts == (0, 0, 0, 1)
    finally:
        envs.close()
    assert truncated_at == [4]
    assert used[0] == 9


def test_a_step_wait_timeout_leaves_the_step_pending(monkeypatch):
    """The fast path gives up at the caller's deadline and the general path raises the
    timeout; the next step_wait returns that same step's batch."""
    used = _count_fast(monkeypatch)
    slow = functools.partial(envs_helpers.Slow, 0.5)
    envs = RemoteVectorEnv([slow] * 2, envs_per_worker=1)
    try:
        envs.reset(seed=0)
        envs.step_async(np.zeros(2, dtype=np.int64))
        with pytest.raises(multiprocessing.TimeoutError):
            envs.step_wait(timeout=0.05)
        obs, *_ = envs.step_wait(timeout=60)
        assert obs.shape == (2, 4)
        envs.step(np.zeros(2, dtype=np.int64))
    finally:
        envs.close()
    assert used[0] >= 1


def test_observations_longer_than_the_batch_raise_instead_of_filling_it():
    """Steps that return 5 floats for a space of 4: the fast path lays the replies out in
    one buffer, and must not read them as a batch of the space's shape (16 of the 20
    floats, rows shifted); the general path raises."""
    envs = RemoteVectorEnv([envs_helpers.LongObs] * 4, envs_per_worker=2)
    try:
        envs.reset(seed=0)
        with pytest.raises(ValueError, match="broadcast"):
            envs.step(np.zeros(4, dtype=np.int64))
    finally:
        envs.close(terminate=True)


def test_observations_that_grow_mid_run_raise_too():
    """The fast path knows each worker's reply layout from its earlier steps: a reply
    whose observations then grow (4 floats, then 5) is read afresh, and raises."""
    envs = RemoteVectorEnv([envs_helpers.LongObsLater] * 4, envs_per_worker=2)
    try:
        envs.reset(seed=0)
        for _ in range(3):
            obs, *_ = envs.step(np.zeros(4, dtype=np.int64))
            assert obs.shape == (4, 4)
        with pytest.raises(ValueError, match="broadcast"):
            envs.step(np.zeros(4, dtype=np.int64))
    finally:
        envs.close(terminate=True)


def test_open_requests_keep_their_own_copy_of_the_actions():
    """A worker replaced mid-step is sent its open Step again: those actions must be the
    ones sent, even if the caller reuses its action array right after ``step_async``."""
    envs = RemoteVectorEnv("CartPole-v1", 4, envs_per_worker=2)
    try:
        envs.reset(seed=0)
        actions = np.array([1, 0, 1, 1], dtype=np.int64)
        envs.step_async(actions)
        actions[:] = 0
        assert [tuple(w.open[0][0].actions) for w in envs._workers] == [(1, 0), (1, 1)]
        envs.step_wait(timeout=60)
    finally:
        envs.close()


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_the_fast_send_writes_the_frames_the_protocol_would(dtype):
    """Each worker's frame is ``protocol.encode`` of the Step it keeps open (the frame a
    replaced worker is sent again), for a batch of 5 envs in workers of 2, 2 and 1."""
    from fibrl.rl.envs.protocol import encode

    envs = RemoteVectorEnv("CartPole-v1", 5, envs_per_worker=2)
    try:
        envs.reset(seed=0)
        sent = []
        for w in envs._workers:
            real = w.chan

            class Capture:
                def send(self, frame, real=real):
                    sent.append(frame)
                    real.send(frame)

                def __getattr__(self, name, real=real):
                    return getattr(real, name)

            w.chan = Capture()
        actions = np.array([1, 0, 1, 1, 0], dtype=dtype)
        envs.step_async(actions)
        opened = [w.open[0][0] for w in envs._workers]
        assert [tuple(m.actions) for m in opened] == [(1, 0), (1, 1), (0,)]
        assert sent == [encode(m) for m in opened]
        envs.step_wait(timeout=60)
    finally:
        envs.close()
