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

Observations of spaces whose batch is not numpy arrays (Text, Graph,
Sequence, OneOf, custom spaces: see :mod:`.spaces`) travel as a 1-D object
array of single observations, which the vector env batches with gymnasium's
``concatenate``.

Autoreset follows gymnasium's ``SyncVectorEnv`` exactly, env by env. With
``on_error="restart"``, an env that raises is recreated here and reset with its
restart seed and the options its episode began with; that env's current result
ends its episode, truncated, with reward 0, ``info["fibrl_restarted"]`` and the
exception's type and message, its final observation being the one its action
was chosen from, and the restart's reset begins the next episode, as each
autoreset mode begins one (:meth:`Worker._restart_step`). The
:class:`~.protocol.Failure` travels back so the vector env can charge its
restart budget. A replacement worker is told each env's last observation and
whether its episode had ended, and reports its envs' restarts the same way.
A reset that raises is retried once on a fresh env with the
same seed and options (never another seed); if that fails too, or with
``on_error="raise"``, the failure goes back to be raised in the caller, and the
env is made anew at its next reset. A worker started to replace a dead one
resets every env with its restart seed before serving requests.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Optional, cast

import numpy as np

from ... import channel
from ...channel import Peer
from .protocol import (Broken, Call, Called, Failure, Hello, Reset, Result, Step, decode,
                       encode, encode_result, row, stack)
from .spaces import is_fixed, objects

__all__ = ["serve", "restart_seed"]

NEXT_STEP, SAME_STEP, DISABLED = "next_step", "same_step", "disabled"
RESTART, RAISE = "restart", "raise"
RESTARTED = "fibrl_restarted"
ERROR_TYPE, ERROR = "fibrl_error_type", "fibrl_error"   # a restart's exception, in infos
#: names ``call`` refuses, as gymnasium's AsyncVectorEnv does: use the methods themselves
NOT_CALLABLE = ("reset", "step", "close")


def restart_seed(root: int, env_id: int, restarts: int) -> int:
    """The seed an env is reset with after its ``restarts``-th restart (deterministic)."""
    return int(np.random.SeedSequence([root, env_id, restarts]).generate_state(1)[0])


class _Slot:
    """One env of this worker and what the next step must do with it."""

    __slots__ = ("fn", "env_id", "env", "obs", "needs_reset", "restarted", "restarts",
                 "attrs", "options", "why", "broken", "last", "fresh", "reset_info")

    def __init__(self, fn: Callable[[], Any], env_id: int, restarts: int,
                 attrs: Optional[dict] = None) -> None:
        self.fn, self.env_id, self.restarts = fn, env_id, restarts
        self.options: Optional[dict] = None   # of the reset that began the current episode
        self.why: tuple = ("", "")           # (type, message) of the latest restart's cause
        self.broken = False                  # raised (on_error="raise"): made anew at reset
        # what set_attr set on this env since the vector env was made: set again on an
        # env made anew (a restart), before its reset
        self.attrs: dict = dict(attrs or {})
        self.env: Any = None   # the gymnasium env fn made (any Env-like object), once made
        self.obs: Any = None   # its latest observation
        self.needs_reset = False
        self.restarted = False
        # a restart: the observation the crashed episode ended with (the one its last
        # action was chosen from), reported as its final observation
        self.last: Any = None
        # NEXT_STEP: a restart reset the env already, so its reset-step returns that
        # reset (its restart seed, its episode's options) instead of resetting again
        self.fresh = False
        self.reset_info: dict = {}   # the info of the restart's reset


class _AutoresetFailed(Exception):
    """(SAME_STEP) ``env.reset()`` raised right after a step that ended the episode; it
    carries that step's result, which stands (the exception is its ``__cause__``)."""

    def __init__(self, result: tuple) -> None:
        super().__init__("autoreset failed")
        self.result = result   # (final obs, info, reward, terminated, truncated)


