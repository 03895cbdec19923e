"""The producer's side of a mailbox owned by another process: :class:`Ledger`, what
this process put on one queue over each connection to its owner, so that items lost
with a connection are reported, never lost silently.

A ``put()`` into a queue owned elsewhere is a one-way message: it returns once the
item is queued for sending. When the connection to the owner drops, the puts still
on their way are gone with it, and only the owner knows how many arrived. So both
sides count, per connection: before this process's first put on a connection, the
ledger names that connection to the owner (a random *token*); the owner counts the
items it receives from that connection. Once the connection drops, the ledger asks
the owner, over a new connection, how many arrived under the token (the owner
answers once it has seen the old connection drop: nothing more can arrive on it),
and the difference is raised (:class:`~fibrl.errors.RemoteObjectError`): by the next
``put()`` (which then puts nothing), by ``close()`` or ``join_thread()``, or at exit
(the process then ends with status 1).

    producer (Ledger)                            owner (Mailbox)
    first put on a connection: producer(token) -> counts what that connection puts
    put, put, ... (sent += 1 each) ------------->  received += 1 each
    the connection drops: (token, sent) in doubt   drop_peer: token -> received, kept
    next put / close / join_thread / exit:
      delivered(token), new connection -------->  received (once it saw the drop)
      sent - received > 0: raise, naming how many
"""
from __future__ import annotations

import functools
import logging
import os
import secrets
import sys
import threading
from typing import Any, Optional

from ...errors import RemoteObjectError
from ..hub import Client, get_hub
from .consumer import Window

__all__ = ["Ledger"]

log = logging.getLogger(__name__)

#: How often a put tries a new connection that drops at once before it gives up.
_TRIES = 3
#: The longest the ledger waits for the owner to say how many items arrived over a
#: connection that dropped (it answers once it has seen the drop: at once, usually).
ASK_TIMEOUT = 30.0


class _Binding:
    """One connection the ledger's puts went over, and how many."""

    __slots__ = ("client", "token", "sent", "doubted")

    def __init__(self, client: Client, token: str) -> None:
        self.client = client
        self.token = token
        self.sent = 0          # items put over it (counted before each is sent)
        self.doubted = False   # it dropped: the owner is to say how many arrived


