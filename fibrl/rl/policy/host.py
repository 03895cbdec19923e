"""The publishing side of a policy store: the versions kept, the listener that answers
readers, and the snapshot file.

Owns what happens in the learner's process. It does not own the blob's layout
(``params``) nor the reader's connection (``reader``).

::

    publish(params) ──freeze──> blob ──Versions.add──> kept[-1]   (a reference swap
                                                         │         under a lock; wakes
                                                         │         the waiting readers)
                                                         └──> SnapshotWriter (its thread:
                                                              tmp file + rename)
    reader ── Request ──> Listener ──> Host._on_request, in that reader's own thread:
                                       Versions.newer (waits up to the request's wait)
                                       ─> peer.send([answer header, blob])

Each reader has its own connection and thread, so a reader that is slow, frozen or
dead holds up nobody but itself: ``publish`` never sends anything. Every reader is
sent the very same blob object (nng copies it into its messages a piece at a time).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import struct
import threading
import time
from typing import Callable, Optional

import fibrl.channel as channel

from .params import BIAS, thaw
from .protocol import Answer, Kind, Op, Request, pack_kept

__all__ = ["Version", "Versions", "Host", "SnapshotWriter", "read_snapshot"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Version:
    """One published version: its number and its read-only blob."""

    number: int
    blob: memoryview


class StoreClosed(Exception):
    """The store was closed while a caller waited on it."""


class Versions:
    """The last ``keep`` versions, and the waits for a newer one (one condition).

    A version handed out by :meth:`newer` or :meth:`get` is *lent* until
    :meth:`release`: its blob is being sent or copied. With ``keep=1``, ``publish``
    builds the next version in the buffer of the current one when nobody holds it
    (:meth:`reclaim`), so that a publisher holds one blob, not two, while it
    publishes; readers that ask meanwhile wait for the new version.
    """

    def __init__(self, keep: int, start: Optional[Version] = None) -> None:
        self._kept: collections.deque = collections.deque(maxlen=keep)
        self._changed = threading.Condition()
        self.closed = False
        self._latest = 0
        self._lent: collections.Counter = collections.Counter()   # number -> holders
        self._rebuilding = False     # the latest's buffer is being overwritten
        if start is not None:
            self._kept.append(start)
            self._latest = start.number

    def _lend(self, version: Version) -> Version:
        self._lent[version.number] += 1
        return version

    def release(self, version: Version) -> None:
        """The blob of ``version`` (from newer/get) is no longer read."""
        with self._changed:
            self._lent[version.number] -= 1
            if self._lent[version.number] <= 0:
                del self._lent[version.number]

    def reclaim(self, size: int) -> Optional[bytearray]:
        """The latest version's buffer, to build the next version in, if ``keep`` is 1,
        it is ``size`` bytes and nobody holds it; None otherwise. Until :meth:`add` (or
        :meth:`abandon`), readers wait."""
        with self._changed:
            if (self._kept.maxlen != 1 or not self._kept or self._rebuilding
                    or self._lent[self._kept[-1].number]):
                return None
            buffer = self._kept[-1].blob.obj
            if not isinstance(buffer, bytearray) or len(buffer) != size:
                return None
            self._kept.pop()
            self._rebuilding = True
            return buffer

    def _settled(self) -> None:
        """Wait (holding the condition) while a version is being rebuilt."""
        self._changed.wait_for(lambda: not self._rebuilding or self.closed)

    @property
    def latest(self) -> int:
        """The newest version's number (0: none yet)."""
        return self._latest

    def kept(self) -> list:
        with self._changed:
            self._settled()
            return [v.number for v in list(self._kept)]

    def add(self, blob: memoryview, lend: bool = False) -> Version:
        """Make ``blob`` the next version (lent to the caller if ``lend``)."""
        with self._changed:
            self._rebuilding = False
            if self.closed:
                self._changed.notify_all()
                raise ValueError("publish on a closed PolicyStore; make a new store")
            self._latest += 1
            version = Version(self._latest, blob)
            self._kept.append(version)
            self._changed.notify_all()
            return self._lend(version) if lend else version

    def abandon(self) -> None:
        """A rebuild failed: the version it replaced is gone; readers wait for the next."""
        with self._changed:
            self._rebuilding = False
            self._changed.notify_all()

    def newer(self, than: int, wait: float) -> Optional[Version]:
        """The newest version if newer than ``than``, waiting up to ``wait`` seconds
        (``inf``: no limit) for one; None if none came.

        Raises:
            StoreClosed: the store was closed (before or while waiting).
        """
        deadline = time.monotonic() + wait if math.isfinite(wait) else None
        with self._changed:
            while not self.closed:
                if self._latest > than and not self._rebuilding and self._kept:
                    return self._lend(self._kept[-1])
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left)
        raise StoreClosed()

    def get(self, number: int) -> Optional[Version]:
        with self._changed:
            self._settled()
            for version in self._kept:
                if version.number == number:
                    return self._lend(version)
        return None

    def close(self) -> None:
        with self._changed:
            self.closed = True
            self._changed.notify_all()


