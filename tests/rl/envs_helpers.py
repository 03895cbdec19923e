"""Environments for the RemoteVectorEnv tests: importable by the workers (by reference)."""
from __future__ import annotations

import os
import time

import gymnasium
import numpy as np
from gymnasium import spaces


class DictTupleEnv(gymnasium.Env):
    """Dict observations holding a Box, a Discrete and a Tuple; ends after 7 steps."""

    def __init__(self) -> None:
        self.observation_space = spaces.Dict({
            "pos": spaces.Box(-10, 10, (3,), np.float32),
            "mode": spaces.Discrete(4),
            "pair": spaces.Tuple((spaces.Discrete(5), spaces.Box(0, 1, (2, 2), np.float64))),
        })
        self.action_space = spaces.Discrete(3)
        self.t = 0

    def _obs(self):
        return {"pos": self.np_random.uniform(-1, 1, 3).astype(np.float32),
                "mode": int(self.np_random.integers(4)),
                "pair": (int(self.np_random.integers(5)), self.np_random.random((2, 2)))}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {"t": self.t}

    def step(self, action):
        self.t += 1
        return self._obs(), float(action) + 0.5, self.t >= 7, False, {"t": self.t}


class CrashAt(gymnasium.Wrapper):
    """CartPole that raises on its ``crash_at``-th step (each new instance counts afresh)."""

    def __init__(self, crash_at: int = 50) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))
        self.crash_at, self.steps = crash_at, 0

    def step(self, action):
        self.steps += 1
        if self.steps == self.crash_at:
            raise RuntimeError(f"boom at step {self.steps}")
        return self.env.step(action)


class AlwaysCrash(CrashAt):
    """Raises on every step."""

    def __init__(self) -> None:
        super().__init__(crash_at=1)

    def step(self, action):
        raise RuntimeError("this env always crashes")


class Slow(gymnasium.Wrapper):
    """CartPole whose step sleeps ``delay`` seconds (a slow simulator)."""

    def __init__(self, delay: float) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))
        self.delay = delay
        self.pid = os.getpid()

    def step(self, action):
        time.sleep(self.delay)
        return self.env.step(action)


class Gated(gymnasium.Wrapper):
    """CartPole whose step waits until the file ``gate`` exists (at most a minute)."""

    def __init__(self, gate: str) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))
        self.gate = gate

    def step(self, action):
        deadline = time.monotonic() + 60.0
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.env.step(action)


class HangAt(CrashAt):
    """Hangs (sleeps an hour) on its ``crash_at``-th step."""

    def step(self, action):
        self.steps += 1
        if self.steps == self.crash_at:
            time.sleep(3600)
        return self.env.step(action)


class Pid(gymnasium.Wrapper):
    """CartPole that knows the pid of its worker (``get_attr("pid")``)."""

    def __init__(self) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))
        self.pid = os.getpid()


class Float64Obs(gymnasium.ObservationWrapper):
    """CartPole whose observations are float64 while its space says float32."""

    def __init__(self) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))

    def observation(self, observation):
        return observation.astype(np.float64) + 1e-9  # not exactly representable in float32


class Counter(gymnasium.Env):
    """Discrete observations (a count modulo 10, as a Python int); ends after 9 steps."""

    observation_space = spaces.Discrete(10)
    action_space = spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = int(self.np_random.integers(10))
        return self.t, {}

    def step(self, action):
        self.t = (self.t + int(action)) % 10
        return self.t, float(self.t), self.t == 9, False, {}


class Frames(gymnasium.Wrapper):
    """CartPole whose ``render()`` is a small frame holding its observation's first value
    (no display or pygame needed)."""

    def __init__(self) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))
        self.last = None

    @property
    def render_mode(self):
        return "rgb_array"

    def reset(self, **kwargs):
        self.last, info = self.env.reset(**kwargs)
        return self.last, info

    def step(self, action):
        out = self.env.step(action)
        self.last = out[0]
        return out

    def render(self):
        return np.full((2, 2, 3), self.last[0], dtype=np.float32)
