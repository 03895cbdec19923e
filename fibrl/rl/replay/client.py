"""What writers and learners hold: :class:`ReplayStore`, its shard proxies, its manager.

Owns the client side: starting one store server per shard (a fibrl manager
server, so a local process, a docker container or a kubernetes pod), turning
torch tensors into numpy arrays and back, spreading inserts over shards,
drawing a sharded batch in proportion to each shard's priority mass, turning
probabilities into importance weights (normalised over every shard's items, as
PER does), joining a store by address from a process that fibrl did not start,
and the clear error when a server is gone. It does not own the stored items
(``table``).

::

    writer ──insert──> shard proxy (shards in turn) ──manager call──> ReplayTable
    learner ──sample(k)── 1 shard: one call (carrying the last priority update)
                          n shards: mass() on each ─> multinomial split of k
                                    ─> sample(c_s) on each (async, in parallel)
                                    ─> probabilities rescaled to the global total
    learner ──sample_async(k)──> the same calls, sent through the process's hub
                                 ─> PendingSample ──get()──> SampleBatch
                                 (the learner trains on the previous batch meanwhile)
    owner: store.address ("tcp://host:port/<table id>,..." per shard) + authkey
       ──> any process: ReplayStore.connect(address, authkey)
           ─> a proxy per shard (authenticated with authkey), checked to be shard i of n

A batch is a dict of numpy arrays, so it crosses the wire as a handful of raw
buffers (pickle protocol 5, large ones out of band), never one object per item.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
from multiprocessing import process
from typing import Any, Optional, TypeVar

import numpy as np

from fibrl.errors import AuthenticationError, ChannelClosed, RemoteObjectError, TransportError
from fibrl.managers import BaseManager, BaseProxy, Token

from .batch import PendingSample, SampleBatch, merge, only, split
from .batch import finish as _finish
from .errors import ReplayStoreLost
from .limiters import LimiterSpec
from .selectors import as_selector
from .table import (TABLE_METHODS, NStep, ReplayTable, TableConfig, check_batch_size,
                    check_beta)

__all__ = ["ReplayStore", "ReplayManager", "ReplayTableProxy", "SampleBatch", "PendingSample",
           "register_replay_store"]


# -- conversions ---------------------------------------------------------------------------------
def _as_array(value: Any) -> np.ndarray:
    torch = sys.modules.get("torch")  # never imported here: only if the program uses it
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _as_batch(batch: Any) -> dict:
    if not isinstance(batch, dict):
        raise TypeError(f"a replay batch is a dict of arrays (one row per item), got "
                        f"{type(batch).__name__}")
    return {str(name): _as_array(value) for name, value in batch.items()}


def _optional_array(value: Any) -> Optional[np.ndarray]:
    return None if value is None else _as_array(value)


class _Update(tuple):
    """A priority update ``(ids, priorities)``: int64 and float64 arrays, flat. It
    pickles as their bytes (a third of the time numpy's own array pickles take both
    ways: the update rides on every sample call of a learner)."""

    def __reduce__(self) -> tuple:
        return (_update_of, (self[0].tobytes(), self[1].tobytes()))


def _update_of(ids: bytes, priorities: bytes) -> tuple[np.ndarray, np.ndarray]:
    return np.frombuffer(ids, np.int64), np.frombuffer(priorities, np.float64)


def _update_arrays(ids: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
    """The arrays of a priority update: ids as int64, priorities as float64, flat."""
    return _Update((_as_array(ids).astype(np.int64).reshape(-1),
                    _as_array(priorities).astype(np.float64).reshape(-1)))


def _as_update(update: Any) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """:func:`_update_arrays` of an ``(ids, priorities)`` update, or None."""
    return None if update is None else _update_arrays(*update)


def _lost(exc: BaseException) -> ReplayStoreLost:
    return ReplayStoreLost(
        f"the replay store server is gone ({exc}): it was shut "
        f"down, killed, or its machine or container vanished, so its items are gone with it. "
        f"Start a new store, or recreate it with ReplayStore.restore(snapshot_path, "
        f"wal_path=...) if it wrote snapshots or a write-ahead log.")


# -- one shard -----------------------------------------------------------------------------------
class ReplayTableProxy(BaseProxy):
    """A proxy for one store server: the whole :class:`ReplayStore` API for one shard.

    What ``manager.ReplayStore(capacity, ...)`` returns from a :class:`ReplayManager`
    (or any manager passed to :func:`register_replay_store`).
    """

    _exposed_ = TABLE_METHODS

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return self._callmethod(method, args)
        except ReplayStoreLost:
            raise
        except RemoteObjectError as exc:
            raise _lost(exc) from exc

    def _call_later(self, method: str, *args: Any) -> Any:
        try:
            return self._call_async(method, args)
        except RemoteObjectError as exc:
            raise _lost(exc) from exc

    def _on_line(self, method: str, *args: Any) -> Any:
        """Send a call on this proxy's own pipelined line (``_call_pipelined``); a
        handle for :meth:`_wait`. A learner's prefetched batches cost a round trip's
        CPU and no more, and the calls sent this way run in the order sent (a shard's
        priority update before the batches drawn after it)."""
        try:
            return self._call_pipelined(method, args)
        except RemoteObjectError as exc:
            raise _lost(exc) from exc

    def _wait(self, handle: Any, timeout: Optional[float] = None) -> Any:
        try:
            return handle.get(timeout)
        except ReplayStoreLost:
            raise
        except RemoteObjectError as exc:
            raise _lost(exc) from exc

    def insert(self, batch: dict, priorities: Any = None, *,
               timeout: Optional[float] = None) -> np.ndarray:
        """Insert a batch; returns the item ids (int64)."""
        return self._call("insert", _as_batch(batch), _optional_array(priorities), timeout)

    def append(self, steps: dict, env_ids: Any, priorities: Any = None, *,
               timeout: Optional[float] = None) -> np.ndarray:
        """Add environment steps (n-step stores); returns the ids of the items completed.
        ``priorities[row]``: the priority of the item starting at step ``row``."""
        return self._call("append", _as_batch(steps), _as_array(env_ids),
                          _optional_array(priorities), timeout)

    def sample(self, batch_size: int, *, timeout: Optional[float] = None,
               as_torch: bool = False, update: Any = None,
               beta: Optional[float] = None) -> SampleBatch:
        """Draw ``batch_size`` items (waits for the rate limiter up to ``timeout``);
        ``update=(ids, priorities)`` sends a priority update in the same call; ``beta``
        overrides the sampler's for this batch's importance weights."""
        return _finish(self._call("sample", int(batch_size), timeout, _as_update(update),
                                  _optional_beta(beta)), as_torch)

    def sample_async(self, batch_size: int, *, timeout: Optional[float] = None,
                     as_torch: bool = False, update: Any = None,
                     beta: Optional[float] = None) -> PendingSample:
        """Like :meth:`sample`, returning at once; see :meth:`ReplayStore.sample_async`."""
        check_batch_size(batch_size)
        handle = self._on_line("sample", int(batch_size), timeout, _as_update(update),
                               _optional_beta(beta))
        return PendingSample([(self, handle)], only, as_torch)

    def update_priorities(self, ids: Any, priorities: Any) -> int:
        """Set new priorities; ids no longer held are ignored. Returns how many applied."""
        return self._call("update_priorities", _as_array(ids), _as_array(priorities))

    def __len__(self) -> int:
        return self._call("size")

    def clear(self) -> None:
        self._call("clear")

    def stats(self) -> dict:
        """inserts, samples, samples_per_insert, insert/sample_blocked_s, size, ..."""
        return self._call("stats")

    def snapshot(self, path: Optional[str] = None) -> dict:
        """Write the items to ``path`` on the server's filesystem; see :class:`ReplayStore`."""
        return self._call("snapshot", path)

    def server_pid(self) -> int:
        return self._call("server_pid")

    def describe(self) -> dict:
        """This shard's index, the store's shard count, the capacity and the sampler."""
        return self._call("describe")

    @property
    def address(self) -> str:
        """Where this shard is: its server's URL and the table's object id, as
        ``tcp://host:port/<id>`` (what :meth:`connect` takes)."""
        return f"{self._token.address}/{self._token.id}"

    @classmethod
    def connect(cls, address: str, authkey: Optional[bytes] = None) -> "ReplayTableProxy":
        """A proxy for the shard at ``address`` (a :attr:`address`), authenticated with
        ``authkey`` (default: this process's authkey).

        Raises:
            fibrl.AuthenticationError: the server does not accept ``authkey``.
            ReplayStoreLost: nothing answers at ``address``.
            ValueError: ``address`` is not a replay shard's address.
        """
        server, ident = _split_address(address)
        key = bytes(process.current_process().authkey if authkey is None else authkey)
        try:
            proxy = cls(Token("ReplayShard", server, ident), authkey=key)   # (an incref)
            proxy.describe()
        except AuthenticationError as exc:
            raise AuthenticationError(
                f"the replay store at {server} did not accept this authkey ({exc}). Pass "
                f"ReplayStore.connect(address, authkey=key) the key of the process that "
                f"made the store (its fibrl.current_process().authkey, or the authkey= "
                f"it gave ReplayStore).") from exc
        except RemoteObjectError as exc:
            if isinstance(exc.__cause__, (TransportError, ChannelClosed)):   # no answer
                raise ReplayStoreLost(
                    f"no replay store answers at {server}: {exc} The store was closed, "
                    f"its process ended, or the address is mistyped; pass store.address "
                    f"as the process that made the store read it.") from exc
            raise ValueError(_not_a_store(server, ident, exc)) from exc
        except AttributeError as exc:   # an object of another kind, without describe()
            raise ValueError(_not_a_store(server, ident, exc)) from exc
        return proxy


