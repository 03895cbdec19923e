"""RemoteVectorEnv behaves as gymnasium's SyncVectorEnv, batch for batch, plus send/recv."""
from __future__ import annotations

import functools
import multiprocessing
import subprocess
import sys

import pytest

from conftest import require_module

gymnasium = require_module("gymnasium", "CI_REQUIRE_DOCKER")
np = require_module("numpy", "CI_REQUIRE_DOCKER")

from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError  # noqa: E402
from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402

from fibrl.rl import RemoteVectorEnv  # noqa: E402

import envs_helpers  # noqa: E402

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


def assert_same(a, b, where=""):
    """Deep equality of batches and info dicts (numpy arrays, object arrays, dicts, tuples)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys()} != {b.keys()}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, tuple):
        assert len(a) == len(b), where
        for j, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{j}]")
    elif isinstance(a, np.ndarray) and a.dtype == object:
        assert b.dtype == object and a.shape == b.shape, where
        for j, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{j}]")
    elif a is None:
        assert b is None, where
    else:
        assert np.asarray(a).dtype == np.asarray(b).dtype, f"{where}: dtypes differ"
        np.testing.assert_array_equal(a, b, err_msg=where)


def run_both(remote, sync, steps, seed=7):
    """Drive both with the same seeds and actions; compare everything, return #episodes ended."""
    rng = np.random.default_rng(seed)
    assert_same(remote.reset(seed=seed), sync.reset(seed=seed), "reset")
    ended = 0
    for t in range(steps):
        actions = rng.integers(0, 2, remote.num_envs)
        got, want = remote.step(actions), sync.step(actions)
        assert_same(got, want, f"step {t}")
        done = want[2] | want[3]
        ended += int(done.sum())
        if remote.autoreset_mode == AutoresetMode.DISABLED and done.any():
            options = {"reset_mask": done}
            assert_same(remote.reset(options=dict(options)), sync.reset(options=dict(options)),
                        f"masked reset after step {t}")
    return ended


@pytest.mark.parametrize("envs_per_worker", [1, 3, 8])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_same_as_sync_vector_env(mode, envs_per_worker):
    fn = functools.partial(gymnasium.make, "CartPole-v1", max_episode_steps=12)
    sync = SyncVectorEnv([fn] * 8, autoreset_mode=mode)
    remote = RemoteVectorEnv("CartPole-v1", 8, envs_per_worker=envs_per_worker,
                             autoreset_mode=mode, env_kwargs={"max_episode_steps": 12},
                             split=4)
    try:
        assert remote.metadata["autoreset_mode"] == mode
        assert remote.single_observation_space == sync.single_observation_space
        assert remote.observation_space == sync.observation_space
        assert remote.action_space == sync.action_space
        ended = run_both(remote, sync, 60)
        assert ended > 16  # both terminations and truncations (12 steps) happened
    finally:
        remote.close()
        sync.close()


def test_dict_and_tuple_observations():
    sync = SyncVectorEnv([envs_helpers.DictTupleEnv] * 5)
    remote = RemoteVectorEnv([envs_helpers.DictTupleEnv] * 5, envs_per_worker=2, split=2)
    try:
        assert remote.observation_space == sync.observation_space
        run_both(remote, sync, 20)
    finally:
        remote.close()
        sync.close()


@pytest.mark.parametrize("make", [envs_helpers.Float64Obs, envs_helpers.Counter],
                         ids=["float64-obs-in-float32-space", "discrete"])
def test_observations_take_the_space_dtype_as_in_sync_vector_env(make):
    sync = SyncVectorEnv([make] * 5)
    remote = RemoteVectorEnv([make] * 5, envs_per_worker=3, split=2)
    try:
        run_both(remote, sync, 30)
    finally:
        remote.close()
        sync.close()


def test_worker_stacks_observations_that_do_not_fit_its_space():
    from fibrl.rl.envs.worker import Worker, _obs_rows

    worker = Worker(0, 0, [], [], [], "next_step", 0, 0, None)
    worker.obs_rows = _obs_rows(gymnasium.spaces.Box(0, 1, (4,), np.float32), 2)
    fits = worker._batch([np.ones(4), np.zeros(4)])
    assert fits.dtype == np.float32 and fits.shape == (2, 4)
    odd = worker._batch([np.ones(3), np.zeros(3)])  # as the env gave them
    assert odd.dtype == np.float64 and odd.shape == (2, 3) and worker.obs_rows is None
    assert _obs_rows(gymnasium.spaces.Dict({"a": gymnasium.spaces.Discrete(2)}), 2) is None


def test_send_recv_one_slow_env_does_not_hold_up_the_others(tmp_path):
    # env 0's step waits for a file the test makes only after the fast envs stepped 6 times
    gate = tmp_path / "go"
    fns = [functools.partial(envs_helpers.Gated, str(gate))] + [envs_helpers.Pid] * 3
    envs = RemoteVectorEnv(fns, envs_per_worker=1)
    try:
        envs.reset(seed=0)
        envs.send(np.zeros(4, dtype=np.int64))
        for _ in range(6):  # the fast envs keep stepping while env 0 is held
            obs, rewards, terms, truncs, infos = envs.recv(num=3, timeout=30)
            assert sorted(infos["env_id"].tolist()) == [1, 2, 3]
            assert obs.shape == (3, 4) and set(rewards.tolist()) <= {0.0, 1.0}  # 0: autoreset
            envs.send(np.ones(3, dtype=np.int64), env_ids=infos["env_id"])
        with pytest.raises(ValueError, match="running"):
            envs.send(np.zeros(1, dtype=np.int64), env_ids=[1])
        *_, infos = envs.recv(num=3, timeout=30)  # the last send of 1, 2, 3
        assert sorted(infos["env_id"].tolist()) == [1, 2, 3]
        with pytest.raises(multiprocessing.TimeoutError):
            envs.recv(num=1, timeout=0.2)  # env 0 is still held
        gate.touch()
        obs, rewards, *_, infos = envs.recv(num=1, timeout=30)
        assert infos["env_id"].tolist() == [0] and obs.shape == (1, 4)
        with pytest.raises(NoAsyncCallError):
            envs.recv()
    finally:
        gate.touch()
        envs.close()


