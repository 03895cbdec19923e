"""The loop that runs in each RemoteVectorEnv worker (a fibrl Process).

A worker hosts ``k`` envs. It connects one :mod:`fibrl.channel` channel to
the vector env's listener (authenticated with the run's secret, under the
run's transport settings, ``tls`` included), says ``Hello``, then answers one request
at a time on that channel::

    vector env (Listener)                  worker w (local process, container or pod)
    peer.send(Step) ---------------------> recv -> step envs of half 1 -> Result --+
                                                    step envs of half 2 -> Result --+
    reader thread -> queue <-------------------------------------------------------+

With ``direct`` (the local backend), the worker also listens itself and names
its address in ``Hello``; the vector env dials it, sends its full-batch
requests there and receives their replies on its own thread (no reader
thread, no hand-off in the vector env's process)::

    vector env                             worker w
    Channel.send(Step) ------------------> its listener's reader thread: step envs
    Channel.recv() <---------------------- Result (on the connection the request came on)

A request is answered on the connection it came on, so the partial-batch
requests (``send``/``recv``) and ``call`` keep using the first one.

With ``split`` on, a request for many envs is answered in two halves: the
first half travels (and the vector env can hand it to ``recv``) while the
second half is stepped.

A step's observations are written into one array the worker keeps, of the
observation space's dtype (the dtype the vector env's batch has too), and
copied from it into the reply frame; observations that do not fit it (Dict and
Tuple spaces, or an env whose observations disagree with its space) are
stacked instead.

Autoreset follows gymnasium's ``SyncVectorEnv`` exactly, env by env. An env
that raises is recreated here and reset with its restart seed; that env's
current result is the fresh reset observation with ``truncated=True`` and
``info["fibrl_restarted"]``, and the traceback travels back so the vector env
can charge its restart budget. A worker started to replace a dead one resets
every env that way before serving requests.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Optional

import numpy as np

from ... import channel
from ...channel import Peer
from .protocol import (Broken, Call, Called, Hello, Reset, Result, Step, decode, encode,
                       encode_result, row, stack)

__all__ = ["serve", "restart_seed"]

NEXT_STEP, SAME_STEP, DISABLED = "next_step", "same_step", "disabled"
RESTARTED = "fibrl_restarted"


def restart_seed(root: int, env_id: int, restarts: int) -> int:
    """The seed an env is reset with after its ``restarts``-th restart (deterministic)."""
    return int(np.random.SeedSequence([root, env_id, restarts]).generate_state(1)[0])


class _Slot:
    """One env of this worker and what the next step must do with it."""

    __slots__ = ("fn", "env_id", "env", "obs", "needs_reset", "restarted", "restarts",
                 "attrs")

    def __init__(self, fn: Callable[[], Any], env_id: int, restarts: int,
                 attrs: Optional[dict] = None) -> None:
        self.fn, self.env_id, self.restarts = fn, env_id, restarts
        # what set_attr set on this env since the vector env was made: set again on an
        # env made anew (a restart), before its reset
        self.attrs: dict = dict(attrs or {})
        self.env: Any = None   # the gymnasium env fn made (any Env-like object), once made
        self.obs: Any = None   # its latest observation
        self.needs_reset = False
        self.restarted = False


class Worker:
    """Steps its envs for one vector env; see the module docstring."""

    def __init__(self, index: int, gen: int, fns: list, env_ids: list, restarts: list,
                 mode: str, root_seed: int, split: int, outbox: Any,
                 attrs: Optional[list] = None) -> None:
        self.index, self.gen, self.mode, self.root = index, gen, mode, root_seed
        self.split, self.outbox = split, outbox
        attrs = attrs or [None] * len(fns)
        self.slots = [_Slot(fn, i, r, a) for fn, i, r, a in zip(fns, env_ids, restarts, attrs)]
        self.obs_rows: Any = None   # reused batch of observations, when the space allows

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> bool:
        for j, slot in enumerate(self.slots):
            try:
                slot.env = _made(slot)
            except Exception:
                self.outbox.send(Broken(self.index, self.gen, j, traceback.format_exc()))
                return False
        if self.gen > 0:  # a replacement: every env starts over, reseeded
            for slot in self.slots:
                slot.restarts -= 1  # the vector env counted this restart already
                if not self._recreate(slot, fresh=False):
                    return False
        env = self.slots[0].env
        self.obs_rows = _obs_rows(env.observation_space, len(self.slots))
        self.outbox.send(Called(self.index, self.gen, 0, [{
            "observation_space": env.observation_space, "action_space": env.action_space,
            "metadata": getattr(env, "metadata", {}), "render_mode": env.render_mode,
            "spec": getattr(env, "spec", None)}]))
        return True

    def close(self) -> None:
        for slot in self.slots:
            try:
                if slot.env is not None:
                    slot.env.close()
            except Exception:
                pass  # closing at exit: nothing to report to

    def _recreate(self, slot: _Slot, fresh: bool = True) -> bool:
        """Recreate (when ``fresh``) and reset one env with its next restart seed."""
        slot.restarts += 1
        seed = restart_seed(self.root, slot.env_id, slot.restarts)
        try:
            if fresh:
                try:
                    slot.env.close()
                except Exception:
                    pass  # the env is broken already; its replacement matters
                slot.env = _made(slot)
            slot.obs, _ = slot.env.reset(seed=seed)
        except Exception:
            self.outbox.send(Broken(self.index, self.gen, self.slots.index(slot),
                                    traceback.format_exc()))
            return False
        slot.restarted = True
        slot.needs_reset = False
        return True

    # -- requests -----------------------------------------------------------------------
    def handle(self, msg: Any, outbox: Any = None) -> bool:
        """Answer ``msg`` (on ``outbox``, by default the worker's); False: stop serving."""
        if outbox is not None:
            self.outbox = outbox
        if isinstance(msg, Step):
            return self._step(msg)
        if isinstance(msg, Reset):
            return self._reset(msg)
        if isinstance(msg, Call):
            self.outbox.send(self._call(msg))
            return True
        return False  # Close

    def _reset(self, msg: Reset) -> bool:
        obs, infos, restarts = [], [], []
        for j, seed in zip(msg.slots, msg.seeds):
            slot = self.slots[j]
            try:
                slot.obs, info = slot.env.reset(seed=seed, options=msg.options)
                slot.restarted = slot.needs_reset = False
            except Exception:
                restarts.append((j, traceback.format_exc()))
                if not self._recreate(slot):
                    return False
                info, slot.restarted = {RESTARTED: True}, False
            obs.append(slot.obs)
            infos.append(info or None)
        self.outbox.send(Result(self.index, self.gen, msg.seq, msg.slots, stack(obs), None,
                                None, None, infos, tuple(restarts)))
        return True

    def _step(self, msg: Step) -> bool:
        n = len(msg.slots)
        cut = n // 2 if self.split and n >= self.split else n
        for lo, hi in ((0, cut), (cut, n)):
            if hi > lo and not self._step_part(msg, lo, hi):
                return False
        return True

    def _step_part(self, msg: Step, lo: int, hi: int) -> bool:
        m = hi - lo
        obs, infos, restarts = [], [], []
        rewards = np.empty(m, dtype=np.float64)
        terms, truncs = np.empty(m, dtype=np.bool_), np.empty(m, dtype=np.bool_)
        actions = msg.actions
        plain = type(actions) is np.ndarray
        for k in range(m):
            j = msg.slots[lo + k]
            slot = self.slots[j]
            try:
                action = actions[lo + k] if plain else row(actions, lo + k)
                info, rewards[k], terms[k], truncs[k] = self._step_one(slot, action)
            except Exception:
                restarts.append((j, traceback.format_exc()))
                if not self._recreate(slot):
                    return False
                info, rewards[k], terms[k], truncs[k] = self._step_one(slot, None)
            obs.append(slot.obs)
            infos.append(info or None)
        self.outbox.send_frame(encode_result(self.index, self.gen, msg.seq, msg.slots[lo:hi],
                                             self._batch(obs), rewards, terms, truncs, infos,
                                             tuple(restarts)))
        return True

    def _batch(self, obs: list) -> Any:
        """The observations as one batch: rows of the reused array when they fit it (sent,
        that is copied, before the next step), else stacked."""
        out = self.obs_rows
        if out is not None:
            try:
                for k, o in enumerate(obs):
                    out[k] = o
                return out[:len(obs)]
            except (ValueError, TypeError):
                self.obs_rows = None  # an observation that does not fit its space
        return stack(obs)

    def _step_one(self, slot: _Slot, action: Any) -> tuple:
        if slot.restarted:  # report the restart in place of this step
            slot.restarted = False
            slot.needs_reset = self.mode == NEXT_STEP
            info: dict[str, Any] = {RESTARTED: True}
            if self.mode == SAME_STEP:
                info = {"final_obs": slot.obs, "final_info": {RESTARTED: True}, RESTARTED: True}
            return info, 0.0, False, True
        if self.mode == NEXT_STEP and slot.needs_reset:
            slot.obs, info = slot.env.reset()
            slot.needs_reset = False
            return info, 0.0, False, False
        slot.obs, reward, term, trunc, info = slot.env.step(action)
        if self.mode == NEXT_STEP:
            slot.needs_reset = bool(term or trunc)
        elif self.mode == SAME_STEP and (term or trunc):
            final = {"final_obs": slot.obs, "final_info": info}
            slot.obs, info = slot.env.reset()
            info = {**final, **info}
        return info, reward, term, trunc

    def _call(self, msg: Call) -> Called:
        values: list[Any] = []
        try:
            for k, slot in enumerate(self.slots):
                if msg.values is not None:
                    setattr(slot.env, msg.name, msg.values[k])
                    slot.attrs[msg.name] = msg.values[k]
                    values.append(None)
                    continue
                attr = slot.env.get_wrapper_attr(msg.name)
                if msg.kwargs is not None and callable(attr):
                    attr = attr(*msg.args, **msg.kwargs)
                values.append(attr)
        except Exception as exc:
            return Called(self.index, self.gen, msg.seq, [], exc)
        return Called(self.index, self.gen, msg.seq, values)


class _Outbox:
    """Sends messages as frames of :func:`.protocol.encode` (compact per-step frames) on a
    ``Channel`` or a listener's ``Peer``."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel

    def send(self, msg: Any) -> None:
        self.channel.send(encode(msg))

    def send_frame(self, frame: Any) -> None:
        self.channel.send(frame)


def _obs_rows(space: Any, n: int) -> Optional[np.ndarray]:
    """A reusable array for ``n`` observations of ``space``, when its batch is one numpy
    array (Box, Discrete, MultiDiscrete, MultiBinary), else None. Written into, an
    observation takes the space's dtype, as the vector env's own batch does."""
    from gymnasium.vector.utils import create_empty_array

    try:
        rows = create_empty_array(space, n, fn=np.zeros)
    except Exception:
        return None  # a space gymnasium cannot batch: observations are stacked
    return rows if type(rows) is np.ndarray and rows.dtype.kind in "biuf" else None


def _made(slot: _Slot) -> Any:
    """A new env for ``slot``, with what set_attr set on its predecessors."""
    env = slot.fn()
    for name, value in slot.attrs.items():
        setattr(env, name, value)
    return env


def serve(index: int, gen: int, fns: list, env_ids: list, restarts: list, mode: str,
          root_seed: int, split: int, address: str, direct: bool = False,
          attrs: Optional[list] = None) -> None:
    """Entry point of a worker process: start the envs, then answer requests until Close."""
    # (the run's secret and this worker's transport settings: tls, limits)
    conn = channel.connect(address)
    outbox = _Outbox(conn)
    failed: list = []
    stop: list[bool] = []

    def on_direct(peer: Peer, data: Any) -> None:
        # the vector env's direct connection: answered here, in its reader thread
        if stop:
            return
        try:
            reply_to = peer.context.get("outbox")
            if reply_to is None:
                reply_to = peer.context["outbox"] = _Outbox(peer)
            if not worker.handle(decode(data), reply_to):
                stop.append(True)
                conn.close()  # wakes the main thread, which then exits
        except BaseException as exc:  # the process must end, as in the main thread
            failed.append(exc)
            stop.append(True)
            conn.close()

    listener = None
    if direct:
        listener = channel.listen(on_direct)
    worker = Worker(index, gen, fns, env_ids, restarts, mode, root_seed, split, outbox, attrs)
    outbox.send(Hello(index, gen, listener.address if listener is not None else ""))
    try:
        if not worker.start():
            return
        while True:
            try:
                msg = decode(conn.recv())
            except EOFError:  # ChannelClosed: the vector env is gone (or a direct Close)
                break
            if not worker.handle(msg, outbox):
                break
        if failed:
            raise failed[0]
    finally:
        if listener is not None:
            listener.close()
        worker.close()
        conn.close()
