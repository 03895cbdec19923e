"""The errors a replay store raises (besides ``ValueError``/``TypeError`` for bad input).

::

    TimeoutError
     └── RateLimiterTimeout      a blocked insert or sample waited past its timeout
    OSError
     └── ReplayStorageError      a snapshot or write-ahead log record could not be written
    fibrl.errors.RemoteObjectError
     └── ReplayStoreLost         the store server (or one shard) is gone
"""
from __future__ import annotations

from fibrl.errors import RemoteObjectError

__all__ = ["RateLimiterTimeout", "ReplayStorageError", "ReplayStoreLost"]


class RateLimiterTimeout(TimeoutError):
    """The rate limiter held an insert or sample back longer than its timeout."""


class ReplayStoreLost(RemoteObjectError):
    """The store server of a shard was killed, shut down or lost with its machine."""


class ReplayStorageError(OSError):
    """A store server could not write a snapshot or a write-ahead log record (a full
    disk, a missing directory, no permission). ``errno`` is the operating system's
    reason (``errno.ENOSPC`` for a full disk).

    The call that raised it kept nothing: an insert, ``append``, priority update or
    ``clear`` whose log record failed was not applied (retry it once the disk has room),
    and a failed snapshot left the previous snapshot file as it was. The store goes on
    serving.
    """
