"""``RemoteVectorEnv``: a gymnasium ``VectorEnv`` whose envs live in fibrl workers.

Owns the vector env's state machine, the batching of actions and results,
the partial-batch API (``send``/``recv``) and the restart policy (which
worker to replace, the restart budget, the per-env step deadline). The loop
inside each worker is :mod:`.worker`; the message types are :mod:`.protocol`.
It is built on fibrl's public API only: workers are ``Process`` es started,
watched and replaced by :mod:`fibrl.supervisor` (the supervisor a ``Pool`` uses,
with this module's restart policy), and messages travel on the authenticated
listeners and channels of :mod:`fibrl.channel`, which obey the run's transport
settings (``tls``, handshake timeout, pending-connection limit) as every other
socket of fibrl does. Per-step
messages are the compact frames of :mod:`.protocol`; the rest are
``fibrl.channel.dumps`` frames::

    this process                                          workers (any backend)
    send(actions, ids) -- one Step frame per worker ---->  worker 0: envs 0..k-1
                       -- (Listener peer -> Channel) --->  worker 1: envs k..2k-1
    recv(num) <- inbox <- reader thread per peer <======  Result frame per half-step
                 inbox <- Died(w) <- supervisor thread <- process sentinels

A worker dials the vector env's listener (as fibrl workers dial their
parent), so the same layout works on every backend. One request and one
reply per half-step is the floor a Pipe or a manager call would double.

On the local backend each worker also listens, and this process dials it
back: ``step``/``reset`` requests go on that direct connection and their
replies are received on the calling thread, worker after worker, with no
reader thread and no queue in between (the hand-off between threads cost
more than the message itself). ``send``/``recv`` and ``call`` keep the
listener path, which returns whichever worker finishes first.

A dead worker (killed, OOM, container or pod gone, or past its step deadline)
is replaced: its envs are recreated and reset with their restart seeds, the
requests it held are sent again, and each of its envs reports its next result
with ``truncated=True`` and ``info["fibrl_restarted"]``. The envs whose results
had not come back are the suspects, charged to the restart budget: more than
``max_restarts`` restarts of one env within ``restart_window`` of its steps raise
:class:`EnvCrashError`. With ``on_error="raise"``, what an env's own code raises
is raised in the caller instead of restarting that env.

Spaces (how a batch travels, whether the envs' spaces agree, whether actions
are in the action space) are :mod:`.spaces`' decisions.
"""
from __future__ import annotations

import collections
import copy
import functools
import itertools
import logging
import queue
import threading
import time
from multiprocessing import TimeoutError as MpTimeoutError
from typing import Any, Callable, Iterable, Optional, Sequence, Union, cast

import numpy as np
from gymnasium import logger
from gymnasium.error import (AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError,
                             ResetNeeded)
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from ... import channel
from ...context import default_context
from ...errors import ChannelClosed, TransportError, describe_exitcode
from ...supervisor import Policy, Supervisor
from . import fastpath
from .manager import make_gym_env
from .protocol import (Broken, Call, Called, Close, Died, Hello, Reset, Result, Started,
                       StartFailed, Step, decode, encode, row, rows, write_rows)
from .restarts import EnvCrashError, RestartBudget, RestartLog, blame, last_line, rebuilt
from .spaces import (ActionCheck, InvalidActionError, check_mode, check_spaces, is_fixed,
                     objects)
from .worker import RAISE, RESTART, RESTARTED, serve

__all__ = ["RemoteVectorEnv", "EnvCrashError", "AsyncState", "InvalidActionError"]

log = logging.getLogger(__name__)

get_context = default_context.get_context  # what ``fibrl.get_context`` is

_SLICE = 0.25  # seconds a direct receive waits before looking at deaths and Hellos


class AsyncState:
    """What the vector env waits for (as gymnasium's ``AsyncVectorEnv``)."""

    DEFAULT = "default"
    WAITING_RESET = "reset"
    WAITING_STEP = "step"
    PARTIAL = "send/recv"


_MODES = {AutoresetMode.NEXT_STEP: "next_step", AutoresetMode.SAME_STEP: "same_step",
          AutoresetMode.DISABLED: "disabled"}


class _WorkerSlot:
    """One worker as this process sees it: its process, connection and open requests."""

    def __init__(self, index: int, env_ids: list) -> None:
        self.index = index
        self.env_ids = env_ids
        self.ids = np.array(env_ids, dtype=np.int64)
        self.span = slice(env_ids[0], env_ids[-1] + 1)   # its envs are consecutive
        self.slots = tuple(range(len(env_ids)))
        self.gen = -1
        self.wid = -1                # its process's id at the supervisor
        self.proc: Any = None
        self.peer: Any = None        # its transport peer, once it said Hello
        self.chan: Any = None        # the direct Channel to its own listener (local backend)
        self.direct = False          # open requests were sent on ``chan``
        self.open: list = []         # requests sent and not fully answered: (msg, sent_at)
        self.prefix: dict = {}       # (dtype, shape) of actions -> (count, a Step frame's
                                     # middle, its actions' start and end in the batch's bytes)
        self.reply: Optional[tuple] = None   # (header, layout) of its last compact reply's obs
        self.ready = False
        self.killed_for: Optional[str] = None
        self.replacing = False       # inside _replace: a loss then asks for another start
        self.respawn = False         # the incarnation being started was lost


