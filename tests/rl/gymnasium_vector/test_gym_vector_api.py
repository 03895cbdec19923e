"""gymnasium's vector-env tests (tests/vector/ of gymnasium 1.4), rewritten to run against
RemoteVectorEnv: the VectorEnv API as AsyncVectorEnv and SyncVectorEnv keep it.

What gymnasium tests there that is not here, and why, is listed in docs/envs.md
("gymnasium's vector tests").
"""
from __future__ import annotations

import functools
import multiprocessing
import re

import pytest

from conftest import require_module

gymnasium = require_module("gymnasium", "CI_REQUIRE_DOCKER")
np = require_module("numpy", "CI_REQUIRE_DOCKER")

from gymnasium import spaces  # noqa: E402
from gymnasium.error import (AlreadyPendingCallError, ClosedEnvironmentError,  # noqa: E402
                             NoAsyncCallError)
from gymnasium.utils.env_checker import data_equivalence  # noqa: E402
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorWrapper  # noqa: E402

from fibrl.rl import RemoteVectorEnv  # noqa: E402

import gym_vector_helpers as helpers  # noqa: E402

# every test runs with one env per worker and with several envs per worker
LAYOUTS = [1, 3]


def _maker(per_worker):
    made = []

    def make(env_fns, **kwargs):
        envs = RemoteVectorEnv(env_fns, envs_per_worker=per_worker, **kwargs)
        made.append(envs)
        return envs
    return make, made


@pytest.fixture(params=LAYOUTS, ids=lambda k: f"{k}-per-worker")
def vector(request):
    """Makes RemoteVectorEnvs with this layout; closes them after the test."""
    make, made = _maker(request.param)
    yield make
    for envs in made:
        envs.close(terminate=True)


@pytest.fixture
def vector2():
    """Makes RemoteVectorEnvs of 2 envs per worker (3 envs: a worker of 2 and one of 1),
    for the tests run once per space."""
    make, made = _maker(2)
    yield make
    for envs in made:
        envs.close(terminate=True)


def cart_poles(n, **kwargs):
    return [functools.partial(helpers.made, "CartPole-v1", i, **kwargs) for i in range(n)]


# -- test_vector_env.py ------------------------------------------------------------------
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_equal_to_sync_vector_env(vector, mode):
    fns = cart_poles(4)
    remote, sync = vector(fns, autoreset_mode=mode), SyncVectorEnv(fns, autoreset_mode=mode)
    for name in ("num_envs", "observation_space", "single_observation_space", "action_space",
                 "single_action_space"):
        assert getattr(remote, name) == getattr(sync, name), name
    got, want = remote.reset(seed=0), sync.reset(seed=0)
    assert np.all(got[0] == want[0]) and data_equivalence(got[1], want[1])
    for _ in range(100):
        actions = remote.action_space.sample()
        assert actions in sync.action_space
        got, want = remote.step(actions), sync.step(actions)
        for a, b in zip(got[:4], want[:4]):
            assert np.all(a == b)
        assert data_equivalence(got[4], want[4])
    sync.close()


@pytest.mark.parametrize("space", helpers.TEST_SPACES, ids=str)
def test_every_space_as_observations_and_actions(vector2, space):
    fn = functools.partial(helpers.GenericEnv, space, space, step_func=helpers.checked_step)
    envs = vector2([fn] * 3)
    assert envs.observation_space == envs.action_space
    obs, _ = envs.reset()
    assert obs in envs.observation_space
    obs, *_ = envs.step(envs.action_space.sample())   # the env asserts each action
    assert obs in envs.observation_space
    assert envs.restart_counts == (0, 0, 0)


def test_final_obs_and_info(vector):
    fn = functools.partial(helpers.GenericEnv, spaces.Discrete(4), spaces.Discrete(4),
                           helpers.final_obs_reset, helpers.final_obs_step)
    envs = vector([fn])
    obs, info = envs.reset()
    assert obs == np.array([0]) and info == {"reset": np.array([True]),
                                             "_reset": np.array([True])}
    for action in (1, 2):
        obs, _, terminated, _, info = envs.step([action])
        assert obs == np.array([action]) and terminated == np.array([False])
        assert info == {"action": np.array([action]), "_action": np.array([True])}
    obs, _, terminated, _, info = envs.step([3])
    assert obs == np.array([0]) and terminated == np.array([True])
    assert info == {"action": 3, "_action": np.array([True])}
    obs, _, terminated, _, info = envs.step([0])   # the autoreset step
    assert obs == np.array([0]) and info["reset"] == np.array([True])


