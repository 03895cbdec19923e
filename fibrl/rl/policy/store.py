"""What learners and rollout workers hold: :class:`PolicyStore` and :class:`PolicyFollower`.

Owns the public API: one class whose object is the *publisher* in the process that
made it (it hosts the versions there, see ``host``) and a *reader* everywhere else
(it pickles into one: a fibrl ``Process`` argument, a ``Queue`` item; or
:meth:`PolicyStore.connect` from any Python process). It does not own the blob
(``params``), the listener (``host``) nor the connection (``reader``).

::

    learner process                                  rollout worker (any backend)
    PolicyStore ── publish ──> Versions (+ snapshot)  PolicyStore (a reader)
         │ pickles into ─────────────────────────────>   │ latest(newer_than=v)
         └─ Host: a fibrl.channel listener <── one connection, made on first use
"""
from __future__ import annotations

import math
import os
import weakref
from multiprocessing import process as mp_process
from typing import Any, Optional

from .errors import VersionNotKept
from .host import Host, SnapshotWriter, StoreClosed, Version, Versions, read_snapshot
from .params import lay_out, prepare, thaw, to_torch
from .protocol import HEADER, Kind, Op, unpack_kept
from .reader import Reader

__all__ = ["PolicyStore", "PolicyFollower"]

# multiprocessing's bytes subclass for keys (typeshed does not declare it)
_AuthenticationString: type[bytes] = mp_process.AuthenticationString  # type: ignore[attr-defined]
# Seconds close() gives the snapshot thread to write the last version published.
SNAPSHOT_CLOSE_TIMEOUT = 120.0


