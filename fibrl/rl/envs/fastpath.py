"""The common step, received without the general machinery.

Most calls to ``RemoteVectorEnv.step`` are a full batch: every worker holds exactly one
open request, sent on its direct connection, and answers with one compact ``Result``
frame (numeric observations; see ``protocol``). This module receives those replies in
worker order on the caller's thread, checking each one's header as it arrives, and cuts
the batch arrays from one buffer joined once: a few slices per worker, instead of a
``Result`` message, a chunk queue and the dispatch of the general path (about a third of
the parent's time per worker at 8 workers x 1 env).

It never decides anything the general path would decide differently. Anything else (a
frame of another kind, a reply from another generation, a partial answer, observations
of another shape, a slow or lost worker, something waiting in the env's inbox) hands
every frame received so far to the general path, in order, as if it had received them
itself, and that path finishes the step.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import numpy as np
from gymnasium.vector import VectorEnv

from ...channel import loads
from ...errors import ChannelClosed
from .protocol import (_RESULT, _RESULT_TAG, _STEP, _STEP_TAG, _U32, Step, _array_head,
                       _head_at, _slots, decode)

if TYPE_CHECKING:
    from .vector import RemoteVectorEnv

__all__ = ["send_steps", "step_replies", "merge_infos"]


def send_steps(env: RemoteVectorEnv, actions: np.ndarray) -> bool:
    """Send a full batch's Steps, one per worker, on the direct connections; False (and
    nothing sent) when the general path must: a worker without a direct connection, or
    actions that are not a numeric array.

    Each frame is sent as soon as it is made, and the open requests are recorded after
    the last one: the time from the caller's action to the first worker's start is on
    every step's critical path. They keep views of a copy of ``actions`` (to send again
    to a replaced worker), never of the caller's array."""
    if actions.dtype.kind not in "biufc" or actions.ndim > 32:
        return False
    workers = env._workers
    for w in workers:
        if w.chan is None:
            return False
    key = (actions.dtype, actions.shape[1:])
    raw = actions.tobytes()   # (C order: each worker's envs are one run of its bytes)
    seq = env._seq
    for w in workers:
        seq += 1
        made = w.prefix.get(key)
        if made is None:   # the same at every step: the slots and the array header, and
            row = len(raw) // len(actions)   # where the worker's actions lie in ``raw``
            made = w.prefix[key] = (len(w.slots), _slots(len(w.slots)).pack(*w.slots)
                                    + _array_head(actions[w.span]),
                                    w.span.start * row, w.span.stop * row)
        n, middle, lo, hi = made
        try:
            w.chan.send(b"".join((_STEP.pack(_STEP_TAG, seq, n), middle, raw[lo:hi])))
        except ChannelClosed:
            pass  # the worker died: the supervisor posts the Died message that replaces it
    held = actions.copy()
    now = time.monotonic()
    seq = env._seq
    for w in workers:
        seq += 1
        w.open.append((Step(seq, w.slots, held[w.span]), now))
        w.direct = True
    env._seq = seq
    return True


def _ready(env: RemoteVectorEnv) -> bool:
    """Whether the pending step is the common case: whole requests on direct connections,
    nothing received yet, nothing posted to the inbox."""
    latest = env._obs
    if (env._chunks or not env._inbox.empty() or len(env._pending) != env.num_envs
            or type(latest) is not np.ndarray or latest.dtype.kind not in "biufc"):
        return False
    for w in env._workers:
        if (w.chan is None or not w.direct or len(w.open) != 1
                or type(w.open[0][0]) is not Step or w.open[0][0].slots != w.slots):
            return False
    return True


def _left(env: RemoteVectorEnv, deadline: Optional[float], slice_s: float) -> float:
    """How long one receive may wait before the general path must look around."""
    hang = env._hang_deadline()
    if deadline is None and hang is None:
        return slice_s
    until = min(d for d in (deadline, hang) if d is not None)
    return min(slice_s, until - time.monotonic())


def step_replies(env: RemoteVectorEnv, deadline: Optional[float],
                 slice_s: float) -> Optional[tuple]:
    """The step's 5-tuple, or None when the general path must finish it (it then holds
    every reply this function received)."""
    if not _ready(env):
        return None
    frames: list = []
    batch = _Batch()
    if _receive(env, deadline, slice_s, frames, batch):
        out = batch.finish(env)
        if out is not None:
            return out
    for frame in frames:  # the general path takes over, with what came so far
        env._handle(decode(frame))
    return None


