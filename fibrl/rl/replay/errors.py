"""The errors a replay store raises (besides ``ValueError``/``TypeError`` for bad input).

::

    TimeoutError
     └── RateLimiterTimeout      a blocked insert or sample waited past its timeout
    fibrl.errors.RemoteObjectError
     └── ReplayStoreLost         the store server (or one shard) is gone
"""
from __future__ import annotations

from fibrl.errors import RemoteObjectError

__all__ = ["RateLimiterTimeout", "ReplayStoreLost"]


class RateLimiterTimeout(TimeoutError):
    """The rate limiter held an insert or sample back longer than its timeout."""


class ReplayStoreLost(RemoteObjectError):
    """The store server of a shard was killed, shut down or lost with its machine."""
