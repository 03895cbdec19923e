"""The common step, received without the general machinery.

Most calls to ``RemoteVectorEnv.step`` are a full batch: every worker holds exactly one
open request, sent on its direct connection, and answers with one compact ``Result``
frame (numeric observations; see ``protocol``). This module receives those replies in
worker order on the caller's thread and writes them straight into the batch arrays: one
header check and a few array copies per worker, instead of a ``Result`` message, a chunk
queue and the dispatch of the general path (about a third of the parent's time per
worker at 8 workers x 1 env).

It never decides anything the general path would decide differently. The replies are
all received and checked first; anything else (a frame of another kind, a reply from
another generation, a partial answer, a slow or lost worker, something waiting in the
env's inbox) hands every frame received so far to the general path, in order, as if it
had received them itself, and that path finishes the step.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import numpy as np
from gymnasium.vector import VectorEnv

from ...channel import loads
from ...errors import ChannelClosed
from .protocol import (_RESULT, _RESULT_TAG, _STEP, _STEP_TAG, _U32, Step, _array_head,
                       _layout, _slots, decode)

if TYPE_CHECKING:
    from .vector import RemoteVectorEnv

__all__ = ["send_steps", "step_replies", "merge_infos"]


def send_steps(env: RemoteVectorEnv, actions: np.ndarray) -> bool:
    """Send a full batch's Steps, one per worker, on the direct connections; False (and
    nothing sent) when the general path must: a worker without a direct connection, or
    actions that are not a numeric array. ``actions`` is the vector env's own copy
    (the open requests keep views of it, to send again to a replaced worker)."""
    if actions.dtype.kind not in "biufc" or actions.ndim > 32:
        return False
    workers = env._workers
    for w in workers:
        if w.chan is None:
            return False
    key = (actions.dtype, actions.shape[1:])
    seq = env._seq
    now = time.monotonic()
    frames = []
    for w in workers:   # every frame first: the first replies do not slow the later sends
        seq += 1
        acts = actions[w.span]
        prefix = w.prefix.get(key)
        if prefix is None:   # the slots and the array header: the same at every step
            prefix = w.prefix[key] = _slots(len(w.slots)).pack(*w.slots) + _array_head(acts)
        frames.append(b"".join((_STEP.pack(_STEP_TAG, seq, len(w.slots)), prefix,
                                acts.tobytes())))
        w.open.append((Step(seq, w.slots, acts), now))
    env._seq = seq
    for w, frame in zip(workers, frames):
        w.direct = True
        try:
            w.chan.send(frame)
        except ChannelClosed:
            pass  # the worker died: the supervisor posts the Died message that replaces it
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
    if _receive(env, deadline, slice_s, frames):
        parts = [_read(frame, w) for w, frame in zip(env._workers, frames)]
        if all(part is not None for part in parts):
            done = _assemble(env, parts)
            if done is not None:
                return done
    for frame in frames:  # the general path takes over, with what came so far
        env._handle(decode(frame))
    return None


def _receive(env: RemoteVectorEnv, deadline: Optional[float], slice_s: float,
             frames: list) -> bool:
    """Receive one compact reply per worker, in order, into ``frames``; False at the
    first other frame, lost connection, or moment when the general path must look
    around (something in the inbox, the caller's deadline, a hung step)."""
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
        if frame[:2] != _RESULT_TAG:
            return False
    return True


def _read(frame: Any, w: Any) -> Optional[tuple]:
    """``(w, obs layout, obs bytes, rewards bytes, terminated bytes, truncated bytes,
    infos)`` of ``w``'s reply to its open step, or None for anything else (a restart
    included: the general path counts it)."""
    _, worker, gen, seq, n = _RESULT.unpack_from(frame)
    if worker != w.index or gen != w.gen or seq != w.open[0][0].seq or n != len(w.slots):
        return None
    at = _RESULT.size + 4 * n
    end = at + 2 + frame[at] + 4 * frame[at + 1 + frame[at]]
    layout = _layout(bytes(frame[at:end]))
    at = end + layout[3]
    size = _U32.unpack_from(frame, at + 10 * n)[0]
    infos = None
    if size:
        infos, restarts = loads(memoryview(frame)[at + 10 * n + 4:at + 10 * n + 4 + size])
        if restarts:
            return None
    return (w, layout, frame[end:at], frame[at:at + 8 * n], frame[at + 8 * n:at + 9 * n],
            frame[at + 9 * n:at + 10 * n], infos)


def _assemble(env: RemoteVectorEnv, parts: list) -> Optional[tuple]:
    """The batch, from the replies' bytes joined in worker order (their envs are
    consecutive): a few array operations per step, not per worker. None if the
    workers' observations differ in dtype or shape (the general path batches those)."""
    dtype, shape = parts[0][1][0], parts[0][1][1][1:]
    order: list = []
    for w, layout, _, _, _, _, infos in parts:
        if layout[0] != dtype or layout[1][1:] != shape:
            return None
        if infos:
            order.extend((w.span.start + j, info) for j, info in enumerate(infos) if info)
    num = env.num_envs
    obs = np.frombuffer(bytearray(b"".join([p[2] for p in parts])), dtype)
    obs = obs.reshape((num,) + shape)
    rewards = np.frombuffer(bytearray(b"".join([p[3] for p in parts])), np.float64)
    terms = np.frombuffer(bytearray(b"".join([p[4] for p in parts])), np.bool_)
    truncs = np.frombuffer(bytearray(b"".join([p[5] for p in parts])), np.bool_)
    latest: Any = env._obs   # (a numeric array: see _ready)
    latest[...] = obs
    for w in env._workers:
        w.open.clear()
        w.direct = False
    env._pending.clear()
    return obs, rewards, terms, truncs, merge_infos(order, num)


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