def test_seeds_are_kept_when_reset_without_one(vector):
    envs = vector(cart_poles(4))
    assert envs.np_random_seed == (0, 1, 2, 3)   # as each env was first seeded
    envs.reset(seed=42)
    assert envs.np_random_seed == (42, 43, 44, 45)
    envs.reset(seed=None)
    assert envs.np_random_seed == (42, 43, 44, 45)


def test_partial_reset(vector):
    envs = vector([functools.partial(gymnasium.make, "CartPole-v1")] * 3,
                  autoreset_mode=AutoresetMode.DISABLED)
    first, _ = envs.reset(seed=[0, 1, 2])
    envs.action_space.seed(123)
    for _ in range(3):
        stepped, *_ = envs.step(envs.action_space.sample())
    masked, _ = envs.reset(seed=[0, 1, 0], options={"reset_mask": np.array([True, True, False])})
    assert np.all(masked[:2] == first[:2]) and np.all(masked[2] == stepped[2])


def test_reset_mask_refused_in_gymnasiums_words(vector):
    envs = vector([functools.partial(gymnasium.make, "CartPole-v1")] * 3,
                  autoreset_mode=AutoresetMode.DISABLED)
    envs.reset(options={"reset_mask": np.array([True, True, True])})
    for mask, error, text in (
            (np.array([True]), ValueError, "must have shape `(3,)`, got (1,)"),
            (np.array([True, True, False, False]), ValueError, "must have shape `(3,)`, got (4,)"),
            (np.array([[True, True, True]]), ValueError, "must have shape `(3,)`, got (1, 3)"),
            (np.array([False, False, False]), ValueError,
             "must contain a boolean array with at least one True value, got reset_mask="
             "[False False False]"),
            (np.array([1, 1, 0]), TypeError, "must have `dtype=np.bool_`, got int64"),
            (np.array([1.0, 1.0, 0.0]), TypeError, "must have `dtype=np.bool_`, got float64")):
        with pytest.raises(error, match=re.escape(f"`options['reset_mask']` {text}")):
            envs.reset(options={"reset_mask": mask})


def test_action_count(vector):
    envs = vector([functools.partial(gymnasium.make, "CartPole-v1")] * 4)
    envs.reset()
    actions = envs.action_space.sample()
    assert all(len(x) == 4 for x in envs.step(actions)[:4])
    with pytest.raises(ValueError):
        envs.step(actions[:3])
    with pytest.raises(ValueError):
        envs.step(np.concatenate([actions, actions[:1]]))
    with pytest.raises(TypeError):
        envs.step(0)


# -- test_async_vector_env.py and test_sync_vector_env.py --------------------------------
def test_metadata_is_the_vector_envs_own(vector):
    next_step = vector(cart_poles(1), autoreset_mode=AutoresetMode.NEXT_STEP)
    same_step = vector(cart_poles(1), autoreset_mode=AutoresetMode.SAME_STEP)
    assert next_step.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    assert same_step.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    assert "autoreset_mode" not in helpers.made("CartPole-v1", 0).metadata


def test_reset_and_step_batches(vector):
    envs = vector(cart_poles(8))
    observations, infos = envs.reset()
    assert isinstance(envs.observation_space, spaces.Box) and isinstance(infos, dict)
    assert observations.dtype == envs.observation_space.dtype
    assert observations.shape == (8,) + envs.single_observation_space.shape
    assert observations.shape == envs.observation_space.shape
    assert isinstance(envs.single_action_space, spaces.Discrete)
    assert isinstance(envs.action_space, spaces.MultiDiscrete)
    for actions in ([envs.single_action_space.sample() for _ in range(8)],
                    envs.action_space.sample()):
        observations, rewards, terminations, truncations, _ = envs.step(actions)
        assert observations.shape == envs.observation_space.shape
        assert rewards.dtype.kind == "f" and rewards.shape == (8,)
        assert terminations.dtype == np.bool_ and terminations.shape == (8,)
        assert truncations.dtype == np.bool_ and truncations.shape == (8,)


def test_call_and_set_attr(vector):
    envs = vector(cart_poles(4))
    envs.reset()
    gravity = envs.call("gravity")
    assert gravity == (9.8,) * 4 and all(isinstance(g, float) for g in gravity)
    envs.set_attr("gravity", [9.81, 3.72, 8.87, 1.62])
    assert envs.get_attr("gravity") == (9.81, 3.72, 8.87, 1.62)
    with pytest.raises(ValueError, match="use `reset` directly"):
        envs.call("reset")
    assert envs.render_mode is None