def test_step_wait_timeout_and_state_errors():
    envs = RemoteVectorEnv([functools.partial(envs_helpers.Slow, 0.5)] * 2, envs_per_worker=1)
    try:
        envs.reset(seed=1)
        with pytest.raises(NoAsyncCallError):
            envs.step_wait()
        envs.step_async(np.zeros(2, dtype=np.int64))
        with pytest.raises(AlreadyPendingCallError):
            envs.step_async(np.zeros(2, dtype=np.int64))
        with pytest.raises(AlreadyPendingCallError):
            envs.reset()
        with pytest.raises(multiprocessing.TimeoutError):
            envs.step_wait(timeout=0.05)
        obs, rewards, *_ = envs.step_wait(timeout=10)  # the same step, still pending
        assert obs.shape == (2, 4) and rewards.tolist() == [1.0, 1.0]
    finally:
        envs.close()
    with pytest.raises(gymnasium.error.ClosedEnvironmentError):
        envs.step(np.zeros(2, dtype=np.int64))


def test_call_get_attr_set_attr_and_wrappers():
    envs = RemoteVectorEnv([envs_helpers.Pid] * 3, envs_per_worker=2)
    try:
        pids = envs.get_attr("pid")
        assert len(pids) == 3 and pids[0] == pids[1] != pids[2]
        envs.set_attr("delay_marker", [1, 2, 3])
        assert envs.get_attr("delay_marker") == (1, 2, 3)
        assert envs.call("get_wrapper_attr", "delay_marker") == (1, 2, 3)
        wrapped = gymnasium.wrappers.vector.RecordEpisodeStatistics(envs)
        wrapped.reset(seed=0)
        episodes = 0
        for _ in range(60):
            *_, infos = wrapped.step(np.zeros(3, dtype=np.int64))
            episodes += int(infos.get("_episode", np.zeros(3, bool)).sum())
        assert episodes >= 3  # always pushing left ends CartPole within ~10 steps
    finally:
        envs.close()


def test_import_fibrl_rl_imports_neither_gymnasium_nor_numpy():
    code = ("import sys, fibrl, fibrl.rl; "
            "print(sorted({'gymnasium', 'numpy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]"


def test_a_batch_of_the_wrong_size_raises_and_the_vector_env_goes_on():
    """A user's mistake is raised in the caller, as gymnasium's vector envs do; it used to
    reach the workers and come back as a "restarted" env (3 actions for 4 envs) or be
    ignored (5 actions)."""
    envs = RemoteVectorEnv("CartPole-v1", 4, envs_per_worker=2, seed=0)
    try:
        envs.reset(seed=0)
        for bad, got in ((np.zeros(3, np.int64), 3), (np.zeros(5, np.int64), 5),
                         ([0, 1, 0], 3)):
            with pytest.raises(ValueError, match=f"{got} actions for 4 envs"):
                envs.step(bad)
        with pytest.raises(TypeError, match="one action per env"):
            envs.step(np.int64(1))
        with pytest.raises(ValueError, match="1 actions for 2 envs"):
            envs.send(np.zeros(1, np.int64), [0, 2])
        obs, *_ = envs.step([0, 1, 0, 1])   # still usable, nothing restarted
        assert obs.shape == (4, 4) and envs.restart_counts == (0, 0, 0, 0)
    finally:
        envs.close()


def test_np_random_seed_render_and_reset_mask_errors_as_gymnasium_has_them():
    import envs_helpers

    sync = SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * 3)
    envs = RemoteVectorEnv([envs_helpers.Frames] * 3, envs_per_worker=2, seed=0)
    try:
        sync.reset(seed=3)
        obs, _ = envs.reset(seed=3)
        assert envs.np_random_seed == sync.np_random_seed == (3, 4, 5)
        assert [type(g).__name__ for g in envs.np_random] == ["Generator"] * 3
        frames = envs.render()
        assert len(frames) == 3 and [f[0, 0, 0] for f in frames] == obs[:, 0].tolist()
        for mask, error in (([True, False, True], TypeError),
                            (np.ones(2, np.bool_), ValueError),
                            (np.ones(3, np.int64), TypeError),
                            (np.zeros(3, np.bool_), ValueError)):
            with pytest.raises(error):
                sync.reset(options={"reset_mask": mask})
            with pytest.raises(error):
                envs.reset(options={"reset_mask": mask})
    finally:
        envs.close()
        sync.close()


def test_closing_with_a_step_pending_warns_as_gymnasium_does():
    envs = RemoteVectorEnv("CartPole-v1", 2, seed=0)
    envs.reset(seed=0)
    envs.step_async(np.zeros(2, np.int64))
    with pytest.warns(UserWarning, match="pending call to `step` to complete"):
        envs.close()
    assert envs.closed
