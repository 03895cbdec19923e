"""Authenticated point-to-point channels over nanomsg-next-gen (pynng).

This is the only module that imports pynng. It owns connection set-up, mutual
authentication, the framing of raw messages and the mapping of nng errors to
fibrl errors. It knows nothing of what the frames mean (``hub``, ``messages``).

Connection set-up::

    client                                   Listener (address = accept socket)
    Req0 --- b"FBHELLO1" ------------------>  Rep0 accept thread
         <-- b"FBADDR1" + tcp://host:port --  opens a Pair1 socket for this peer
    Pair1 dial ----------------------------> Pair1 (one per peer: back-pressure,
         --- b"FBH1" + client nonce ---->       never drops, unlike polyamorous
         <-- b"FBC1" + server nonce + mac --    mode which discards on a full queue)
         --- b"FBA1" + mac -------------->   verified: the peer is authenticated
         <-- b"FBOK" -----------------------
         <== frames, both ways ============> reader thread per peer -> on_frame()

Nothing a peer sends is unpickled here, and a peer's frames reach
``on_frame`` only after it proved it knows the secret (HMAC-SHA256 over a fresh
nonce, in both directions, as ``multiprocessing.connection`` does). A peer that
does not finish the handshake within ``auth_timeout`` is dropped.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from typing import Callable, Optional

import pynng

from .errors import AuthenticationError, ChannelClosed, TransportError

__all__ = ["Listener", "Peer", "Channel", "HELLO", "tcp_address"]

log = logging.getLogger(__name__)

HELLO = b"FBHELLO1"
_ADDR = b"FBADDR1"
_H, _C, _A, _OK, _NO = b"FBH1", b"FBC1", b"FBA1", b"FBOK", b"FBNO"
# Connections still authenticating, at most: each holds a socket and a thread for up
# to auth_timeout, so an unauthenticated flood must not be able to pile them up.
MAX_AUTHENTICATING = 128
_NONCE = 32
_MAC = 32


def _mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def tcp_address(host: str, port: int) -> str:
    """The nng URL of ``host:port``; an IPv6 host is bracketed (nng refuses ``tcp://::1:0``).

    Example:
        >>> tcp_address("10.0.0.5", 0), tcp_address("fd00::5", 7000), tcp_address("[::1]", 0)
        ('tcp://10.0.0.5:0', 'tcp://[fd00::5]:7000', 'tcp://[::1]:0')
    """
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def _address_of(sock: pynng.Socket) -> str:
    # pynng's SockAddr.port has the wrong byte order; str() is right.
    return "tcp://" + str(sock.listeners[0].local_address)


def _pair() -> pynng.Pair1:
    return pynng.Pair1(recv_max_size=0)


class Peer:
    """The server side of one authenticated connection."""

    def __init__(self, sock: pynng.Pair1, peer_id: int) -> None:
        self._sock = sock
        self.id = peer_id
        self.closed = False
        self.context: dict = {}  # per-connection state kept by the frame handler
        self.thread: Optional[threading.Thread] = None

    def send(self, data: bytes) -> None:
        """Send one frame; raises :class:`ChannelClosed` when the peer is gone."""
        try:
            self._sock.send(data)
        except pynng.NNGException as exc:
            raise ChannelClosed(f"peer {self.id} is gone ({exc})") from exc

    def close(self) -> None:
        self.closed = True
        self._sock.close()

    def __repr__(self) -> str:
        return f"<Peer {self.id}>"


FrameHandler = Callable[[Peer, bytes], None]
LossHandler = Callable[[Peer], None]


class Listener:
    """Accepts authenticated peers and hands their frames to ``on_frame``.

    Args:
        host: interface to bind (``127.0.0.1`` unless workers run elsewhere).
        secret: the run's shared secret.
        on_frame: called in the peer's reader thread with each frame.
        on_lost: called once when an authenticated peer disconnects.
        auth_timeout: seconds a peer has to authenticate.
        port: port of the accept socket (0: any free port; a manager may fix one).

    Example:
        >>> lst = Listener("127.0.0.1", b"k", on_frame=lambda p, d: p.send(d))
        >>> ch = Channel.connect(lst.address, b"k"); ch.send(b"x"); ch.recv(5)
        b'x'
    """

    def __init__(self, host: str, secret: bytes, *, on_frame: FrameHandler,
                 on_lost: Optional[LossHandler] = None, auth_timeout: float = 10.0,
                 port: int = 0) -> None:
        self._host = host
        self._secret = secret
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._auth_timeout = auth_timeout
        self._accept = pynng.Rep0()
        try:
            self._accept.listen(tcp_address(host, port))
        except pynng.NNGException as exc:
            self._accept.close()
            raise TransportError(
                f"cannot listen on {host}: {exc}. Set listen_host to an address of this "
                f"machine that workers can reach (fibrl.init(listen_host=...)).") from exc
        self.address = _address_of(self._accept)
        self._peers: dict[int, Peer] = {}
        self._lock = threading.Lock()
        self._slots = threading.Condition(self._lock)
        self._authenticating = 0
        self._next_id = 0
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"fibrl-accept-{self.address}")
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                msg = self._accept.recv()
            except pynng.NNGException:
                return  # closed
            try:
                self._accept.send(self._open_peer() if msg == HELLO else _NO)
            except pynng.NNGException:
                if self._closed:
                    return

    def _open_peer(self) -> bytes:
        with self._slots:
            if self._authenticating >= MAX_AUTHENTICATING:
                log.warning("%d peers are still authenticating on %s; the next waits for "
                            "one of them (at most auth_timeout)", self._authenticating,
                            self.address)
            # a slot frees within auth_timeout: each handshake ends by then
            self._slots.wait_for(lambda: self._authenticating < MAX_AUTHENTICATING
                                 or self._closed)
            if self._closed:
                return _NO
            self._authenticating += 1
            self._next_id += 1
            peer = Peer(_pair(), self._next_id)
        sock = peer._sock
        # Armed before the handshake: the socket serves its first connection only, so
        # no second one can slip in after (or during) the first one's authentication.
        _close_on_disconnect(sock)
        try:
            sock.listen(tcp_address(self._host, 0))
        except pynng.NNGException as exc:   # no port left, say: refuse this one only
            log.warning("cannot open a connection for a new peer on %s: %s", self._host, exc)
            sock.close()
            self._handshake_done()
            return _NO
        thread = threading.Thread(target=self._serve, args=(peer,), daemon=True,
                                  name=f"fibrl-peer-{peer.id}")
        peer.thread = thread
        thread.start()
        return _ADDR + _address_of(sock).encode()

    def _serve(self, peer: Peer) -> None:
        sock = peer._sock
        good = self._authenticate(peer)
        self._handshake_done()
        with self._lock:
            if not good or self._closed:
                sock.close()
                return
            self._peers[peer.id] = peer
        log.debug("peer %s authenticated on %s", peer.id, self.address)
        try:
            while True:
                try:
                    data = sock.recv()
                except pynng.NNGException:
                    break
                self._on_frame(peer, data)
        finally:
            with self._lock:
                self._peers.pop(peer.id, None)
            peer.closed = True
            sock.close()
            log.debug("peer %s of %s disconnected", peer.id, self.address)
            if self._on_lost is not None and not self._closed:
                self._on_lost(peer)

    def _handshake_done(self) -> None:
        with self._slots:
            self._authenticating -= 1
            self._slots.notify()

    def _authenticate(self, peer: Peer) -> bool:
        sock = peer._sock
        sock.recv_timeout = int(self._auth_timeout * 1000)
        try:
            hello = sock.recv()
            if len(hello) != 4 + _NONCE or not hello.startswith(_H):
                log.warning("dropping peer %s: first message is not a fibrl hello", peer.id)
                return False
            nonce = os.urandom(_NONCE)
            sock.send(_C + nonce + _mac(self._secret, b"S", hello[4:]))
            answer = sock.recv()
            good = answer.startswith(_A) and hmac.compare_digest(
                answer[4:], _mac(self._secret, b"C", nonce))
            sock.send(_OK if good else _NO)
            if not good:
                log.warning("dropping peer %s: wrong secret", peer.id)
            return good
        except pynng.NNGException as exc:
            log.debug("peer %s did not finish authenticating: %s", peer.id, exc)
            return False
        finally:
            sock.recv_timeout = -1

    def close(self, join: float = 0.0) -> None:
        """Stop accepting and drop every peer, waiting up to ``join`` s for their threads."""
        with self._lock:
            self._closed = True
            self._slots.notify_all()
            peers = list(self._peers.values())
        self._accept.close()
        for peer in peers:
            peer.close()
        if join:
            self._thread.join(join)
            for peer in peers:
                peer.thread.join(join)


class Channel:
    """The client side of an authenticated connection to a :class:`Listener`.

    Frames are sent with :meth:`send` and received with :meth:`recv`; the
    channel never reconnects: once the connection drops it stays closed and
    ``on_lost`` (if given) runs once.
    """

    def __init__(self, sock: pynng.Pair1, address: str) -> None:
        self._sock = sock
        self.address = address
        self.closed = False
        self._lost_cb: Optional[Callable[[], None]] = None
        self._lost_once = threading.Lock()
        sock.add_post_pipe_remove_cb(lambda _pipe: _call_soon(self._lost))

    @classmethod
    def connect(cls, address: str, secret: bytes, timeout: float = 30.0) -> "Channel":
        """Connect and authenticate to the listener at ``address``.

        Raises:
            AuthenticationError: either side did not know the secret.
            TransportError: nothing listens there, or it did not answer in time.
        """
        data_address = _ask_address(address, timeout)
        sock = _pair()
        # A listener that dies mid-handshake closes the pipe, but a Pair1 recv does not
        # end with it (nng would wait for a redial): close the socket then, so the
        # handshake fails at once instead of after ``timeout``.
        _close_on_disconnect(sock)
        try:
            sock.dial(data_address, block=True)
            _client_handshake(sock, secret, timeout, address)
        except BaseException:
            sock.close()
            raise
        return cls(sock, address)

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once when the connection drops (now, if it already has)."""
        self._lost_cb = callback
        if self.closed:
            self._lost()

    def _lost(self) -> None:
        if not self._lost_once.acquire(blocking=False):
            return
        self.closed = True
        self._sock.close()
        if self._lost_cb is not None:
            self._lost_cb()
        else:
            self._lost_once.release()  # let a callback registered later run

    def send(self, data: bytes) -> None:
        """Send one frame; raises :class:`ChannelClosed` when the connection is gone."""
        try:
            self._sock.send(data)
        except pynng.NNGException as exc:
            raise ChannelClosed(
                f"connection to {self.address} is closed ({exc}); the process at the "
                f"other end exited or was killed.") from exc

    def recv(self, timeout: Optional[float] = None) -> bytes:
        """Receive one frame, waiting at most ``timeout`` seconds (None: forever)."""
        self._sock.recv_timeout = -1 if timeout is None else max(1, int(timeout * 1000))
        try:
            return self._sock.recv()
        except pynng.Timeout as exc:
            raise TimeoutError(f"no message from {self.address} within {timeout} s") from exc
        except pynng.NNGException as exc:
            raise ChannelClosed(
                f"connection to {self.address} is closed ({exc}); the process at the "
                f"other end exited or was killed.") from exc

    def close(self) -> None:
        self.closed = True
        self._sock.close()


def _call_soon(fn: Callable[[], None]) -> None:
    # nng runs pipe callbacks on its own threads, where closing the socket
    # deadlocks; hand the work to a short-lived thread.
    threading.Thread(target=fn, daemon=True, name="fibrl-pipe-event").start()


def _close_on_disconnect(sock: pynng.Socket) -> None:
    """Close ``sock`` when its first pipe goes away: a one-peer socket whose peer left
    is done (nng would keep a send or recv waiting for a redial)."""
    sock.add_post_pipe_remove_cb(lambda _pipe: _call_soon(sock.close))


def _ask_address(address: str, timeout: float) -> str:
    req = pynng.Req0(resend_time=-1, recv_timeout=int(timeout * 1000),
                     send_timeout=int(timeout * 1000))
    _close_on_disconnect(req)  # as in Channel.connect
    try:
        req.dial(address, block=True)
        req.send(HELLO)
        answer = req.recv()
    except pynng.Closed as exc:
        raise TransportError(
            f"{address} went away while we asked for its data address; the fibrl process "
            f"that owns it has exited.") from exc
    except pynng.ConnectionRefused as exc:
        raise TransportError(
            f"nothing listens at {address} (connection refused); the fibrl process that "
            f"owns it has exited.") from exc
    except pynng.Timeout as exc:
        raise TransportError(f"{address} did not answer within {timeout} s.") from exc
    except pynng.NNGException as exc:
        raise TransportError(f"cannot connect to {address}: {exc}") from exc
    finally:
        req.close()
    if not answer.startswith(_ADDR):
        raise TransportError(f"{address} is not a fibrl listener (answered {answer[:16]!r}).")
    return answer[len(_ADDR):].decode()


def _client_handshake(sock: pynng.Pair1, secret: bytes, timeout: float,
                      address: str = "the listener") -> None:
    sock.recv_timeout = int(timeout * 1000)
    nonce = os.urandom(_NONCE)
    try:
        sock.send(_H + nonce)
        challenge = sock.recv()
        if not challenge.startswith(_C) or not hmac.compare_digest(
                challenge[4 + _NONCE:], _mac(secret, b"S", nonce)):
            raise AuthenticationError(
                "the listener did not prove it knows the run's secret: it belongs to another "
                "fibrl run or is not fibrl. Check the address and the authkey/FIBRL_SECRET.")
        sock.send(_A + _mac(secret, b"C", challenge[4:4 + _NONCE]))
        verdict = sock.recv()
    except pynng.Closed as exc:
        raise TransportError(
            f"{address} went away during the authentication handshake; the fibrl process "
            f"that owns it has exited.") from exc
    except pynng.NNGException as exc:
        raise AuthenticationError(f"authentication handshake failed: {exc}") from exc
    finally:
        sock.recv_timeout = -1
    if verdict != _OK:
        raise AuthenticationError(
            "the listener rejected our secret: this process and the listener belong to "
            "different fibrl runs (wrong authkey or FIBRL_SECRET).")