def test_reset_and_step_timeouts(vector):
    envs = vector([functools.partial(helpers.SleepyEnv, 0.3)] * 4)
    envs.reset_async()
    with pytest.raises(multiprocessing.TimeoutError):
        envs.reset_wait(timeout=0.1)
    envs.reset_wait(timeout=60)   # fibrl keeps the call pending (gymnasium drops it)
    fast = vector([functools.partial(helpers.SleepyEnv, 0.0)] * 4)
    fast.reset()
    fast.step_async(np.array([0.1, 0.1, 0.3, 0.1], np.float32))
    with pytest.raises(multiprocessing.TimeoutError):
        fast.step_wait(timeout=0.1)


def test_calls_out_of_order(vector):
    envs = vector(cart_poles(4))
    with pytest.raises(NoAsyncCallError, match=re.escape(
            "Calling `reset_wait` without any prior call to `reset_async`.")):
        envs.reset_wait()
    envs.reset()
    with pytest.raises(NoAsyncCallError, match=re.escape(
            "Calling `step_wait` without any prior call to `step_async`.")):
        envs.step_wait()
    envs.step_async(envs.action_space.sample())
    with pytest.raises(AlreadyPendingCallError, match=re.escape(
            "Calling `reset_async` while waiting for a pending call to `step` to complete")):
        envs.reset_async()
    with pytest.warns(UserWarning, match=re.escape(
            "Calling `close` while waiting for a pending call to `step` to complete.")):
        envs.close()
    envs = vector(cart_poles(4))
    envs.reset_async()
    with pytest.raises(AlreadyPendingCallError, match=re.escape(
            "Calling `step_async` while waiting for a pending call to `reset` to complete")):
        envs.step_async(envs.action_space.sample())
    with pytest.warns(UserWarning, match=re.escape(
            "Calling `close` while waiting for a pending call to `reset` to complete.")):
        envs.close()


def test_closed(vector):
    envs = vector(cart_poles(4))
    envs.close()
    with pytest.raises(ClosedEnvironmentError):
        envs.reset()


def test_envs_with_different_spaces_are_refused(vector):
    fns = cart_poles(8)
    fns[1] = functools.partial(helpers.made, "FrozenLake-v1", 1)
    with pytest.raises(RuntimeError, match=re.escape(
            "RemoteVectorEnv(..., observation_mode='same') however the sub-environments "
            "observation spaces are not equivalent")):
        vector(fns)


def test_custom_spaces(vector):
    envs = vector([helpers.AnyIntEnv] * 4)
    reset_observations, _ = envs.reset()
    assert isinstance(envs.single_action_space, helpers.AnyInt)
    assert isinstance(envs.action_space, spaces.Tuple)
    step_observations, *_ = envs.step(("action-2", "action-3", "action-5", "action-7"))
    assert isinstance(envs.single_observation_space, helpers.AnyInt)
    assert isinstance(envs.observation_space, spaces.Tuple)
    assert reset_observations == ("reset",) * 4
    assert step_observations == ("step(action-2)", "step(action-3)", "step(action-5)",
                                 "step(action-7)")


def test_float16_observations(vector):
    space = spaces.Box(-1.0, 1.0, (3,), np.float16)
    envs = vector([functools.partial(helpers.GenericEnv, space)] * 2)
    observations, _ = envs.reset(seed=0)
    assert observations.dtype == np.float16 and observations.shape == (2, 3)
    observations, *_ = envs.step(envs.action_space.sample())
    assert observations.dtype == np.float16 and observations.shape == (2, 3)


def test_an_envs_error_reaches_the_caller(vector):
    """gymnasium's AsyncVectorEnv raises what the env raised (its worker then shuts down);
    RemoteVectorEnv does with on_error="raise", and goes on after a reset."""
    fn = functools.partial(helpers.GenericEnv, reset_func=helpers.failing_reset,
                           step_func=helpers.failing_step)
    envs = vector([fn] * 2, on_error="raise", check_actions=False)
    envs.reset(seed=[0, 0])
    with pytest.raises(ValueError, match="Error in reset"):
        envs.reset(seed=[1, 0])
    envs = vector([fn] * 3, on_error="raise", check_actions=False)
    envs.reset(seed=[0, 0, 0])
    with pytest.raises(ValueError, match="Error in step"):
        envs.step(np.array([[0.0], [1.0], [2.0]], np.float32))


# -- test_observation_mode.py ------------------------------------------------------------
def boxes(highs, shape=5):
    return [functools.partial(helpers.GenericEnv, spaces.Box(0, h, (shape,))) for h in highs]


def test_invalid_observation_mode(vector):
    with pytest.raises(ValueError, match=re.escape(
            "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single "
            "and batch observation space, actual got invalid")):
        vector(boxes([1, 1, 1]), observation_mode="invalid")


