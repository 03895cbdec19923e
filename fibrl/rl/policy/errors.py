"""The errors a policy store raises (besides ``TypeError``/``ValueError`` for bad input).

::

    fibrl.errors.ChannelClosed (a TransportError and an EOFError)
     └── PolicyStoreLost      the publishing process exited, was killed or closed the store
    KeyError
     └── VersionNotKept       get(v) of a version the store no longer keeps, or not yet made
"""
from __future__ import annotations

from collections.abc import Iterable

from fibrl.errors import ChannelClosed

__all__ = ["PolicyStoreLost", "VersionNotKept"]


class PolicyStoreLost(ChannelClosed):
    """The process that publishes the policy is gone, or closed its store."""


class VersionNotKept(KeyError):
    """A version that the store does not hold: older than the last ``keep``, or newer
    than the latest. ``kept`` lists the versions it holds (oldest first)."""

    def __init__(self, message: str, kept: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.kept = tuple(kept)

    def __str__(self) -> str:   # KeyError's own quotes the message as a key
        return str(self.args[0])
