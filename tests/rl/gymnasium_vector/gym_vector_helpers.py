"""Envs and spaces for the adapted gymnasium vector tests (importable by the workers).

gymnasium's own tests build their envs with a configurable test env and closures; these
are module-level equivalents, so that a worker on any backend imports them by name.
"""
from __future__ import annotations

import copy
import time

import gymnasium
import numpy as np
from gymnasium import spaces


def sample_reset(env, seed=None, options=None):
    """Reset: a sample of the observation space, seeded from the env's seed."""
    env.observation_space.seed(env.np_random_seed)
    return env.observation_space.sample(), {"options": options}


def sample_step(env, action):
    """Step: a sample, reward 0, never ending."""
    return env.observation_space.sample(), 0, False, False, {}


def checked_step(env, action):
    """Step that asserts its action is in the action space (as most envs do)."""
    assert action in env.action_space, f"{action!r} not in {env.action_space}"
    return env.observation_space.sample(), 0, False, False, {}


class GenericEnv(gymnasium.Env):
    """An env whose spaces, reset and step are given (functions taking the env first)."""

    def __init__(self, observation_space=None, action_space=None, reset_func=sample_reset,
                 step_func=sample_step, render_mode=None) -> None:
        self.observation_space = copy.deepcopy(observation_space or spaces.Box(0, 1, (1,)))
        self.action_space = copy.deepcopy(action_space or spaces.Box(0, 1, (1,)))
        self.reset_func, self.step_func = reset_func, step_func
        self.render_mode = render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.reset_func(self, seed=seed, options=options)

    def step(self, action):
        return self.step_func(self, action)


def made(env_id, seed, **kwargs):
    """``gymnasium.make(env_id)`` with its action space and its first reset seeded."""
    env = gymnasium.make(env_id, disable_env_checker=True, **kwargs)
    env.action_space.seed(seed)
    env.reset(seed=seed)
    return env


class SleepyEnv(gymnasium.Env):
    """Image observations; reset sleeps ``slow_reset`` s, step sleeps ``action`` s."""

    observation_space = spaces.Box(0, 255, (64, 64, 3), np.uint8)
    action_space = spaces.Box(0.0, 1.0, (), np.float32)

    def __init__(self, slow_reset: float = 0.3) -> None:
        self.slow_reset = slow_reset

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        time.sleep(self.slow_reset)
        return self.observation_space.sample(), {}

    def step(self, action):
        time.sleep(float(action))
        return self.observation_space.sample(), 0.0, False, False, {}


class AnyInt(spaces.Space):
    """A custom space (gymnasium has no batching rule for it)."""

    def sample(self, mask=None, probability=None):
        return int(self.np_random.integers(0, 10))

    def contains(self, x):
        return 0 <= x <= 10

    def __eq__(self, other):
        return isinstance(other, AnyInt)


class AnyIntEnv(gymnasium.Env):
    """Custom spaces; observations are strings that quote the action."""

    observation_space = AnyInt()
    action_space = AnyInt()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "reset", {}

    def step(self, action):
        return f"step({action:s})", 0.0, False, False, {}


def counting_reset(env, seed=None, options=None):
    env.count = seed if seed is not None else 0
    return env.count, {}


def counting_step(env, action):
    env.count += 1
    return env.count, action, env.count == env.max_count, False, {}


def sampled_counting_reset(env, seed=None, options=None):
    env.count = 0
    env.observation_space.seed(env.np_random_seed)
    return env.observation_space.sample(), {}


def sampled_counting_step(env, action):
    env.count += 1
    return env.observation_space.sample(), action, env.count == env.max_count, False, {}


def failing_reset(env, seed=None, options=None):
    if seed == 1:
        raise ValueError("Error in reset")
    return env.observation_space.sample(), {}


def failing_step(env, action):
    if action >= 1:
        raise ValueError(f"Error in step with {action}")
    return env.observation_space.sample(), 0, False, False, {}


def final_obs_reset(env, seed=None, options=None):
    return 0, {"reset": True}


def final_obs_step(env, action):
    return (action if action < 3 else 0), 0, action >= 3, False, {"action": action}


class InfoEnv(gymnasium.Env):
    """Returns ``infos[0]`` from reset and ``infos[1]`` from step (ending every step)."""

    observation_space = spaces.Box(0, 1)
    action_space = spaces.Box(0, 1)

    def __init__(self, infos) -> None:
        self.infos = infos

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), self.infos[0]

    def step(self, action):
        return self.observation_space.sample(), 0, True, False, self.infos[1]


# The kinds of space gymnasium's vector tests run through (their own list is longer, with
# more bounds and dtypes of the same kinds).
TEST_SPACES = [
    spaces.Discrete(3),
    spaces.Discrete(3, start=-1),
    spaces.Discrete(n=4, dtype=np.int32, start=1),
    spaces.Box(0.0, 1.0),
    spaces.Box(0.0, np.inf, (2, 2)),
    spaces.Box(np.array([-10.0, 0.0]), np.array([10.0, 10.0]), dtype=np.float64),
    spaces.Box(0, 255, (2, 2, 3), np.uint8),
    spaces.Box(np.array([0, 0, 1]), np.array([1, 0, 1]), dtype=np.bool_),
    spaces.Box(np.array([-np.inf, -np.inf, 0, -10]), np.array([np.inf, 0, np.inf, 10]),
               dtype=np.int32),
    spaces.MultiDiscrete([2, 2]),
    spaces.MultiDiscrete([[2, 3], [3, 2]], start=[[10, 20], [30, 40]]),
    spaces.MultiDiscrete([2, 3], dtype=np.uint16),
    spaces.MultiBinary(8),
    spaces.MultiBinary([2, 3]),
    spaces.Text(6),
    spaces.Text(min_length=3, max_length=6, charset="abcdef"),
    spaces.Tuple((spaces.Discrete(5), spaces.Box(0.0, 1.0, (2,), np.float64))),
    spaces.Tuple((spaces.Discrete(3), spaces.Dict(position=spaces.Box(0.0, 1.0),
                                                  velocity=spaces.Discrete(2)))),
    spaces.Tuple((spaces.Graph(spaces.Box(-1, 1, (2, 1)), None), spaces.Discrete(2))),
    spaces.Dict(a=spaces.Box(0, 1, (3, 3)),
                b=spaces.Dict(b_1=spaces.Box(-100, 100, (2,)), b_2=spaces.Box(-1, 1, (2,))),
                c=spaces.Discrete(4)),
    spaces.Dict(a=spaces.Dict(a=spaces.Graph(spaces.Box(-100, 100, (2, 2)), None),
                              b=spaces.Box(-100, 100, (2, 2)))),
    spaces.Graph(spaces.Box(-100, 100, (3, 4)), spaces.Discrete(5)),
    spaces.Graph(spaces.Discrete(3), spaces.Discrete(4)),
    spaces.Graph(spaces.Dict(f1=spaces.Discrete(5), f2=spaces.MultiBinary(5)),
                 spaces.Box(1, 4)),
    spaces.Sequence(spaces.Discrete(4)),
    spaces.Sequence(spaces.Dict(feature=spaces.Box(0, 1, (3,)))),
    spaces.Sequence(spaces.Box(0.0, 1.0), stack=True),
    spaces.Sequence(spaces.Dict(a=spaces.Box(0, 1, (3,)), b=spaces.Discrete(5)), stack=True),
    spaces.OneOf([spaces.Discrete(3), spaces.Box(0.0, 1.0)]),
    spaces.OneOf([spaces.MultiBinary(2), spaces.MultiDiscrete([2, 2])]),
]