def _not_a_store(server: str, ident: str, exc: BaseException) -> str:
    return (f"{server} answered, but holds no replay store {ident!r} ({exc}): it is "
            f"another fibrl process or manager, or another store's server. Pass "
            f"store.address as the process that made the store read it, while that "
            f"store is open.")


def _split_address(address: str) -> tuple[str, str]:
    """``(server URL, object id)`` of one shard's address, ``tcp://host:port/<id>``."""
    server, _, ident = address.strip().rpartition("/")
    scheme, sep, where = server.partition("://")
    if not (sep and scheme in ("tcp", "tls+tcp") and ":" in where and "/" not in where
            and ident):
        raise ValueError(
            f"{address!r} is not a replay store address: each shard's is "
            f"'tcp://host:port/<id>' (or 'tls+tcp://...'), and a store's is its shards' "
            f"joined by commas. Pass store.address as the process that made the store "
            f"printed it.")
    return server, ident


def _shard_addresses(address: Any) -> list:
    """The shard addresses of a store address (a comma-joined string or a sequence)."""
    if isinstance(address, str):
        parts = address.split(",")
    elif isinstance(address, (list, tuple)) and all(isinstance(a, str) for a in address):
        parts = list(address)
    else:
        raise TypeError(f"a replay store address is a string (store.address), got "
                        f"{type(address).__name__}")
    parts = [part.strip() for part in parts if part.strip()]
    if not parts:
        raise ValueError("an empty replay store address; pass store.address")
    return parts