class PolicyStore:
    """Versioned policy parameters, published by one learner, read by any number of
    processes (it pickles: pass it to ``fibrl.Process`` workers or through a Queue).

    The store lives in the process that makes it: no server process is started.
    ``publish`` freezes the params into one private buffer and makes it the next
    version (a reference swap: it never waits for a reader). Each reader has one
    connection to that process; the large arrays of a version are serialized once
    and the same buffer is sent to every reader that asks, by that reader's own
    thread, so a slow or dead reader delays nobody else. A reader never sees part
    of a version, and changing the learner's arrays after ``publish`` changes no
    published version. With ``keep=1``, the next version is written into the
    buffer of the current one when no reader is receiving it at that moment (readers
    that ask meanwhile wait for the new one), so the store holds one copy of the
    params, not two, while the learner publishes.

    Args:
        keep: how many of the latest versions :meth:`get` can return.
        snapshot_path: a file that holds the latest version: written after each
            publish, on a background thread (a temporary file renamed over it, so
            the file always holds one whole version). If it exists, the store starts
            from it, with its version number (see :meth:`restore`).

    Example:
        >>> store = PolicyStore(keep=2)
        >>> v = store.publish(net.state_dict())       # 1, 2, 3, ...
        >>> fibrl.Process(target=rollouts, args=(store, queue)).start()
        >>> # in the worker:
        >>> follower = store.follow(as_torch=True)
        >>> if follower.refresh():                     # one small round trip if none new
        ...     net.load_state_dict(follower.params)
    """

    def __init__(self, keep: int = 1, snapshot_path: Optional[str] = None) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be a positive int (how many versions get() can "
                             f"return), got {keep!r}")
        start = None
        if snapshot_path is not None:
            snapshot_path = os.fspath(snapshot_path)
            if os.path.exists(snapshot_path):
                start = read_snapshot(snapshot_path)
        self._versions: Optional[Versions] = Versions(keep, start)
        self._snapshots = (None if snapshot_path is None else
                           SnapshotWriter(snapshot_path, self._versions.release))
        if self._snapshots is not None and start is not None:
            self._snapshots.written = start.number
        self._keep = keep
        self._host: Optional[Host] = Host(self._versions)
        self._reader: Optional[Reader] = None
        self._authkey: Optional[bytes] = None
        self._address = self._host.address
        self._finalizer: Any = weakref.finalize(self, _shut, self._host, self._snapshots)

    @classmethod
    def restore(cls, path: str, *, keep: int = 1) -> "PolicyStore":
        """A store that starts from the snapshot at ``path`` (its params and version
        number) and keeps writing its snapshots there.

        Raises:
            FileNotFoundError: nothing at ``path``.
            ValueError: ``path`` is not a policy snapshot, or is damaged.
        """
        if not os.path.exists(path):
            raise FileNotFoundError(f"no policy snapshot at {path}: give the "
                                    f"snapshot_path of the PolicyStore that wrote it")
        return cls(keep, snapshot_path=path)

    @classmethod
    def connect(cls, address: str, *, authkey: Optional[bytes] = None) -> "PolicyStore":
        """A reader of the store at ``address`` (its :attr:`address`), for a process
        that fibrl did not start; it is what fibrl processes get by pickling.

        Args:
            address: the publishing store's :attr:`address`.
            authkey: the publishing run's secret (its
                ``fibrl.current_process().authkey``), handed over out of band.
                Default: this process's authkey.

        The connection is made on first use; a wrong ``authkey`` raises
        :class:`fibrl.AuthenticationError` then.
        """
        if authkey is not None:
            if not isinstance(authkey, (bytes, bytearray)) or not authkey:
                raise TypeError(f"authkey must be non-empty bytes, got "
                                f"{type(authkey).__name__}")
            own = bytes(mp_process.current_process().authkey)
            # multiprocessing's key type: pickled only to start a process, never
            # into a queue item or a file
            authkey = None if bytes(authkey) == own else _AuthenticationString(bytes(authkey))
        return _reader(address, authkey)

    # -- pickling: the versions stay with the publisher; a reader travels -------------
    def __reduce__(self) -> tuple:
        return (_reader, (self._address, self._authkey))

    @property
    def address(self) -> str:
        """Where readers connect: give it to :meth:`connect`."""
        return self._address

    @property
    def is_publisher(self) -> bool:
        """True in the process that made the store (the one that may publish)."""
        return self._host is not None

    @property
    def version(self) -> int:
        """The latest version's number (0: none published yet). One round trip in a
        reader, free in the publisher."""
        if self._versions is not None:
            return self._versions.latest
        return self._ask(Op.INFO)[0].version

    def versions(self) -> list:
        """The numbers of the versions kept, oldest first (what :meth:`get` returns)."""
        if self._versions is not None:
            return self._versions.kept()
        _answer, frame = self._ask(Op.INFO)
        return unpack_kept(frame[HEADER:])

    def is_stale(self, version: int, max_lag: int = 0) -> bool:
        """Whether something made with policy ``version`` is more than ``max_lag``
        versions behind the latest: what a learner that keeps rollouts on-policy drops.

        Example:
            >>> version, rollout = queue.get()
            >>> if store.is_stale(version, max_lag=0):
            ...     dropped += 1                          # made by an older policy
        """
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
            raise ValueError(f"max_lag must be an int >= 0, got {max_lag!r}")
        return self.version - int(version) > max_lag

    def follow(self, *, as_torch: bool = False) -> "PolicyFollower":
        """A :class:`PolicyFollower` of this store (for a rollout worker)."""
        return PolicyFollower(self, as_torch=as_torch)

    # -- publishing --------------------------------------------------------------------
    def publish(self, params: Any) -> int:
        """Make ``params`` the next version; returns its number (1, 2, ...).

        ``params``: a dict of numpy arrays, numbers, strings and nested dicts, or a
        torch ``state_dict`` (tensors on any device: they are copied to the CPU and
        read as numpy arrays; one of a dtype numpy lacks stays a CPU tensor). The
        values are copied before this returns: change them freely afterwards.

        Raises:
            TypeError: ``params`` is not a dict, or holds a value that cannot be
                pickled (the message names its key).
            RuntimeError: this is a reader, not the process that made the store.
            ValueError: the store is closed.
        """
        if self._versions is None:
            raise RuntimeError(
                "only the process that made this PolicyStore publishes to it; this one is "
                "a reader (it came through pickling or PolicyStore.connect). Send what you "
                "want published to the learner instead.")
        versions = self._versions
        prepared = prepare(params)   # (what can fail, before anything changes)
        buffer = versions.reclaim(prepared.size)
        try:
            blob = lay_out(prepared, buffer)
        except BaseException:
            if buffer is not None:
                versions.abandon()
            raise
        version = versions.add(blob, lend=self._snapshots is not None)
        if self._snapshots is not None:
            self._snapshots.submit(version)
        return version.number

    def wait_snapshot(self, timeout: Optional[float] = None) -> bool:
        """Whether the snapshot file holds the latest version, waiting up to ``timeout``
        seconds (None: no limit) for the background writer.

        Raises:
            OSError: the last write failed (the error of that write).
            RuntimeError: the store has no ``snapshot_path``, or this is a reader.
        """
        if self._snapshots is None or self._versions is None:
            raise RuntimeError("wait_snapshot() is for the publisher of a store made with "
                               "snapshot_path")
        return self._snapshots.wait(self._versions.latest, timeout)

    # -- reading -----------------------------------------------------------------------
    def latest(self, newer_than: Optional[int] = None, timeout: Optional[float] = None,
               as_torch: bool = False) -> Optional[tuple]:
        """The latest version as ``(version, params)`` if it is newer than
        ``newer_than`` (None: any version), else None.

        Args:
            newer_than: the version the caller holds already.
            timeout: seconds to wait for a newer version when there is none yet: the
                publisher answers as soon as one is published. None or 0: answer at
                once; ``math.inf``: wait without limit.
            as_torch: CPU torch tensors instead of numpy arrays.

        When nothing newer exists, this costs one small round trip (a few dozen bytes
        each way). The params are the reader's own: arrays rebuilt on the received
        message, writable, shared with nobody.

        Raises:
            PolicyStoreLost: the publisher is gone (exited, killed, closed the store).
            ModuleNotFoundError: ``as_torch=True`` without torch.
        """
        than = 0 if newer_than is None else _as_int(newer_than, "newer_than")
        wait = _wait_of(timeout)
        if self._versions is not None:
            try:
                found = self._versions.newer(than, wait)
            except StoreClosed:
                raise ValueError("this PolicyStore is closed") from None
            return None if found is None else (found.number, self._local(found, as_torch))
        answer, frame = self._ask(Op.LATEST, than, wait)
        if answer.kind is Kind.NOTHING:
            return None
        return answer.version, _received(frame, as_torch)

    def get(self, version: int, *, as_torch: bool = False) -> Any:
        """The params of ``version``, one of the last ``keep`` published.

        Raises:
            VersionNotKept: (a ``KeyError``) ``version`` is older than those kept, or
                not published yet; the message and ``.kept`` name those kept.
            PolicyStoreLost: the publisher is gone.
        """
        number = _as_int(version, "version")
        if self._versions is not None:
            found = self._versions.get(number)
            if found is None:
                raise _not_kept(number, self._versions.latest, self._versions.kept())
            return self._local(found, as_torch)
        answer, frame = self._ask(Op.GET, number)
        if answer.kind is Kind.MISSING:
            raise _not_kept(number, answer.version, unpack_kept(frame[HEADER:]))
        return _received(frame, as_torch)

    def _local(self, version: Version, as_torch: bool) -> Any:
        assert self._versions is not None
        try:
            params = thaw(bytearray(version.blob))   # a copy: the kept blob stays frozen
        finally:
            self._versions.release(version)
        return to_torch(params) if as_torch else params

    def _ask(self, op: Op, version: int = 0, wait: float = 0.0) -> tuple:
        assert self._reader is not None
        return self._reader.ask(op, version, wait)

    # -- the end -----------------------------------------------------------------------
    def close(self) -> None:
        """Publisher: end every reader's connection (their next call raises
        :class:`PolicyStoreLost`) and write the pending snapshot. Reader: end this
        reader's connection. Idempotent."""
        if self._reader is not None:
            self._reader.close()
        self._finalizer()

    def __enter__(self) -> "PolicyStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        role = (f"publisher, version {self._versions.latest}, keep={self._keep}"
                if self._versions is not None else "reader")
        return f"<PolicyStore {role} at {self._address}>"


