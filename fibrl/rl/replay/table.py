"""The replay table: the object a store server hosts (one per shard).

Owns the stored items (one preallocated numpy array per column, one row per
slot), item ids, priorities, sample counts, eviction, rate limiting, n-step
assembly, snapshots and the write-ahead log of one shard. It does not own
the process it runs in or how clients reach it (``client`` starts it in a
fibrl manager server), nor how items are chosen (``selectors``) or admitted
(``limiters``).

Every sync manager call runs on the server thread of the calling client
thread, so calls arrive concurrently; one condition variable guards the
state, and a call that the rate limiter holds back waits on it (with the
caller's timeout) until another call changes the counters::

    writer threads --insert/append--+                     +--> columns[name][slot]
    learner threads --sample/update-+--> Condition(lock) -+--> indexes (sampler, remover)
    snapshot caller --fork under lock (or chunked copy)---+--> write-ahead log (before ack)
                         child process writes the file from its frozen view

An id is ``(sequence * capacity + slot) * num_shards + shard``: the shard and
slot are read off the id (no lookup table), and the sequence number makes it
unique across shards and never reused, so a priority update for an evicted
item finds another id (or none) in its slot and is ignored.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Literal, Optional, TypedDict, overload

import numpy as np
from numpy.typing import ArrayLike

from .errors import RateLimiterTimeout, ReplayStorageError
from .limiters import Limiter, LimiterSpec
from .packed import gather
from .persist import WriteAheadLog, read_log, read_snapshot, write_snapshot
from .selectors import Fifo, Prioritized, SelectorSpec, Uniform, index_key, make_index

__all__ = ["NStep", "TableConfig", "ReplayTable", "TABLE_METHODS", "check_batch_size",
           "check_beta"]

log = logging.getLogger(__name__)

TABLE_METHODS = ("insert", "append", "sample", "update_priorities", "size", "clear", "stats",
                 "mass", "snapshot", "server_pid", "describe")


@dataclasses.dataclass(frozen=True)
class NStep:
    """n-step returns assembled on the server from per-environment step streams.

    Steps appended with :meth:`ReplayStore.append` carry ``obs``, ``action``,
    ``reward``, ``next_obs``, ``done`` (terminated) and optionally ``truncated``;
    the stored item keeps the first step's other columns, with ``reward`` the
    discounted sum of up to ``n`` rewards, ``next_obs`` the last step's, and
    ``discount`` ``gamma ** m`` (0 after a termination). A priority appended with
    a step is the priority of the item that starts at that step.
    """

    n: int = 3
    gamma: float = 0.99

    def __post_init__(self) -> None:
        if self.n < 1 or not 0 <= self.gamma <= 1:
            raise ValueError(f"NStep needs n >= 1 and 0 <= gamma <= 1, got {self!r}")


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """Everything one shard's table is built from (picklable, stored in snapshots)."""

    capacity: int
    sampler: SelectorSpec = Uniform()
    remover: SelectorSpec = Fifo()
    rate_limiter: Optional[LimiterSpec] = None
    max_times_sampled: Optional[int] = None
    n_step: Optional[NStep] = None
    seed: Optional[int] = None
    shard: int = 0
    num_shards: int = 1
    wal_path: Optional[str] = None
    wal_fsync: bool = False
    snapshot_path: Optional[str] = None
    snapshot_every: Optional[float] = None

    def validate(self) -> Limiter:
        """Raise ``ValueError`` for a bad or deadlocking configuration; the limiter."""
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {self.capacity!r}")
        if self.max_times_sampled is not None and self.max_times_sampled < 1:
            raise ValueError(f"max_times_sampled must be >= 1 or None, got "
                             f"{self.max_times_sampled!r}")
        if self.snapshot_every is not None and not self.snapshot_path:
            raise ValueError("snapshot_every needs snapshot_path (where to write them)")
        return Limiter(self.rate_limiter, self.capacity, self.max_times_sampled)


class _Counters(TypedDict):
    """A table's counters (``stats()`` reports them; snapshots keep them)."""

    inserts: int
    samples: int
    evictions: int
    insert_blocked_s: float
    sample_blocked_s: float
    inserts_waiting: int
    samples_waiting: int
    snapshots: int
    last_snapshot_stall_s: float
    stale_updates: int


