"""What a crashing env returns in each autoreset mode, with and without a neighbour env.

Each test's docstring states the contract (docs/envs.md, "What a crash returns"). Every
test runs with one env per worker and with two (the crashing env's neighbour lives in
its process). The envs are :class:`envs_helpers.Crashy`: its observation ``[t, draw,
level, resets]`` says how far into its episode it is, which seed and options its episode
began with, and how many resets its instance made.
"""
from __future__ import annotations

import functools

import pytest

from conftest import require_module

gymnasium = require_module("gymnasium", "CI_REQUIRE_DOCKER")
np = require_module("numpy", "CI_REQUIRE_DOCKER")

from gymnasium.error import ResetNeeded  # noqa: E402

from fibrl.rl import RemoteVectorEnv  # noqa: E402
from fibrl.rl.envs.worker import restart_seed  # noqa: E402

import envs_helpers  # noqa: E402
from envs_helpers import Crashy, CrashyError  # noqa: E402

ROOT = 7   # the vector env's seed: the root of its restart seeds
PER_WORKER = pytest.mark.parametrize("per_worker", [1, 2])


def make(fns, per_worker, mode, **kwargs):
    return RemoteVectorEnv(fns, envs_per_worker=per_worker, autoreset_mode=mode, seed=ROOT,
                           **kwargs)


def first_obs(seed, level=0, resets=1):
    """What a Crashy's ``resets``-th reset returns for ``seed`` and ``level``."""
    env = Crashy()
    for _ in range(resets - 1):
        env.reset()
    return env.reset(seed=seed, options={"level": level} if level else None)[0]


def restart_obs(env_id, level=0, restarts=1):
    """The first observation of env ``env_id`` after its ``restarts``-th restart."""
    return first_obs(restart_seed(ROOT, env_id, restarts), level)


def once(tmp_path, **crash):
    """Env 1's factory: a Crashy crashing as ``crash`` says, once across instances."""
    return functools.partial(Crashy, once=str(tmp_path / "once"), **crash)


def steps(envs, count, action=1):
    out = None
    for _ in range(count):
        out = envs.step(np.full(envs.num_envs, action))
    return out


# -- a crash in reset() ------------------------------------------------------------------
@PER_WORKER
def test_a_reset_that_raises_is_retried_on_a_fresh_env_with_the_callers_seed(per_worker,
                                                                             tmp_path):
    """on_error="restart": a reset() in which an env raises is retried once on an env
    made anew, with the caller's seed and options; the caller gets that valid first
    observation, infos saying it restarted and why, and the neighbour's reset as if
    nothing happened. The env then steps normally."""
    envs = make([Crashy, once(tmp_path, reset_crash=1)], per_worker, "NextStep")
    try:
        obs, infos = envs.reset(seed=10, options={"level": 2})
        np.testing.assert_array_equal(obs[0], first_obs(10, level=2))
        np.testing.assert_array_equal(obs[1], first_obs(11, level=2))
        assert infos["_fibrl_restarted"].tolist() == [False, True]
        assert infos["fibrl_error_type"][1] == "CrashyError"
        assert "reset crash at reset 1" in infos["fibrl_error"][1]
        assert infos["resets"].tolist() == [1, 1]
        assert envs.restart_counts == (0, 1)
        obs, rewards, terms, truncs, infos = envs.step(np.array([1, 2]))
        assert obs[:, 0].tolist() == [1, 1] and rewards.tolist() == [2.0, 3.0]
        assert not truncs.any() and "fibrl_restarted" not in infos
    finally:
        envs.close()


@PER_WORKER
def test_a_reset_that_raises_reaches_the_caller_with_its_type_in_raise_mode(per_worker,
                                                                           tmp_path):
    """on_error="raise": the env's exception reaches reset()'s caller with its own type;
    that env must be reset before it steps (ResetNeeded), and the next reset makes it
    anew and works (the neighbour too)."""
    envs = make([Crashy, once(tmp_path, reset_crash=1)], per_worker, "NextStep",
                on_error="raise")
    try:
        with pytest.raises(CrashyError, match="reset crash at reset 1") as info:
            envs.reset(seed=10)
        assert "env 1" in "".join(getattr(info.value, "__notes__", []))
        with pytest.raises(ResetNeeded, match=r"envs \[1\]"):
            envs.step(np.array([1, 1]))
        obs, infos = envs.reset(seed=10)
        np.testing.assert_array_equal(obs[1], first_obs(11))
        assert "fibrl_restarted" not in infos and envs.restart_counts == (0, 0)
        obs, rewards, *_ = envs.step(np.array([1, 1]))
        assert obs[:, 0].tolist() == [1, 1] and rewards.tolist() == [2.0, 2.0]
    finally:
        envs.close()