def _reader(address: str, authkey: Optional[bytes]) -> PolicyStore:
    """A reader store of ``address`` (what a store unpickles into)."""
    store = PolicyStore.__new__(PolicyStore)
    store._versions = None
    store._snapshots = None
    store._keep = 0
    store._host = None
    store._authkey = authkey
    store._address = address
    store._reader = Reader(address, None if authkey is None else bytes(authkey))
    store._finalizer = weakref.finalize(store, store._reader.close)
    return store


def _shut(host: Optional[Host], snapshots: Optional[SnapshotWriter]) -> None:
    if host is not None:
        host.close()
    if snapshots is not None:
        snapshots.close(SNAPSHOT_CLOSE_TIMEOUT)


def _received(frame: Any, as_torch: bool) -> Any:
    """The params of a PARAMS answer, rebuilt on the frame (copied only when it is
    read-only, or its memory is not aligned for every dtype)."""
    if type(frame) is not memoryview or frame.readonly or _address(frame) % 16:
        frame = memoryview(bytearray(frame))
    params = thaw(frame[HEADER:])
    return to_torch(params) if as_torch else params


def _address(view: memoryview) -> int:
    import numpy as np
    return int(np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data)


def _not_kept(number: int, latest: int, kept: list) -> VersionNotKept:
    if number > latest:
        return VersionNotKept(f"version {number} has not been published yet (the latest "
                              f"is {latest})", kept)
    return VersionNotKept(f"version {number} is no longer kept: the store keeps the last "
                          f"{len(kept)} version(s), now {kept}. Make it with a larger "
                          f"keep= to get older ones.", kept)


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np
            if isinstance(value, np.integer):
                return int(value)
        except ModuleNotFoundError:   # pragma: no cover (numpy comes with fibrl[rl])
            pass
        raise TypeError(f"{name} must be an int (a version number), got "
                        f"{type(value).__name__}")
    return value