def test_observation_mode_same_with_differing_spaces(vector):
    with pytest.raises((AssertionError, RuntimeError), match=(
            "the sub-environments observation spaces are not equivalent. .*If this is "
            "intentional, use `observation_mode='different'` instead.")):
        vector(boxes([1, 2, 3], 2), observation_mode="same")


@pytest.mark.parametrize("mode", ["different", "custom"])
def test_observation_mode_different_with_differing_spaces(vector, mode):
    singles = [spaces.Box(0, h, (5,)) for h in (1, 2, 3)]
    given = mode if mode == "different" else (
        spaces.Box(0, np.repeat(np.arange(1, 4), 5).reshape((3, 5)), (3, 5)),
        spaces.Box(0, 1, (5,)))
    envs = vector(boxes([1, 2, 3]), observation_mode=given)
    from gymnasium.vector.utils import batch_differing_spaces
    assert envs.observation_space == batch_differing_spaces(singles)
    assert envs.single_observation_space == singles[0]
    envs.reset()
    envs.step(envs.action_space.sample())


@pytest.mark.parametrize("mode", ["different", "custom"])
def test_observation_mode_different_with_differing_shapes(vector, mode):
    fns = [functools.partial(helpers.GenericEnv, spaces.Box(0, 1, (i + 1,))) for i in range(3)]
    given = mode if mode == "different" else (spaces.Box(0, 4, (3, 5)), spaces.Box(0, 4, (5,)))
    with pytest.raises((AssertionError, RuntimeError, ValueError)):
        vector(fns, observation_mode=given)


@pytest.mark.parametrize("mode", ["same", "different", "custom"])
def test_mixed_observation_spaces(vector, mode):
    fns = [functools.partial(helpers.GenericEnv, s) for s in (
        spaces.Box(0, 1, (3,)), spaces.Discrete(5),
        spaces.Dict(a=spaces.Discrete(2), b=spaces.Box(0, 1, (2,))))]
    given = mode if mode != "custom" else (spaces.Box(0, 4, (3, 5)), spaces.Box(0, 4, (5,)))
    with pytest.raises((AssertionError, RuntimeError, TypeError)):
        vector(fns, observation_mode=given)


# -- test_autoreset_mode.py --------------------------------------------------------------
def counters(mode, vector):
    fn = functools.partial(helpers.GenericEnv, spaces.Discrete(5), spaces.Discrete(5),
                           helpers.counting_reset, helpers.counting_step)
    envs = vector([fn] * 3, autoreset_mode=mode)
    assert envs.metadata["autoreset_mode"] == mode
    envs.set_attr("max_count", [2, 3, 3])
    obs, info = envs.reset()
    assert np.all(obs == [0, 0, 0]) and info == {}
    return envs


def expect(result, obs, rewards, terminations, info=None):
    got_obs, got_rewards, got_terms, got_truncs, got_info = result
    assert np.all(got_obs == obs) and np.all(got_rewards == rewards)
    assert np.all(got_terms == terminations) and not got_truncs.any()
    if info is None:
        assert got_info == {}
    else:
        assert data_equivalence(got_info, info), got_info


def test_autoreset_next_step(vector):
    envs = counters(AutoresetMode.NEXT_STEP, vector)
    for obs, rewards, terms in (([1, 1, 1], [1, 2, 3], [0, 0, 0]),
                                ([2, 2, 2], [1, 2, 3], [1, 0, 0]),
                                ([0, 3, 3], [0, 2, 3], [0, 1, 1]),
                                ([1, 0, 0], [1, 0, 0], [0, 0, 0])):
        expect(envs.step([1, 2, 3]), obs, rewards, np.array(terms, bool))


def final(obs, ended):
    return {"final_obs": np.array(obs, dtype=object), "final_info": {},
            "_final_obs": np.array(ended), "_final_info": np.array(ended)}


def test_autoreset_same_step(vector):
    envs = counters(AutoresetMode.SAME_STEP, vector)
    expect(envs.step([1, 2, 3]), [1, 1, 1], [1, 2, 3], [False] * 3)
    expect(envs.step([1, 2, 3]), [0, 2, 2], [1, 2, 3], [True, False, False],
           final([2, None, None], [True, False, False]))
    expect(envs.step([1, 2, 3]), [1, 0, 0], [1, 2, 3], [False, True, True],
           final([None, 3, 3], [False, True, True]))
    expect(envs.step([1, 2, 3]), [0, 1, 1], [1, 2, 3], [True, False, False],
           final([2, None, None], [True, False, False]))