class RemoteVectorEnv(VectorEnv):
    """A ``gymnasium.vector.VectorEnv`` stepping its envs in fibrl workers, batched.

    Why one class of this size: gymnasium's ``VectorEnv`` API (``reset``, ``step``, their
    async halves, ``call``, ``get_attr``, ``set_attr``, ``close``) and envpool's partial
    batches (``send``/``recv``) share one state machine and one set of open requests,
    which the receiving side (replies, deaths, replacements) also updates. Starting and
    watching workers is :mod:`fibrl.supervisor`'s; the worker loop, the messages and the
    restart budget are elsewhere.

    Args:
        env_fns: a gymnasium env id, or a sequence of callables returning envs.
        num_envs: number of envs (only with an env id; else ``len(env_fns)``).
        envs_per_worker: envs hosted by each worker; each worker gets one
            message per step carrying the actions of all its envs.
        autoreset_mode: a ``gymnasium.vector.AutoresetMode`` (or its value).
        backend: ``"local"``, ``"docker"`` or ``"kubernetes"``; default: the
            context's.
        env_kwargs: keyword arguments for ``gymnasium.make`` (env id only).
        wrappers: callables applied to each env made from an env id.
        step_timeout: seconds one request may take before its worker is
            declared hung, killed and replaced (``None``: no deadline).
        max_restarts: more than this many restarts of one env within
            ``restart_window`` of its own steps raise :class:`EnvCrashError`
            (an env that crashes now and then goes on; one that crashes in a
            loop is stopped).
        restart_window: how many of an env's steps ``max_restarts`` counts over.
        on_error: ``"restart"`` (recreate an env whose ``step``/``reset``
            raises, and go on) or ``"raise"`` (raise its exception in the
            caller, with the remote traceback as ``__cause__``; the envs that
            raised must be reset before they step again). A dead or hung worker
            is replaced either way.
        observation_mode: as gymnasium's ``AsyncVectorEnv``: ``"same"`` (every
            env has the same observation space), ``"different"`` (spaces of
            one shape and dtype, batched with ``batch_differing_spaces``), or a
            tuple ``(observation_space, single_observation_space)``.
        check_actions: refuse actions outside the action space with
            :class:`InvalidActionError` before sending them (``False``: send
            them as they are, as gymnasium's vector envs do).
        isolate_envs: one process per env (``envs_per_worker=1``), so a hard
            crash names its env and takes no other env with it.
        split: when >= 2, a request for at least this many envs of one worker
            comes back in two halves, so the first half travels (and ``recv``
            can return it) while the second is stepped. Off by default: each
            extra reply costs CPU on both sides, more than the overlap saves
            for small observations (see docs/envs.md).
        start_timeout: seconds to wait for a worker to start.
        seed: root of the restart seeds (random when ``None``).

    Attributes:
        policy_version: set it to the version of the policy whose actions you send
            (for example a :class:`fibrl.rl.PolicyFollower`'s ``version``); while it
            is not None, every ``step``, ``step_wait`` and ``recv`` reports in
            ``infos["policy_version"]`` the version in force when each row's action
            was sent (with ``send``/``recv``, rows of one batch may differ).

    Example:
        >>> envs = RemoteVectorEnv("CartPole-v1", 8, envs_per_worker=4)
        >>> obs, infos = envs.reset(seed=0)
        >>> obs, rewards, terminated, truncated, infos = envs.step(envs.action_space.sample())
        >>> envs.close()
    """

    def __init__(self, env_fns: Union[str, Sequence[Callable[[], Any]]],
                 num_envs: Optional[int] = None, *, envs_per_worker: int = 1,
                 autoreset_mode: Union[str, AutoresetMode] = AutoresetMode.NEXT_STEP,
                 backend: Optional[str] = None, env_kwargs: Optional[dict] = None,
                 wrappers: Iterable[Callable] = (), step_timeout: Optional[float] = None,
                 max_restarts: int = 10, restart_window: int = 100, split: int = 0,
                 start_timeout: float = 300.0, seed: Optional[int] = None,
                 on_error: str = RESTART, observation_mode: Any = "same",
                 check_actions: bool = True, isolate_envs: bool = False) -> None:
        self._fns = _env_fns(env_fns, num_envs, env_kwargs, tuple(wrappers))
        self.num_envs = len(self._fns)
        envs_per_worker = _per_worker(envs_per_worker, isolate_envs)
        if on_error not in (RESTART, RAISE):
            raise ValueError(f"on_error must be {RESTART!r} or {RAISE!r}, got {on_error!r}")
        self.on_error, self.observation_mode = on_error, check_mode(observation_mode)
        self._check_actions_on = check_actions
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self._backend, self._step_timeout = backend, step_timeout
        self._budget = RestartBudget(self.num_envs, max_restarts, restart_window)
        self._restart_log = RestartLog()
        self._attrs: list[dict] = [{} for _ in range(self.num_envs)]   # set_attr's, per env
        self._options: list = [None] * self.num_envs   # each episode's reset options
        # whether each env's latest result ended its episode (a replacement worker needs
        # it: with NEXT_STEP, that env's next step is a reset-step)
        self._ended = np.zeros(self.num_envs, dtype=np.bool_)
        self._any_options = False
        self._why: list = [("", "")] * self.num_envs   # why each env last restarted
        self._failures: list = []      # (env_id, Failure) to raise once the call is done
        self._broken: set = set()      # envs that raised (on_error="raise"): reset first
        self._tick = 0                 # step() calls: every env stepped once each
        self._sent = np.zeros(self.num_envs, dtype=np.int64)   # send() steps, per env
        self.policy_version: Optional[int] = None
        self._versions = np.zeros(self.num_envs, dtype=np.int64)  # at each env's send
        self._built = False
        self._split, self._start_timeout = (split if split >= 2 else 0), start_timeout
        self._direct = (backend or get_context().config.backend) == "local"
        # a SeedSequence made without entropy draws an int (typed int | Sequence[int] | None)
        self._root = int(seed if seed is not None
                         else cast(int, np.random.SeedSequence().entropy) % 2**63)
        self._seeds: list = [None] * self.num_envs
        self._seq = 0
        self._state = AsyncState.DEFAULT
        self._error: Optional[BaseException] = None
        self.closed = False
        self._chunks: collections.deque = collections.deque()   # (env_ids, Result, rows)
        self._pending: set = set()   # envs whose step or reset is not answered yet
        self._every_env = frozenset(range(self.num_envs))
        self._called: dict = {}
        ids = list(range(self.num_envs))
        self._workers = [_WorkerSlot(w, ids[lo:lo + envs_per_worker])
                         for w, lo in enumerate(range(0, self.num_envs, envs_per_worker))]
        self._where = [(w.index, j) for w in self._workers for j in range(len(w.env_ids))]
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # the process hub's secret and transport settings (tls, limits), as for its own
        self._listener = channel.listen(lambda peer, data: self._inbox.put((peer, data)))
        self._lock = threading.Lock()
        # the workers' starts and ends come to the inbox, handled by the stepping thread
        self._starts = _Starts(self._inbox, self._on_started)
        self._supervisor = Supervisor(get_context(), self._starts, self._starts.spec,
                                      "fibrl-envs", role="env-worker",
                                      max_starters=len(self._workers), close_ended=False)
        self._supervisor.start()
        try:
            for worker in self._workers:
                self._spawn(worker)
            meta = self._await_ready(time.monotonic() + start_timeout)
        except BaseException:
            self._shutdown(0.0)
            raise
        try:
            self._setup_spaces(meta)
        except BaseException:
            self._shutdown(0.0)
            raise
        self._built = True

    @property
    def processes(self) -> list:
        """The ``fibrl.Process`` of each worker, in worker order (env ``i`` lives in worker
        ``i // envs_per_worker``). A worker that dies is replaced by a new process."""
        with self._lock:
            return [w.proc for w in self._workers]

    # gymnasium's vector envs answer these from their envs (the vector env's own seed and
    # generator of VectorEnv do not apply: nothing is drawn here)
    @property
    def np_random_seed(self) -> tuple:  # type: ignore[override]
        """Each env's ``np_random_seed``, as gymnasium's vector envs report it."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]
    def np_random(self) -> tuple:  # type: ignore[override]
        """Each env's ``np_random`` generator (copies: the envs keep drawing from theirs)."""
        return self.get_attr("np_random")

    def render(self) -> tuple:
        """Each env's ``render()`` (its ``render_mode`` decides what that is)."""
        return self.call("render")

    @property
    def restart_counts(self) -> tuple:
        """How many times each env was restarted (a crash of its own, or of a neighbour in
        its worker: a worker's envs start over together)."""
        return tuple(self._budget.counts)

    # -- set-up ---------------------------------------------------------------------------
    def _setup_spaces(self, metas: list) -> None:
        """Batch the spaces the workers reported (every env's), as ``observation_mode`` says;
        ``RuntimeError`` when they cannot be batched together."""
        meta = metas[0]
        single, batched = check_spaces(
            [s for m in metas for s in m["observation_spaces"]],
            [s for m in metas for s in m["action_spaces"]], self.observation_mode,
            self.num_envs)
        self.single_observation_space, self.observation_space = single, batched
        self.single_action_space = meta["action_space"]
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = dict(meta["metadata"] or {})
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = meta["render_mode"]
        self.spec = meta["spec"]
        # spaces whose batch is not numpy arrays: rows of an object array, batched on return
        self._dynamic = not is_fixed(single)
        self._obs = (objects([None] * self.num_envs) if self._dynamic else
                     create_empty_array(single, self.num_envs, fn=np.zeros))
        self._check_actions = ActionCheck(self.single_action_space, self._check_actions_on)
        self._action_spaces: dict = {}   # n -> the batched action space of n envs

    def _spawn(self, worker: _WorkerSlot) -> None:
        """Have the supervisor start (or replace) the process of ``worker``; it dials our
        listener and says Hello."""
        gen = worker.gen + 1
        fns = [self._fns[i] for i in worker.env_ids]
        counts = [self._budget.counts[i] for i in worker.env_ids]
        lasts = ended = None
        if gen > 0 and self._built:   # what its envs' episodes ended with (docs/envs.md)
            lasts = [copy.deepcopy(row(self._obs, i)) for i in worker.env_ids]
            ended = [bool(self._ended[i]) for i in worker.env_ids]
        spec = {"target": serve, "name": f"fibrl-env-worker-{worker.index}",
                "backend": self._backend,
                "args": (worker.index, gen, fns, worker.env_ids, counts,
                         _MODES[self.autoreset_mode], self._root, self._split,
                         self._listener.address, self._direct,
                         [self._attrs[i] for i in worker.env_ids], self.on_error,
                         [self._options[i] for i in worker.env_ids],
                         [self._why[i] for i in worker.env_ids], lasts, ended)}
        if worker.chan is not None:
            worker.chan.close()
        # The generation changes before the process exists: its Hello (which may come
        # before its start returns) is the new one's, and what the old one sends is not.
        with self._lock:
            worker.peer, worker.ready, worker.killed_for = None, False, None
            worker.chan, worker.direct = None, False
            worker.gen, worker.proc = gen, None
            worker.wid = self._starts.request(worker.index, gen, spec)
        self._supervisor.wake()

    def _on_started(self, index: int, gen: int, process: Any) -> None:
        """(A starter thread of the supervisor) worker ``index``'s process ``gen`` runs."""
        worker = self._workers[index]
        with self._lock:
            if worker.gen == gen:
                worker.proc = process

    def _up(self, worker: _WorkerSlot) -> bool:
        return worker.ready and worker.proc is not None

    def _await_ready(self, deadline: float) -> list:
        """Wait for every worker; what each reported of its envs (spaces, metadata)."""
        while not all(self._up(w) for w in self._workers):
            self._pump(deadline, "the workers to start")
        return [self._called.pop((0, w.index))[0] for w in self._workers]

    # -- the receiving engine ----------------------------------------------------------
    def _pump(self, deadline: Optional[float], what: str) -> None:
        """Handle one reply; raise ``multiprocessing.TimeoutError`` past ``deadline``."""
        self._check_alive()
        for worker in self._workers:
            if worker.direct and worker.chan is not None:
                self._pump_direct(worker, deadline, what)
                return
        hang = self._hang_deadline()
        limits = [d for d in (deadline, hang) if d is not None]
        until = min(limits) if limits else None
        left = None if until is None else max(0.0, until - time.monotonic())
        try:
            item = self._inbox.get(timeout=left)
        except queue.Empty:
            if hang is not None and time.monotonic() >= hang:
                self._kill_hung()
                return
            raise MpTimeoutError(f"RemoteVectorEnv: timed out waiting for {what}; the "
                                 "envs are still running (call the wait method again), "
                                 "or raise the timeout") from None
        self._dispatch(item)

    def _pump_direct(self, worker: _WorkerSlot, deadline: Optional[float], what: str) -> None:
        """Receive ``worker``'s next reply on its direct connection, on this thread; between
        slices of waiting, handle what the listener and the supervisor posted (deaths,
        replacements' Hellos)."""
        if not self._inbox.empty():   # only this thread takes from the inbox
            self._dispatch(self._inbox.get_nowait())
            return
        hang = self._hang_deadline()
        left = _SLICE
        if deadline is not None or hang is not None:
            until = min(d for d in (deadline, hang) if d is not None)
            left = min(_SLICE, until - time.monotonic())
        try:
            if left <= 0:
                raise TimeoutError
            frame = worker.chan.recv(left)
        except TimeoutError:
            now = time.monotonic()
            if hang is not None and now >= hang:
                self._drain_direct()  # replies already there must not count as hung
                self._kill_hung()
            elif deadline is not None and now >= deadline:
                raise MpTimeoutError(f"RemoteVectorEnv: timed out waiting for {what}; the "
                                     "envs are still running (call the wait method again), "
                                     "or raise the timeout") from None
            return
        except ChannelClosed:
            worker.chan = None  # the worker is gone: its Died message replaces it
            return
        self._handle(decode(frame))

    def _drain_direct(self) -> None:
        """Handle every reply already waiting on the direct connections."""
        for worker in self._workers:
            while worker.direct and worker.chan is not None:
                try:
                    frame = worker.chan.recv(0.001)
                except TimeoutError:
                    break
                except ChannelClosed:
                    worker.chan = None
                    break
                self._handle(decode(frame))

    def _dispatch(self, item: Any) -> None:
        """Handle an item of the inbox: a frame from the listener, or what the supervisor
        posted (Started, StartFailed, Died)."""
        if isinstance(item, tuple):
            peer, frame = item
            item = decode(frame)
            if isinstance(item, Hello):
                worker = self._workers[item.worker]
                if item.gen == worker.gen:
                    worker.peer = peer
                    if item.address:
                        self._dial(worker, item.address)
                return
        self._handle(item)

    def _dial(self, worker: _WorkerSlot, address: str) -> None:
        """Open the direct connection to ``worker``'s listener (the listener path stays
        in use if that fails)."""
        try:
            worker.chan = channel.connect(address, min(30.0, self._start_timeout))
        except (TransportError, OSError) as exc:
            log.warning("RemoteVectorEnv: no direct connection to worker %d (%s); its "
                        "replies go through the listener", worker.index, exc)

    def _handle(self, msg: Any) -> None:
        worker = self._workers[msg.worker]
        if msg.gen != worker.gen:
            return  # from a worker already replaced
        if isinstance(msg, Result):
            self._on_result(worker, msg)
        elif isinstance(msg, Called):
            self._on_called(worker, msg)
        elif isinstance(msg, Broken):
            # the worker exits: all its envs start over in the next one
            culprit = worker.env_ids[msg.slot]
            self._restart_worker(worker, msg.traceback, [culprit], last_line(msg.traceback))
        elif isinstance(msg, Died):
            detail = f"; {msg.detail}" if msg.detail else ""
            reason = worker.killed_for or (f"its worker process ended "
                                           f"({describe_exitcode(msg.exitcode)}{detail})")
            suspects = self._suspects(worker)
            who = blame(suspects) if worker.ready else "while starting its envs"
            reason = f"worker {worker.index} (envs {worker.env_ids}): {reason}, {who}"
            kind = "StepTimeout" if worker.killed_for else "WorkerDied"
            self._restart_worker(worker, reason, suspects or worker.env_ids, (kind, reason))
        elif isinstance(msg, StartFailed):
            raise msg.error
        # (Started: only wakes a thread waiting for the worker to be up)

    def _on_result(self, worker: _WorkerSlot, msg: Result) -> None:
        for failure in msg.restarts:
            env_id = worker.env_ids[failure.slot]
            if failure.restarted:
                self._charge([env_id], failure.traceback)
            else:   # raised in the caller once the call is complete
                self._failures.append((env_id, failure))
        if msg.slots == worker.slots:  # all its envs (the common case): rows by slice
            self._chunks.append((worker.ids, msg, worker.span))
        else:
            env_ids = worker.ids[list(msg.slots)]
            self._chunks.append((env_ids, msg, env_ids))
        for i, (req, sent) in enumerate(worker.open):
            if req.seq == msg.seq:
                del worker.open[i]
                if len(msg.slots) == len(req.slots):
                    worker.direct = worker.direct and bool(worker.open)
                    break  # the whole request answered (the common case)
                done = set(msg.slots)
                left = tuple(s for s in req.slots if s not in done)
                if left:
                    worker.open.append((_narrow(req, left), sent))
                break

    def _on_called(self, worker: _WorkerSlot, msg: Called) -> None:
        if msg.seq == 0:
            worker.ready = True
            if not self._built:   # the vector env is being built: its envs' spaces
                self._called[(0, worker.index)] = msg.values
            return
        worker.open = [(r, t) for r, t in worker.open if r.seq != msg.seq]
        worker.direct = worker.direct and bool(worker.open)
        self._called[(msg.seq, worker.index)] = msg

    def _charge(self, env_ids: Sequence[int], why: str, culprits: Sequence[int] = ()) -> None:
        """Count a restart of ``env_ids``, charged to ``culprits`` (default: all of them)
        against their budgets; past one, fail for good."""
        culprits = culprits or env_ids
        self._restart_log.tell(culprits[0], why)
        self._budget.restarted(env_ids)
        try:
            for i in culprits:
                self._budget.charge(i, why, self._tick + int(self._sent[i]))
        except EnvCrashError as exc:
            self._error = exc
            raise

    def _suspects(self, worker: _WorkerSlot) -> list:
        """The envs of ``worker`` whose step or reset had not come back: one of them made it
        die (a hard crash leaves no trace of which); none when it died idle."""
        slots = {s for req, _ in worker.open if not isinstance(req, Call) for s in req.slots}
        return [worker.env_ids[s] for s in sorted(slots)]

    def _restart_worker(self, worker: _WorkerSlot, why: str, culprits: list,
                        kind: tuple) -> None:
        """Charge a lost worker's restart to ``culprits`` and replace it; every env of it
        reports ``kind`` (type, message) in its restart's infos."""
        for i in worker.env_ids:
            self._why[i] = kind
        self._charge(worker.env_ids, why, culprits)
        if worker.replacing:
            worker.respawn = True   # the _replace waiting for it (up the stack) starts another
            return
        self._replace(worker)

    def _replace(self, worker: _WorkerSlot) -> None:
        """Start a new incarnation of ``worker`` and send it the requests it held. An
        incarnation lost while starting is charged and started again here, in a loop (not
        a call deeper per loss: a budget of thousands of restarts must not overflow the
        stack)."""
        held = worker.open
        worker.open = []
        worker.replacing = True
        try:
            worker.respawn = True
            while worker.respawn:
                worker.respawn = False
                self._supervisor.kill(worker.wid)   # (one that reported Broken exits anyway)
                self._spawn(worker)
                deadline = time.monotonic() + self._start_timeout
                while not self._up(worker) and not worker.respawn:
                    self._pump(deadline, f"worker {worker.index} to restart")
        finally:
            worker.replacing = False
        direct = self._state in (AsyncState.WAITING_STEP, AsyncState.WAITING_RESET)
        for msg, _ in held:
            self._post(worker, msg, direct and not isinstance(msg, Call))

    def _hang_deadline(self) -> Optional[float]:
        if self._step_timeout is None:
            return None
        sent = [t for w in self._workers for _, t in w.open if t != float("inf")]
        return min(sent) + self._step_timeout if sent else None

    def _kill_hung(self) -> None:
        now = time.monotonic()
        for worker in self._workers:
            if any(now - t >= self._step_timeout for _, t in worker.open):
                worker.killed_for = (f"its step took longer than step_timeout="
                                     f"{self._step_timeout:g} s; the worker was killed")
                worker.open = [(m, float("inf")) for m, _ in worker.open]
                self._supervisor.kill(worker.wid)

    def _post(self, worker: _WorkerSlot, msg: Any, direct: bool = False) -> None:
        self._post_all([(worker, msg)], direct)

    def _post_all(self, posts: list, direct: bool = False) -> None:
        """Send requests; ``direct``: on the workers' direct connections where they have one
        (full-batch steps and resets, whose replies are received in worker order)."""
        # encode every request first, then send them back to back: the first workers'
        # replies then do not slow the later sends
        frames = [encode(msg) for _, msg in posts]
        now = time.monotonic()
        for (worker, msg), frame in zip(posts, frames):
            worker.open.append((msg, now))
            try:
                if direct and worker.chan is not None:
                    worker.direct = True
                    worker.chan.send(frame)
                else:
                    worker.peer.send(frame)
            except ChannelClosed:
                pass  # the worker died: the supervisor posts the Died message that replaces it

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error
        if self.closed:
            raise ClosedEnvironmentError("RemoteVectorEnv: the vector env is closed")

    # -- sending and collecting --------------------------------------------------------
    def _send_steps(self, actions: Any, env_ids: Optional[np.ndarray]) -> None:
        """One Step per worker concerned; ``env_ids`` None: every env (the common case)."""
        n = self.num_envs if env_ids is None else len(env_ids)
        if type(actions) is not np.ndarray or actions.shape[:1] != (n,):
            actions = self._action_batch(actions, n)
        self._check_actions(actions)
        if self._broken:
            self._refuse_broken(env_ids)
        posts = []
        if env_ids is None:
            plain = type(actions) is np.ndarray
            sent = plain and fastpath.send_steps(self, actions)
            # (after the sends: the first worker's start is on every step's critical path)
            self._tick += 1
            if self.policy_version is not None:
                self._versions[:] = self.policy_version
            self._pending.update(self._every_env)
            if sent:
                return
            if plain:   # a request may be sent again later: not a view of the caller's array
                actions = actions.copy()
            for w in self._workers:
                acts = actions[w.span] if plain else rows(actions, w.span)
                posts.append((w, Step(self._next_seq(), w.slots, acts)))
        else:
            by_worker: dict = collections.defaultdict(list)
            for k, env_id in enumerate(env_ids.tolist()):
                w, j = self._where[env_id]
                by_worker[w].append((j, k))
            for w, pairs in by_worker.items():
                slots = tuple(j for j, _ in pairs)
                acts = rows(actions, np.array([k for _, k in pairs]))
                posts.append((self._workers[w], Step(self._next_seq(), slots, acts)))
            self._pending.update(env_ids.tolist())
            self._sent[env_ids] += 1
            if self.policy_version is not None:
                self._versions[env_ids] = self.policy_version
        self._post_all(posts, direct=env_ids is None)

    def _action_batch(self, actions: Any, n: int) -> Any:
        """``actions`` checked to be a batch of ``n``; for an action space whose batch is not
        numpy arrays, made an object array of the single actions (gymnasium's ``iterate``)."""
        if self._check_actions.fixed:
            _check_count(actions, n)
            return actions
        space = self._action_spaces.get(n)
        if space is None:
            space = self._action_spaces[n] = batch_space(self.single_action_space, n)
        try:
            items = list(iterate(space, actions))
        except Exception as exc:
            raise TypeError(f"RemoteVectorEnv: actions must be a batch of {n} actions of "
                            f"{self.single_action_space} (as action_space.sample() gives), "
                            f"got {type(actions).__name__} {actions!r:.80}") from exc
        if len(items) != n:
            raise ValueError(f"RemoteVectorEnv: {len(items)} actions for {n} envs; pass one "
                             f"action per env")
        return objects(items)

    def _refuse_broken(self, env_ids: Optional[np.ndarray]) -> None:
        ids = range(self.num_envs) if env_ids is None else env_ids.tolist()
        broken = sorted(self._broken.intersection(ids))
        if broken:
            raise ResetNeeded(f"RemoteVectorEnv: envs {broken} raised (on_error='raise') and "
                              f"must be reset before they step again: call reset() (or reset "
                              f"with options={{'reset_mask': mask}} covering them)")

    def _collect(self, num: int, deadline: Optional[float], what: str) -> list:
        """The first ``num`` finished envs, as a list of (env_ids, Result, rows) pieces;
        ``rows`` indexes the envs' rows of a full batch: a slice, or ``env_ids``."""
        got, count = [], 0
        while count < num:
            if not self._chunks:
                self._pump(deadline, what)
                continue
            env_ids, msg, where = self._chunks.popleft()
            take = min(num - count, len(env_ids))
            if take < len(env_ids):
                tail = env_ids[take:]
                self._chunks.appendleft((tail, _result_tail(msg, take), tail))
                env_ids, msg = env_ids[:take], _result_head(msg, take)
                where = env_ids
            got.append((env_ids, msg, where))
            count += take
        for env_ids, _, _ in got:
            self._pending.difference_update(env_ids.tolist())
        return got

    def _assemble(self, got: list, n: int, by_id: bool) -> tuple:
        """Batch the pieces: row ``i`` is env ``i`` (``by_id``) or rows in arrival order.

        Every piece also updates the latest observations (``self._obs``), which a masked
        reset returns for the envs it does not reset."""
        obs = None if by_id else self._empty_batch(n)
        rewards = np.zeros(n, dtype=np.float64)
        terms, truncs = np.zeros(n, dtype=np.bool_), np.zeros(n, dtype=np.bool_)
        start = 0
        order: list[tuple[int, dict]] = []
        for env_ids, msg, where in got:
            write_rows(self._obs, where, msg.obs)
            if by_id:
                idx = where
            else:
                idx = slice(start, start + len(env_ids))
                start += len(env_ids)
                write_rows(obs, idx, msg.obs)
            if msg.rewards is not None:
                rewards[idx], terms[idx], truncs[idx] = msg.rewards, msg.terminated, msg.truncated
            if any(msg.infos):
                at = range(idx.start, idx.stop) if type(idx) is slice else idx.tolist()
                order.extend((i, info) for i, info in zip(at, msg.infos) if info)
        infos = fastpath.merge_infos(order, n)
        out = _copy(self._obs) if by_id else obs
        if self._dynamic:
            out = self._concatenated(out)
        return out, rewards, terms, truncs, infos

    def _empty_batch(self, n: int) -> Any:
        if self._dynamic:
            return objects([None] * n)
        return create_empty_array(self.single_observation_space, n, fn=np.zeros)

    def _concatenated(self, items: Any) -> Any:
        """The batch of single observations ``items`` as ``SyncVectorEnv`` returns it (its
        own copies: the vector env keeps ``items`` for masked resets)."""
        space = self.single_observation_space
        out: Any = create_empty_array(space, len(items), fn=np.zeros)
        return copy.deepcopy(concatenate(space, list(items), out))

    def _raise_failures(self, what: str) -> None:
        """Raise what an env's own code raised during the call just completed (the first env
        that raised; the others are named in a note). Those envs need a reset."""
        if not self._failures:
            return
        failures = sorted(self._failures, key=lambda p: p[0])
        self._failures = []
        self._broken.update(i for i, _ in failures)
        env_id, failure = failures[0]
        others = "".join(f"\n  env {i}: {f.summary}" for i, f in failures[1:])
        exc = rebuilt(failure, f"env {env_id} raised in {what}")
        add_note = getattr(exc, "add_note", None)   # Python 3.11+
        if add_note is not None:
            add_note(f"(raised by env {env_id} of a RemoteVectorEnv in {what}"
                     f"{'; the other envs that raised:' + others if others else ''}; reset "
                     f"envs {sorted(self._broken)} before they step again)")
        raise exc

    def _forget_options(self, ended: np.ndarray, env_ids: Optional[np.ndarray],
                        infos: dict) -> None:
        """Envs whose episode ended begin the next without reset options (as an autoreset
        does); a restart of them passes none. An episode cut short by a restart is not
        one of them: the restart began the next one with the same options."""
        if self.autoreset_mode == AutoresetMode.DISABLED or not ended.any():
            return
        restarted = infos.get("_" + RESTARTED)
        if restarted is not None:
            ended = ended & ~restarted
        for i in (np.flatnonzero(ended) if env_ids is None else env_ids[ended]).tolist():
            self._options[i] = None
        self._any_options = any(o is not None for o in self._options)

    # -- gymnasium's API ---------------------------------------------------------------
    def reset(self, *, seed: Union[int, Sequence[Optional[int]], None] = None,
              options: Optional[dict] = None) -> tuple:
        """Reset all envs (or those of ``options["reset_mask"]``); returns ``(obs, infos)``."""
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(self, seed: Union[int, Sequence[Optional[int]], None] = None,
                    options: Optional[dict] = None) -> None:
        self._check_alive()
        self._expect_idle("reset_async")
        seeds = _seeds(seed, self.num_envs)
        options = dict(options) if options is not None else None
        mask = options.pop("reset_mask", None) if options is not None else None
        ids = np.arange(self.num_envs) if mask is None else _mask_ids(mask, self.num_envs)
        for i in ids.tolist():
            if seeds[i] is not None:
                self._seeds[i] = seeds[i]
            self._options[i] = options   # what a restart in this episode resets with
        self._any_options = any(o is not None for o in self._options)
        self._broken.difference_update(ids.tolist())   # their workers make them anew
        for worker in self._workers:
            slots = tuple(j for j, i in enumerate(worker.env_ids) if i in set(ids.tolist()))
            if slots:
                self._post(worker, Reset(self._next_seq(), slots,
                                         tuple(seeds[worker.env_ids[j]] for j in slots),
                                         options), direct=True)
        self._pending.update(ids.tolist())
        self._reset_ids = ids
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: Optional[float] = None) -> tuple:
        self._expect(AsyncState.WAITING_RESET, "reset_wait", "reset_async")
        deadline = None if timeout is None else time.monotonic() + timeout
        got = self._collect(len(self._pending), deadline, "reset")
        self._state = AsyncState.DEFAULT
        obs, _, _, _, infos = self._assemble(got, self.num_envs, True)
        self._ended[self._reset_ids] = False
        self._raise_failures("reset")
        return obs, infos

    def step(self, actions: Any) -> tuple:
        """Step every env with its action; returns gymnasium's 5-tuple of batches."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        self._check_alive()
        self._expect_idle("step_async")
        self._send_steps(actions, None)
        self._state = AsyncState.WAITING_STEP

    def step_wait(self, timeout: Optional[float] = None) -> tuple:
        """Wait for the step sent by :meth:`step_async`; ``multiprocessing.TimeoutError``
        after ``timeout`` seconds (the step stays pending: call ``step_wait`` again)."""
        self._expect(AsyncState.WAITING_STEP, "step_wait", "step_async")
        deadline = None if timeout is None else time.monotonic() + timeout
        out = fastpath.step_replies(self, deadline, _SLICE)
        if out is None:
            got = self._collect(len(self._pending), deadline, "step")
            out = self._assemble(got, self.num_envs, True)
        self._state = AsyncState.DEFAULT
        np.logical_or(out[2], out[3], out=self._ended)
        if self._failures:
            self._raise_failures("step")
        if self._any_options:
            self._forget_options(out[2] | out[3], None, out[4])
        if self.policy_version is not None:
            out[4]["policy_version"] = self._versions.copy()
        return out

    # -- partial batches ---------------------------------------------------------------
    def send(self, actions: Any, env_ids: Optional[Sequence[int]] = None) -> None:
        """Step the envs ``env_ids`` (default: all) with ``actions`` (one row each), without
        waiting; envs still running from an earlier ``send`` cannot be sent again."""
        self._check_alive()
        if self._state not in (AsyncState.DEFAULT, AsyncState.PARTIAL):
            raise AlreadyPendingCallError(
                f"RemoteVectorEnv.send while a {self._state} call is pending; finish it first",
                self._state)
        ids = np.arange(self.num_envs) if env_ids is None else np.asarray(env_ids, np.int64)
        busy = sorted(self._pending.intersection(ids.tolist()))
        bad = len(set(ids.tolist())) != len(ids) or ids.min() < 0 or ids.max() >= self.num_envs
        if busy or bad:
            raise ValueError(f"RemoteVectorEnv.send: env_ids {ids.tolist()} must be distinct "
                             f"ids in [0, {self.num_envs}) and not running; running: {busy}")
        self._send_steps(actions, ids)
        self._state = AsyncState.PARTIAL

    def recv(self, num: Optional[int] = None, timeout: Optional[float] = None) -> tuple:
        """The first ``num`` envs to finish (default: all sent), as ``(obs, rewards,
        terminated, truncated, infos)`` batches of ``num`` rows in finishing order, with
        the env of each row in ``infos["env_id"]``."""
        if self._state != AsyncState.PARTIAL:
            raise NoAsyncCallError("RemoteVectorEnv.recv without a send", self._state)
        num = len(self._pending) if num is None else num
        if not 0 < num <= len(self._pending):
            raise ValueError(f"RemoteVectorEnv.recv: num={num}, but {len(self._pending)} "
                             "envs are running")
        deadline = None if timeout is None else time.monotonic() + timeout
        got = self._collect(num, deadline, f"{num} envs")
        if not self._pending:
            self._state = AsyncState.DEFAULT
        obs, rewards, terms, truncs, infos = self._assemble(got, num, False)
        infos["env_id"] = np.concatenate([ids for ids, _, _ in got])
        self._ended[infos["env_id"]] = terms | truncs
        self._raise_failures("step")
        if self._any_options:
            self._forget_options(terms | truncs, infos["env_id"], infos)
        if self.policy_version is not None:
            infos["policy_version"] = self._versions[infos["env_id"]]
        return obs, rewards, terms, truncs, infos

    # -- call, get_attr, set_attr ------------------------------------------------------
    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple:
        """Call ``name`` on every env (or read it, if not callable); a tuple, one per env."""
        return self._call_all(Call(0, name, args, kwargs))

    def get_attr(self, name: str) -> tuple:
        """The attribute ``name`` of every env."""
        return self._call_all(Call(0, name))

    def set_attr(self, name: str, values: Any) -> None:
        """Set ``name`` on every env: one value each (list/tuple) or the same value."""
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(f"set_attr needs {self.num_envs} values, got {len(values)}")
        for worker in self._workers:
            worker_values = tuple(values[i] for i in worker.env_ids)
            self._call_one(worker, Call(self._next_seq(), name, values=worker_values))
        self._gather("set_attr")
        for i, value in enumerate(values):   # a worker that replaces a dead one sets them
            self._attrs[i][name] = value

    def _call_all(self, template: Call) -> tuple:
        for worker in self._workers:
            self._call_one(worker, Call(self._next_seq(), template.name, template.args,
                                        template.kwargs))
        return tuple(v for called in self._gather(template.name) for v in called.values)

    def _call_one(self, worker: _WorkerSlot, msg: Call) -> None:
        self._check_alive()
        self._expect_idle("call")
        self._post(worker, msg)

    def _gather(self, what: str) -> list:
        wanted = {(r.seq, w.index) for w in self._workers for r, _ in w.open
                  if isinstance(r, Call)}
        while not wanted.issubset(self._called):
            self._pump(None, f"{what} on every env")
        results = [self._called.pop(key) for key in sorted(wanted, key=lambda k: k[1])]
        for called in results:
            if called.error is not None:
                env_id = self._workers[called.worker].env_ids[called.error.slot]
                raise rebuilt(called.error, f"env {env_id} raised in {what}")
        return results

    # -- state machine -----------------------------------------------------------------
    def _expect_idle(self, what: str) -> None:
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(   # gymnasium's words, then how to go on
                f"Calling `{what}` while waiting for a pending call to `{self._state}` to "
                f"complete (RemoteVectorEnv: call its wait method, or recv, first)",
                self._state)

    def _expect(self, state: str, what: str, before: str) -> None:
        self._check_alive()
        if self._state != state:
            raise NoAsyncCallError(f"Calling `{what}` without any prior call to `{before}`.",
                                   state)

    # -- closing -----------------------------------------------------------------------
    def close_extras(self, timeout: Optional[float] = None, terminate: bool = False,
                     **kwargs: Any) -> None:
        grace = 0.0 if terminate else (5.0 if timeout is None else timeout)
        if self._state != AsyncState.DEFAULT and self._error is None and not self.closed:
            logger.warn(f"Calling `close` while waiting for a pending call to "
                        f"`{self._state}` to complete.")   # (gymnasium's words)
            finish = {AsyncState.WAITING_STEP: self.step_wait,
                      AsyncState.WAITING_RESET: self.reset_wait}.get(self._state)
            if finish is not None and grace > 0:
                try:
                    finish(grace)
                except Exception:
                    pass   # closing anyway: the workers are stopped next
        self._shutdown(grace)

    def _shutdown(self, grace: float) -> None:
        self.closed = True
        self._starts.closed = True   # the supervisor ends once no worker is left
        for worker in self._workers:
            if worker.peer is not None:
                try:
                    worker.peer.send(encode(Close()))
                except ChannelClosed:
                    pass  # the worker is gone already
            if worker.chan is not None:
                worker.chan.close()
        self._supervisor.wake()
        if not self._supervisor.join(grace):
            self._supervisor.terminate()   # past the grace: kill the rest
            if not self._supervisor.join(10.0):
                log.warning("RemoteVectorEnv: workers did not end within 10 s of a kill")
        self._listener.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            try:
                self.close(terminate=True)
            except Exception:
                pass  # interpreter shutdown: the workers exit when this process goes

    def __repr__(self) -> str:
        return (f"RemoteVectorEnv(num_envs={self.num_envs}, workers={len(self._workers)}, "
                f"autoreset_mode={self.autoreset_mode.value})")


def _check_count(actions: Any, n: int) -> None:
    """Raise, as gymnasium's vector envs do, unless ``actions`` is a batch of ``n`` actions
    (an array, a sequence, or dicts/tuples of them, with ``n`` rows)."""
    leaf = actions
    while isinstance(leaf, (dict, tuple)) and len(leaf):
        leaf = next(iter(leaf.values())) if isinstance(leaf, dict) else leaf[0]
    if isinstance(leaf, (str, bytes)) or np.ndim(leaf) == 0:
        raise TypeError(f"RemoteVectorEnv: actions must be a batch with one action per env "
                        f"({n} rows), got {type(actions).__name__} {actions!r:.80}")
    got = len(leaf)
    if got != n:
        raise ValueError(f"RemoteVectorEnv: {got} actions for {n} envs; pass one action per "
                         f"env (a batch of {n} rows, as the action_space samples)")


class _Starts(Policy):
    """The vector env's side of its supervisor: the worker incarnations to start, and
    their starts and ends posted to the inbox, which the stepping thread handles (it
    decides what a loss costs and when to replace)."""

    def __init__(self, inbox: queue.SimpleQueue, on_started: Callable[[int, int, Any], None]):
        self.closed = False
        self._inbox = inbox
        self._on_started = on_started
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._queued: list[int] = []
        self._of: dict[int, tuple[int, int, dict]] = {}   # wid -> (worker, gen, its spec)

    def request(self, worker: int, gen: int, spec: dict) -> int:
        """Queue a start of incarnation ``gen`` of ``worker``; its id at the supervisor."""
        with self._lock:
            wid = next(self._ids)
            self._of[wid] = (worker, gen, spec)
            self._queued.append(wid)
        return wid

    def spec(self, wid: int) -> dict:
        with self._lock:
            return self._of[wid][2]

    def reserve_workers(self) -> list[int]:
        with self._lock:
            queued, self._queued = self._queued, []
        return [] if self.closed else queued

    def finished(self) -> bool:
        return self.closed

    def started(self, wid: int, process: Any) -> None:
        with self._lock:
            worker, gen, _ = self._of[wid]
        self._on_started(worker, gen, process)
        self._inbox.put(Started(worker, gen))

    def start_failed(self, wid: int, exc: BaseException) -> None:
        with self._lock:
            worker, gen, _ = self._of.pop(wid)
        if not self.closed:
            self._inbox.put(StartFailed(worker, gen, exc))

    def lose(self, wid: int, exitcode: Optional[int], detail: str = "",
             load_error: str = "") -> None:
        with self._lock:
            worker, gen, _ = self._of.pop(wid, (-1, -1, {}))
        if worker >= 0 and not self.closed:
            self._inbox.put(Died(worker, gen, exitcode, load_error or detail))


# -- helpers ----------------------------------------------------------------------------
def _env_fns(env_fns: Any, num_envs: Optional[int], env_kwargs: Optional[dict],
             wrappers: tuple) -> list:
    if isinstance(env_fns, str):
        if num_envs is None or num_envs < 1:
            raise ValueError("RemoteVectorEnv(env_id, num_envs): num_envs must be >= 1")
        fn = functools.partial(_make_wrapped, env_fns, env_kwargs or {}, wrappers)
        return [fn] * num_envs
    fns = list(env_fns)
    if not fns or not all(callable(f) for f in fns):
        raise TypeError("RemoteVectorEnv: env_fns must be an env id or a non-empty sequence "
                        "of callables returning envs")
    if num_envs is not None and num_envs != len(fns):
        raise ValueError(f"num_envs={num_envs} but {len(fns)} env_fns were given")
    return fns


def _make_wrapped(env_id: str, env_kwargs: dict, wrappers: tuple) -> Any:
    env = make_gym_env(env_id, **env_kwargs)
    for wrapper in wrappers:
        env = wrapper(env)
    return env


def _seeds(seed: Any, n: int) -> list:
    if seed is None:
        return [None] * n
    if isinstance(seed, (int, np.integer)):
        return [int(seed) + i for i in range(n)]
    seeds = list(seed)
    if len(seeds) != n:
        raise ValueError(f"If seeds are passed as a list the length must match num_envs={n} "
                         f"but got length={len(seeds)}.")
    return seeds


def _mask_ids(mask: Any, n: int) -> np.ndarray:
    """The env ids of a reset mask, refused as gymnasium's vector envs refuse it (in
    their words)."""
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
    if mask.shape != (n,):
        raise ValueError(f"`options['reset_mask']` must have shape `({n},)`, got {mask.shape}")
    if mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
    if not mask.any():
        raise ValueError(f"`options['reset_mask']` must contain a boolean array with at least "
                         f"one True value, got reset_mask={mask}")
    return np.flatnonzero(mask)


def _per_worker(envs_per_worker: int, isolate_envs: bool) -> int:
    if envs_per_worker < 1:
        raise ValueError(f"envs_per_worker must be >= 1, got {envs_per_worker}")
    if isolate_envs and envs_per_worker != 1:
        raise ValueError(f"isolate_envs=True runs one env per process; it cannot go with "
                         f"envs_per_worker={envs_per_worker}")
    return envs_per_worker


def _narrow(req: Any, slots: tuple) -> Any:
    """``req`` restricted to the slots still unanswered (a half came back already)."""
    if isinstance(req, Step):
        keep = np.array([req.slots.index(s) for s in slots])
        return Step(req.seq, slots, rows(req.actions, keep))
    if isinstance(req, Reset):
        return Reset(req.seq, slots, tuple(req.seeds[req.slots.index(s)] for s in slots),
                     req.options)
    return req


def _cut(msg: Result, sl: slice) -> Result:
    pick = np.arange(len(msg.slots))[sl]
    rewards = None if msg.rewards is None else msg.rewards[sl]
    return Result(msg.worker, msg.gen, msg.seq, msg.slots[sl], rows(msg.obs, pick), rewards,
                  None if msg.terminated is None else msg.terminated[sl],
                  None if msg.truncated is None else msg.truncated[sl], msg.infos[sl], ())


def _result_head(msg: Result, n: int) -> Result:
    return _cut(msg, slice(0, n))


def _result_tail(msg: Result, n: int) -> Result:
    return _cut(msg, slice(n, None))


def _copy(obs: Any) -> Any:
    if isinstance(obs, dict):
        return {k: _copy(v) for k, v in obs.items()}
    if isinstance(obs, tuple):
        return tuple(_copy(v) for v in obs)
    return np.array(obs, copy=True)