class Host:
    """A listener (``fibrl.channel``) that answers readers from :class:`Versions`."""

    def __init__(self, versions: Versions) -> None:
        self.versions = versions
        self.listener = channel.listen(self._on_request)

    @property
    def address(self) -> str:
        return self.listener.address

    def _on_request(self, peer: channel.Peer, frame: bytes) -> None:
        try:
            request = Request.unpack(frame)
        except ValueError as exc:
            log.warning("closing the connection of policy-store reader %r: %s (a reader "
                        "of another fibrl version?)", peer, exc)
            peer.close()
            return
        try:
            answer, lent = self._answer(request)
        except StoreClosed:
            return   # close() ends the connection: the reader is told it is lost
        try:
            peer.send(answer)
        except channel.ChannelClosed:
            pass     # the reader went away meanwhile: nobody to tell
        finally:
            if lent is not None:
                self.versions.release(lent)

    def _answer(self, request: Request) -> tuple[list, Optional[Version]]:
        """The answer's parts, and the version lent for it (released once sent)."""
        versions = self.versions
        if request.op is Op.LATEST:
            found = versions.newer(request.version, max(0.0, request.wait))
        elif request.op is Op.GET:
            found = versions.get(request.version)
            if found is None:
                return [Answer(Kind.MISSING, request.seq, versions.latest).pack(),
                        pack_kept(versions.kept())], None
        else:
            return [Answer(Kind.INFO, request.seq, versions.latest).pack(),
                    pack_kept(versions.kept())], None
        if found is None:
            return [Answer(Kind.NOTHING, request.seq, versions.latest).pack()], None
        return [Answer(Kind.PARAMS, request.seq, found.number).pack(), found.blob], found

    def close(self) -> None:
        """Wake the waiting readers' threads, then end every connection."""
        self.versions.close()
        self.listener.close(join=5.0)   # its threads done before the process may exit


# -- the snapshot file -------------------------------------------------------------------
_FILE = struct.Struct("<8sq")     # magic, version; then the blob
_FILE_MAGIC = b"FBPOLSN1"
assert _FILE.size == BIAS          # the blob's arrays stay aligned when read back


def write_snapshot(path: str, version: Version) -> None:
    """Write ``version`` to ``path`` atomically: a temporary file beside it, synced,
    renamed over it. A reader of ``path`` sees the old file or the new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as out:
            out.write(_FILE.pack(_FILE_MAGIC, version.number))
            out.write(version.blob)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_snapshot(path: str) -> Version:
    """The version written to ``path`` (its params checked by rebuilding them).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a policy snapshot, or is truncated.
    """
    size = os.path.getsize(path)
    data = bytearray(size)
    with open(path, "rb") as src:
        read = src.readinto(data)
    if read != size or size < _FILE.size:
        raise ValueError(f"{path} is truncated ({read} of {size} bytes)")
    magic, number = _FILE.unpack_from(data)
    if magic != _FILE_MAGIC or number < 1:
        raise ValueError(f"{path} is not a fibrl policy snapshot (it starts with "
                         f"{bytes(data[:8])!r}); give the snapshot_path a PolicyStore wrote")
    blob = memoryview(data)[_FILE.size:].toreadonly()
    try:
        thaw(blob)
    except Exception as exc:
        raise ValueError(f"{path} holds a damaged policy snapshot: {exc}") from exc
    return Version(number, blob)


class SnapshotWriter:
    """Writes the newest version handed to it to ``path``, on its own thread, so that
    ``publish`` does not wait for the disk. Versions that come faster than the disk
    takes them are skipped: the file always ends up holding the newest one."""

    def __init__(self, path: str, release: Callable[[Version], None]) -> None:
        self.path = path
        self._release = release      # of a version handed over (lent), once written
        self._pending: Optional[Version] = None
        self._changed = threading.Condition()
        self.written = 0                        # the version in the file
        self.error: Optional[OSError] = None    # the last write's failure, if any
        self._closing = False
        self._thread: Optional[threading.Thread] = None

    def submit(self, version: Version) -> None:
        """Write ``version`` (lent to this writer: released once written or skipped)."""
        with self._changed:
            skipped = self._pending
            if version.number <= max(self.written, skipped.number if skipped else 0):
                self._release(version)
                return   # (two threads publishing: a newer one was handed over first)
            if skipped is not None:
                self._release(skipped)
            self._pending = version
            self._changed.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="fibrl-policy-snapshot")
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._pending is None and not self._closing:
                    self._changed.wait()
                version, self._pending = self._pending, None
            if version is None:
                return
            try:
                self._write(version)
            finally:
                self._release(version)

    def _write(self, version: Version) -> None:
        try:
            write_snapshot(self.path, version)
            error = None
        except OSError as exc:
            log.error("could not write policy version %d to %s: %s; the file keeps "
                      "version %d", version.number, self.path, exc, self.written)
            error = exc
        with self._changed:
            self.error = error
            if error is None:
                self.written = version.number
            self._changed.notify_all()

    def wait(self, number: int, timeout: Optional[float]) -> bool:
        """Whether version ``number`` (or a newer one) is in the file, waiting up to
        ``timeout`` seconds (None: no limit) for the writer.

        Raises:
            OSError: the last write failed (disk full, no permission...).
        """
        with self._changed:
            done = self._changed.wait_for(
                lambda: self.written >= number or self.error is not None
                or self._thread is None, timeout)
            if self.error is not None and self.written < number:
                raise self.error
            return done and self.written >= number

    def close(self, timeout: float) -> None:
        """Write what is pending (up to ``timeout`` seconds), then stop the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.error("the policy snapshot of %s was not written within %.0f s of "
                          "close(); it may hold an older version", self.path, timeout)