# -- NEXT_STEP ---------------------------------------------------------------------------
@PER_WORKER
def test_next_step_a_crash_ends_the_episode_and_the_next_step_is_its_reset_step(per_worker,
                                                                               tmp_path):
    """NEXT_STEP, an env raises in step: that step ends its episode, truncated, reward 0,
    with the observation its action was chosen from as the final one. Its next step is a
    reset-step, as after any episode end: the action is ignored, reward 0, not ended, and
    the observation is the restart's reset (restart seed, the episode's options). The step
    after that steps the env; the neighbour steps throughout."""
    envs = make([Crashy, once(tmp_path, step_crash=3)], per_worker, "NextStep")
    try:
        envs.reset(seed=10, options={"level": 2})
        obs, *_ = steps(envs, 2)
        last = obs[1].copy()
        obs, rewards, terms, truncs, infos = steps(envs, 1)   # env 1 raises
        np.testing.assert_array_equal(obs[1], last)
        assert obs[0, 0] == 3 and rewards.tolist() == [2.0, 0.0]
        assert terms.tolist() == [False, False] and truncs.tolist() == [False, True]
        assert infos["_fibrl_restarted"].tolist() == [False, True]
        assert infos["fibrl_error_type"][1] == "CrashyError" and "final_obs" not in infos
        obs, rewards, terms, truncs, infos = envs.step(np.array([2, 2]))   # its reset-step
        np.testing.assert_array_equal(obs[1], restart_obs(1, level=2))
        assert obs[0, 0] == 4 and rewards.tolist() == [3.0, 0.0]
        assert not terms.any() and not truncs.any()
        assert "fibrl_restarted" not in infos and infos["resets"][1] == 1
        obs, rewards, *_ = steps(envs, 1)
        assert obs[:, 0].tolist() == [5, 1] and rewards.tolist() == [2.0, 2.0]
        assert obs[1, 1:].tolist() == restart_obs(1, level=2)[1:].tolist()   # its episode
    finally:
        envs.close()


@PER_WORKER
def test_next_step_a_crash_in_the_autoreset_is_that_reset_step(per_worker, tmp_path):
    """NEXT_STEP, an env's reset raises in its reset-step (the step after its episode
    ended): there is no episode to end, so that step stays a reset-step (reward 0, not
    ended) whose observation is the restart's reset (restart seed, no options: an
    autoreset episode begins without them), with infos saying it restarted. The next step
    steps the env."""
    envs = make([Crashy, once(tmp_path, length=2, reset_crash=2)], per_worker, "NextStep")
    try:
        envs.reset(seed=10, options={"level": 2})
        obs, rewards, terms, truncs, infos = steps(envs, 2)
        assert terms.tolist() == [False, True]
        obs, rewards, terms, truncs, infos = steps(envs, 1)   # env 1's autoreset raises
        np.testing.assert_array_equal(obs[1], restart_obs(1))
        assert rewards.tolist() == [2.0, 0.0] and not terms.any() and not truncs.any()
        assert infos["_fibrl_restarted"].tolist() == [False, True]
        assert "reset crash at reset 2" in infos["fibrl_error"][1]
        obs, rewards, terms, truncs, infos = steps(envs, 1)
        assert obs[:, 0].tolist() == [4, 1] and rewards.tolist() == [2.0, 2.0]
        assert "fibrl_restarted" not in infos
    finally:
        envs.close()


# -- SAME_STEP ---------------------------------------------------------------------------
@PER_WORKER
def test_same_step_a_crash_gives_the_last_observation_as_final_obs(per_worker, tmp_path):
    """SAME_STEP, an env raises in step: the step is truncated, reward 0; its observation
    is the restart's reset (restart seed, the episode's options), ``final_obs`` the
    observation the action was chosen from, and ``final_info`` (like the step's own
    infos) says it restarted and why. The next step steps the new episode."""
    envs = make([Crashy, once(tmp_path, step_crash=3)], per_worker, "SameStep")
    try:
        envs.reset(seed=10, options={"level": 2})
        obs, *_ = steps(envs, 2)
        last = obs[1].copy()
        obs, rewards, terms, truncs, infos = steps(envs, 1)
        np.testing.assert_array_equal(obs[1], restart_obs(1, level=2))
        assert rewards.tolist() == [2.0, 0.0] and truncs.tolist() == [False, True]
        assert not terms.any()
        assert infos["_final_obs"].tolist() == [False, True]
        np.testing.assert_array_equal(infos["final_obs"][1], last)
        assert infos["final_info"]["fibrl_restarted"][1]
        assert infos["final_info"]["fibrl_error_type"][1] == "CrashyError"
        assert infos["_fibrl_restarted"].tolist() == [False, True]
        assert infos["resets"][1] == 1   # the restart's reset info, as an autoreset's
        obs, rewards, *_ = steps(envs, 1)
        assert obs[:, 0].tolist() == [4, 1] and rewards.tolist() == [2.0, 2.0]
    finally:
        envs.close()


