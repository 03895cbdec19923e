"""Files a replay table writes: snapshots and the write-ahead log.

Owns both file formats and nothing else (the table decides when to write).

- A snapshot is a magic line, a pickled header (the configuration, the
  counters and each array's name, dtype and shape), then each array's raw
  bytes: every stored column and the slot bookkeeping. It is written to
  ``path + ".tmp"`` and renamed over ``path``, so a reader sees the previous
  snapshot or the new one, whole. A write that fails (a full disk) removes
  the temporary file and leaves ``path`` as it was.
- The write-ahead log is a sequence of records ``length:u64 | crc32:u32 |
  pickle`` appended with one ``os.write`` each. A record is acknowledged to
  the client only after its write returned, so a SIGKILLed store loses no
  acknowledged insert (the OS holds the bytes); ``fsync=True`` also survives
  a machine crash, at the cost of one disk flush per call. A torn last record
  (killed mid-write, never acknowledged) fails its length or CRC check and is
  dropped on replay. A record the disk has no room for is cut off again at
  once and raised as :class:`ReplayStorageError`, so the change it describes
  is neither applied nor acknowledged, and later records stay readable.
"""
from __future__ import annotations

import contextlib
import errno
import os
import pickle
import struct
import time
import weakref
import zlib
from typing import Any, Iterator

import numpy as np

from .errors import ReplayStorageError

__all__ = ["write_snapshot", "read_snapshot", "WriteAheadLog", "read_log"]

_RECORD = struct.Struct("<QI")
_MAGIC = b"FIBRL-REPLAY-SNAPSHOT-1\n"
_LEN = struct.Struct("<Q")
_SLICE = 1 << 20


def write_snapshot(path: str, arrays: dict, meta: dict, yield_gil: bool = True) -> None:
    """Write ``arrays`` and ``meta`` atomically to ``path``.

    Arrays are written 1 MB at a time: each slice is one ``write`` that releases
    the GIL, and with ``yield_gil`` the writer also yields between slices, so the
    store's other threads keep answering calls meanwhile (one whole-array write
    or copy would hold it for tens of ms). A forked writer has no other threads.
    """
    layout = [(name, value.dtype.str, value.shape) for name, value in arrays.items()]
    header = pickle.dumps(dict(meta=meta, layout=layout), protocol=5)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as out:
            out.write(_MAGIC + _LEN.pack(len(header)) + header)
            for value in arrays.values():
                flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8).data
                for lo in range(0, len(flat), _SLICE):
                    out.write(flat[lo:lo + _SLICE])
                    if yield_gil:
                        time.sleep(0)  # let the threads serving calls take the GIL first
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        # a half-written file would keep the space a full disk needs back
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_snapshot(path: str) -> tuple:
    """``(arrays, meta)`` as written by :func:`write_snapshot`."""
    try:
        src = open(path, "rb")
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"no replay snapshot at {path!r} on the store server's filesystem (the path is "
            f"read by the store process, which may run in a container or pod: use a "
            f"volume both can see)") from exc
    with src:
        magic = src.read(len(_MAGIC))
        if magic != _MAGIC:
            raise ValueError(f"{path!r} is not a fibrl replay snapshot (it starts with "
                             f"{magic!r}, not {_MAGIC!r})")
        (length,) = _LEN.unpack(src.read(_LEN.size))
        header = pickle.loads(src.read(length))
        arrays = {}
        for name, dtype, shape in header["layout"]:
            count = int(np.prod(shape, dtype=np.int64))
            arrays[name] = np.fromfile(src, dtype=np.dtype(dtype), count=count).reshape(shape)
            if arrays[name].size != count:
                raise ValueError(f"the replay snapshot {path!r} is truncated (column {name!r})")
    return arrays, header["meta"]


class WriteAheadLog:
    """An append-only record file; :meth:`append` returns once the OS has the bytes.

    A record that cannot be written whole (a full disk) is cut off again, so the
    file always ends with a whole record, and the records appended once there is
    room are read back after it. If even that cut fails, the log refuses every
    later record (they would be unreadable behind the torn one)."""

    def __init__(self, path: str, fsync: bool = False) -> None:
        self.path = path
        self.fsync = fsync
        self.broken = ""  # why the log refuses records (its end could not be repaired)
        end = 0  # where the last whole record ends
        for _record, record_end in read_log(path):
            end = record_end
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        # closed by close() or, for a log its table dropped, when it is collected
        self._closer = weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, end)  # a torn tail would hide every record appended after it
        self.offset = end

    def append(self, record: Any) -> None:
        """Write ``record`` whole, or raise :class:`ReplayStorageError` with the file as
        it was (the caller then must not apply the change the record describes)."""
        if self.broken:
            raise ReplayStorageError(errno.EIO, self.broken)
        body = pickle.dumps(record, protocol=5)
        data = _RECORD.pack(len(body), zlib.crc32(body)) + body
        view = memoryview(data)
        try:
            while view:
                written = os.write(self.fd, view)
                view = view[written:]
            if self.fsync:
                os.fsync(self.fd)
        except OSError as exc:
            raise self._failed(exc) from exc
        self.offset += len(data)

    def _failed(self, exc: OSError) -> ReplayStorageError:
        """The error for a record that could not be written, its torn bytes cut off."""
        what = (f"could not write to the replay store's write-ahead log {self.path!r} "
                f"({exc.strerror or exc}), so the change was not applied")
        try:
            os.ftruncate(self.fd, self.offset)
        except OSError as cut:
            self.broken = (f"the replay store's write-ahead log {self.path!r} ends with a "
                           f"torn record that could not be cut off ({cut.strerror or cut}); "
                           f"it takes no more records. Take a snapshot and restore from it "
                           f"with a new wal_path")
            return ReplayStorageError(exc.errno or errno.EIO, f"{what}; {self.broken}")
        return ReplayStorageError(exc.errno or errno.EIO,
                                  f"{what}: retry the call once the disk has room (free "
                                  f"space, or move wal_path to a larger volume)")

    def close(self) -> None:
        if self.fd >= 0:
            self.fd = -1
            self._closer()


def read_log(path: str, offset: int = 0) -> Iterator[Any]:
    """``(record, end offset)`` for each record of the log at ``path`` from byte
    ``offset``; a torn tail is dropped."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as src:
        src.seek(offset)
        while True:
            head = src.read(_RECORD.size)
            if len(head) < _RECORD.size:
                return
            length, crc = _RECORD.unpack(head)
            body = src.read(length)
            if len(body) < length or zlib.crc32(body) != crc:
                return
            yield pickle.loads(body), src.tell()
