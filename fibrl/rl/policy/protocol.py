"""What a policy store's reader and its host say to each other: one request frame,
one answer frame, each a fixed little-endian header.

::

    reader ── Request(op, seq, version, wait) ─────────────> host (24 bytes)
           <─ Answer(kind, seq, version) [+ payload] ──────  (16-byte header)

    op LATEST  version = newer than this; wait = seconds the host may hold the answer
               -> PARAMS (version, the version's blob) or NOTHING (version = latest)
    op GET     version = this one        -> PARAMS, or MISSING (payload: versions kept)
    op INFO                              -> INFO (version = latest; payload: versions kept)

``seq`` pairs an answer with its request: a reader that gave up waiting drops the
late answer when it comes. The header of an answer is :data:`HEADER` bytes long, the
offset at which the blob's arrays are aligned (see ``params``).
"""
from __future__ import annotations

import dataclasses
import enum
import struct

__all__ = ["Op", "Kind", "Request", "Answer", "HEADER", "pack_kept", "unpack_kept"]

_REQUEST = struct.Struct("<BxxxIqd")
_ANSWER = struct.Struct("<BxxxIq")
HEADER = _ANSWER.size


class Op(enum.IntEnum):
    LATEST = 1
    GET = 2
    INFO = 3


class Kind(enum.IntEnum):
    PARAMS = 1
    NOTHING = 2
    MISSING = 3
    INFO = 4


@dataclasses.dataclass(frozen=True)
class Request:
    op: Op
    seq: int
    version: int = 0
    wait: float = 0.0

    def pack(self) -> bytes:
        return _REQUEST.pack(self.op, self.seq, self.version, self.wait)

    @classmethod
    def unpack(cls, frame: bytes) -> "Request":
        """Raises ValueError for a frame that is no request (of this version)."""
        if len(frame) != _REQUEST.size:
            raise ValueError(f"a policy-store request is {_REQUEST.size} bytes, got "
                             f"{len(frame)}")
        op, seq, version, wait = _REQUEST.unpack(frame)
        return cls(Op(op), seq, version, wait)


@dataclasses.dataclass(frozen=True)
class Answer:
    kind: Kind
    seq: int
    version: int = 0

    def pack(self) -> bytes:
        return _ANSWER.pack(self.kind, self.seq, self.version)

    @classmethod
    def unpack(cls, frame) -> "Answer":
        """The header of an answer frame; ValueError for a frame that is none."""
        if len(frame) < HEADER:
            raise ValueError(f"a policy-store answer has a {HEADER}-byte header, got "
                             f"{len(frame)} bytes")
        kind, seq, version = _ANSWER.unpack_from(frame)
        return cls(Kind(kind), seq, version)


def pack_kept(kept: list) -> bytes:
    """The payload that lists versions (int64 each)."""
    return struct.pack(f"<{len(kept)}q", *kept)


def unpack_kept(payload) -> list:
    if len(payload) % 8:
        raise ValueError("a malformed list of versions in a policy-store answer")
    return list(struct.unpack(f"<{len(payload) // 8}q", payload))