def _optional_beta(beta: Optional[float]) -> Optional[float]:
    return None if beta is None else check_beta(beta)


def make_table(capacity: int, **options: Any) -> ReplayTable:
    """The server side of ``manager.ReplayStore(capacity, **options)`` (one shard)."""
    return ReplayTable(_config(capacity, **options))


def make_shard(config: TableConfig, restore_path: Optional[str] = None) -> ReplayTable:
    return ReplayTable(config, restore_path)


def restore_shard(path: str, overrides: dict) -> ReplayTable:
    from .persist import read_snapshot
    _arrays, meta = read_snapshot(path)
    return ReplayTable(dataclasses.replace(meta["config"], **overrides), path)


_Manager = TypeVar("_Manager", bound=BaseManager)


def register_replay_store(manager_class: type[_Manager]) -> type[_Manager]:
    """Add ``ReplayStore(capacity, ...)`` (one shard) to a manager class; returns it.

    Example:
        >>> from fibrl.managers import SyncManager
        >>> class Mgr(SyncManager): pass
        >>> register_replay_store(Mgr)  # doctest: +ELLIPSIS
        <class ...Mgr'>
    """
    manager_class.register("ReplayStore", make_table, proxytype=ReplayTableProxy)
    manager_class.register("ReplayShard", make_shard, proxytype=ReplayTableProxy)
    manager_class.register("ReplayRestore", restore_shard, proxytype=ReplayTableProxy)
    return manager_class