@PER_WORKER
def test_same_step_a_crash_in_the_autoreset_keeps_the_steps_own_result(per_worker,
                                                                      tmp_path):
    """SAME_STEP, an env's episode ends and its reset right after raises: the step's own
    result stands (its reward, terminated, ``final_obs`` and ``final_info``, the latter
    with the restart added); the observation is the restart's reset (no options, as an
    autoreset's)."""
    envs = make([Crashy, once(tmp_path, length=2, reset_crash=2)], per_worker, "SameStep")
    try:
        obs, _ = envs.reset(seed=10, options={"level": 2})
        begun = obs[1].copy()
        steps(envs, 1)
        obs, rewards, terms, truncs, infos = steps(envs, 1, action=2)   # ends, reset raises
        assert rewards.tolist() == [3.0, 3.0]
        assert terms.tolist() == [False, True] and not truncs.any()
        final = infos["final_obs"][1]
        assert final[0] == 2 and final[1:].tolist() == begun[1:].tolist()
        assert infos["final_info"]["t"][1] == 2 and infos["final_info"]["fibrl_restarted"][1]
        np.testing.assert_array_equal(obs[1], restart_obs(1))
        assert infos["_fibrl_restarted"].tolist() == [False, True]
        assert "reset crash at reset 2" in infos["fibrl_error"][1]
        obs, rewards, *_ = steps(envs, 1)
        assert obs[:, 0].tolist() == [3, 1]
    finally:
        envs.close()


