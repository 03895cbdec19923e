"""Authenticated point-to-point connections between fibrl processes.

This is the message plane that fibrl's own objects ride on, for code that needs a
connection of its own: one process calls :func:`listen` and hands the listener's
``address`` to others (as a ``Process`` argument, through a ``Queue``...), which call
:func:`connect` with it. Frames are ``bytes``; :func:`dumps` and :func:`loads` turn
Python objects into frames and back (NumPy arrays and large ``bytes`` travel without
extra copies), or use a binary layout of your own.

Every connection obeys the same rules as the rest of the run:

- it is authenticated with the run's secret (HMAC challenge and response; a peer
  without the secret is refused before it can send a frame, and nothing it sends is
  unpickled);
- with ``fibrl.init(tls=True)`` the listener speaks TLS only and :func:`connect`
  refuses a plaintext address before sending anything;
- the handshake timeout and the limit on pending connections of the config hold;
- a lost connection is reported: ``send`` and ``recv`` raise
  :class:`~fibrl.errors.ChannelClosed`, and ``on_lost`` callbacks run once.

What differs from a ``Pipe``: a channel connects two processes you name by address
(no object to pass around first), a listener serves any number of peers, and frames
are handed to your callback in the reader thread of their connection, in order per
connection. A channel never reconnects.

Example:
    >>> import fibrl.channel as channel
    >>> echo = channel.listen(lambda peer, frame: peer.send(frame))
    >>> ch = channel.connect(echo.address)
    >>> ch.send(channel.dumps({"step": 1}))
    >>> channel.loads(ch.recv(timeout=10))
    {'step': 1}
    >>> ch.close(); echo.close()
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from .errors import ChannelClosed
from .hosting.hub import get_hub
from .wire import serialization
from .wire.transport import Channel, Listener, Peer

__all__ = ["listen", "connect", "dumps", "loads", "Channel", "Listener", "Peer",
           "ChannelClosed"]


def listen(on_message: Callable[[Peer, Any], None],
           on_lost: Optional[Callable[[Peer], None]] = None) -> Listener:
    """Listen for authenticated connections from the run's processes.

    Args:
        on_message: called as ``on_message(peer, frame)`` for each frame a peer sends,
            in that peer's reader thread (one at a time per peer, in the order sent).
            ``frame`` is ``bytes``, or a writable ``memoryview`` for a large one.
            Answer with ``peer.send(...)``; ``peer.context`` is a dict for state of
            your own per connection. An exception it raises ends that peer's
            connection (and is reported as an uncaught exception of its thread).
        on_lost: called once with the peer when its connection ends.

    Returns:
        A :class:`Listener` on this process's ``listen_host``, with the run's secret
        and transport settings (``tls``, ``auth_timeout``, pending-connection limit).
        Give ``listener.address`` to the processes that should connect;
        ``listener.close()`` ends it and every connection it accepted.
    """
    return get_hub().open_listener(on_message, on_lost)


def connect(address: str, timeout: Optional[float] = None, *,
            authkey: Optional[bytes] = None) -> Channel:
    """Connect to a listener of this run (see :func:`listen`) and authenticate.

    Args:
        address: a :attr:`Listener.address` (``tcp://...``, or ``tls+tcp://...`` with
            TLS on).
        timeout: seconds to connect and authenticate (default: the config's
            ``start_timeout``).
        authkey: the secret to prove, for a process that fibrl did not start (a
            script of its own, a service) connecting to a listener of a fibrl run:
            that run's ``fibrl.current_process().authkey``, handed over out of band.
            Default: this process's authkey (the run's secret in any fibrl process).
            The ``tls`` setting still comes from this process's config; with TLS on,
            the certificate is derived from this key too.

    Returns:
        A :class:`Channel`: ``send(frame)``, ``recv(timeout=None)``, ``on_lost(fn)``,
        ``close()``.

    Raises:
        AuthenticationError: the listener does not know this run's secret (or
            ``authkey``).
        TransportError: nothing listens at ``address``, it did not answer in time, or
            it is a plaintext address while ``tls`` is on.
        TypeError: ``authkey`` is not bytes.
    """
    hub = get_hub()
    if authkey is None:
        return hub.open_channel(address, timeout)
    if not isinstance(authkey, (bytes, bytearray)) or not authkey:
        raise TypeError(f"authkey must be non-empty bytes (the run's "
                        f"fibrl.current_process().authkey), got {type(authkey).__name__}")
    return hub.settings.connect(address, bytes(authkey), timeout)


def dumps(obj: Any) -> bytes:
    """``obj`` as one frame: a pickle (protocol 5) whose large buffers (NumPy arrays,
    ``bytes``) are laid out after it instead of copied into it. What pickle refuses
    (a lambda, a closure) is pickled by value with cloudpickle.

    Raises:
        SerializationError: ``obj`` cannot be pickled (the message says why).
    """
    return serialization.dumps(obj)


def loads(frame: Any) -> Any:
    """The object of a frame made by :func:`dumps` (``bytes`` or a ``memoryview``, as
    ``recv`` returns it; a large array is rebuilt on the frame's memory, not copied).

    Raises:
        FrameError: ``frame`` is not such a frame.
    """
    return serialization.loads(frame)