def test_autoreset_disabled(vector):
    envs = counters(AutoresetMode.DISABLED, vector)
    expect(envs.step([1, 2, 3]), [1, 1, 1], [1, 2, 3], [False] * 3)
    expect(envs.step([1, 2, 3]), [2, 2, 2], [1, 2, 3], [True, False, False])
    obs, info = envs.reset(options={"reset_mask": np.array([True, False, False])})
    assert np.all(obs == [0, 2, 2]) and info == {}
    expect(envs.step([1, 2, 3]), [1, 3, 3], [1, 2, 3], [False, True, True])
    obs, info = envs.reset(options={"reset_mask": np.array([False, True, True])})
    assert np.all(obs == [1, 0, 0]) and info == {}
    expect(envs.step([1, 2, 3]), [2, 1, 1], [1, 2, 3], [True, False, False])


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
def test_autoreset_metadata(vector, mode):
    for given in (mode, mode.value):
        envs = vector([helpers.GenericEnv] * 2, autoreset_mode=given)
        assert envs.metadata["autoreset_mode"] == mode


@pytest.mark.parametrize("space", helpers.TEST_SPACES, ids=str)
def test_same_step_final_obs_is_in_the_space(vector2, space):
    fn = functools.partial(helpers.GenericEnv, space, spaces.Discrete(5),
                           helpers.sampled_counting_reset, helpers.sampled_counting_step)
    envs = vector2([fn] * 3, autoreset_mode=AutoresetMode.SAME_STEP)
    envs.set_attr("max_count", [2, 3, 3])
    envs.reset()
    envs.step([1, 2, 3])
    *_, info = envs.step([1, 2, 3])
    assert info["final_obs"][0] in envs.single_observation_space
    *_, info = envs.step([1, 2, 3])
    assert info["final_obs"][1] in envs.single_observation_space
    assert info["final_obs"][2] in envs.single_observation_space


# -- test_vector_env_info.py -------------------------------------------------------------
def test_infos_are_batched(vector):
    envs = vector([functools.partial(helpers.InfoEnv, [{"a": 1}, {"c": np.array([1, 2])}]),
                   functools.partial(helpers.InfoEnv, [{"a": 2, "b": 3},
                                                       {"c": np.array([3, 4])}])])
    _, info = envs.reset()
    assert data_equivalence(info, {"a": np.array([1, 2]), "b": np.array([0, 3]),
                                   "_a": np.array([True, True]), "_b": np.array([False, True])})
    *_, info = envs.step(envs.action_space.sample())
    assert data_equivalence(info, {"c": np.array([[1, 2], [3, 4]]),
                                   "_c": np.array([True, True])})


# -- test_vector_wrapper.py --------------------------------------------------------------
class CountingResets(VectorWrapper):
    def __init__(self, env):
        super().__init__(env)
        self.counter = 0

    def reset(self, *, seed=None, options=None):
        self.counter += 1
        return super().reset(seed=seed, options=options)


def test_vector_wrappers_forward_to_it(vector):
    wrapped = CountingResets(vector([functools.partial(gymnasium.make, "FrozenLake-v1")]))
    wrapped.reset()
    assert wrapped.counter == 1
    plain = vector([functools.partial(gymnasium.make, "CartPole-v1")] * 3)
    wrapped = CountingResets(vector([functools.partial(gymnasium.make, "CartPole-v1")] * 3))
    assert np.allclose(wrapped.env.call("gravity"), plain.call("gravity"))
    plain.set_attr("gravity", [20.0] * 3)
    wrapped.env.set_attr("gravity", [20.0] * 3)
    assert np.allclose(wrapped.env.get_attr("gravity"), plain.get_attr("gravity"))
    assert plain.metadata == wrapped.metadata
    plain.metadata = {"render_modes": ["rgb_array"]}
    assert plain.metadata != wrapped.metadata


# -- test_sync_vector_env.py: seeding of the batched action space -------------------------
def test_action_space_samples_follow_the_envs_seeded_space(vector):
    """As in SyncVectorEnv, the batched action space starts from the generator of the env's
    own action space (here seeded by the env's maker)."""
    pendulum = functools.partial(helpers.made, "Pendulum-v1", 123)
    single, one = pendulum(), vector([pendulum])
    remote, sync = vector([pendulum] * 3), SyncVectorEnv([pendulum] * 3)
    assert (remote.action_space.np_random.bit_generator.state
            == sync.action_space.np_random.bit_generator.state)
    for _ in range(100):
        assert np.all(single.action_space.sample() == one.action_space.sample())
        assert np.all(remote.action_space.sample() == sync.action_space.sample())