@PER_WORKER
def test_an_episode_begun_by_a_restart_keeps_its_options_through_a_lost_worker(per_worker,
                                                                              tmp_path):
    """A restart begins the next episode with the crashed one's reset options (it is not
    an autoreset): if that episode's worker is then lost, the replacement resets the env
    with those options again."""
    envs = make([Crashy, once(tmp_path, step_crash=2)], per_worker, "SameStep")
    try:
        envs.reset(seed=10, options={"level": 2})
        obs, *_, infos = steps(envs, 2)   # env 1 raises: restarted with level 2
        assert infos["_fibrl_restarted"].tolist() == [False, True] and obs[1, 2] == 2
        steps(envs, 1)
        envs.processes[1 // per_worker].kill()
        for _ in range(200):   # until a step meets the replacement
            obs, *_, infos = steps(envs, 1)
            if infos.get("_fibrl_restarted", [False, False])[1]:
                break
        np.testing.assert_array_equal(obs[1], restart_obs(1, level=2, restarts=2))
    finally:
        envs.close()


# -- DISABLED ----------------------------------------------------------------------------
@PER_WORKER
def test_disabled_a_crash_ends_the_episode_and_a_masked_reset_begins_the_next(per_worker,
                                                                             tmp_path):
    """DISABLED, an env raises in step: the step is truncated, reward 0, with the
    observation the action was chosen from, and infos saying it restarted and why (no
    final_obs: this mode has none). As after any episode end, reset it with a reset_mask:
    that reset has the caller's seed and options, the neighbour keeps its observation and
    goes on."""
    envs = make([Crashy, once(tmp_path, step_crash=3)], per_worker, "Disabled")
    try:
        envs.reset(seed=10, options={"level": 2})
        obs, *_ = steps(envs, 2)
        last = obs[1].copy()
        obs, rewards, terms, truncs, infos = steps(envs, 1)
        np.testing.assert_array_equal(obs[1], last)
        assert rewards.tolist() == [2.0, 0.0] and truncs.tolist() == [False, True]
        assert infos["_fibrl_restarted"].tolist() == [False, True]
        assert infos["fibrl_error_type"][1] == "CrashyError" and "final_obs" not in infos
        obs, infos = envs.reset(seed=[None, 20], options={"reset_mask": truncs, "level": 1})
        assert obs[0, 0] == 3
        # the new instance's second reset: the restart made the first
        np.testing.assert_array_equal(obs[1], first_obs(20, level=1, resets=2))
        obs, rewards, terms, truncs, infos = steps(envs, 1)
        assert obs[:, 0].tolist() == [4, 1] and rewards.tolist() == [2.0, 2.0]
        assert not truncs.any() and "fibrl_restarted" not in infos
    finally:
        envs.close()


# -- a lost worker reports as a crash does -------------------------------------------------
@pytest.mark.parametrize("mode", ["NextStep", "SameStep", "Disabled"])
def test_a_lost_worker_reports_its_envs_as_crashed_envs_report(mode, tmp_path):
    """A worker that ends its process mid-step (here, with its env and a neighbour): each
    of its envs reports its restart as an env that raised does in that mode: the final
    observation is the one its action was chosen from (the step's observation in NEXT_STEP
    and DISABLED, ``final_obs`` in SAME_STEP), and the restart's reset keeps the episode's
    options."""
    envs = make([Crashy, once(tmp_path, exit_step=3)], 2, mode)
    try:
        envs.reset(seed=10, options={"level": 2})
        obs, *_ = steps(envs, 2)
        last = obs.copy()
        obs, rewards, terms, truncs, infos = steps(envs, 1)   # env 1 ends the worker
        assert rewards.tolist() == [0.0, 0.0] and truncs.tolist() == [True, True]
        assert infos["fibrl_error_type"].tolist() == ["WorkerDied"] * 2
        fresh = np.stack([restart_obs(0, level=2), restart_obs(1, level=2)])
        if mode == "SameStep":
            np.testing.assert_array_equal(obs, fresh)
            np.testing.assert_array_equal(np.stack(infos["final_obs"]), last)
        else:
            np.testing.assert_array_equal(obs, last)
        if mode == "NextStep":   # the reset-steps
            obs, rewards, terms, truncs, infos = steps(envs, 1)
            np.testing.assert_array_equal(obs, fresh)
            assert rewards.tolist() == [0.0, 0.0] and not truncs.any()
        if mode == "Disabled":
            obs, _ = envs.reset(options={"reset_mask": truncs, "level": 2})
        obs, rewards, *_ = steps(envs, 1)
        assert obs[:, 0].tolist() == [1, 1] and rewards.tolist() == [2.0, 2.0]
    finally:
        envs.close()


def test_next_step_a_worker_lost_during_a_reset_step_still_gives_that_reset_step(tmp_path):
    """NEXT_STEP: a worker lost while one of its envs was taking its reset-step (its
    episode had just ended): that env's step is still a reset-step (reward 0, not ended,
    the restart's reset, which, as an autoreset, has no options), while its neighbour,
    cut mid-episode, ends its episode truncated."""
    fns = [once(tmp_path, exit_step=3), functools.partial(Crashy, length=2)]
    envs = make(fns, 2, "NextStep")
    try:
        envs.reset(seed=10, options={"level": 2})
        obs, rewards, terms, truncs, infos = steps(envs, 2)
        assert terms.tolist() == [False, True]
        last = obs[0].copy()
        obs, rewards, terms, truncs, infos = steps(envs, 1)   # env 0 ends the worker
        np.testing.assert_array_equal(obs[0], last)
        np.testing.assert_array_equal(obs[1], restart_obs(1))
        assert truncs.tolist() == [True, False] and not terms.any()
        assert rewards.tolist() == [0.0, 0.0]
        assert infos["_fibrl_restarted"].tolist() == [True, True]
        obs, rewards, terms, truncs, infos = steps(envs, 1)
        np.testing.assert_array_equal(obs[0], restart_obs(0, level=2))   # its reset-step
        assert obs[1, 0] == 1 and rewards.tolist() == [0.0, 2.0]
    finally:
        envs.close()


def test_helpers_crashy_counts_per_instance_and_once_across_instances(tmp_path):
    """(The helper env itself) each instance counts its own resets and steps; ``once``
    makes a crash happen in the first instance that reaches it only."""
    env = envs_helpers.Crashy(step_crash=2, once=str(tmp_path / "x"))
    env.reset(seed=0)
    env.step(0)
    with pytest.raises(CrashyError):
        env.step(0)
    again = envs_helpers.Crashy(step_crash=2, once=str(tmp_path / "x"))
    again.reset(seed=0)
    again.step(0)
    assert again.step(0)[0][0] == 2
