"""The restart policy of :class:`~fibrl.rl.envs.RemoteVectorEnv`: what a restart costs.

Owns the per-env restart budget (:class:`RestartBudget`, counted in each env's own
steps), the rate-limited restart log (:class:`RestartLog`), the wording of who is to
blame for a lost worker (:func:`blame`), and the exceptions an env raised, rebuilt in
the caller (:func:`rebuilt`). Deciding when to restart and replacing workers is
:mod:`.vector`'s; recreating an env inside a worker is :mod:`.worker`'s.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Sequence

from ...errors import chain_remote
from .protocol import Failure

__all__ = ["EnvCrashError", "RestartBudget", "RestartLog", "blame", "last_line", "rebuilt"]

log = logging.getLogger("fibrl.rl.envs.vector")   # where users look for restarts

_RESTART_LOG_S = 10.0   # restarts of a failure already logged: one summary line this often


class EnvCrashError(RuntimeError):
    """An env crashed more often than its restart budget allows."""


class RestartBudget:
    """How often each env restarted: in all (a restarted env's seed depends on it), and
    within its last ``window`` steps, where more than ``limit`` restarts end the vector
    env. Counted in the env's own steps, not in seconds, so the budget tells an env
    that crashes in a loop from one that crashes now and then, however fast it steps."""

    def __init__(self, num_envs: int, limit: int, window: int) -> None:
        if limit < 0 or window < 1:
            raise ValueError(f"max_restarts must be >= 0 and restart_window >= 1 (steps), "
                             f"got {limit} and {window}")
        self.counts = [0] * num_envs
        self.limit, self.window = limit, window
        self._at: list[collections.deque] = [collections.deque() for _ in range(num_envs)]

    def restarted(self, env_ids: Sequence[int]) -> None:
        """Count a restart of each of ``env_ids``."""
        for i in env_ids:
            self.counts[i] += 1

    def charge(self, env_id: int, why: str, step: int) -> None:
        """Charge a restart to ``env_id``, at its ``step``-th step; :class:`EnvCrashError`
        once its budget is spent."""
        at = self._at[env_id]
        at.append(step)
        while at[0] <= step - self.window:
            at.popleft()
        if len(at) > self.limit:
            raise EnvCrashError(
                f"env {env_id} crashed and its restart budget is spent: {len(at)} "
                f"restarts within its last {self.window} steps (max_restarts="
                f"{self.limit}, restart_window={self.window}). Likely cause: the env fails "
                f"every time (a bug in its step/reset, a missing dependency on the "
                f"worker's backend, or too little memory). Last failure of env {env_id}:\n"
                f"{why.rstrip()}\nFix the env, or raise max_restarts/restart_window if "
                f"these crashes are expected.")


class RestartLog:
    """Tells restarts without flooding the log: a failure seen for the first time (by
    its last line, the exception) with its whole traceback, repeats of it in one line at
    most every ``_RESTART_LOG_S`` seconds, with how many there were meanwhile."""

    def __init__(self) -> None:
        self._seen: set = set()
        self._quiet = 0          # repeats not logged since the last line
        self._next = 0.0         # when a repeat may be logged again

    def tell(self, env_id: int, why: str) -> None:
        text = why.rstrip()
        last = text.splitlines()[-1].strip() if text else "(no reason given)"
        if last not in self._seen and len(self._seen) < 100:
            self._seen.add(last)
            log.warning("RemoteVectorEnv: env %d restarted: %s", env_id, text)
            return
        now = time.monotonic()
        if now < self._next:
            self._quiet += 1
            return
        more = f" ({self._quiet} more restarts not logged)" if self._quiet else ""
        log.warning("RemoteVectorEnv: env %d restarted again: %s%s", env_id, last, more)
        self._quiet, self._next = 0, now + _RESTART_LOG_S


def last_line(tb: str) -> tuple:
    """``(type, message)`` of a formatted traceback's last line."""
    text = tb.rstrip()
    last = text.splitlines()[-1].strip() if text else "RuntimeError"
    kind, _, message = last.partition(": ")
    return kind.rsplit(".", 1)[-1], message


def blame(suspects: list) -> str:
    if not suspects:
        return "while idle (killed from outside, or out of memory): no env was stepping"
    if len(suspects) == 1:
        return f"while stepping env {suspects[0]}: that env caused it"
    return (f"while stepping envs {suspects}: one of them caused it (a hard crash leaves no "
            f"trace of which; isolate_envs=True names it)")


def rebuilt(failure: Failure, what: str) -> BaseException:
    """The exception of ``failure`` with its remote traceback as ``__cause__`` (a
    ``RuntimeError`` naming its type when it could not be pickled)."""
    exc = failure.error
    if exc is None:
        exc = RuntimeError(f"{what}: {failure.summary} (the exception itself could not be "
                           f"pickled)")
    return chain_remote(exc, failure.traceback)
