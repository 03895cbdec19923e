"""Files a replay table writes: snapshots and the write-ahead log.

Owns both file formats and nothing else (the table decides when to write).

- A snapshot is a magic line, a pickled header (the configuration, the
  counters and each array's name, dtype and shape), then each array's raw
  bytes: every stored column and the slot bookkeeping. It is written to
  ``path + ".tmp"`` and renamed over ``path``, so a reader sees the previous
  snapshot or the new one, whole.
- The write-ahead log is a sequence of records ``length:u64 | crc32:u32 |
  pickle`` appended with one ``os.write`` each. A record is acknowledged to
  the client only after its write returned, so a SIGKILLed store loses no
  acknowledged insert (the OS holds the bytes); ``fsync=True`` also survives
  a machine crash, at the cost of one disk flush per call. A torn last record
  (killed mid-write, never acknowledged) fails its length or CRC check and is
  dropped on replay.
"""
from __future__ import annotations

import os
import pickle
import struct
import time
import zlib
from typing import Any, Iterator

import numpy as np

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
    with open(tmp, "wb") as out:
        out.write(_MAGIC + _LEN.pack(len(header)) + header)
        for value in arrays.values():
            flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8).data  # memoryview
            for lo in range(0, len(flat), _SLICE):
                out.write(flat[lo:lo + _SLICE])
                if yield_gil:
                    time.sleep(0)  # let the threads serving calls take the GIL first
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


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
    """An append-only record file; :meth:`append` returns once the OS has the bytes."""

    def __init__(self, path: str, fsync: bool = False) -> None:
        self.path = path
        self.fsync = fsync
        end = 0  # where the last whole record ends
        for _record, record_end in read_log(path):
            end = record_end
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.ftruncate(self.fd, end)  # a torn tail would hide every record appended after it
        self.offset = end

    def append(self, record: Any) -> None:
        body = pickle.dumps(record, protocol=5)
        data = _RECORD.pack(len(body), zlib.crc32(body)) + body
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]
        if self.fsync:
            os.fsync(self.fd)
        self.offset += len(data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