def _wait_of(timeout: Optional[float]) -> float:
    if timeout is None:
        return 0.0
    wait = float(timeout)
    if math.isnan(wait) or wait < 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
    return wait


class PolicyFollower:
    """What a rollout worker holds: the newest params it took from a store, and
    their version, to tag what it produces with.

    Attributes:
        version: the version of :attr:`params` (0 until the first :meth:`refresh`
            that found one).
        params: the params of that version (None until then).

    Example:
        >>> follower = store.follow(as_torch=True)
        >>> if not follower.refresh(timeout=60):      # the first version
        ...     raise TimeoutError("the learner published nothing in 60 s")
        >>> while True:
        ...     if follower.refresh():                # a newer version: load it
        ...         net.load_state_dict(follower.params)
        ...     queue.put((follower.version, rollout(net)))
    """

    def __init__(self, store: PolicyStore, *, as_torch: bool = False) -> None:
        self.store = store
        self.as_torch = as_torch
        self.version = 0
        self.params: Any = None

    def refresh(self, timeout: Optional[float] = None) -> bool:
        """Take the latest version if it is newer than :attr:`version`, waiting up to
        ``timeout`` seconds for one (None: answer at once). True when it took one."""
        found = self.store.latest(newer_than=self.version, timeout=timeout,
                                  as_torch=self.as_torch)
        if found is None:
            return False
        self.version, self.params = found
        return True

    def __repr__(self) -> str:
        return f"<PolicyFollower at version {self.version} of {self.store!r}>"