class ReplayTable:
    """One shard's items; its public methods are what the proxy calls.

    Why one class of this size: inserts, samples, removals, priority updates, the rate
    limiter's accounting and the write-ahead log change one shard's state under one
    condition; the samplers, removers, limiters, n-step assembly and snapshots are
    their own classes, called from here."""

    #: how :meth:`snapshot` makes its point-in-time view: "fork" where the OS can
    #: fork, else "chunked" (:class:`PointInTimeCopy`)
    snapshot_method = "fork" if hasattr(os, "fork") else "chunked"

    def __init__(self, config: TableConfig, restore_path: Optional[str] = None) -> None:
        self.config = config
        self.limiter = config.validate()
        self.cond = threading.Condition()
        self.snapshot_lock = threading.Lock()
        self.copy: Optional[PointInTimeCopy] = None  # a snapshot in progress
        self.rng = np.random.default_rng(config.seed)
        self._reset()
        self.counters: _Counters = dict(inserts=0, samples=0, evictions=0,
                                        insert_blocked_s=0.0, sample_blocked_s=0.0,
                                        inserts_waiting=0, samples_waiting=0, snapshots=0,
                                        last_snapshot_stall_s=0.0, stale_updates=0)
        self.next_local = 0
        self.wal_start = 0
        if restore_path is not None:
            self._load(restore_path)
        self.wal = None
        if config.wal_path:
            self._replay_log(config.wal_path, self.wal_start)
            self.wal = WriteAheadLog(config.wal_path, config.wal_fsync)
        self.stop = threading.Event()
        if config.snapshot_every:
            threading.Thread(target=self._periodic_snapshots, daemon=True,
                             name="fibrl-replay-snapshots").start()

    @property
    def columns(self) -> dict:
        """Each column's array (``capacity`` rows); empty until the first insert."""
        return self._columns

    @columns.setter
    def columns(self, columns: dict) -> None:
        self._columns = columns
        self._plans: dict = {}   # gather()'s layouts per batch size: for these columns only

    def _reset(self) -> None:
        cap = self.config.capacity
        self.columns = {}
        self.slot_ids = np.full(cap, -1, dtype=np.int64)
        self.priorities = np.zeros(cap, dtype=np.float64)
        self.times_sampled = np.zeros(cap, dtype=np.int64)
        self.free = list(range(cap - 1, -1, -1))
        self.max_priority = 1.0
        self.pending_steps: dict = {}
        indexes: dict = {}
        remover = self.config.remover
        for spec in (self.config.sampler, remover):
            key = index_key(spec)
            if key not in indexes:
                indexes[key] = make_index(spec, cap, self.slot_ids)
        self.sampler_index = indexes[index_key(self.config.sampler)]
        self.remover_index = indexes[index_key(remover)]
        self.indexes = list(indexes.values())

    # -- writes ------------------------------------------------------------------------------
    def insert(self, batch: dict, priorities: Optional[ArrayLike] = None,
               timeout: Optional[float] = None) -> np.ndarray:
        """Insert a batch (dict of equal-length arrays); returns the new ids."""
        n = _batch_length(batch)
        if n > self.config.capacity:
            raise ValueError(f"a batch of {n} items does not fit a shard of capacity "
                             f"{self.config.capacity}; split it or raise the capacity")
        prios = self._priorities(priorities, n)
        with self.cond:
            self.limiter.check_batch("insert", n)
            self._admit("insert", n, timeout)
            ids = self._insert_locked(batch, prios, None, log=self.wal is not None)
            self.cond.notify_all()
        return ids

    def append(self, steps: dict, env_ids: Any, priorities: Optional[ArrayLike] = None,
               timeout: Optional[float] = None) -> np.ndarray:
        """Add per-environment steps; stores the n-step items they complete (their ids).

        ``priorities[row]`` is the priority of the item that starts at step ``row``
        (stored once its ``n`` steps are in); without it an item gets the largest
        priority seen when it is stored.
        """
        spec = self.config.n_step
        if spec is None:
            raise ValueError("append() assembles n-step items; create the store with "
                             "n_step=NStep(n, gamma) (or call insert() with whole items)")
        n = _batch_length(steps)
        env_ids = np.asarray(env_ids).reshape(-1)
        if len(env_ids) != n:
            raise ValueError(f"append() got {n} steps but {len(env_ids)} env_ids")
        missing = {"obs", "action", "reward", "next_obs", "done"} - set(steps)
        if missing:
            raise ValueError(f"append() steps lack {sorted(missing)}; each step needs obs, "
                             f"action, reward, next_obs, done (and optionally truncated)")
        prios = self._priorities(priorities, n)
        with self.cond:
            # the windows of these envs as they were: an insert that fails (rate limiter
            # timeout, a full disk under the log) puts them back, so a retried append
            # neither loses these steps nor counts them twice
            before = {env: list(self.pending_steps.get(env, ()))
                      for env in set(env_ids.tolist())}
            items, item_prios = self._assemble(steps, env_ids, prios, spec)
        if not items:
            return np.zeros(0, dtype=np.int64)
        batch = {key: np.stack([item[key] for item in items]) for key in items[0]}
        try:
            return self.insert(batch, self._fill_priorities(item_prios), timeout)
        except BaseException:
            with self.cond:
                self.pending_steps.update(before)
            raise

    def _fill_priorities(self, prios: list) -> Optional[np.ndarray]:
        """The priorities of assembled items: None if no step carried one (the insert
        gives each the largest seen), else the given ones with the largest seen for
        steps appended without."""
        if all(p is None for p in prios):
            return None
        return np.asarray([self.max_priority if p is None else p for p in prios])

    def update_priorities(self, ids: Any, priorities: ArrayLike) -> int:
        """Set the priorities of the items still held; returns how many were."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        prios = self._priorities(priorities, len(ids))
        with self.cond:
            if self.wal is not None:   # logged first: a record that fails changes nothing
                self.wal.append(("update", ids, prios))
            return self._update_locked(ids, prios)

    def clear(self) -> None:
        """Remove every item (ids keep counting up, so old ids stay unknown)."""
        with self.cond:
            if self.wal is not None:
                self.wal.append(("clear",))
            self._reset()
            self.cond.notify_all()

    # -- reads -------------------------------------------------------------------------------
    def sample(self, k: int, timeout: Optional[float] = None, update: Any = None,
               beta: Optional[float] = None) -> dict:
        """``k`` items: columns stacked, ids, probabilities, the size they were drawn from,
        and what the client turns into importance weights (``beta``, ``min_probability``:
        the smallest nonzero probability held, None unless ``weights="buffer"``).

        ``update=(ids, priorities)`` applies a priority update first, in the same call.
        ``beta`` overrides the sampler's for this batch's weights (prioritized only).
        """
        check_batch_size(k)
        beta = self._beta(beta)
        if update is not None:
            self.update_priorities(*update)
        with self.cond:
            self.limiter.check_batch("sample", int(k))
            self._admit("sample", int(k), timeout)
            size = self.size()
            slots, probs = self.sampler_index.select(int(k), self.rng)
            mass = self.sampler_index.mass()
            low = self.sampler_index.min_weight()
            # (a small sample's rows are taken straight into the one buffer that is
            # sent: see .packed)
            out = gather(self.columns, slots, self.slot_ids, self.priorities, probs,
                         self._plans, size=size, mass=mass, beta=beta,
                         min_probability=None if low is None else low / mass,
                         weights=getattr(self.config.sampler, "weights", None))
            self.counters["samples"] += len(slots)
            self._count_samples(slots)
            self.cond.notify_all()
        return out

    def _beta(self, beta: Optional[float]) -> Optional[float]:
        """The beta of a sample's importance weights: the call's, else the sampler's."""
        sampler = self.config.sampler
        if beta is None:
            return getattr(sampler, "beta", None)
        if not isinstance(sampler, Prioritized):
            raise ValueError(f"sample(beta={beta!r}): importance weights come with "
                             f"prioritized sampling, and this store samples with "
                             f"{sampler!r}; drop beta= or create the store with "
                             f"sampler=Prioritized(...)")
        return check_beta(beta)

    def size(self) -> int:
        return self.config.capacity - len(self.free)

    def mass(self, update: Any = None) -> tuple:
        """``(sampler mass, size, random, min weight)``: what a sharded client splits a
        batch by (at random for uniform/prioritized samplers, in proportion for ordered
        ones) and normalises importance weights by (the smallest positive sampler weight
        held; None unless ``weights="buffer"``).

        ``update=(ids, priorities)`` applies a priority update first, in the same call.
        """
        if update is not None:
            self.update_priorities(*update)
        with self.cond:
            return (self.sampler_index.mass(), self.size(),
                    isinstance(self.config.sampler, (Uniform, Prioritized)),
                    self.sampler_index.min_weight())

    def stats(self) -> dict:
        with self.cond:
            out: dict[str, Any] = dict(self.counters, size=self.size(),
                                       capacity=self.config.capacity)
        out["samples_per_insert"] = out["samples"] / out["inserts"] if out["inserts"] else 0.0
        return out

    def server_pid(self) -> int:
        """The store server's process id (as its own machine or container sees it)."""
        return os.getpid()

    def describe(self) -> dict:
        """What a client joining by address checks: this table's shard, the store's
        shard count, the capacity and the sampler."""
        cfg = self.config
        return dict(shard=cfg.shard, num_shards=cfg.num_shards, capacity=cfg.capacity,
                    sampler=cfg.sampler)

    # -- persistence -------------------------------------------------------------------------
    def snapshot(self, path: Optional[str] = None) -> dict:
        """Write the items held now to ``path`` while inserts and samples go on.

        Where the OS can fork (Linux, macOS), the server forks under its lock: the
        child holds a frozen copy-on-write view of the table and writes the file in
        its own process, so it neither holds the lock nor competes for this
        process's GIL. Elsewhere a :class:`PointInTimeCopy` is made a chunk at a time.

        Returns ``path``, ``items``, ``stall_s`` (the longest time the lock was held
        for the snapshot: what a concurrent insert or sample may wait), ``copy_s``,
        ``write_s`` and ``method`` (``"fork"`` or ``"chunked"``).
        """
        path = path or self.config.snapshot_path
        if not path:
            raise ValueError("snapshot() needs a path (or create the store with snapshot_path)")
        with self.snapshot_lock:
            if self.snapshot_method == "fork":
                result = self._snapshot_forked(path)
            else:
                result = self._snapshot_chunked(path)
            with self.cond:
                self.counters["snapshots"] += 1
                self.counters["last_snapshot_stall_s"] = result["stall_s"]
        return result

    def _snapshot_meta(self) -> dict:
        return dict(config=self.config, counters=dict(self.counters),
                    next_local=self.next_local, max_priority=self.max_priority,
                    wal_path=self.config.wal_path,
                    wal_offset=self.wal.offset if self.wal is not None else 0)

    def _snapshot_forked(self, path: str) -> dict:
        start = time.perf_counter()
        errors_r, errors_w = os.pipe()
        pid, message = 0, ""
        _load_prctl()   # not in the child: loading a library there could take a lock
        try:
            with self.cond:
                held = time.perf_counter()
                meta = self._snapshot_meta()
                items = self.size()
                server = os.getpid()
                pid = os.fork()
                if pid == 0:  # the child: never returns, never touches the lock or sockets
                    _write_in_child(path, PointInTimeCopy.arrays(self), meta, errors_w,
                                    server)
                stall = time.perf_counter() - held
            forked = time.perf_counter()
            os.close(errors_w)
            errors_w = -1
            with os.fdopen(errors_r, "rb") as pipe:
                errors_r = -1
                message = pipe.read().decode("utf-8", "replace")  # EOF when the child ends
        finally:
            for fd in (errors_r, errors_w):
                if fd >= 0:
                    os.close(fd)
            status = os.waitpid(pid, 0)[1] if pid else 0
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            number, _, message = message.partition("\n")
            raise _storage_error(path, int(number) if number.isdigit() else errno.EIO,
                                 f"writer process exit code {code}: "
                                 f"{message.strip() or 'no message'}")
        return dict(path=path, items=items, stall_s=stall, copy_s=forked - start,
                    write_s=time.perf_counter() - forked, method="fork")

    def _snapshot_chunked(self, path: str) -> dict:
        start = time.perf_counter()
        spare = PointInTimeCopy.spare(self)
        with self.cond:
            held = time.perf_counter()
            copy = self.copy = PointInTimeCopy(self, spare)
            meta = self._snapshot_meta()
            items = self.size()
            stall = time.perf_counter() - held
        try:
            while not copy.done():
                with self.cond:  # the time to get the lock is not a stall of others
                    held = time.perf_counter()
                    copy.copy_chunk()
                    stall = max(stall, time.perf_counter() - held)
                # hand the GIL over between chunks: a thread that never blocks keeps it
                # for the whole switch interval each time a serving thread gives it up
                time.sleep(0)
        finally:
            with self.cond:
                self.copy = None
        copied = time.perf_counter()
        try:
            write_snapshot(path, copy.out, meta)
        except OSError as exc:
            raise _storage_error(path, exc.errno or errno.EIO,
                                 f"{type(exc).__name__}: {exc}") from exc
        return dict(path=path, items=items, stall_s=stall, copy_s=copied - start,
                    write_s=time.perf_counter() - copied, method="chunked")

    def _load(self, path: str) -> None:
        arrays, meta = read_snapshot(path)
        if meta["config"].capacity != self.config.capacity:
            raise ValueError(f"the snapshot at {path!r} holds a shard of capacity "
                             f"{meta['config'].capacity}, not {self.config.capacity}; "
                             f"restore it with the same capacity and number of shards")
        self.columns = {name[5:]: value for name, value in arrays.items()
                        if name.startswith("data.")}
        self.slot_ids[:] = arrays["slot_ids"]
        self.priorities[:] = arrays["priorities"]
        self.times_sampled[:] = arrays["times_sampled"]
        live = np.flatnonzero(self.slot_ids >= 0)
        live = live[np.argsort(self.slot_ids[live], kind="stable")]  # insertion order
        self.free = sorted(set(range(self.config.capacity)) - set(live.tolist()), reverse=True)
        for index in self.indexes:
            index.add(live, self.slot_ids[live], self.priorities[live])
        self.counters.update(meta["counters"])
        self.next_local = meta["next_local"]
        self.max_priority = meta["max_priority"]
        if meta["wal_path"] and meta["wal_path"] == self.config.wal_path:
            self.wal_start = meta["wal_offset"]

    def _replay_log(self, path: str, offset: int) -> None:
        for record, _end in read_log(path, offset):
            if record[0] == "insert":
                _kind, ids, batch, prios = record
                self._insert_locked(batch, prios, ids)
            elif record[0] == "update":
                self._update_locked(record[1], record[2])
            else:
                self._reset()

    def _periodic_snapshots(self) -> None:
        while not self.stop.wait(self.config.snapshot_every):
            try:
                self.snapshot()
            except Exception:  # keep serving; the next period tries again
                log.exception("periodic replay snapshot to %s failed",
                              self.config.snapshot_path)

    # -- under the lock ----------------------------------------------------------------------
    def _admit(self, side: Literal["insert", "sample"], n: int,
               timeout: Optional[float]) -> None:
        check = self.limiter.can_insert if side == "insert" else self.limiter.can_sample

        def ready() -> bool:
            return check(n, self.size(), self.counters["inserts"], self.counters["samples"])

        if ready():
            return
        waiting: Literal["inserts_waiting", "samples_waiting"]
        blocked: Literal["insert_blocked_s", "sample_blocked_s"]
        if side == "insert":
            waiting, blocked = "inserts_waiting", "insert_blocked_s"
        else:
            waiting, blocked = "samples_waiting", "sample_blocked_s"
        start = time.monotonic()
        self.counters[waiting] += 1
        try:
            ok = self.cond.wait_for(ready, timeout)
        finally:
            self.counters[waiting] -= 1
        self.counters[blocked] += time.monotonic() - start
        if not ok:
            other = "learners to sample" if side == "insert" else "writers to insert"
            state = self.limiter.describe(self.size(), self.counters["inserts"],
                                          self.counters["samples"])
            raise RateLimiterTimeout(
                f"replay {side} of {n} items waited {timeout} s for the rate limiter and "
                f"timed out: the store was waiting for {other}. State: "
                f"{state}."
                f" Check that the other side is running, or pass a longer timeout, or "
                f"widen the limiter's error_buffer.")

    @overload
    def _priorities(self, priorities: None, n: int) -> None: ...

    @overload
    def _priorities(self, priorities: ArrayLike, n: int) -> np.ndarray: ...

    def _priorities(self, priorities: Optional[ArrayLike], n: int) -> Optional[np.ndarray]:
        if priorities is None:
            return None
        prios = np.asarray(priorities, dtype=np.float64).reshape(-1)
        if len(prios) != n:
            raise ValueError(f"got {len(prios)} priorities for {n} items")
        if n and not (prios.min() >= 0 and prios.max() < np.inf):   # (NaN fails both)
            bad = prios[~np.isfinite(prios) | (prios < 0)][:5]
            raise ValueError(f"priorities must be finite and >= 0, got {bad.tolist()} "
                             f"(a NaN loss upstream is the usual cause)")
        return prios

    def _insert_locked(self, batch: dict, prios: Optional[np.ndarray],
                       ids: Optional[np.ndarray], log: bool = False) -> np.ndarray:
        """Store ``batch`` (with ``ids``, replaying the log; else new ones).

        With ``log``, every check and choice is made first (columns, the items to
        evict, the slots, the ids), then the record is written, then the table
        changes: a record that cannot be written leaves the table as it was."""
        n = _batch_length(batch)
        made = self._check_columns(batch, n)
        try:
            batch = self._as_columns(batch)
        except ValueError:
            if made:
                self.columns = {}
            raise
        cfg = self.config
        overflow = self.size() + n - cfg.capacity
        evict = (self.remover_index.select(overflow, self.rng, distinct=True)[0]
                 if overflow > 0 else np.zeros(0, dtype=np.int64))
        free = self.free + evict.tolist() if len(evict) else self.free   # as _remove leaves it
        slots = np.asarray(free[-n:][::-1], dtype=np.int64)
        if ids is None:
            seqs = np.arange(self.next_local, self.next_local + n, dtype=np.int64)
            ids = (seqs * cfg.capacity + slots) * cfg.num_shards + cfg.shard
        if log and self.wal is not None:
            try:
                self.wal.append(("insert", ids, batch, prios))
            except BaseException:
                if made:   # the first insert made the columns: unmade, nothing was stored
                    self.columns = {}
                raise
        if len(evict):
            self._remove(evict)
            self.counters["evictions"] += len(evict)
        del self.free[-n:]
        self.next_local = max(self.next_local,
                              int(ids.max()) // cfg.num_shards // cfg.capacity + 1)
        if prios is None:
            prios = np.full(n, self.max_priority)
        elif n:
            self.max_priority = max(self.max_priority, float(prios.max()))
        self._touch(slots)
        for name, column in self.columns.items():
            column[slots] = batch[name]
        self.slot_ids[slots] = ids
        self.priorities[slots] = prios
        self.times_sampled[slots] = 0
        for index in self.indexes:
            index.add(slots, ids, prios)
        self.counters["inserts"] += n
        return ids

    def _as_columns(self, batch: dict) -> dict:
        """``batch`` in the columns' dtypes (a ``ValueError`` here, before anything is
        logged or stored, for values that cannot be stored)."""
        out = {}
        for name, value in batch.items():
            try:
                out[name] = np.asarray(value).astype(self.columns[name].dtype,
                                                      casting="same_kind", copy=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"could not store this batch: column {name!r}: {exc}; give "
                                 f"every column the dtype and item shape of the first "
                                 f"insert") from exc
        return out

    def _check_columns(self, batch: dict, n: int) -> bool:
        """Raise ``ValueError`` unless ``batch`` fits the columns; the first batch makes
        them (then True)."""
        if not self.columns:
            cap = self.config.capacity
            self.columns = {name: np.zeros((cap,) + np.shape(value)[1:],
                                           dtype=np.asarray(value).dtype)
                            for name, value in batch.items()}
            return True
        if set(batch) != set(self.columns):
            raise ValueError(f"this batch has columns {sorted(batch)} but the store holds "
                             f"{sorted(self.columns)}; every insert must carry the same keys")
        for name, value in batch.items():
            want = self.columns[name].shape[1:]
            kind = self.columns[name].dtype
            if not np.can_cast(np.asarray(value).dtype, kind, "same_kind"):
                raise ValueError(f"column {name!r}: items of dtype {np.asarray(value).dtype} "
                                 f"cannot be stored as {kind} (set by the first insert)")
            if np.shape(value)[1:] != want:
                raise ValueError(f"column {name!r}: items of shape {np.shape(value)[1:]}, but "
                                 f"the store holds items of shape {want} (set by the first "
                                 f"insert)")
        return False

    def _update_locked(self, ids: np.ndarray, prios: np.ndarray) -> int:
        cfg = self.config
        if cfg.num_shards == 1:
            slots = ids % cfg.capacity
            held = (ids >= 0) & (self.slot_ids.take(slots) == ids)
        else:
            slots = (ids // cfg.num_shards) % cfg.capacity
            held = ((ids >= 0) & (ids % cfg.num_shards == cfg.shard)
                    & (self.slot_ids.take(slots) == ids))
        stale = len(ids) - int(np.count_nonzero(held))
        if stale:
            self.counters["stale_updates"] += stale
            slots, prios = slots[held], prios[held]
        if not len(slots):
            return 0
        self._touch(slots)
        self.priorities[slots] = prios
        self.max_priority = max(self.max_priority, float(prios.max()))
        for index in self.indexes:
            index.update(slots, prios)
        return len(slots)

    def _remove(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        self._touch(slots)
        self.slot_ids[slots] = -1
        for index in self.indexes:
            index.remove(slots)
        self.free.extend(slots.tolist())

    def _touch(self, slots: np.ndarray) -> None:
        if self.copy is not None:
            self.copy.before_write(slots)

    def _count_samples(self, slots: np.ndarray) -> None:
        self._touch(slots)
        np.add.at(self.times_sampled, slots, 1)
        limit = self.config.max_times_sampled
        if limit is not None:
            self._remove(np.unique(slots[self.times_sampled[slots] >= limit]))

    def _assemble(self, steps: dict, env_ids: np.ndarray, prios: Optional[np.ndarray],
                  spec: NStep) -> tuple[list[dict], list]:
        """The items these steps complete, and each one's priority (None: not given)."""
        items: list[dict] = []
        item_prios: list = []
        truncated = steps.get("truncated")
        for row, env in enumerate(env_ids.tolist()):
            pending = self.pending_steps.setdefault(env, [])
            pending.append(({key: np.asarray(value[row]) for key, value in steps.items()
                             if key != "truncated"},
                            None if prios is None else float(prios[row])))
            ended = bool(steps["done"][row]) or (truncated is not None and bool(truncated[row]))
            if ended:
                for j in range(len(pending)):
                    items.append(_nstep_item([step for step, _p in pending[j:]], spec.gamma))
                    item_prios.append(pending[j][1])
                pending.clear()
            elif len(pending) == spec.n:
                items.append(_nstep_item([step for step, _p in pending], spec.gamma))
                item_prios.append(pending[0][1])
                pending.pop(0)
        return items, item_prios


class PointInTimeCopy:
    """A copy of the table as it was when the copy began, made a chunk of rows at a time.

    The table's lock is held for one chunk (a few MB) at a time, so inserts and
    samples go on between chunks. A row that a write is about to change before its
    chunk was copied is saved first (:meth:`before_write`, called under the lock),
    and the chunk copy keeps the saved row: copy-on-write, by rows.
    """

    CHUNK_BYTES = 1 << 20

    def __init__(self, table: "ReplayTable", spare: Optional[dict] = None) -> None:
        sources = self.arrays(table)
        self.sources = sources  # references: a clear() replaces them, leaving these intact
        spare = spare or {}
        self.out = {name: spare[name] if _same_layout(spare.get(name), src)
                    else np.empty_like(src) for name, src in sources.items()}
        self.capacity = table.config.capacity
        self.saved = np.zeros(self.capacity, dtype=bool)
        row_bytes = sum(src[:1].nbytes for src in sources.values())
        self.rows = max(1024, self.CHUNK_BYTES // max(1, row_bytes))
        self.copied = 0

    @staticmethod
    def arrays(table: "ReplayTable") -> dict:
        sources = {f"data.{name}": col for name, col in table.columns.items()}
        sources.update(slot_ids=table.slot_ids, priorities=table.priorities,
                       times_sampled=table.times_sampled)
        return sources

    @classmethod
    def spare(cls, table: "ReplayTable") -> dict:
        """Output arrays made outside the lock, their pages touched (a first touch of
        fresh memory under the lock would stall writers for tens of ms)."""
        with table.cond:
            layout = {name: (src.shape, src.dtype) for name, src in cls.arrays(table).items()}
        spare = {}
        for name, (shape, dtype) in layout.items():
            spare[name] = np.empty(shape, dtype)
            rows = max(1, cls.CHUNK_BYTES // max(1, spare[name][:1].nbytes))
            for lo in range(0, len(spare[name]), rows):
                spare[name][lo:lo + rows] = 0
                time.sleep(0)  # a thread that never blocks would starve the serving ones
        return spare

    def done(self) -> bool:
        return self.copied >= self.capacity

    def before_write(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        slots = slots[slots >= self.copied]
        slots = slots[~self.saved[slots]]
        if len(slots):
            for name, src in self.sources.items():
                self.out[name][slots] = src[slots]
            self.saved[slots] = True

    def copy_chunk(self) -> None:
        lo, hi = self.copied, min(self.capacity, self.copied + self.rows)
        keep = ~self.saved[lo:hi]
        for name, src in self.sources.items():
            where = keep.reshape((-1,) + (1,) * (src.ndim - 1))
            np.copyto(self.out[name][lo:hi], src[lo:hi], where=where)
        self.copied = hi


#: how much lower the forked snapshot writer's CPU priority is than the store's
SNAPSHOT_NICENESS = 19


def _write_in_child(path: str, arrays: dict, meta: dict, errors: int, server: int) -> None:
    """The forked snapshot writer: write the frozen arrays, report a failure on the
    ``errors`` pipe, and leave with ``os._exit`` (no atexit handlers, no finalizers
    touching the parent's sockets or threads)."""
    code = 1
    try:
        # a writer whose store is killed stops too: it must not rename its file over the
        # snapshot later, nor write path.tmp while a restored store writes it as well
        _die_with_parent(server)
        # drop the parent's sockets and files, so that a client sees a killed store
        # go at once instead of when this writer is done
        os.closerange(3, errors)
        os.closerange(errors + 1, _max_fd())
        quiet = os.open(os.devnull, os.O_RDWR)   # nor keep the server's output pipes open
        for fd in (0, 1, 2):
            os.dup2(quiet, fd)
        # the store's serving threads and its clients go first on a busy machine: the
        # snapshot may take longer, but it takes the CPU only when they leave some
        os.nice(SNAPSHOT_NICENESS)
        write_snapshot(path, arrays, meta, yield_gil=False)
        code = 0
    except BaseException as exc:  # reported to the parent, which raises it
        try:
            number = getattr(exc, "errno", None) or errno.EIO
            os.write(errors, f"{number}\n{type(exc).__name__}: {exc}".encode("utf-8",
                                                                             "replace"))
        except OSError:
            pass
    finally:
        os._exit(code)


def _storage_error(path: str, number: int, detail: str) -> ReplayStorageError:
    return ReplayStorageError(
        number, f"writing the replay snapshot {path!r} failed ({detail}); the previous "
                f"snapshot there is kept as it was. Check that the directory exists on the "
                f"store server and has room for another copy of the table")


#: Linux's prctl option that sends a process a signal when its parent ends
_PR_SET_PDEATHSIG = 1
_prctl: Any = None


def _load_prctl() -> Any:
    """libc's ``prctl`` (loaded in the server, before it forks), or False where none."""
    global _prctl
    if _prctl is None:
        _prctl = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes
                _prctl = ctypes.CDLL(None, use_errno=True).prctl
            except (OSError, AttributeError):
                pass
    return _prctl


def _die_with_parent(server: int) -> None:
    """(In the forked writer) be killed when the store server ``server`` ends (Linux);
    exit at once if it is gone already."""
    prctl = _prctl
    if prctl:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server:
        os._exit(1)


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (AttributeError, ValueError, OSError):
        return 65536


def _same_layout(a: Optional[np.ndarray], b: np.ndarray) -> bool:
    return a is not None and a.shape == b.shape and a.dtype == b.dtype


def _nstep_item(window: list, gamma: float) -> dict:
    first, last = window[0], window[-1]
    ret = sum((gamma ** i) * float(step["reward"]) for i, step in enumerate(window))
    done = bool(last["done"])
    item = dict(first)
    item["reward"] = np.float32(ret)
    item["next_obs"] = last["next_obs"]
    item["done"] = last["done"]
    item["discount"] = np.float32(0.0 if done else gamma ** len(window))
    return item


def check_beta(beta: Any) -> float:
    """``beta`` as a float; ``ValueError`` unless it is a finite number >= 0."""
    try:
        value = float(beta)
    except (TypeError, ValueError):
        raise ValueError(f"beta must be a number >= 0, got {beta!r}") from None
    if not 0 <= value < float("inf"):
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    return value


def check_batch_size(k: Any) -> None:
    """Raise ``ValueError`` unless ``k`` is a positive int (a sample's batch size)."""
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"batch_size must be a positive int, got {k!r}")


def _batch_length(batch: Any) -> int:
    if not isinstance(batch, dict) or not batch:
        raise TypeError(f"a replay batch is a non-empty dict of arrays (one row per item), "
                        f"got {type(batch).__name__}")
    lengths = {name: len(value) for name, value in batch.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"the columns of a batch must have equal lengths, got {lengths}")
    n = next(iter(lengths.values()))
    if n < 1:
        raise ValueError("a replay batch needs at least one item")
    return n
