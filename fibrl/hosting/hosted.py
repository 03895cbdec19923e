"""Handles to hosted objects: the one client-side base, and the generic helpers.

A *hosted object* is a :class:`~fibrl.hosting.hub.SharedService` in the hub of the
process that created it; users hold a small *handle* (the owner's address and
the object id) that pickles to any process of the run. This module owns what
every such handle does the same way::

    creating process                       any process
    HostedHandle._host(service)
      hub.register(service) -> oid
      own(handle, oid): the service retires with this handle unless pickled
    pickle.dumps(handle) ---------------->  rebuild(cls, address, oid, state)
      mark_pickled: outlive the creator      handle._call(m, *args)   (call_owner)
                                             handle._parked(m, *args) (interruptible:
                                               withdraw with "cancel" and undo)

and the helpers services and handles share: :func:`answer` (reply with a
result or its exception), :func:`call_owner` (call and wait, a lost owner
raises instead of hanging), :class:`HostedService` (a shared service with a
mutex). Queues (``queues``), the sync primitives (``synchronize``) and
``sharedctypes`` build on it. It does not own any service's meaning, nor the
waiting and liveness pings (``hub``): the only liveness ping is the hub's own.
"""
from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..errors import TransportError, owner_gone
from .hub import Handle, Hub, ReplySink, SharedService, get_hub, mark_pickled, own

if TYPE_CHECKING:
    from ..wire.transport import Peer

__all__ = ["HostedHandle", "HostedService", "answer", "call_owner", "rebuild", "wait_reply"]

_tokens = itertools.count(1)


def answer(reply: ReplySink, fn: Callable[[], Any]) -> None:
    """Reply with ``fn()``, or with the exception it raised."""
    try:
        value = fn()
    except Exception as exc:
        reply.fail(exc)
    else:
        reply(value)


def call_owner(address: Optional[str], oid: str, method: str, *args: Any) -> Any:
    """Call a hosted object and wait for its reply; its owner enforces any deadline.

    A lost owner (even a vanished node, which closes no socket) raises
    :class:`~fibrl.errors.RemoteObjectError` within ``parent_timeout`` (see
    :meth:`fibrl.hosting.hub.Hub.wait`).
    """
    hub = get_hub()
    try:
        handle = hub.call_async(address, oid, method, *args)
    except TransportError as exc:
        raise owner_gone(address, exc) from exc
    return wait_reply(handle, address, hub)


def wait_reply(handle: Handle, address: Optional[str], hub: Hub) -> Any:
    """``handle.get()`` for a call whose deadline its owner enforces, pinging the owner
    between slices (:meth:`fibrl.hosting.hub.Hub.wait`): the one wait of every hosted handle."""
    return hub.wait(handle, address)


class HostedService(SharedService):
    """A shared service whose state is guarded by ``mutex`` (also around ``peer_lost``)."""

    def __init__(self) -> None:
        self.mutex = threading.RLock()

    def peer_lost(self, peer: Peer) -> None:
        with self.mutex:
            super().peer_lost(peer)


class HostedHandle:
    """The client side of a hosted object: address + object id, picklable anywhere.

    Subclasses host their service with :meth:`_host`, add what else travels
    with a pickled copy in :meth:`_state`, and give back what an interrupted
    call obtained in :meth:`_undo`.
    """

    _address: str
    _oid: str

    def _host(self, service: SharedService) -> None:
        hub = get_hub()
        self._oid = hub.register(service)
        self._address = hub.address
        own(self, self._oid)  # a pickled handle keeps the service while in use

    def __reduce__(self) -> tuple[Callable[..., HostedHandle],
                                  tuple[type[HostedHandle], str, str, dict[str, Any]]]:
        mark_pickled(self._address, self._oid)
        return (rebuild, (type(self), self._address, self._oid, self._state()))

    def _state(self) -> dict[str, Any]:
        return {}

    def _call(self, method: str, *args: Any) -> Any:
        return call_owner(self._address, self._oid, method, *args)

    def _parked(self, method: str, *args: Any) -> Any:
        """A call that may park: when interrupted, withdraw it and undo what it got.

        The service receives a per-call token as last argument, and must offer
        ``op_cancel(reply, tid, token)``.
        """
        hub = get_hub()
        token = next(_tokens)
        try:
            handle = hub.call_async(self._address, self._oid, method, *args, token)
        except TransportError as exc:
            raise owner_gone(self._address, exc) from exc
        try:
            return wait_reply(handle, self._address, hub)
        except BaseException:
            if not handle.ready():
                self._withdraw(handle, token)
            raise

    def _withdraw(self, handle: Handle, token: int) -> None:
        try:
            self._call("cancel", threading.get_ident(), token)
            self._undo(wait_reply(handle, self._address, get_hub()))
        except Exception:
            pass  # the owner is gone: nothing is held any more

    def _undo(self, result: Any) -> None:
        """Give back what an interrupted call obtained after all."""


def rebuild(cls: type[HostedHandle], address: str, oid: str,
            state: dict[str, Any]) -> HostedHandle:
    """Unpickle a :class:`HostedHandle` (no service is created: it exists at its owner)."""
    obj = cls.__new__(cls)
    obj._address, obj._oid = address, oid
    obj.__dict__.update(state)
    return obj