class ReplayManager(BaseManager):
    """A manager serving replay stores: ``ReplayManager().start(); m.ReplayStore(1000)``."""


register_replay_store(ReplayManager)


def _config(capacity: int, *, sampler: Any = "uniform", remover: Any = "fifo",
            rate_limiter: Optional[LimiterSpec] = None, max_times_sampled: Optional[int] = None,
            n_step: Optional[NStep] = None, seed: Optional[int] = None, shard: int = 0,
            num_shards: int = 1, wal_path: Optional[str] = None, wal_fsync: bool = False,
            snapshot_path: Optional[str] = None,
            snapshot_every: Optional[float] = None) -> TableConfig:
    config = TableConfig(capacity, as_selector(sampler, "sampler"),
                         as_selector(remover, "remover"), rate_limiter, max_times_sampled,
                         n_step, seed, shard, num_shards, wal_path, wal_fsync, snapshot_path,
                         snapshot_every)
    config.validate()
    return config


def _shard_path(path: Optional[str], shard: int, num_shards: int) -> Optional[str]:
    return path if path is None or num_shards == 1 else f"{path}.shard{shard}"


# -- the store -----------------------------------------------------------------------------------
class ReplayStore:
    """A replay buffer served by ``num_shards`` fibrl processes, shared by every process
    that holds it (it pickles: pass it to Process/Pool workers or through a Queue).

    Why one class of this size: it is the store's whole public API, and each method is
    its shard routing (inserts rotating over the shards, samples and priority updates
    split and merged across them); the servers' state is :class:`ReplayTable`'s, the
    samplers, limiters and n-step assembly their own classes.

    Args:
        capacity: items held in total (split evenly over the shards).
        sampler: ``"uniform"``, ``"prioritized"`` / :class:`Prioritized` (alpha, beta,
            eps), ``"fifo"``, ``"lifo"``, ``"min_heap"``, ``"max_heap"``.
        remover: which item goes when full: any sampler name, ``"fifo"`` by default
            (``"lowest_priority"`` is ``"min_heap"``).
        rate_limiter: :class:`MinSize` (default ``MinSize(1)``), :class:`SampleToInsertRatio`,
            :class:`Queue` or :class:`Stack`; one that can deadlock raises ``ValueError``.
        max_times_sampled: remove an item after it was sampled this many times.
        n_step: :class:`NStep` to assemble n-step items from :meth:`append`.
        num_shards: store servers; inserts rotate over them, prioritized sampling
            stays exact across them.
        seed: seeds the servers' random generators (shard ``i`` gets ``seed + i``).
        wal_path: write-ahead log file on the server (``.shard<i>`` appended when
            sharded); an existing log is replayed at start.
        wal_fsync: fsync each log record (survives a machine crash, not only a kill).
        snapshot_path: snapshot file on the server (``.shard<i>`` appended when
            sharded): where ``snapshot()`` without a path and periodic snapshots write.
        snapshot_every: seconds between periodic snapshots (``None``: none; needs
            ``snapshot_path``).
        authkey: the key the servers accept (default: this process's authkey, the run's
            secret). A key of its own lets processes that fibrl did not start join with
            :meth:`connect` without holding the run's secret; fibrl processes given the
            store when they start get it with the store, others join with ``connect``.
        ctx: the fibrl context whose backend runs the servers (default: current).
        start_timeout: seconds to wait for each server to start.

    Example:
        >>> store = ReplayStore(100_000, sampler=Prioritized(alpha=0.6, beta=0.4))
        >>> ids = store.insert({"obs": obs, "action": act}, priorities=td_error)
        >>> batch = store.sample(256)       # batch["obs"], batch.ids, batch.weights
        >>> store.update_priorities(batch.ids, new_td_error)

        A process that fibrl did not start (a ``torchrun`` rank) joins by address:

        >>> address, key = store.address, fibrl.current_process().authkey   # the owner
        >>> store = ReplayStore.connect(address, authkey=key)               # the joiner
    """

    def __init__(self, capacity: int, *, sampler: Any = "uniform", remover: Any = "fifo",
                 rate_limiter: Optional[LimiterSpec] = None,
                 max_times_sampled: Optional[int] = None, n_step: Optional[NStep] = None,
                 num_shards: int = 1, seed: Optional[int] = None,
                 wal_path: Optional[str] = None, wal_fsync: bool = False,
                 snapshot_path: Optional[str] = None, snapshot_every: Optional[float] = None,
                 authkey: Optional[bytes] = None, ctx: Any = None,
                 start_timeout: Optional[float] = None) -> None:
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
        if capacity < num_shards:
            raise ValueError(f"capacity {capacity} is smaller than num_shards {num_shards}")
        configs = [_config(-(-capacity // num_shards), sampler=sampler, remover=remover,
                           rate_limiter=rate_limiter, max_times_sampled=max_times_sampled,
                           n_step=n_step, seed=None if seed is None else seed + i, shard=i,
                           num_shards=num_shards,
                           wal_path=_shard_path(wal_path, i, num_shards), wal_fsync=wal_fsync,
                           snapshot_path=_shard_path(snapshot_path, i, num_shards),
                           snapshot_every=snapshot_every)
                   for i in range(num_shards)]
        self._start(ctx, start_timeout, [("ReplayShard", (c,)) for c in configs], seed,
                    authkey)

    @classmethod
    def queue(cls, size: int, **options: Any) -> "ReplayStore":
        """A bounded FIFO queue: each item sampled once, oldest first, writers wait when full."""
        from .limiters import Queue
        return cls(size, sampler="fifo", remover="fifo", max_times_sampled=1,
                   rate_limiter=Queue(size), **options)

    @classmethod
    def stack(cls, size: int, **options: Any) -> "ReplayStore":
        """Like :meth:`queue`, newest first."""
        from .limiters import Stack
        return cls(size, sampler="lifo", remover="lifo", max_times_sampled=1,
                   rate_limiter=Stack(size), **options)

    @classmethod
    def restore(cls, path: str, *, num_shards: int = 1, wal_path: Optional[str] = None,
                wal_fsync: bool = False, snapshot_path: Optional[str] = None,
                snapshot_every: Optional[float] = None, authkey: Optional[bytes] = None,
                ctx: Any = None, start_timeout: Optional[float] = None) -> "ReplayStore":
        """A new store holding what :meth:`snapshot` wrote to ``path`` (with the same
        configuration), plus the records of ``wal_path`` written after that snapshot."""
        store = cls.__new__(cls)
        calls = []
        for i in range(num_shards):
            overrides = dict(wal_path=_shard_path(wal_path, i, num_shards), wal_fsync=wal_fsync,
                             snapshot_path=_shard_path(snapshot_path, i, num_shards),
                             snapshot_every=snapshot_every)
            calls.append(("ReplayRestore", (_shard_path(path, i, num_shards), overrides)))
        store._start(ctx, start_timeout, calls, None, authkey)
        return store

    @classmethod
    def connect(cls, address: Any, authkey: Optional[bytes] = None) -> "ReplayStore":
        """A client of the store at ``address`` (a store's :attr:`address`), for a process
        that fibrl did not start: a ``torchrun`` or ``torch.multiprocessing`` rank, a
        script started by hand or by another launcher.

        The client is the one fibrl processes hold (insert, append, sample,
        sample_async, update_priorities, len, stats, snapshot, ...). Its connections
        authenticate with ``authkey`` (the same handshake, and TLS where the store's
        address is ``tls+tcp://``, as every fibrl connection).

        Args:
            address: ``store.address`` as the owner read it: the shards' addresses
                joined by commas (a list of them works too), in shard order.
            authkey: the key the store's servers accept: the owner's
                ``fibrl.current_process().authkey``, or the ``authkey=`` it gave
                ``ReplayStore``. Default: this process's authkey (right in a process
                that inherited it, e.g. one started by the owner with
                ``multiprocessing``).

        Raises:
            fibrl.AuthenticationError: the store does not accept ``authkey``.
            ReplayStoreLost: nothing answers at an address (the store was closed).
            ValueError: ``address`` is not a replay store's (malformed, another kind of
                server, the shards of another store, or missing some shards).

        Example:
            >>> store = ReplayStore.connect(address, authkey=key)   # doctest: +SKIP
            >>> store.insert({"obs": obs}); batch = store.sample(256)  # doctest: +SKIP
        """
        shards = [ReplayTableProxy.connect(part, authkey)
                  for part in _shard_addresses(address)]
        _check_layout(shards)
        store = cls.__new__(cls)
        store._shards = shards
        store._managers = None
        store._setup_client()
        return store

    def _start(self, ctx: Any, start_timeout: Optional[float], calls: list,
               seed: Optional[int], authkey: Optional[bytes] = None) -> None:
        self._managers: Optional[list] = []
        self._shards: list = []
        try:
            for typeid, args in calls:
                manager = ReplayManager(ctx=ctx, authkey=authkey)
                manager.start(timeout=start_timeout)
                self._managers.append(manager)
                self._shards.append(getattr(manager, typeid)(*args))
        except BaseException:
            self.close()
            raise
        self._setup_client(seed)

    def _setup_client(self, seed: Optional[int] = None) -> None:
        # the creator's shard draws are seeded with the store; other processes' are not
        self._rng = np.random.default_rng(None if seed is None else seed + 10_007)
        self._turn = itertools.cycle(np.roll(np.arange(len(self._shards)),
                                             os.getpid() % len(self._shards)).tolist())

    # -- pickling: shards travel, the servers stay owned by the creating process -----------
    def __getstate__(self) -> dict:
        return {"shards": self._shards}

    def __setstate__(self, state: dict) -> None:
        self._shards = state["shards"]
        self._managers = None
        self._setup_client()

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def address(self) -> str:
        """Where the store is, for :meth:`connect`: each shard's server URL and table id
        (``tcp://host:port/<id>``, or ``tls+tcp://`` with TLS), joined by commas in shard
        order. Not a secret: joining also needs the authkey."""
        return ",".join(shard.address for shard in self._shards)

    # -- the API ------------------------------------------------------------------------------
    def insert(self, batch: dict, priorities: Any = None, *,
               timeout: Optional[float] = None) -> np.ndarray:
        """Insert a batch (dict of equal-length arrays or tensors) into one shard.

        ``priorities`` default to the largest priority seen. Returns the item ids.
        Waits up to ``timeout`` seconds (None: no limit) if the rate limiter holds
        writers back, then raises :class:`RateLimiterTimeout`.
        """
        return self._shards[next(self._turn)].insert(batch, priorities, timeout=timeout)

    def append(self, steps: dict, env_ids: Any, priorities: Any = None, *,
               timeout: Optional[float] = None) -> np.ndarray:
        """Add one step per row for environment ``env_ids[row]``; the server assembles
        n-step items (see :class:`NStep`). An environment's steps always go to one shard.

        ``priorities[row]`` is the priority of the n-step item that starts at step
        ``row`` (stored once its steps are in); without it an item gets the largest
        priority seen when it is stored. Returns the ids of the items stored.
        """
        env_ids = _as_array(env_ids).reshape(-1)
        if self.num_shards == 1:
            return self._shards[0].append(steps, env_ids, priorities, timeout=timeout)
        steps = _as_batch(steps)
        prios = _optional_array(priorities)
        if prios is not None:
            prios = prios.reshape(-1)
            if len(prios) != len(env_ids):
                raise ValueError(f"append() got {len(prios)} priorities for "
                                 f"{len(env_ids)} steps; give one per step (row)")
        owner = np.asarray([hash(int(e)) % self.num_shards for e in env_ids.tolist()])
        out = [self._shards[s].append({k: v[owner == s] for k, v in steps.items()},
                                      env_ids[owner == s],
                                      None if prios is None else prios[owner == s],
                                      timeout=timeout)
               for s in np.unique(owner).tolist()]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def sample(self, batch_size: int, *, timeout: Optional[float] = None,
               as_torch: bool = False, update: Any = None,
               beta: Optional[float] = None) -> SampleBatch:
        """Draw ``batch_size`` items: :class:`SampleBatch` with data, ids and (prioritized)
        importance weights; ``as_torch=True`` returns torch tensors.

        ``update=(ids, priorities)`` applies a priority update first; with one shard it
        travels in the same call (one round trip for a learner's update + sample).
        ``beta`` sets this batch's importance-weight exponent (prioritized stores; the
        sampler's ``beta`` by default), for a schedule that anneals it toward 1.

        Example:
            >>> beta = 0.4 + 0.6 * min(1.0, step / total_steps)   # doctest: +SKIP
            >>> batch = store.sample(256, beta=beta)               # doctest: +SKIP
        """
        if self.num_shards == 1:
            return self._shards[0].sample(batch_size, timeout=timeout, as_torch=as_torch,
                                          update=update, beta=beta)
        return self.sample_async(batch_size, timeout=timeout, as_torch=as_torch,
                                 update=update, beta=beta).get()

    def sample_async(self, batch_size: int, *, timeout: Optional[float] = None,
                     as_torch: bool = False, update: Any = None,
                     beta: Optional[float] = None) -> PendingSample:
        """Request a batch and return at once: a :class:`PendingSample` whose ``get()``
        gives what :meth:`sample` would have.

        Request the next batch before training on the current one, and the store
        draws it meanwhile: the round trip is hidden behind the training step.
        Several may be pending. The server draws a batch when its request arrives,
        in the order requests arrive, and its rate limiter counts the batch then
        (``timeout`` is how long the limiter may hold it back, as in :meth:`sample`).
        ``update=(ids, priorities)`` is applied just before this batch is drawn, so
        with one batch prefetched, a batch's new priorities ride on the request
        after next. With several shards, the call waits for the shards' priority
        masses (one round trip) before it returns; the samples come meanwhile.
        ``beta`` sets the batch's importance-weight exponent, as in :meth:`sample`.

        Example:
            >>> pending = store.sample_async(256)
            >>> update = None
            >>> for step in range(steps):
            ...     batch = pending.get()
            ...     pending = store.sample_async(256, update=update)  # drawn while we train
            ...     td_error = train(batch)
            ...     update = (batch.ids, abs(td_error))
        """
        check_batch_size(batch_size)
        beta = _optional_beta(beta)
        if self.num_shards == 1:
            return self._shards[0].sample_async(batch_size, timeout=timeout,
                                                as_torch=as_torch, update=update, beta=beta)
        # each shard's part of the update rides on the call that asks for its mass, on
        # the line that carries its samples: it lands after the batches asked before
        shards = self._shards
        updates = self._split_update(update)
        masses = [s._wait(h) for s, h in
                  zip(shards, [s._on_line("mass", u) for s, u in zip(shards, updates)])]
        mass = np.asarray([m[0] for m in masses], dtype=np.float64)
        size = sum(m[1] for m in masses)
        low = min((m[3] for m in masses if m[3] is not None), default=np.inf)
        if mass.sum() <= 0:  # empty: let the shards' rate limiters decide how to wait
            mass = np.ones(len(shards))
        counts = split(int(batch_size), mass / mass.sum(), self._rng, masses[0][2])
        parts = [(shards[s], shards[s]._on_line("sample", int(c), timeout, None, beta))
                 for s, c in enumerate(counts.tolist()) if c]
        merge_parts = functools.partial(merge, total_mass=float(mass.sum()), size=size, low=low)
        return PendingSample(parts, merge_parts, as_torch)

    def update_priorities(self, ids: Any, priorities: Any) -> int:
        """Set new priorities; ids already evicted are ignored. Returns how many applied."""
        if self.num_shards == 1:
            ids, priorities = _update_arrays(ids, priorities)
            return self._shards[0].update_priorities(ids, priorities)
        pending = [(shard, shard._call_later("update_priorities", *part))
                   for shard, part in zip(self._shards, self._split_update((ids, priorities)))
                   if part is not None]
        return sum(shard._wait(h) for shard, h in pending)

    def _split_update(self, update: Any) -> list:
        """``update=(ids, priorities)`` split by the shard that holds each id: one
        ``(ids, priorities)`` or None per shard."""
        if update is None:
            return [None] * self.num_shards
        ids, priorities = update
        ids, priorities = _update_arrays(ids, priorities)
        if len(ids) != len(priorities):
            raise ValueError(f"a priority update of {len(ids)} ids with {len(priorities)} "
                             f"priorities; give one priority per id")
        owner = ids % self.num_shards
        parts: list = [None] * self.num_shards
        for s in np.unique(owner).tolist():
            mine = owner == s
            parts[s] = _Update((ids[mine], priorities[mine]))
        return parts

    def __len__(self) -> int:
        return sum(len(shard) for shard in self._shards)

    def clear(self) -> None:
        """Remove every item (ids are never reused)."""
        for shard in self._shards:
            shard.clear()

    def stats(self) -> dict:
        """Totals over the shards: inserts, samples, samples_per_insert, insert_blocked_s,
        sample_blocked_s, size, evictions, stale_updates, last_snapshot_stall_s; and
        ``shards``, each shard's own."""
        shards = [shard.stats() for shard in self._shards]
        total = {key: sum(s[key] for s in shards) for key in shards[0]
                 if key not in ("samples_per_insert", "last_snapshot_stall_s")}
        total["samples_per_insert"] = (total["samples"] / total["inserts"]
                                       if total["inserts"] else 0.0)
        total["last_snapshot_stall_s"] = max(s["last_snapshot_stall_s"] for s in shards)
        total["shards"] = shards
        return total

    def snapshot(self, path: Optional[str] = None) -> dict:
        """Write every item to ``path`` (``path.shard<i>`` per shard) on the servers'
        filesystem. Inserts and samples go on meanwhile: a shard's lock is held only
        while its server forks (``stall_s``); the forked child writes the file from
        its frozen view of the table. Raises ``OSError`` if a file cannot be written."""
        results = [shard.snapshot(_shard_path(path, i, self.num_shards))
                   for i, shard in enumerate(self._shards)]
        return dict(paths=[r["path"] for r in results], items=sum(r["items"] for r in results),
                    stall_s=max(r["stall_s"] for r in results),
                    write_s=sum(r["write_s"] for r in results))

    def server_pids(self) -> list:
        """Each shard server's process id (as its own machine or container sees it)."""
        return [shard.server_pid() for shard in self._shards]

    def close(self) -> None:
        """Stop the store servers (only in the process that created the store)."""
        for manager in self._managers or ():
            manager.shutdown()
        self._managers = []

    def __enter__(self) -> "ReplayStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ReplayStore {self.num_shards} shard(s)>"


def _check_layout(shards: list) -> None:
    """Raise ``ValueError`` unless ``shards`` are every shard of one store, in order."""
    infos = [shard.describe() for shard in shards]
    found = [(info["shard"], info["num_shards"]) for info in infos]
    if found != [(i, len(shards)) for i in range(len(shards))]:
        raise ValueError(
            f"these addresses name shards {[f'{i} of {n}' for i, n in found]}, not every "
            f"shard of one store in order; pass store.address whole, as its owner read it")