class Ledger:
    """What this process put on the queue ``oid`` at ``address``, per connection to its
    owner (see the module doc). One per process and queue, shared by its handles."""

    _registry: dict[tuple[str, str], Ledger] = {}
    _registry_lock = threading.Lock()
    _epoch = -1   # Window.epoch it was made in (a forked child starts with none)
    #: items found undelivered since this process started (its exit status says so)
    undelivered = 0

    def __init__(self, address: str, oid: str) -> None:
        self.address, self.oid = address, oid
        self.lock = threading.RLock()
        self.binding: Optional[_Binding] = None   # the connection puts go over now
        self.doubts: list[_Binding] = []   # connections that dropped, not yet settled

    @classmethod
    def of(cls, address: str, oid: str) -> "Ledger":
        """This process's ledger for the queue ``oid`` at ``address`` (made on first use)."""
        with cls._registry_lock:
            if cls._epoch != Window.epoch:
                if cls._epoch == -1:
                    from .. import runtime

                    runtime.at_exit(runtime.CONNECTIONS, cls.settle_at_exit)
                    runtime.at_exit(runtime.HUB, cls._exit_status)
                cls._registry, cls._epoch, cls.undelivered = {}, Window.epoch, 0
            ledger = cls._registry.get((address, oid))
            if ledger is None:
                ledger = cls._registry[address, oid] = cls(address, oid)
            return ledger

    # -- putting -----------------------------------------------------------------------
    def put(self, payload: Any) -> None:
        """Send the one-way put of ``payload`` (an encoded item) over the connection this
        ledger counts; raises when items put before were found lost with a connection."""
        for _ in range(_TRIES):
            binding = self.binding
            if binding is None or binding.client.lost:
                binding = self._bind()
            binding.sent += 1   # first: an item sent into a connection that drops is counted
            try:
                binding.client.send(self.oid, "put", (payload, None), payload.borrowed)
                return
            except RemoteObjectError:   # it dropped just now: nothing was queued
                binding.sent -= 1
        raise _unstable(self.address)

    def _bind(self) -> _Binding:
        """A connection to the owner that counts this ledger's puts: the current one, or
        a new one named to the owner. Settles the connections that dropped first."""
        with self.lock:
            binding = self.binding
            if binding is not None and not binding.client.lost:
                return binding   # (another thread bound it meanwhile)
            if binding is not None:
                self._doubt(binding)
            self.settle()
            for _ in range(_TRIES):
                client = get_hub().client(self.address)   # (raises: the owner is gone)
                binding = _Binding(client, secrets.token_hex(8))
                try:   # ahead of the puts, on the same connection: frames keep their order
                    client.send(self.oid, "producer", (binding.token,))
                except RemoteObjectError:
                    continue
                self.binding = binding
                break
            else:
                raise _unstable(self.address)
        client.on_lost(functools.partial(self._doubt, binding))   # (at once if it dropped)
        return binding

    def _doubt(self, binding: _Binding) -> None:
        """``binding``'s connection dropped: how many of its puts arrived is to be asked."""
        with self.lock:
            if not binding.doubted:
                binding.doubted = True
                if binding.sent:
                    self.doubts.append(binding)
            if self.binding is binding:
                self.binding = None

    # -- settling ----------------------------------------------------------------------
    def settle(self) -> None:
        """Ask the owner how many of the items put over each connection that dropped
        arrived; raise :class:`RemoteObjectError` naming those that did not."""
        with self.lock:
            binding = self.binding
            if binding is not None and binding.client.lost:
                self._doubt(binding)   # (before its connection's own callback runs)
            doubts, self.doubts = self.doubts, []
            if not doubts:
                return
            sent = sum(b.sent for b in doubts)
            try:
                hub = get_hub()
                received = sum(hub.call(self.address, self.oid, "delivered", b.token,
                                        timeout=ASK_TIMEOUT) for b in doubts)
            except Exception as exc:
                Ledger.undelivered += sent
                raise RemoteObjectError(
                    f"up to {sent} item(s) put on queue {self.oid!r} from this process "
                    f"may not have been delivered: the connection to the queue's owner at "
                    f"{self.address} dropped while they were on their way, and the owner "
                    f"could not say how many arrived ({exc}). Put again what must "
                    f"arrive, if the queue still exists.") from exc
            missing = sent - received
            if missing > 0:
                Ledger.undelivered += missing
                raise RemoteObjectError(
                    f"{missing} item(s) put on queue {self.oid!r} from this process were "
                    f"not delivered: the connection to the queue's owner at {self.address} "
                    f"dropped while they were on their way (it received {received} of the "
                    f"{sent} put over that connection). Put them again if they must "
                    f"arrive; the puts since went over a new connection.")

    def confirm(self) -> None:
        """Wait until what this process sent has reached the owners it went to, then
        settle the connections that dropped meanwhile (``join_thread``)."""
        get_hub().flush(None)
        self.settle()

    @classmethod
    def settle_at_exit(cls) -> None:
        """At exit: flush this process's puts, then report every item found lost."""
        if not cls._registry:
            return
        hub = get_hub()
        hub.flush(10.0)
        for ledger in list(cls._registry.values()):
            try:
                ledger.settle()
            except RemoteObjectError as exc:
                _tell(f"fibrl process {os.getpid()}: {exc}")

    @classmethod
    def _exit_status(cls) -> None:
        """The exit sequence's last step: a process that lost items it put ends with
        status 1 (a zero status would say it did all it was asked)."""
        if cls.undelivered and cls._epoch == Window.epoch:
            _tell(f"fibrl process {os.getpid()}: exiting with status 1: "
                  f"{cls.undelivered} item(s) it put on queues were not delivered.")
            logging.shutdown()
            os._exit(1)


def _unstable(address: str) -> RemoteObjectError:
    return RemoteObjectError(f"cannot put on a queue owned by the process at {address}: "
                             f"each new connection to it drops at once. Check that process "
                             f"and the network between them.")


def _tell(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (AttributeError, ValueError, OSError):
        pass   # the program closed its stderr
    try:
        sys.stdout.flush()
    except (AttributeError, ValueError, OSError):
        pass