def _receive(env: RemoteVectorEnv, deadline: Optional[float], slice_s: float,
             frames: list, batch: _Batch) -> bool:
    """Receive one compact reply per worker, in order, into ``frames``, each read into
    ``batch`` as it comes (while the later workers still step); False at the first
    other frame, lost connection, or moment when the general path must look around
    (something in the inbox, the caller's deadline, a hung step)."""
    bounded = deadline is not None or env._step_timeout is not None
    left = slice_s
    for w in env._workers:
        while True:
            if bounded:
                left = _left(env, deadline, slice_s)
                if left <= 0:
                    return False
            try:
                frame = w.chan.recv(left)
                break
            except TimeoutError:
                if not env._inbox.empty():
                    return False
            except ChannelClosed:
                w.chan = None  # the worker is gone: its Died message replaces it
                return False
        frames.append(frame)
        if frame[:2] != _RESULT_TAG or not batch.add(w, frame):
            return False
    return True


class _Batch:
    """The replies of one full step, gathered as sections to copy in one join: every
    worker's rewards, then observations, terminated and truncated flags (rewards first,
    so each array starts aligned). The workers' envs are consecutive: worker order is
    env order."""

    __slots__ = ("layout", "rewards", "obs", "terms", "truncs", "order")

    def __init__(self) -> None:
        self.layout: Any = None
        self.rewards: list = []
        self.obs: list = []
        self.terms: list = []
        self.truncs: list = []
        self.order: list = []   # (env, info) of the envs with a non-empty info

    def add(self, w: Any, frame: Any) -> bool:
        """Take ``w``'s reply to its open step; False for anything else (a restart
        included: the general path counts it), or observations of another dtype or
        shape than the other workers' (the general path batches those)."""
        _, worker, gen, seq, n = _RESULT.unpack_from(frame)
        if worker != w.index or gen != w.gen or seq != w.open[0][0].seq or n != len(w.slots):
            return False
        at = _RESULT.size + 4 * n
        known = w.reply   # the header of this worker's last reply: the same, step after step
        if known is not None and type(frame) is bytes and frame.startswith(known[0], at):
            layout, at = known[1], at + len(known[0])
        else:
            head = at
            layout, at = _head_at(frame, head)
            if layout[1][:1] != (n,):
                return False
            w.reply = (bytes(frame[head:at]), layout)
        if self.layout is None:
            self.layout = layout
        elif layout is not self.layout and (layout[0] != self.layout[0]
                                            or layout[1][1:] != self.layout[1][1:]):
            return False
        rew = at + layout[3]
        flags = rew + 8 * n
        size = _U32.unpack_from(frame, flags + 2 * n)[0]
        if size:
            infos, restarts = loads(memoryview(frame)[flags + 2 * n + 4:flags + 2 * n + 4 + size])
            if restarts:
                return False
            self.order.extend((w.span.start + j, info) for j, info in enumerate(infos) if info)
        self.rewards.append(frame[rew:flags])
        self.obs.append(frame[at:rew])
        self.terms.append(frame[flags:flags + n])
        self.truncs.append(frame[flags + n:flags + 2 * n])
        return True

    def finish(self, env: RemoteVectorEnv) -> Optional[tuple]:
        """The step's 5-tuple: the sections joined, the step's requests closed; None if
        the observations' shape is not the batch's (the general path says what is
        wrong)."""
        latest: Any = env._obs   # (a numeric array: see _ready)
        if self.layout[1][1:] != latest.shape[1:]:
            return None
        num = env.num_envs
        buf = bytearray().join(self.rewards + self.obs + self.terms + self.truncs)
        flags = len(buf) - 2 * num
        obs = np.ndarray(latest.shape, self.layout[0], buf, 8 * num)
        latest[...] = obs
        for w in env._workers:
            w.open.clear()
            w.direct = False
        env._pending.clear()
        return (obs, np.ndarray(num, np.float64, buf), np.ndarray(num, np.bool_, buf, flags),
                np.ndarray(num, np.bool_, buf, flags + num), merge_infos(self.order, num))


class _Infos:
    """Builds gymnasium's batched info dict for ``num_envs`` envs (VectorEnv's own code)."""

    # bound to this class: its recursive calls reach it through ``self``
    _add_info: ClassVar[Callable[[Any, dict[str, Any], dict[str, Any], int], dict[str, Any]]] = (
        VectorEnv._add_info)

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs


def merge_infos(order: list, num_envs: int) -> dict:
    """gymnasium's batched info dict of ``num_envs`` envs from ``(row, info)`` pairs."""
    infos: dict[str, Any] = {}
    if order:
        batch = _Infos(num_envs)
        for i, info in sorted(order, key=lambda p: p[0]):
            infos = batch._add_info(infos, info, i)
    return infos