class Worker:
    """Steps its envs for one vector env; see the module docstring."""

    def __init__(self, index: int, gen: int, fns: list, env_ids: list, restarts: list,
                 mode: str, root_seed: int, split: int, outbox: Any,
                 attrs: Optional[list] = None, on_error: str = RESTART,
                 options: Optional[list] = None, reasons: Optional[list] = None,
                 lasts: Optional[list] = None, ended: Optional[list] = None) -> None:
        self.index, self.gen, self.mode, self.root = index, gen, mode, root_seed
        self.split, self.outbox, self.on_error = split, outbox, on_error
        attrs = attrs or [None] * len(fns)
        self.slots = [_Slot(fn, i, r, a) for fn, i, r, a in zip(fns, env_ids, restarts, attrs)]
        for slot, opts, why, last, done in zip(self.slots, options or [None] * len(fns),
                                               reasons or [("", "")] * len(fns),
                                               lasts or [None] * len(fns),
                                               ended or [False] * len(fns)):
            # (a replacement) what the vector env last returned for each env: how its
            # episode ended, and whether its next step is a NEXT_STEP reset-step
            slot.options, slot.why, slot.last = opts, why, last
            slot.needs_reset = bool(done) and mode == NEXT_STEP
        self.obs_rows: Any = None   # reused batch of observations, when the space allows
        self.stats: dict = {}       # envs stepped -> reused rewards, terminated, truncated
        self.dynamic = False        # observations travel as an object array (see .spaces)
        self.blank: Any = None      # an observation standing in for an env that raised

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
        self.dynamic = not is_fixed(env.observation_space)
        self.blank = None if self.dynamic else _blank(env.observation_space)
        self.outbox.send(Called(self.index, self.gen, 0, [{
            "observation_space": env.observation_space, "action_space": env.action_space,
            "observation_spaces": [s.env.observation_space for s in self.slots],
            "action_spaces": [s.env.action_space for s in self.slots],
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

    def _recreate(self, slot: _Slot, fresh: bool = True,
                  failure: Optional[Failure] = None) -> bool:
        """Recreate (when ``fresh``) and reset one env with its next restart seed and the
        options its episode began with."""
        slot.restarts += 1
        if failure is not None:
            slot.why = (failure.error_type, failure.message)
        seed = restart_seed(self.root, slot.env_id, slot.restarts)
        try:
            if fresh:
                _remake(slot)
            slot.obs, info = slot.env.reset(seed=seed, options=slot.options)
        except Exception:
            self.outbox.send(Broken(self.index, self.gen, self.slots.index(slot),
                                    traceback.format_exc()))
            return False
        slot.reset_info = dict(info or {})
        slot.restarted = True
        return True

    # -- requests -----------------------------------------------------------------------
    def handle(self, msg: Any, outbox: Any = None) -> bool:
        """Answer ``msg`` (on ``outbox``, by default the worker's); False: stop serving."""
        if outbox is not None:
            self.outbox = outbox
        if type(msg) is Step:   # (the common message first)
            return self._step(msg)
        if isinstance(msg, Reset):
            return self._reset(msg)
        if isinstance(msg, Call):
            self.outbox.send(self._call(msg))
            return True
        return False  # Close

    def _reset(self, msg: Reset) -> bool:
        obs, infos, failures = [], [], []
        for j, seed in zip(msg.slots, msg.seeds):
            slot = self.slots[j]
            info = None
            try:
                if slot.broken:   # it raised before (on_error="raise"): start afresh
                    slot.broken = False
                    _remake(slot)
                info = self._reset_one(slot, seed, msg.options)
            except Exception as exc:
                failure = Failure.capture(j, exc, restarted=self.on_error == RESTART)
                failures.append(failure)
                if failure.restarted:   # once more on a fresh env, with the same seed
                    info = self._retry_reset(slot, seed, msg.options, failure, failures)
                    if info is False:
                        return False
                else:
                    slot.broken = True
            obs.append(slot.obs if slot.obs is not None else self.blank)
            infos.append(info or None)
        self.outbox.send(Result(self.index, self.gen, msg.seq, msg.slots, self._stack(obs),
                                None, None, None, infos, tuple(failures)))
        return True

    def _reset_one(self, slot: _Slot, seed: Any, options: Optional[dict]) -> Any:
        slot.obs, info = slot.env.reset(seed=seed, options=options)
        slot.options = options
        slot.restarted = slot.needs_reset = slot.fresh = False
        slot.last = None
        return info

    def _retry_reset(self, slot: _Slot, seed: Any, options: Optional[dict],
                     failure: Failure, failures: list) -> Any:
        """The info of a reset retried on a fresh env; None if it raised again (then the
        caller sees that failure), False if the env cannot even be made."""
        try:
            _remake(slot)
        except Exception:
            self.outbox.send(Broken(self.index, self.gen, self.slots.index(slot),
                                    traceback.format_exc()))
            return False
        slot.restarts += 1
        slot.why = (failure.error_type, failure.message)
        try:
            info = self._reset_one(slot, seed, options)
        except Exception as exc:
            failures.append(Failure.capture(failure.slot, exc, restarted=False))
            slot.broken = True
            return None
        return {**(info or {}), RESTARTED: True, ERROR_TYPE: slot.why[0], ERROR: slot.why[1]}

    def _step(self, msg: Step) -> bool:
        n = len(msg.slots)
        if not self.split or n < self.split:
            return self._step_part(msg, 0, n)
        cut = n // 2
        return self._step_part(msg, 0, cut) and self._step_part(msg, cut, n)

    def _step_part(self, msg: Step, lo: int, hi: int) -> bool:
        m = hi - lo
        obs, infos = [], []
        restarts: list[Failure] = []
        stats = self.stats.get(m)
        if stats is None:   # reused: the reply holds copies (its frame is built here)
            stats = self.stats[m] = (np.empty(m, dtype=np.float64), np.empty(m, dtype=np.bool_),
                                     np.empty(m, dtype=np.bool_))
        rewards, terms, truncs = stats
        actions = msg.actions
        plain = type(actions) is np.ndarray
        for k in range(m):
            j = msg.slots[lo + k]
            slot = self.slots[j]
            try:
                action = actions[lo + k] if plain else row(actions, lo + k)
                ob, info, rewards[k], terms[k], truncs[k] = self._step_one(slot, action)
            except _AutoresetFailed as exc:   # the step stands; the env restarts under it
                if not self._failed(slot, j, cast(Exception, exc.__cause__), restarts):
                    return False
                ob, info, rewards[k], terms[k], truncs[k] = self._after_autoreset(slot,
                                                                                  exc.result)
            except Exception as exc:
                slot.last = slot.obs   # what this step's action was chosen from
                if not self._failed(slot, j, exc, restarts):
                    return False
                ob, info, rewards[k], terms[k], truncs[k] = (
                    self._step_one(slot, None) if slot.restarted
                    else (slot.obs, None, 0.0, False, False))
            obs.append(ob)
            infos.append(info or None)
        self.outbox.send_frame(encode_result(self.index, self.gen, msg.seq, msg.slots[lo:hi],
                                             self._batch(obs), rewards, terms, truncs, infos,
                                             tuple(restarts)))
        return True

    def _failed(self, slot: _Slot, j: int, exc: Exception, failures: list) -> bool:
        """Handle an exception of env ``j``'s step: recreate it (``on_error="restart"``) or
        keep it for the caller; False when the env cannot even be made anew."""
        failure = Failure.capture(j, exc, restarted=self.on_error == RESTART)
        failures.append(failure)
        if not failure.restarted:
            slot.broken = True
            return True
        return self._recreate(slot, failure=failure)

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
        return self._stack(obs)

    def _stack(self, obs: list) -> Any:
        """A fresh batch: stacked arrays, or the observations themselves in an object
        array for the spaces whose batch is not arrays."""
        return objects(obs) if self.dynamic else stack(obs)

    def _step_one(self, slot: _Slot, action: Any) -> tuple:
        """``(obs, info, reward, terminated, truncated)`` of one env's step."""
        if slot.restarted:  # report the restart in place of this step
            return self._restart_step(slot)
        if self.mode == NEXT_STEP and slot.needs_reset:
            if slot.fresh:   # a restart reset it: that reset begins the episode
                slot.fresh = slot.needs_reset = False
                return slot.obs, dict(slot.reset_info), 0.0, False, False
            slot.options = None   # an autoreset episode begins without options
            slot.obs, info = slot.env.reset()   # (if it raises, this is still a reset-step)
            slot.needs_reset = False
            return slot.obs, info, 0.0, False, False
        slot.obs, reward, term, trunc, info = slot.env.step(action)
        if self.mode == NEXT_STEP:
            slot.needs_reset = bool(term or trunc)
        elif self.mode == SAME_STEP and (term or trunc):
            final = (slot.obs, info, reward, term, trunc)
            slot.options = None
            try:
                slot.obs, info = slot.env.reset()
            except Exception as exc:
                raise _AutoresetFailed(final) from exc
            info = {"final_obs": final[0], "final_info": final[1], **info}
        return slot.obs, info, reward, term, trunc

    def _why(self, slot: _Slot) -> dict:
        return {RESTARTED: True, ERROR_TYPE: slot.why[0], ERROR: slot.why[1]}

    def _restart_step(self, slot: _Slot) -> tuple:
        """The step that reports a restart (see docs/envs.md, "What a crash returns").

        The crashed episode ends here, truncated, with reward 0 and the observation
        its last action was chosen from as its final one; the restart's reset begins
        the next episode: in this step's observation (SAME_STEP), at the next step,
        a reset-step (NEXT_STEP), or at your masked reset (DISABLED). An env whose
        previous episode had ended already (NEXT_STEP: this step was its reset-step)
        has no episode to end: the step is that reset-step, the restart's reset."""
        slot.restarted = False
        last, slot.last = slot.last, None
        if last is None:
            last = slot.obs   # (nothing was returned for this env yet)
        why = self._why(slot)
        if self.mode == NEXT_STEP and slot.needs_reset:
            slot.needs_reset = False
            return slot.obs, {**slot.reset_info, **why}, 0.0, False, False
        if self.mode == SAME_STEP:
            info = {**slot.reset_info, "final_obs": last, "final_info": dict(why), **why}
            return slot.obs, info, 0.0, False, True
        slot.needs_reset = slot.fresh = self.mode == NEXT_STEP
        return last, why, 0.0, False, True

    def _after_autoreset(self, slot: _Slot, result: tuple) -> tuple:
        """(SAME_STEP) the result of a step that ended its episode and whose reset raised:
        the step's own result, with the restarted env's first observation (or, with
        ``on_error="raise"``, the final one: the env must be reset anyway)."""
        final, info, reward, term, trunc = result
        if not slot.restarted:
            return final, None, reward, term, trunc
        slot.restarted = False
        slot.last = None
        why = self._why(slot)
        info = {**slot.reset_info, "final_obs": final, "final_info": {**(info or {}), **why},
                **why}
        return slot.obs, info, reward, term, trunc

    def _call(self, msg: Call) -> Called:
        values: list[Any] = []
        k = 0
        try:
            for k, slot in enumerate(self.slots):
                if msg.values is not None:
                    _set_attr(slot.env, msg.name, msg.values[k])
                    slot.attrs[msg.name] = msg.values[k]
                    values.append(None)
                    continue
                if msg.kwargs is not None and msg.name in NOT_CALLABLE:
                    raise ValueError(f"Trying to call function `{msg.name}` with `call`, use "
                                     f"`{msg.name}` directly instead.")
                attr = slot.env.get_wrapper_attr(msg.name)
                if msg.kwargs is not None and callable(attr):
                    attr = attr(*msg.args, **msg.kwargs)
                values.append(attr)
        except Exception as exc:
            return Called(self.index, self.gen, msg.seq, [], Failure.capture(k, exc, False))
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


def _blank(space: Any) -> Any:
    """An all-zero observation of ``space`` (for an env that raised before its first)."""
    from gymnasium.vector.utils import create_empty_array

    return row(create_empty_array(space, 1, fn=np.zeros), 0)


def _set_attr(env: Any, name: str, value: Any) -> None:
    """Set ``name`` where gymnasium's vector envs set it: on the wrapper or env that has
    it (``set_wrapper_attr``), else on the outer env."""
    setter = getattr(env, "set_wrapper_attr", None)
    if setter is not None:
        setter(name, value)
    else:
        setattr(env, name, value)


def _made(slot: _Slot) -> Any:
    """A new env for ``slot``, with what set_attr set on its predecessors."""
    env = slot.fn()
    for name, value in slot.attrs.items():
        _set_attr(env, name, value)
    return env


def _remake(slot: _Slot) -> None:
    """Close ``slot``'s env (it may be broken: errors are ignored) and make a new one."""
    try:
        if slot.env is not None:
            slot.env.close()
    except Exception:
        pass  # the env is broken already; its replacement matters
    slot.env = _made(slot)


def serve(index: int, gen: int, fns: list, env_ids: list, restarts: list, mode: str,
          root_seed: int, split: int, address: str, direct: bool = False,
          attrs: Optional[list] = None, on_error: str = RESTART,
          options: Optional[list] = None, reasons: Optional[list] = None,
          lasts: Optional[list] = None, ended: Optional[list] = None) -> None:
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
    worker = Worker(index, gen, fns, env_ids, restarts, mode, root_seed, split, outbox, attrs,
                    on_error, options, reasons, lasts, ended)
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
