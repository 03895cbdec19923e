"""RemoteVectorEnv and gymnasium spaces: every space batches as SyncVectorEnv batches it,
the envs' spaces are checked at construction (``observation_mode``), and actions are
checked against the action space before they are sent."""
from __future__ import annotations

import functools

import pytest

from conftest import require_module

gymnasium = require_module("gymnasium", "CI_REQUIRE_DOCKER")
np = require_module("numpy", "CI_REQUIRE_DOCKER")

from gymnasium import spaces  # noqa: E402
from gymnasium.utils.env_checker import data_equivalence  # noqa: E402
from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402
from gymnasium.vector.utils import batch_differing_spaces  # noqa: E402

from fibrl.rl import RemoteVectorEnv  # noqa: E402
from fibrl.rl.envs import InvalidActionError  # noqa: E402
from fibrl.rl.envs.spaces import ActionCheck, is_fixed  # noqa: E402

import envs_helpers  # noqa: E402

# one of each kind gymnasium's batching utilities support, plain and nested
SPACES = [
    spaces.Box(-1, 1, (2, 3), np.float32),
    spaces.Discrete(5, start=-2),
    spaces.MultiDiscrete([3, 4]),
    spaces.MultiBinary(5),
    spaces.Text(6),
    spaces.Text(min_length=2, max_length=4, charset="abc"),
    spaces.Graph(node_space=spaces.Box(-1, 1, (2,)), edge_space=spaces.Discrete(3)),
    spaces.Sequence(spaces.Discrete(4)),
    spaces.Sequence(spaces.Box(0, 1, (2,)), stack=True),
    spaces.OneOf([spaces.Discrete(3), spaces.Box(0, 1, (2,))]),
    spaces.Dict(a=spaces.Text(3), b=spaces.Discrete(2)),
    spaces.Tuple((spaces.Graph(spaces.Discrete(3), None), spaces.Box(0, 1, (2,)))),
    spaces.Dict(a=spaces.Discrete(3), b=spaces.Tuple((spaces.MultiBinary(2),
                                                       spaces.Box(0, 1, ())))),
]


@pytest.mark.parametrize("space", SPACES, ids=lambda s: type(s).__name__)
def test_every_space_batches_as_in_sync_vector_env(space):
    """Observations and actions of every space kind, as SyncVectorEnv returns them; Text
    raised "'str' object does not support item assignment", OneOf returned empty tuples."""
    fns = [functools.partial(envs_helpers.SpaceEnv, space)] * 3
    sync = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    remote = RemoteVectorEnv(fns, envs_per_worker=2, autoreset_mode="SameStep")
    try:
        assert remote.observation_space == sync.observation_space
        assert remote.action_space == sync.action_space
        got, want = remote.reset(seed=4), sync.reset(seed=4)
        assert data_equivalence(got, want), (got, want)
        assert got[0] in remote.observation_space
        remote.action_space.seed(1)
        sync.action_space.seed(1)
        for _ in range(3):
            actions = remote.action_space.sample()
            assert data_equivalence(actions, sync.action_space.sample())
            got, want = remote.step(actions), sync.step(actions)
            assert data_equivalence(got, want), (got, want)
            assert got[0] in remote.observation_space
        masked, _ = remote.reset(options={"reset_mask": np.array([False, True, False])})
        assert masked in remote.observation_space
        assert remote.restart_counts == (0, 0, 0)   # the envs' own asserts held
    finally:
        remote.close()
        sync.close()


def test_custom_spaces_travel_as_objects():
    remote = RemoteVectorEnv([envs_helpers.CustomSpaceEnv] * 4, envs_per_worker=3)
    try:
        assert isinstance(remote.action_space, spaces.Tuple)
        assert remote.reset()[0] == ("reset",) * 4
        obs, *_ = remote.step(("a-2", "a-3", "a-5", "a-7"))  # not checked: custom space
        assert obs == ("step(a-2)", "step(a-3)", "step(a-5)", "step(a-7)")
        remote.send(["x", "y"], env_ids=[3, 1])
        obs, *_, infos = remote.recv(num=2, timeout=60)
        assert sorted(obs) == ["step(x)", "step(y)"] and sorted(infos["env_id"]) == [1, 3]
        with pytest.raises(ValueError, match="3 actions for 4 envs"):
            remote.step(("a", "b", "c"))
    finally:
        remote.close()


def test_fast_path_is_kept_for_array_spaces():
    assert all(is_fixed(s) for s in SPACES[:4] + SPACES[-1:])
    assert not any(is_fixed(s) for s in SPACES[4:-1])


def frozen_lake():
    return gymnasium.make("FrozenLake-v1")


def cart_pole():
    return gymnasium.make("CartPole-v1")


def box_env(high):
    return envs_helpers.SpaceEnv(spaces.Box(0, high, (5,), np.float32), spaces.Discrete(2))


@pytest.mark.timeout(180)   # 15-60 s measured on a loaded two-core machine
def test_envs_whose_spaces_differ_are_refused_at_construction():
    with pytest.raises(RuntimeError, match="observation spaces are not equivalent"):
        RemoteVectorEnv([cart_pole, frozen_lake, cart_pole], envs_per_worker=2)
    fns = [functools.partial(box_env, h) for h in (1, 2, 3)]
    with pytest.raises(RuntimeError, match="observation_mode='different'"):
        RemoteVectorEnv(fns, envs_per_worker=2)
    with pytest.raises(ValueError, match="Invalid `observation_mode`"):
        RemoteVectorEnv(fns, observation_mode="invalid")
    with pytest.raises(TypeError, match="Spaces"):
        RemoteVectorEnv(fns, observation_mode=(1, 2))
    odd_actions = [cart_pole, functools.partial(envs_helpers.SpaceEnv,
                                                cart_pole().observation_space,
                                                spaces.Discrete(3))]
    with pytest.raises(RuntimeError, match="action space different"):
        RemoteVectorEnv(odd_actions)


