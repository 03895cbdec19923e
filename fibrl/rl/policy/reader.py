"""The reading side of a policy store: one connection to the publishing process.

Owns the connection (made on first use with ``fibrl.channel.connect``, kept for the
reader's life), the pairing of answers with requests, the wait for an answer, and
the clear error when the publisher is gone. It does not own what the answers mean
(``store``).

::

    latest/get/version ──lock──> Request ──> the host's listener
                        <──────── Answer (its seq; an older seq is a late answer to
                                  a request given up on: dropped)

One request at a time per reader (a lock): threads that share a reader take turns.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Optional

import fibrl.channel as channel
from fibrl.errors import AuthenticationError, TransportError

from .errors import PolicyStoreLost
from .protocol import Answer, Op, Request

__all__ = ["Reader", "ANSWER_TIMEOUT"]

# Seconds an answer may take beyond the wait asked for: the transfer of a large version
# on a busy machine. Past it the learner is taken to be frozen (TimeoutError).
ANSWER_TIMEOUT = 300.0


class Reader:
    """A connection to the policy store hosted at ``address``."""

    def __init__(self, address: str, authkey: Optional[bytes] = None) -> None:
        self.address = address
        self.authkey = authkey
        self._channel: Optional[channel.Channel] = None
        self._lock = threading.Lock()
        self._seq = 0
        self.closed = False

    def ask(self, op: Op, version: int = 0, wait: float = 0.0) -> tuple:
        """Send one request and return ``(Answer, frame)``.

        Raises:
            PolicyStoreLost: the publisher is gone (or closed the store).
            AuthenticationError: the publisher does not know this reader's authkey.
            TimeoutError: no answer within ``wait`` + :data:`ANSWER_TIMEOUT` seconds.
        """
        with self._lock:
            conn = self._connect()
            self._seq = (self._seq + 1) & 0xFFFFFFFF
            seq = self._seq
            try:
                conn.send(Request(op, seq, version, wait).pack())
                return self._answer(conn, seq, wait)
            except channel.ChannelClosed as exc:
                self._channel = None
                raise self._lost(exc) from exc

    def _answer(self, conn: channel.Channel, seq: int, wait: float) -> tuple:
        # the same timeout for every receive of a wait (the channel sets it on its
        # socket only when it changes); the deadline bounds a run of late answers
        limit = wait + ANSWER_TIMEOUT if math.isfinite(wait) else None
        deadline = None if limit is None else time.monotonic() + limit
        while deadline is None or time.monotonic() < deadline:
            try:
                frame = conn.recv(timeout=limit)
            except TimeoutError:
                break
            answer = Answer.unpack(frame)
            if answer.seq == seq:
                return answer, frame
        raise TimeoutError(
            f"the policy store at {self.address} did not answer within "
            f"{ANSWER_TIMEOUT:.0f} s beyond the {wait} s wait: the publishing process is "
            f"frozen or overloaded. Call again to retry (a late answer is dropped).")

    def _connect(self) -> channel.Channel:
        if self.closed:
            raise ValueError("this PolicyStore reader was closed; unpickle or connect a "
                             "new one")
        if self._channel is None:
            try:
                self._channel = channel.connect(self.address, authkey=self.authkey)
            except AuthenticationError:
                raise
            except TransportError as exc:
                raise self._lost(exc) from exc
        return self._channel

    def _lost(self, exc: BaseException) -> PolicyStoreLost:
        return PolicyStoreLost(
            f"the policy store at {self.address} is gone ({exc}): the process that "
            f"publishes it closed it, exited or was killed. Readers cannot go on "
            f"without it: restart the learner (PolicyStore.restore(snapshot_path) starts "
            f"from the last version written) and hand the new store to the readers.")

    def close(self) -> None:
        """End the connection (a call waiting on it raises :class:`PolicyStoreLost`)."""
        self.closed = True
        conn, self._channel = self._channel, None
        if conn is not None:
            conn.close()
