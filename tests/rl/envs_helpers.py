"""Environments for the RemoteVectorEnv tests: importable by the workers (by reference)."""
from __future__ import annotations

import copy
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


class HangsInFirstStep(gymnasium.Wrapper):
    """CartPole whose first step of all (the first instance, in any worker, to create
    the file ``inside``) creates that file and then hangs (an hour): a test waits for
    the file, then kills the worker while it is inside that step. Every other step is
    CartPole's."""

    def __init__(self, inside: str) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))
        self.inside = inside
        self.pid = os.getpid()

    def step(self, action):
        try:
            os.close(os.open(self.inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return self.env.step(action)
        time.sleep(3600)
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


class LongObs(gymnasium.Wrapper):
    """CartPole whose steps return 5 floats while its space (and its reset) says 4."""

    def __init__(self) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))

    def step(self, action):
        obs, *rest = self.env.step(action)
        return (np.append(obs, np.float32(7.0)), *rest)


class LongObsLater(LongObs):
    """CartPole whose steps return its 4 floats at first, then 5 from its 4th step on."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def step(self, action):
        self.steps += 1
        return super().step(action) if self.steps > 3 else self.env.step(action)


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


class SpaceEnv(gymnasium.Env):
    """Observations sampled from ``obs`` (seeded by reset); its step asserts that the action
    is in ``act`` (default: ``obs``), as gymnasium's own envs do."""

    def __init__(self, obs, act=None) -> None:
        # its own copies: envs made in one process must not share a space's generator
        self.observation_space = copy.deepcopy(obs)
        self.action_space = copy.deepcopy(obs if act is None else act)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        return self.observation_space.sample(), {}

    def step(self, action):
        assert self.action_space.contains(action), f"{action!r} not in {self.action_space}"
        return self.observation_space.sample(), 1.0, False, False, {}


class CustomSpace(spaces.Space):
    """A space gymnasium knows nothing about: integers 0..10."""

    def sample(self, mask=None, probability=None):
        return int(self.np_random.integers(0, 11))

    def contains(self, x):
        return isinstance(x, int) and 0 <= x <= 10

    def __eq__(self, other):
        return isinstance(other, CustomSpace)


class CustomSpaceEnv(gymnasium.Env):
    """Custom observation and action spaces; observations are strings naming the action."""

    observation_space = CustomSpace()
    action_space = CustomSpace()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "reset", {}

    def step(self, action):
        return f"step({action})", 0.0, False, False, {}


class Tiny(gymnasium.Env):
    """The cheapest env: a step counter; its observation is ``(steps, level)``, the level
    given in reset's options (0 without)."""

    observation_space = spaces.Box(0, np.inf, (2,), np.float64)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.level = 0, (options or {}).get("level", 0)
        return np.array([self.t, self.level], dtype=np.float64), {}

    def step(self, action):
        self.t += 1
        return np.array([self.t, self.level], dtype=np.float64), 1.0, False, False, {}


class Flaky(Tiny):
    """Raises on every ``every``-th step of each instance (a new instance counts afresh)."""

    def __init__(self, every: int = 500) -> None:
        self.every = every

    def step(self, action):
        if self.t + 1 == self.every:
            raise ConnectionResetError(f"simulator dropped the connection at step {self.t + 1}")
        return super().step(action)


class ExitAt(Tiny):
    """Ends its whole process (``os._exit``, no exception, no reply) on step ``at``."""

    def __init__(self, at: int = 3) -> None:
        self.at = at

    def step(self, action):
        if self.t + 1 == self.at:
            os._exit(3)
        return super().step(action)


class SeedFails(Tiny):
    """Its reset raises ``ValueError`` for seed 1; its step raises for action 1."""

    def reset(self, *, seed=None, options=None):
        if seed == 1:
            raise ValueError("Error in reset with seed 1")
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if action == 1:
            raise ValueError(f"Error in step with {action}")
        return super().step(action)


class Unpicklable(Exception):
    """An exception that cannot travel by pickle (its argument is a lock)."""

    def __init__(self, lock) -> None:
        super().__init__("unpicklable failure")
        self.lock = lock


class RaisesUnpicklable(Tiny):
    def step(self, action):
        import threading

        raise Unpicklable(threading.Lock())


class CrashyError(Exception):
    """What :class:`Crashy` raises (a type of its own, to see it reach the caller)."""


class Crashy(gymnasium.Env):
    """Observations ``[t, draw, level, resets]``: steps into the episode, a number drawn
    from the env's generator at reset (it follows the reset's seed), the ``level`` given
    in reset's options (0 without) and the resets this instance made. Episodes end
    (terminated) after ``length`` steps; the reward is the action plus 1.

    It raises :class:`CrashyError` in the instance's ``reset_crash``-th reset (before
    anything is reset) or ``step_crash``-th step, and ends its process on the instance's
    ``exit_step``-th step (0: never). With ``once`` (a file path), each of them happens
    once across instances and processes (a file next to ``once`` records that it did)."""

    observation_space = spaces.Box(0, np.inf, (4,), np.float64)
    action_space = spaces.Discrete(3)

    def __init__(self, length: int = 1000, reset_crash: int = 0, step_crash: int = 0,
                 exit_step: int = 0, once=None) -> None:
        self.length, self.once = length, once
        self.reset_crash, self.step_crash, self.exit_step = reset_crash, step_crash, exit_step
        self.resets = self.steps = self.t = 0
        self.draw = self.level = 0.0

    def _now(self, kind: str, count: int, at: int) -> bool:
        if not at or count != at:
            return False
        if self.once is not None:
            marker = f"{self.once}.{kind}"
            if os.path.exists(marker):
                return False
            open(marker, "w").close()
        return True

    def _obs(self):
        return np.array([self.t, self.draw, self.level, self.resets], dtype=np.float64)

    def reset(self, *, seed=None, options=None):
        self.resets += 1
        if self._now("reset", self.resets, self.reset_crash):
            raise CrashyError(f"reset crash at reset {self.resets}")
        super().reset(seed=seed)
        self.t, self.level = 0, float((options or {}).get("level", 0))
        self.draw = float(self.np_random.random())
        return self._obs(), {"resets": self.resets}

    def step(self, action):
        self.steps += 1
        if self._now("step", self.steps, self.step_crash):
            raise CrashyError(f"step crash at step {self.steps}")
        if self._now("exit", self.steps, self.exit_step):
            os._exit(3)
        self.t += 1
        return self._obs(), float(action) + 1.0, self.t >= self.length, False, {"t": self.t}