@pytest.mark.parametrize("mode", ["different", "custom"])
def test_observation_mode_different_batches_differing_bounds(mode):
    boxes = [spaces.Box(0, h, (5,), np.float32) for h in (1, 2, 3)]
    fns = [functools.partial(box_env, h) for h in (1, 2, 3)]
    given = "different" if mode == "different" else (batch_differing_spaces(boxes), boxes[0])
    envs = RemoteVectorEnv(fns, envs_per_worker=2, observation_mode=given)
    try:
        assert envs.observation_space == batch_differing_spaces(boxes)
        assert envs.single_observation_space == boxes[0]
        obs, _ = envs.reset(seed=0)
        assert obs in envs.observation_space and obs[2].max() > 1   # env 2's own bounds
        envs.step(envs.action_space.sample())
    finally:
        envs.close()
    shapes = [functools.partial(envs_helpers.SpaceEnv, spaces.Box(0, 1, (i + 1,)),
                                spaces.Discrete(2)) for i in range(3)]
    with pytest.raises(RuntimeError, match="common shape and dtype"):
        RemoteVectorEnv(shapes, observation_mode="different")


def test_an_invalid_action_raises_before_anything_is_sent():
    envs = RemoteVectorEnv("CartPole-v1", 4, envs_per_worker=2, seed=0)
    try:
        envs.reset(seed=0)
        with pytest.raises(AssertionError, match="env 2's action"):   # what CartPole raises
            envs.step(np.array([0, 1, 3, 0]))
        with pytest.raises(ValueError, match="env 0's action"):
            envs.step(np.array([-1, 1, 1, 0]))
        with pytest.raises(InvalidActionError, match="Discrete"):
            envs.step(np.array([0.0, 1.0, 1.0, 0.0]))   # floats: Discrete.contains refuses
        with pytest.raises(InvalidActionError):
            envs.send(np.array([5]), env_ids=[1])
        obs, *_ = envs.step([0, 1, 1, 0])
        assert obs.shape == (4, 4) and envs.restart_counts == (0, 0, 0, 0)
    finally:
        envs.close()


def test_check_actions_false_sends_them_as_gymnasium_does():
    """Unchecked, CartPole's own assert fires in the worker: a restart (the default) or
    the AssertionError itself (on_error="raise")."""
    envs = RemoteVectorEnv("CartPole-v1", 2, check_actions=False, on_error="raise")
    try:
        envs.reset(seed=0)
        with pytest.raises(AssertionError, match="invalid"):
            envs.step(np.array([3, 0]))
    finally:
        envs.close()


@pytest.mark.parametrize("space, good, bad", [
    (spaces.Box(-1, 1, (2,), np.float32), [[0.5, -1.0], [1.0, 0.0]], [[0.5, -1.5], [0, 0]]),
    (spaces.Box(-1, 1, (2,), np.float32), [[0.5, -1.0], [1.0, 0.0]], [[0.5, 0.5, 0.5]] * 2),
    (spaces.Box(-np.inf, np.inf, (2,)), [[1e30, -1e30], [0, 0]], [[1, 2, 3], [1, 2, 3]]),
    (spaces.Discrete(5, start=-2), [-2, 2, 0], [0, -3, 1]),
    (spaces.Discrete(5, start=-2), [-2, 2, 0], [0, 3, 1]),
    (spaces.Discrete(4), np.array([3, 0], np.uint8), np.array([4, 0], np.uint8)),
    (spaces.MultiDiscrete([2, 3]), [[1, 2], [0, 0]], [[1, 3], [0, 0]]),
    (spaces.MultiBinary(3), [[1, 0, 1], [0, 0, 0]], [[1, 2, 0], [0, 0, 0]]),
    (spaces.Dict(a=spaces.Discrete(3), b=spaces.Box(0, 1, ())),
     {"a": [2, 0], "b": [0.5, 1.0]}, {"a": [2, 3], "b": [0.5, 1.0]}),
    (spaces.Tuple((spaces.Discrete(2), spaces.MultiBinary(2))),
     ([1, 0], [[1, 1], [0, 0]]), ([1, 0], [[1, 1], [0, 5]])),
    (spaces.Text(3, charset="ab"), ("ab", "b"), ("ab", "c")),
], ids=lambda p: type(p).__name__ if isinstance(p, spaces.Space) else "")
def test_action_check_is_vectorized_for_arrays_and_follows_contains(space, good, bad):
    check = ActionCheck(space)
    check(np.asarray(good) if isinstance(good, list) else good)
    with pytest.raises(InvalidActionError, match="not in the action space"):
        check(np.asarray(bad) if isinstance(bad, list) else bad)
    ActionCheck(space, enabled=False)(bad)   # check_actions=False


def test_a_reset_that_fails_on_its_seed_raises_instead_of_reseeding():
    """The env raises for seed 1: retried once on a fresh env with seed 1, then raised in
    the caller; it used to come back reset with a restart seed, silently."""
    envs = RemoteVectorEnv([envs_helpers.SeedFails] * 2, envs_per_worker=2)
    try:
        envs.reset(seed=[0, 0])
        with pytest.raises(ValueError, match="Error in reset with seed 1") as info:
            envs.reset(seed=[1, 0])
        assert "RemoteTraceback" in type(info.value.__cause__).__name__
        assert "SeedFails" in str(info.value.__cause__) or "reset" in str(info.value.__cause__)
        assert envs.restart_counts == (1, 0)   # the retry on a fresh env
        obs, _ = envs.reset(seed=[2, 3])       # usable again
        assert obs.shape == (2, 2)
    finally:
        envs.close()
