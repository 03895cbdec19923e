"""Authenticated point-to-point channels over nanomsg-next-gen (pynng).

This is the only module that imports pynng. It owns connection set-up, mutual
authentication, the framing of raw messages, the mapping of nng errors to fibrl
errors, the limits that keep unauthenticated peers harmless, and optional TLS.
It knows nothing of what the frames mean (``hub``, ``messages``).

Connection set-up (the accept socket answers each request at once and keeps no
state for a peer until that peer has proved it knows the secret)::

    client                                   Listener
    Req0 --- FBHELLO2 + client nonce ------>  Rep0 accept thread (1 KiB receive limit,
         <-- FBCHAL2 + ticket + server mac --   at most max_pending connections)
         --- FBAUTH2 + nonce + ticket + mac ->  ticket fresh and unused, mac right:
         <-- FBADDR2 + tcp://host:port -------  opens a Pair1 data socket for this peer
    Pair1 dial ----------------------------> Pair1 (one per peer: back-pressure, never
         --- token (mac of both nonces) --->    drops; it takes its first connection
         <-- FBOK ---------------------------   only: nng closes any later one before it
         <== frames, both ways ============>   reaches the socket) -> reader -> on_frame()

The ticket is the server nonce: a time stamp and a MAC under a per-listener key,
so the accept socket can check it without remembering anything; a used ticket
is remembered until it expires (``auth_timeout``), so a recorded exchange cannot
be replayed. Nothing a peer sends is unpickled here, and a peer's frames reach
``on_frame`` only after it proved it knows the secret (HMAC-SHA256 over fresh
nonces, in both directions, as ``multiprocessing.connection`` does).

Limits on strangers: without TLS a :class:`~fibrl.wire.gate.Gate` owns the TCP ports
and hands nng (through its ``socket://`` transport) only connections whose 8-byte
nng header arrived within ``HEADER_TIMEOUT`` and names the protocol of the socket
behind the port; those still waiting count against ``max_pending`` with the accept
socket's. The accept socket takes messages of at most 1 KiB and holds at most
``max_pending`` connections, any of them for at most ``auth_timeout``. A full
listener is a queue, not a lottery: newer connections wait (in the kernel's listen
backlog, without TLS) until a held one finishes its handshake or is *idle*, i.e. has
sent nothing while the accept thread waited for it (a peer whose message is queued
behind others is never idle) for longer than the grace, and then closed for a waiting
one. The grace is ``IDLE_GRACE``, or twice the longest silence of the peers that
authenticated in the last ``_SILENCE_WINDOW`` seconds if that is more (on a loaded
machine a peer may take a while to answer; a stranger cannot stretch it, as only
peers that know the secret count). With TLS nng accepts by itself: past the limit
an idle connection is closed for the new one, or the new one is refused and its peer
tries again (:func:`_authenticate_retrying`); so does a peer whose connection waited
in the queue longer than nng's own negotiation limit (``_NEGOTIATION_S``). A data
socket exists only for a peer that authenticated and takes one connection: its port
stops listening once that connection is handed on (with TLS, where nng listens
itself, the port stays open and every later connection is closed as it arrives), and
only the end of that connection ends the peer.
Every dropped or refused peer is logged with its address and the reason, at most
``_LOG_BURST`` times per ``_LOG_WINDOW`` seconds per listener.

TLS (``tls=True``): both sockets speak ``tls+tcp://``; each side presents the
run's certificate, whose key is derived from the secret (:func:`run_certificate`),
and requires the other to present it, so a peer without the secret cannot even
open a connection, and frames are encrypted.
"""
from __future__ import annotations

import atexit
import collections
import errno
import functools
import hashlib
import hmac
import itertools
import logging
import os
import random
import resource
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

# pynng's curio support reads concurrent.futures through `import concurrent`, counting
# on another module to have imported it (asyncio does, and workers defer asyncio:
# fibrl.wire.deferred).
import concurrent.futures  # noqa: F401
import pynng
from pynng import _nng
from pynng.exceptions import check_err

from ..errors import AuthenticationError, ChannelClosed, TransportError
from .gate import Gate, Port, sp_header

if TYPE_CHECKING:
    from .serialization import FramePart

__all__ = ["Settings", "Listener", "Peer", "Channel", "HELLO", "run_certificate", "tcp_address"]

log = logging.getLogger(__name__)

HELLO = b"FBHELLO2"
_CHAL, _AUTH, _ADDR = b"FBCHAL2", b"FBAUTH2", b"FBADDR2"
_OK, _NO = b"FBOK", b"FBNO"
_NONCE = 32
_MAC = 32
_TICKET = 32            # time stamp (8) + random (8) + MAC under the listener's key (16)
# What a stranger can make a listener buffer: every set-up message fits in far less.
HANDSHAKE_MAX_SIZE = 1024
# Connections to the accept socket kept at most (each holds a descriptor), and never
# more than this share of the process's descriptor limit, so workers keep the rest.
MAX_PENDING = 64
_NOFILE_SHARE = 8
# Seconds a TCP connection to a plaintext listener may take to send nng's header (nng
# itself would hold it 10 s, unseen); never more than the listener's auth_timeout.
HEADER_TIMEOUT = 5.0
# The SP protocol numbers of the peers each socket expects (see gate.sp_header).
_REQ0, _PAIR1 = 0x30, 0x11
_LOG_BURST, _LOG_WINDOW = 20, 10.0
# Seconds an unauthenticated connection may stay silent while the listener waits for
# it (its accept thread idle) and newer connections wait for its slot, before it is
# closed for one of them; a peer answers each handshake message at once.
IDLE_GRACE = 0.5
_SILENCE_WINDOW = 30.0
# A client whose handshake connection was closed under it (a listener full of idle
# strangers, or refusing past its limit with TLS) starts it again until its timeout,
# pausing this long, doubled each time (at most 1 s), with jitter.
_RETRY_PAUSE = 0.05
# nng's TCP transport gives up on a connection whose peer has not sent its 8-byte header
# within this long (fixed in nng): a dial to a full listener, whose connection waits in
# its queue (the kernel's listen backlog, or the gate's) longer than that, fails with
# a timeout and is started again (a slow listener, not a lost connection).
_NEGOTIATION_S = 10.0
# While a handshake waits for the listener's answer, how often it checks that its
# connection still stands: nng's TLS transport can lose a connection the listener closed
# as it arrived (past its limit) without closing the pipe, whose request then waits for
# its whole timeout; the check finds such a pipe, closes it and the handshake tries again.
_HANDSHAKE_CHECK_S = 0.25


# -- frames: one copy into nng's message on send, none out of it on receive ------------------
_lib, _ffi = _nng.lib, _nng.ffi
# Frames at least this large are received without a copy: the caller gets a writable view
# of nng's own message, freed when the last view of it is collected. Smaller ones are
# copied into ``bytes`` (cheaper than keeping nng's message alive).
ZERO_COPY_MIN = 64 * 1024
# Frames larger than this travel as a header and pieces of this size, so that neither
# side ever holds a second copy of a large frame in nng's messages: the sender copies
# one piece at a time, the receiver copies each into the frame's one buffer.
PIECE = 4 << 20
# A receiver waiting for the next piece of a large frame gives up after this long without
# one (only when its receive has a timeout: with none, it waits as it was asked to; a
# reader thread has none).
PIECE_STALL_S = 60.0
_LARGE = struct.Struct("<8sQ")
_LARGE_TAG = b"FB\x00LARGE"[:8]

#: A received frame: ``bytes``, or a writable ``memoryview`` of a large one (no copy).
Frame = Union[bytes, memoryview]


def _send_frame(sock: pynng.Socket, handle: Any,
                frame: FramePart | list[FramePart]) -> None:
    """Send ``frame`` on ``sock`` (``handle``: its nng id, read once by the caller, as
    pynng builds a new one per read): bytes, or a list of byte-like parts sent as one frame.

    Parts are copied once, straight into nng's messages; they are never joined into
    an intermediate ``bytes`` (a large array is copied once on its way out, a piece at
    a time). The caller holds the connection's send lock: pieces of two frames must
    not interleave. (The commonest frame, ``bytes`` of up to ``PIECE``, the caller
    :meth:`_Reading.send` sends itself, without this call.)
    """
    if type(frame) is not list:
        # (one part: mypy narrows on ``type(x) is list`` only where it holds)
        frame = [frame]  # type: ignore[list-item]
    if len(frame) == 1 and type(frame[0]) is bytes and len(frame[0]) <= PIECE:
        check_err(_lib.nng_send(handle, frame[0], len(frame[0]), 0))
        return
    parts = [p if type(p) is bytes else memoryview(p).cast("B") for p in frame]
    total = sum(len(p) for p in parts)
    if total < ZERO_COPY_MIN:
        sock.send(b"".join(parts))
        return
    if total <= PIECE:
        _send_msg(sock, parts, total)
        return
    sock.send(_LARGE.pack(_LARGE_TAG, total))
    piece: list[memoryview] = []
    size = 0
    for part in parts:
        view = part if type(part) is memoryview else memoryview(part)
        while len(view):
            take = view[:PIECE - size]
            piece.append(take)
            size += len(take)
            view = view[len(take):]
            if size == PIECE:
                _send_msg(sock, piece, size)
                piece, size = [], 0
    if size:
        _send_msg(sock, piece, size)


def _send_msg(sock: pynng.Socket, parts: Sequence[bytes | memoryview], total: int) -> None:
    holder = _ffi.new("nng_msg **")
    check_err(_lib.nng_msg_alloc(holder, total))
    msg = holder[0]
    body = memoryview(_ffi.buffer(_lib.nng_msg_body(msg), total))
    offset = 0
    for part in parts:
        body[offset:offset + len(part)] = part
        offset += len(part)
    body.release()
    err = _lib.nng_sendmsg(sock.socket, msg, 0)
    if err:
        _lib.nng_msg_free(msg)  # nng owns it only when the send succeeded
        check_err(err)


def _drop_empty(msg: Any) -> None:
    """Free ``msg``, an empty message: no fibrl frame is empty, so one carries nothing
    (a peer speaking some other protocol); the receive goes on."""
    _lib.nng_msg_free(msg)
    log.debug("dropped an empty message (no fibrl frame is empty)")


def _frame_of(conn: "_Reading", msg: Any, size: int, stall: Optional[float]) -> Frame:
    """The frame on ``conn`` that starts with the received message ``msg``: ``bytes``
    when small, else a writable memoryview (of nng's message itself, or of the one
    buffer a frame sent in pieces was gathered in)."""
    body = _ffi.cast(_CHARS, _lib.nng_msg_body(msg))
    if size < ZERO_COPY_MIN:
        data: bytes = _ffi.unpack(body, size)
        _lib.nng_msg_free(msg)
        if size == _LARGE.size and data.startswith(_LARGE_TAG):
            return _gather(conn, _LARGE.unpack(data)[1], stall)
        return data
    body = _ffi.gc(body, lambda _body, msg=msg: _lib.nng_msg_free(msg), size)
    return memoryview(_ffi.buffer(body, size))


_NONBLOCK = _lib.NNG_FLAG_NONBLOCK
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL   # a polled descriptor closed
# Closing a socket wakes a thread that polls its descriptor; this bounds the wait anyway.
_POLL_MS = 5000
_AIO_TIMEOUT = {_lib.NNG_ETIMEDOUT, _lib.NNG_ECANCELED}
_NULL = _ffi.NULL
_CHARS = _ffi.typeof("char *")


def _recv_frame_nowait(conn: "_Reading") -> Optional[Frame]:
    """The next frame on ``conn`` if one is already here, else None."""
    holder = _ffi.new("nng_msg **")
    err = _lib.nng_recvmsg(conn._handle, holder, _NONBLOCK)
    if err == _lib.NNG_EAGAIN:
        return None
    check_err(err)
    msg = holder[0]
    size = _lib.nng_msg_len(msg)
    if not size:
        _drop_empty(msg)
        return _recv_frame_nowait(conn)   # (what came after it, if anything)
    return _frame_of(conn, msg, size, None)   # (a reader thread: no receive timeout)


class _Aio:
    """One thread's nng aio for receiving in that thread: a receive posted this way
    takes the message before nng marks the socket readable, so a reader thread that
    waits for readability (:class:`Channel`) is not woken for it."""

    __slots__ = ("aio", "busy", "thread", "posting", "cancelled", "ms", "stale", "spent")

    def __init__(self) -> None:
        self.aio = _new_aio()
        self.ms: Optional[int] = None   # the timeout set on the aio now (nng's ms)
        # The aio still points at the message its last receive handed out (which the
        # caller has freed since): cleared before the next receive is posted, not
        # after this one, so that a frame's way to the code that answers it makes one
        # nng call fewer. Nothing reads an aio's message between its receives.
        self.stale = False
        # The small message whose bytes :meth:`recv` copied out last: freed when the next
        # receive is posted, for the same reason.
        self.spent: Any = None
        self.busy = False   # a receive is posted on it, or its message not taken yet
        self.thread = threading.get_ident()   # the one thread that receives with it
        # Held while a receive is being posted. nng's cancel of an aio that its protocol
        # has begun but not yet scheduled (inside nng_recv_aio) ends the caller's wait
        # while the receive goes on: the aio stays queued on the socket, takes the next
        # frame for nobody (it is cleared by the next receive: lost), and posting it
        # again makes nng panic ("appending node already on a list"). A cancel from
        # another thread waits until the receive is posted, or finished.
        self.posting = threading.Lock()
        # A cancel was made during the receive in progress. One that lands just as nng
        # completes that receive (between its marking the aio done and its accounting
        # of the completion, on nng's thread) ends the wait early; the accounting that
        # follows then lands on whatever the aio does next: the next receive's wait
        # ends at once while that receive stays queued on the socket (its frame is
        # cleared by the one after: lost), or posting again makes nng panic. An aio
        # whose receive was cancelled and still ended with a frame, or ended with
        # neither a frame nor an error, is therefore retired (see _retire).
        self.cancelled = False

    def recv(self, conn: "_Reading", timeout: Optional[float],
             ready: Optional[Callable[[], bool]] = None) -> Optional[Frame]:
        """The next frame on ``conn``'s socket, or None when none came within ``timeout``
        seconds, or when :meth:`cancel` was called (or ``ready()`` was true once the
        receive was posted: a ``cancel`` just before it would have been missed)."""
        msg = self.take(conn._handle, timeout, ready)
        if msg is None:
            return None
        size = _lib.nng_msg_len(msg)
        if size >= ZERO_COPY_MIN or size == _LARGE.size:
            return _frame_of(conn, msg, size, None if timeout is None else PIECE_STALL_S)
        if not size:
            _drop_empty(msg)
            return None   # (the caller asks again unless what it waits for happened)
        # the common case, as _frame_of has it, without its call
        data: bytes = _ffi.unpack(_ffi.cast(_CHARS, _lib.nng_msg_body(msg)), size)
        spent, self.spent = self.spent, msg   # (freed by the next take; None here unless
        if spent is not None:                 # this receive ran inside another one)
            _lib.nng_msg_free(spent)
        return data

    def take(self, handle: Any, timeout: Optional[float],
             ready: Optional[Callable[[], bool]] = None) -> Any:
        """nng's next message on the socket whose id is ``handle`` (the caller frees it),
        or None, as :meth:`recv`."""
        if self.busy or self.thread != threading.get_ident():
            # Entered again before the receive in progress took its message: Python
            # code that ran inside it on this thread (a collection's callback, a signal
            # handler) receives too. Posting this aio again would make nng panic, or
            # drop the frame that the receive in progress got; a spare one is used.
            return _reentered(self, handle, timeout, ready)
        self.busy = True
        aio = self.aio
        try:
            if self.stale:
                _lib.nng_aio_set_msg(aio, _NULL)
                self.stale = False
            spent = self.spent
            if spent is not None:
                self.spent = None
                _lib.nng_msg_free(spent)
            ms = -1 if timeout is None else max(1, int(timeout * 1000))
            if ms != self.ms:
                _lib.nng_aio_set_timeout(aio, ms)
                self.ms = ms
            with self.posting:
                self.cancelled = False
                _lib.nng_recv_aio(handle, aio)
            if ready is not None and ready():
                self.cancelled = True
                _lib.nng_aio_cancel(aio)   # (this thread: the receive is posted, or done)
            _lib.nng_aio_wait(aio)
            # The aio keeps pointing at the message it received until it is cleared, and
            # the caller frees that message: a receive that ends with no error and no
            # message (nng ends one so at times when a peer is killed) must not hand it
            # out again. It was cleared before this receive was posted (``stale``), and
            # one that failed points at none; so a message there means it succeeded.
            msg = _lib.nng_aio_get_msg(aio)
            if msg == _NULL:
                err = _lib.nng_aio_result(aio)
                if err in _AIO_TIMEOUT and not self.cancelled:
                    return None   # (ended by its timeout: nng is done with the aio)
                if err and err not in _AIO_TIMEOUT:
                    check_err(err)
                # Nothing came, or it was cancelled: two cancels landing together can
                # end the wait before nng's accounting of the first is done, which would
                # then land on this aio's next receive.
                self._retire()
                return None   # (the caller asks again unless it has what it waits for)
            if self.cancelled:
                _lib.nng_aio_set_msg(aio, _NULL)   # (a retired aio's message is freed)
                self._retire()
            else:
                self.stale = True
        finally:
            self.busy = False
        return msg

    def cancel(self) -> None:
        """End the receive this aio waits for now, if any (from any thread)."""
        with self.posting:   # (never in the middle of posting one: see __init__)
            self.cancelled = True
            _lib.nng_aio_cancel(self.aio)

    def _retire(self) -> None:
        """Go on with a new nng aio. The old one may still have nng's accounting of its
        completion to come, or (ended with neither frame nor error) still be queued on
        the socket: it is cancelled (which takes it off the socket's queue) and freed
        only ``_RETIRED_S`` later, when nng is long done with it."""
        fresh = _new_aio()
        with self.posting:
            old, self.aio = self.aio, fresh
            self.ms = None
        _lib.nng_aio_cancel(old)
        _retired_add(old)

    def __del__(self, _free: Callable[[Any], None] = _lib.nng_aio_free,
                _free_msg: Callable[[Any], None] = _lib.nng_msg_free,
                _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # (at exit a daemon thread may still wait on it; None: freed already)
        if self.aio is not None and not (_nng_down or _finalizing()):
            _free(self.aio)
            if self.spent is not None:
                _free_msg(self.spent)


def _new_aio() -> Any:
    holder = _ffi.new("nng_aio **")
    check_err(_lib.nng_aio_alloc(holder, _ffi.NULL, _ffi.NULL))
    return holder[0]


_ACCEPT_EXIT_S = 2.0   # how long a listener's close waits for its accept thread to stop
_RETIRED_S = 5.0   # how long a retired aio waits before it is freed (nng needs microseconds)
_retired: collections.deque[tuple[float, Any]] = collections.deque()   # (when, aio), oldest first
_retired_lock = threading.Lock()


def _retired_add(aio: Any) -> None:
    """Keep ``aio`` (retired by :meth:`_Aio._retire`) for ``_RETIRED_S``; free those
    retired longer ago."""
    now = time.monotonic()
    with _retired_lock:
        _retired.append((now, aio))
        while _retired and now - _retired[0][0] >= _RETIRED_S and not _nng_down:
            _, old = _retired.popleft()
            msg = _lib.nng_aio_get_msg(old)
            if msg != _ffi.NULL:   # (a frame the queued receive took before its cancel)
                log.error("a frame received by a receive that had already ended was "
                          "dropped; the connection it came on may have lost it")
                _lib.nng_msg_free(msg)   # (nng_aio_free leaves an aio's message alone)
            _lib.nng_aio_free(old)


_aios = threading.local()
_reentries = 0


def _handshake_bytes(aio: _Aio, conn: "_Reading", timeout: Optional[float],
                     ready: Callable[[], bool]) -> Optional[bytes]:
    """:meth:`_Aio.recv` for what an unauthenticated sender says: the message's bytes as
    they came (at most ``HANDSHAKE_MAX_SIZE`` of them), never read as a frame header."""
    msg = aio.take(conn._handle, timeout, ready)
    if msg is None:
        return None
    size = min(_lib.nng_msg_len(msg), HANDSHAKE_MAX_SIZE)
    data: bytes = _ffi.unpack(_ffi.cast(_CHARS, _lib.nng_msg_body(msg)), size)
    _lib.nng_msg_free(msg)
    return data


def _reentered(outer: _Aio, handle: Any, timeout: Optional[float],
               ready: Optional[Callable[[], bool]]) -> Any:
    """A receive on a thread whose own aio is in use by a receive in progress: on an aio
    of its own (the first such case logs where it came from)."""
    global _reentries
    _reentries += 1
    if _reentries == 1:
        log.warning("a receive started inside another on the same thread, or on another "
                    "thread's aio (it uses an aio of its own); where it came from:",
                    stack_info=True)
    spare = _Aio()
    try:
        return spare.take(handle, timeout, ready)
    finally:
        _lib.nng_aio_free(spare.aio)
        spare.aio = None


def _thread_aio() -> _Aio:
    try:
        aio: _Aio = _aios.aio
    except AttributeError:
        aio = _aios.aio = _Aio()
    return aio


def _gather(conn: "_Reading", total: int, stall: Optional[float]) -> memoryview:
    """The rest of a frame sent in pieces, ``total`` bytes: the pieces follow each other
    (no receive timeout splits them), but a sender stopped mid-frame (frozen, cut off)
    does not hold the receiver longer than ``stall`` seconds without a piece (None: no
    limit, for a receive that has none). A wake of this thread meanwhile (a cancel of
    its aio) is not the end of the frame: the receive goes on."""
    frame = memoryview(bytearray(total))
    offset = 0
    aio = _thread_aio()
    if not conn._enter(aio):
        raise pynng.Closed("closed", _lib.NNG_ECLOSED)
    try:
        progress = time.monotonic()
        while offset < total:
            left = None if stall is None else progress + stall - time.monotonic()
            if left is not None and left <= 0:
                raise FrameStalled(
                    f"the peer sent {offset} of a {total}-byte frame, then nothing for "
                    f"{stall:g} s (frozen or cut off); the connection is dropped, as the "
                    f"rest of that frame cannot be told from what follows")
            msg = aio.take(conn._handle, left, conn._is_closed)
            if msg is None:
                if conn.closed:
                    raise pynng.Closed("closed", _lib.NNG_ECLOSED)
                continue
            progress = time.monotonic()
            size = _lib.nng_msg_len(msg)
            try:
                if size > total - offset:
                    raise TransportError(f"a frame announced as {total} bytes came with "
                                         f"more; the peer is broken")
                frame[offset:offset + size] = _ffi.buffer(_lib.nng_msg_body(msg), size)
            finally:
                _lib.nng_msg_free(msg)
            offset += size
    finally:
        conn._leave(aio)
    return frame


class FrameStalled(TransportError):
    """A large frame stopped arriving midway (see :data:`PIECE_STALL_S`)."""


def _mac(secret: bytes, role: bytes, data: bytes) -> bytes:
    return hmac.new(secret, role + data, hashlib.sha256).digest()


def tcp_address(host: str, port: int, scheme: str = "tcp") -> str:
    """The nng URL of ``host:port``; an IPv6 host is bracketed (nng refuses ``tcp://::1:0``).

    Example:
        >>> tcp_address("10.0.0.5", 0), tcp_address("fd00::5", 7000), tcp_address("[::1]", 0)
        ('tcp://10.0.0.5:0', 'tcp://[fd00::5]:7000', 'tcp://[::1]:0')
    """
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _address_of(sock: pynng.Socket, scheme: str) -> str:
    # pynng's SockAddr.port has the wrong byte order; str() is right.
    return f"{scheme}://" + str(sock.listeners[0].local_address)


def _scheme(tls: bool) -> str:
    return "tls+tcp" if tls else "tcp"


def _default_max_pending() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_PENDING
    return max(4, min(MAX_PENDING, soft // _NOFILE_SHARE))


@functools.lru_cache(maxsize=4)
def run_certificate(secret: bytes) -> tuple[str, str]:
    """The run's TLS certificate and key (PEM), derived from its secret.

    Every process of a run derives the same key from the secret it already has,
    so TLS needs nothing more handed to workers, and a process without the
    secret can neither present the certificate nor impersonate a listener.
    Needs the ``cryptography`` package (``pip install fibrl[tls]``).
    """
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:
        raise TransportError(
            "tls=True needs the cryptography package, which is not installed. "
            "Install it with `pip install fibrl[tls]` (in the worker image too).") from exc
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # P-256's n
    value = int.from_bytes(_mac(secret, b"fibrl tls key", b""), "big") % (order - 1) + 1
    key = ec.derive_private_key(value, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fibrl")])
    serial = int.from_bytes(_mac(secret, b"fibrl tls serial", b"")[:16], "big") >> 1
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(serial)
            .not_valid_before(datetime.datetime(2000, 1, 1))
            .not_valid_after(datetime.datetime(2099, 12, 31))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("fibrl")]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem


def _tls_config(secret: bytes, server: bool) -> pynng.TLSConfig:
    cert, key = run_certificate(secret)
    mode = pynng.TLSConfig.MODE_SERVER if server else pynng.TLSConfig.MODE_CLIENT
    return pynng.TLSConfig(mode, server_name=None if server else "fibrl", ca_string=cert,
                           own_cert_string=cert, own_key_string=key,
                           auth_mode=pynng.TLSConfig.AUTH_MODE_REQUIRED)


# nng starts its thread pools with the process's first socket, sized by default for a
# busy server (several task, expire and resolver threads). A worker needs few: it
# talks to its parent and the few peers it uses. ``set_nng_threads`` sizes them, and
# FIBRL_NNG_THREADS="task,expire,poller,resolver" overrides it for any process.
_NNG_PARAMS = (("task", "NNG_INIT_NUM_TASK_THREADS", "NNG_INIT_MAX_TASK_THREADS"),
               ("expire", "NNG_INIT_NUM_EXPIRE_THREADS", "NNG_INIT_MAX_EXPIRE_THREADS"),
               ("poller", "NNG_INIT_NUM_POLLER_THREADS", "NNG_INIT_MAX_POLLER_THREADS"),
               ("resolver", "NNG_INIT_NUM_RESOLVER_THREADS", None))
WORKER_NNG_THREADS = {"task": 2, "expire": 1, "poller": 1, "resolver": 1}
_nng_started = False


def _threads_from_env() -> Optional[dict[str, int]]:
    text = os.environ.get("FIBRL_NNG_THREADS", "").strip()
    if not text:
        return None
    try:
        counts = [int(part) for part in text.split(",")]
        if len(counts) != len(_NNG_PARAMS) or min(counts) < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"FIBRL_NNG_THREADS={text!r} is not four positive counts; set it "
                         f"to 'task,expire,poller,resolver', e.g. '2,1,1,1', or unset it") from None
    return dict(zip((name for name, _, _ in _NNG_PARAMS), counts))


def set_nng_threads(counts: Optional[dict[str, int]] = None) -> bool:
    """Size nng's thread pools for this process; False once nng has started (too late).

    ``counts`` maps task/expire/poller/resolver to a thread count; FIBRL_NNG_THREADS wins.
    """
    counts = _threads_from_env() or counts
    if _nng_started:
        return False
    if not counts:
        return True
    lib = pynng.lib
    for name, num, most in _NNG_PARAMS:
        if name not in counts:
            continue
        value = int(counts[name])
        if value < 1:
            raise ValueError(f"nng {name} threads must be at least 1, not {value}")
        lib.nng_init_set_parameter(getattr(lib, num), value)
        if most is not None:
            lib.nng_init_set_parameter(getattr(lib, most), value)
    return True


def _make(kind: type, secret: bytes, tls: bool, server: bool,
          **options: Any) -> pynng.Socket:
    global _nng_started
    if not _nng_started:
        set_nng_threads()   # FIBRL_NNG_THREADS, if set, before nng starts
        _nng_started = True
    sock = _closed_apart(kind)(**options)
    if tls:
        sock.tls_config = _tls_config(secret, server)
    return sock


class _ClosedApart:
    """Mixed into every nng socket fibrl makes: one that is collected unclosed is closed
    on a short-lived thread of its own, never by the thread that collects it.

    pynng closes a socket in ``__del__``, on whichever thread the collection happens to
    run, and ``nng_close`` waits until nng's reaper thread has removed the socket's
    connections. A collection on the reaper thread itself (a pipe callback allocates, so
    it may collect) or on a thread that holds a lock a pipe callback waits for would then
    never return, and every later connection of the process would wait behind it."""

    _closing = False

    def close(self) -> None:
        self._closing = True
        super().close()  # type: ignore[misc]

    def __del__(self) -> None:
        if self._closing or _nng_down or not hasattr(self, "_socket"):
            return   # (closed; at exit nng is shut down; or its constructor failed)
        self._closing = True
        _call_soon(self.close)   # (the thread holds the socket until it is closed)


_closed_apart_kinds: dict[type, type] = {}


def _closed_apart(kind: type) -> type:
    """``kind`` (a pynng socket class) with :class:`_ClosedApart` mixed in."""
    made = _closed_apart_kinds.get(kind)
    if made is None:
        made = _closed_apart_kinds[kind] = type(kind.__name__, (_ClosedApart, kind), {})
    return made


class _DropLog:
    """Logs dropped or refused peers once each, at most ``_LOG_BURST`` per window."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._count = 0
        self._suppressed = 0

    def __call__(self, remote: object, reason: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._window_start > _LOG_WINDOW:
                suppressed, self._suppressed = self._suppressed, 0
                self._window_start, self._count = now, 0
                if suppressed:
                    log.warning("%s: %d more peers were dropped in the last %.0f s (not "
                                "logged one by one)", self._where, suppressed, _LOG_WINDOW)
            self._count += 1
            if self._count > _LOG_BURST:
                self._suppressed += 1
                return
        log.warning("%s: dropped peer %s: %s", self._where, remote, reason)


# Remote addresses of the connections a gate handed on, by nng pipe id (nng's socket
# transport, which carries them, cannot tell a pipe's remote address).
_gate_addresses: dict[int, str] = {}


def _remote(pipe: Optional[pynng.Pipe]) -> str:
    if pipe is None:
        return "?"
    known = _gate_addresses.get(pipe.id)
    if known is not None:
        return known
    try:
        return str(pipe.remote_address)
    except pynng.NNGException:
        return "?"


class _Door:
    """Turns the TCP connections a :class:`~fibrl.wire.gate.Gate` hands on into connections of
    one nng socket (through nng's ``socket://`` transport, which takes a connected
    descriptor), remembering each one's remote address for the log.

    Each ``socket://`` listener has at most one hand-off in flight, so the pipe it makes
    is known to be that connection's; a few listeners serve a socket.
    """

    _MOST = 8        # socket:// listeners per nng socket
    _STALE = 2.0     # s after which a hand-off that made no pipe frees its listener

    def __init__(self, sock: pynng.Socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._idle: list[pynng.Listener] = []
        self._busy: dict[int, tuple[Any, str, float]] = {}   # listener id -> (l, addr, since)
        self._made = 0
        # registered before the owner's callbacks, so they can already name the peer
        sock.add_pre_pipe_connect_cb(self._connected)
        sock.add_post_pipe_remove_cb(self._removed)

    def hand(self, conn: socket.socket, address: str) -> bool:
        now = time.monotonic()
        with self._lock:
            for lid, (lst, _, since) in list(self._busy.items()):
                if now - since > self._STALE:   # its peer left during nng's negotiation
                    del self._busy[lid]
                    self._idle.append(lst)
            if self._idle:
                lst = self._idle.pop()
            elif self._made < self._MOST:
                lst, self._made = None, self._made + 1
            else:
                return False
        if lst is None:
            lst = self._sock.listen("socket://")
        lid = _lib.nng_listener_id(lst.listener)
        with self._lock:
            self._busy[lid] = (lst, address, now)
        rv = _lib.nng_listener_set_int(lst.listener, b"socket:fd", conn.fileno())
        if rv == 0:
            conn.detach()   # nng owns the descriptor now
            return True
        with self._lock:
            self._busy.pop(lid, None)
            self._idle.append(lst)
        if rv == _lib.NNG_ENOSPC:
            return False
        check_err(rv)
        return False

    def _connected(self, pipe: pynng.Pipe) -> None:
        lid = _lib.nng_listener_id(_lib.nng_pipe_listener(pipe.pipe))
        with self._lock:
            entry = self._busy.pop(lid, None)
            if entry is not None:
                self._idle.append(entry[0])
        if entry is not None:
            _gate_addresses[pipe.id] = entry[1]

    def _removed(self, pipe: pynng.Pipe) -> None:
        _gate_addresses.pop(pipe.id, None)

    @property
    def in_flight(self) -> int:
        """Connections handed to nng that are not pipes of the socket yet (one whose peer
        left during nng's negotiation stops counting after ``_STALE`` seconds)."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for _, _, since in self._busy.values() if now - since <= self._STALE)


class _OnePipe:
    """A socket that serves its first connection only: later ones are refused, and
    only the removal of that first connection closes the socket (so a stranger who
    connects too cannot end it)."""

    def __init__(self, sock: pynng.Socket, refused: Callable[[str, str], None],
                 close: Callable[[], None]) -> None:
        self._sock = sock
        self._refused = refused
        self._close = close
        self._lock = threading.Lock()
        self.pipe_id: Optional[int] = None
        sock.add_pre_pipe_connect_cb(self._pre_connect)
        sock.add_post_pipe_remove_cb(self._removed)

    def _pre_connect(self, pipe: pynng.Pipe) -> None:
        with self._lock:
            if self.pipe_id is None:
                self.pipe_id = pipe.id
                return
        self._refused(_remote(pipe), "a second connection to a one-peer socket")
        _close_pipe(pipe)   # allowed here: nng then reports neither its connect nor its removal

    def _removed(self, pipe: pynng.Pipe) -> None:
        if pipe.id == self.pipe_id:
            _call_soon(self._close)


# The aio of each thread that reads a socket's frames itself (read_here), by thread id,
# entered, cancelled and left under the lock: a wake meant for one wait never reaches
# another receive of that thread (a later one, a channel's recv_here). The aio is the
# thread's own for its whole life: nng is never asked to free one it may still hold.
_waiting: dict[int, _Aio] = {}
_waiting_lock = threading.Lock()


def wake_reader(ident: int) -> None:
    """End the wait of thread ``ident`` in :meth:`_Reading.read_here`, if it waits there:
    what it waited for happened elsewhere (another thread, another peer)."""
    if ident == threading.get_ident():
        return   # a thread that wakes itself is not inside read_here: nothing to end
    with _waiting_lock:
        aio = _waiting.get(ident)
        if aio is not None:
            aio.cancel()


class _Reading:
    """How the threads of a process read one data socket (a :class:`Peer`'s or a
    :class:`Channel`'s): one thread at a time, the one holding :attr:`lead`. A thread
    that waits for what the socket carries reads it itself (:meth:`read_here`); the
    connection's reader thread reads only while nobody does, sleeping until the socket
    is readable (:meth:`wait_readable`), which nng does not signal for a frame that a
    waiting thread's receive takes."""

    _sock: pynng.Socket
    _handle: Any         # _sock's nng id (pynng's ``socket``), read once
    closed: bool
    shared = True        # other threads may read_here (False: its reader thread only)
    _poll: select.poll   # made by _watch(), before any wait_readable()
    _send_lock: threading.Lock
    wake = staticmethod(wake_reader)   # (for a caller that imports no transport)

    def silence(self) -> Optional[float]:
        """Seconds since this connection last received any bytes (a frame still arriving
        counts), from the kernel's TCP state; None where that is unknown (not Linux, or
        the connection is gone). A frame of gigabytes can take longer than a liveness
        limit to arrive, and what is sent after it (an answer to a ping) waits behind
        it: a connection that keeps receiving has a live peer."""
        pipes = self._sock.pipes
        if not pipes:
            return None
        local: Optional[str] = None   # (a gate's hand-off: nng knows neither end, the
        try:                          # gate the remote one)
            address = pipes[0].local_address
            if address.family == _lib.NNG_AF_INET:
                local = str(address)
        except pynng.NNGException:
            pass
        return tcp_silence(local, _remote(pipes[0]))

    def _readable_init(self) -> None:
        self.lead = threading.Lock()   # held by the thread that reads the frames now
        # nng 1.11 can abort the process (its timer thread locks a mutex of the freed
        # socket) or leave the receive waiting for good when a socket is closed while
        # another thread receives on it with a timeout, most often just after its
        # connection went. So every blocking receive on the socket is posted on an aio
        # listed here while it is in progress (_enter, _leave); close() cancels those,
        # and the nng close is left to the last receiver out. No lock on this path: a
        # receiver lists itself, then looks at ``closed``; close() sets ``closed``, then
        # looks at the list (list.append, list.remove and attribute writes are atomic
        # under the GIL), so either the receiver backs out or close() sees it.
        self._receiving: list[_Aio] = []
        self._shut = threading.Lock()   # taken by whoever closes the socket: once

    def _enter(self, aio: _Aio) -> bool:
        """List a receive about to be posted on ``aio``; False once closed."""
        self._receiving.append(aio)
        if self.closed:
            self._leave(aio)
            return False
        return True

    def _leave(self, aio: _Aio) -> None:
        self._receiving.remove(aio)
        if self.closed and not self._receiving:
            self._shut_socket()

    def _shut_socket(self) -> None:
        if not self._shut.acquire(blocking=False):
            return
        me = threading.current_thread()
        with _soon_lock:   # (so that exit waits for this close: see _finish_pipe_events)
            if _nng_down:
                return     # at exit: nng objects are left to the process's end
            _soon.add(me)
        try:
            self._sock.close()   # (closes the descriptor the reader thread polls: it wakes)
        finally:
            with _soon_lock:
                _soon.discard(me)

    def _is_closed(self) -> bool:
        return self.closed

    def _receive_once(self, aio: _Aio, timeout: Optional[float],
                      ready: Callable[[], bool]) -> Optional[Frame]:
        """One receive on ``aio``, listed while it is in progress (not while the frame is
        handled: a handler may send, and a send blocked on a lost connection ends only
        with the socket's close). Raises pynng.Closed once this end is closed."""
        if not self._enter(aio):
            raise pynng.Closed("closed", _lib.NNG_ECLOSED)
        try:
            return aio.recv(self, timeout, ready)
        finally:
            self._leave(aio)

    def _receive(self, timeout: Optional[float],
                 read: Callable[..., Optional[Frame]] = _Aio.recv) -> Optional[Frame]:
        """The next frame, received in this thread (``read``: how a message is made one);
        None after ``timeout`` seconds (None: no limit). Raises pynng.Closed once this
        end is closed, here or elsewhere."""
        aio = _thread_aio()
        receiving = self._receiving
        receiving.append(aio)   # (_enter and _leave, inlined: once per frame on this path)
        try:
            if self.closed:
                raise pynng.Closed("closed", _lib.NNG_ECLOSED)
            start = time.monotonic()
            left = timeout
            closed = self._is_closed
            while True:
                frame = read(aio, self, left, closed)
                if frame is not None:
                    return frame
                if self.closed:
                    raise pynng.Closed("closed", _lib.NNG_ECLOSED)
                if timeout is not None:   # (else a wake or an empty frame: go on)
                    left = start + timeout - time.monotonic()
                    if left <= 0:
                        return None
        finally:
            receiving.remove(aio)
            if self.closed and not receiving:
                self._shut_socket()

    def _watch(self) -> None:
        """Make nng's readable descriptor (two descriptors): raises NNGException (out
        of descriptors) here, rather than in the reader thread."""
        poll = select.poll()
        poll.register(self._sock.recv_fd, select.POLLIN)
        self._poll = poll

    def wait_readable(self) -> bool:
        """Sleep until a frame waits to be received (True, or after a while) or the
        socket is closed (False)."""
        events = self._poll.poll(_POLL_MS)
        return not self.closed and not any(event & _GONE for _, event in events)

    def read_here(self, ready: Callable[[], bool], timeout: Optional[float],
                  on_frame: Callable[[Frame], None]) -> bool:
        """Read frames in the calling thread, handing each to ``on_frame`` as the reader
        thread would, until ``ready()`` (whichever thread makes it true elsewhere calls
        :func:`wake_reader`) or ``timeout`` seconds. Returns False at once when another
        thread reads now. A broken socket is closed (the reader thread reports it)."""
        if self.closed or not self.shared or not self.lead.acquire(False):
            return False
        me = threading.get_ident()
        aio = _thread_aio()
        with _waiting_lock:
            # (a frame handler of an outer read_here of this thread may read here too:
            # the same aio, entered once, left by the outer call)
            nested = me in _waiting
            _waiting[me] = aio

        def done() -> bool:
            return self.closed or ready()

        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                data = self._receive_once(aio, left, done)
                if data is not None:
                    on_frame(data)
        except (pynng.NNGException, TransportError):
            self.close()
        except MemoryError:
            log.error("%r received a message larger than this process can allocate; "
                      "closing it", self)
            self.close()
        except Exception:
            # as the reader thread does: the connection goes, and the caller's wait goes
            # on (an exception out of here would leave its request parked, unanswered)
            log.exception("%r: a frame could not be read or handled; closing it", self)
            self.close()
        finally:
            if not nested:
                with _waiting_lock:
                    del _waiting[me]
            self.lead.release()
        return True

    def send(self, frame: FramePart | list[FramePart]) -> None:
        """Send one frame: a bytes-like object, or a list of them sent as one frame
        (each copied once, never joined first). Raises :class:`ChannelClosed` when the
        other end is gone."""
        if _faults is not None and _faults.take(self, frame):
            return   # a test's fault seam dropped, held or cut it (fibrl.wire.faults)
        try:
            with self._send_lock:
                if type(frame) is bytes and len(frame) <= PIECE:   # the commonest frame
                    err = _lib.nng_send(self._handle, frame, len(frame), 0)
                    if err:
                        check_err(err)
                else:
                    _send_frame(self._sock, self._handle, frame)
        except pynng.NNGException as exc:
            raise ChannelClosed(self._gone(exc)) from exc

    def _gone(self, exc: Exception) -> str:
        raise NotImplementedError

    def close(self) -> None:
        """Close this end of the connection; the other end sees it as lost. A receive in
        progress on another thread is ended first (see _readable_init)."""
        self.closed = True
        receiving = tuple(self._receiving)
        for aio in receiving:
            aio.cancel()
        if not self._receiving:
            self._shut_socket()


class Peer(_Reading):
    """The server side of one authenticated connection.

    One thread at a time reads its frames (it holds the *lead*) and runs the frame
    handler on each. A handler about to run something that may last takes
    :meth:`offload`: calling what it returns (from any thread: a timer) while that
    frame is still being handled starts a new reader thread, hands it the lead, and
    the busy one stops reading once its handler returns. Frames keep their order: a
    new reader starts only while the old one is inside the handler, never while it
    receives.

    A thread of this process that waits for something this peer sends may read and
    handle the frames itself meanwhile (:class:`_Reading`).
    """

    def __init__(self, sock: pynng.Pair1, peer_id: int) -> None:
        self._sock = sock
        self._handle = sock.socket   # (nng's id of it: pynng makes one per attribute read)
        self._send_lock = threading.Lock()
        self.id = peer_id
        self.closed = False
        self.context: dict[Any, Any] = {}  # per-connection state kept by the frame handler
        self.thread: Optional[threading.Thread] = None   # the reader now
        self.port: Optional[Port] = None   # its data port at the gate, until connected
        self._reader = 0                   # generation of the reader thread now
        self._busy: Optional[int] = None   # the generation handling a frame now, if any
        self._state = threading.Lock()
        self._new_reader: Optional[Callable[[int], threading.Thread]] = None
        self._readable_init()

    def offload(self) -> Callable[[], bool]:
        """Called by the frame handler: a function that lets another thread read the
        next frames if this one is still handling its frame (True when it did)."""
        return functools.partial(self._hand_off, self._reader)

    def _hand_off(self, generation: int) -> bool:
        with self._state:
            if self._busy != generation or self._reader != generation or self.closed:
                return False
            new_reader = self._new_reader
            assert new_reader is not None   # (set before the peer's first frame is read)
            self._reader = generation + 1
            self._busy = None
            self.lead.release()   # the busy reader's: it reads no more
            self.thread = new_reader(self._reader)
        return True

    def _handling(self, generation: int, busy: bool) -> bool:
        """Mark reader ``generation`` busy with a frame, or done with it; False once it
        is done and another thread reads instead."""
        with self._state:
            if busy:
                self._busy = generation
                return True
            if self._busy == generation:
                self._busy = None
            return self._reader == generation

    def _gone(self, exc: Exception) -> str:
        return f"peer {self.id} is gone ({exc})"

    def __repr__(self) -> str:
        return f"<Peer {self.id}>"


FrameHandler = Callable[[Peer, Frame], None]
LossHandler = Callable[[Peer], None]


class _Pending:
    """A connection to a listener's accept socket, not authenticated (yet)."""

    __slots__ = ("pipe", "connected", "since", "answering", "silence")

    def __init__(self, pipe: pynng.Pipe, now: float) -> None:
        self.pipe = pipe
        self.connected = now     # for the auth_timeout every connection has
        self.since = now         # since when the listener waits for it to speak
        self.answering = False   # its request is being answered now
        self.silence = 0.0       # the longest it made the listener wait so far


class Listener:
    """Accepts authenticated peers and hands their frames to ``on_frame``.

    Why one class of this size: a connection's admission is one sequence over one set
    of counts (accepted on the accept socket, answered a challenge, sent its ticket,
    given a data socket, checked its token, then a :class:`Peer`), and the limit on
    connections that have not finished it spans every step, so that a stranger
    holds at most ``max_pending`` of them whichever step it stalls in. The bytes
    before nng's header are :class:`~fibrl.wire.gate.Gate`'s, and an admitted
    connection is its :class:`Peer`'s.

    Args:
        host: interface to bind (``127.0.0.1`` unless workers run elsewhere).
        secret: the run's shared secret.
        on_frame: called in the peer's reader thread with each frame.
        on_lost: called once when an authenticated peer disconnects.
        auth_timeout: seconds a peer has to authenticate; also how long a connection
            that has not authenticated may stay idle.
        port: port of the accept socket (0: any free port; a manager may fix one).
        tls: encrypt and require the run's certificate (``tls+tcp://`` addresses).
        max_pending: unauthenticated connections held at most (None: 64, or an eighth
            of the descriptor limit if that is less); more wait for a slot.
        shared: other threads of this process may read a peer's frames themselves
            (:meth:`Peer.read_here`, as the hub's calls do). False: only the peer's
            reader thread reads them, waiting inside its receive (one wake-up fewer
            per frame, no readiness descriptors); ``read_here`` then returns False.

    Example:
        >>> lst = Listener("127.0.0.1", b"k", on_frame=lambda p, d: p.send(d))
        >>> ch = Channel.connect(lst.address, b"k"); ch.send(b"x"); ch.recv(5)
        b'x'
    """

    def __init__(self, host: str, secret: bytes, *, on_frame: FrameHandler,
                 on_lost: Optional[LossHandler] = None, auth_timeout: float = 10.0,
                 port: int = 0, tls: bool = False,
                 max_pending: Optional[int] = None, shared: bool = True) -> None:
        self._host = host
        self._shared = shared
        self._secret = secret
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._auth_timeout = auth_timeout
        self._tls = tls
        self._key = os.urandom(32)          # signs this listener's tickets
        self._used: dict[bytes, float] = {}  # ticket -> when it expires
        self._max_pending = max_pending or _default_max_pending()
        self._grace = min(IDLE_GRACE, auth_timeout / 2)   # the least; see _idle_grace
        # (when, longest silence in its handshake) of the peers that authenticated lately
        self._silences: collections.deque[tuple[float, float]] = collections.deque(maxlen=64)
        self._pipes: dict[int, _Pending] = {}   # the accept socket's connections, by id
        self._dropped = _DropLog(f"listener on {host}")
        self._lock = threading.Lock()
        self._accept = _make(pynng.Rep0, secret, tls, True,
                             recv_max_size=HANDSHAKE_MAX_SIZE)
        # the accept thread's receive: while it is in progress, no request waits for us
        self._receive: Optional[Any] = _new_aio()
        # held while that receive is posted; close() cancels it under it, so the accept
        # socket is never closed under a receive (see _Reading._readable_init)
        self._posting = threading.Lock()
        # Plaintext: a gate owns the TCP ports and hands nng only connections that sent
        # nng's header (nng's TLS transport cannot take a descriptor: it listens itself).
        self._gate: Optional[Gate] = None
        self._door: Optional[_Door] = None   # (set with the gate)
        door: Optional[_Door] = None
        if not tls:
            self._gate = Gate(f"{host}:{port}", refused=self._refused,
                              max_pending=self._max_pending, others=lambda: self.pending,
                              evict=self._evict_idle,
                              header_timeout=min(auth_timeout, HEADER_TIMEOUT),
                              grace=self._grace)
            door = self._door = _Door(self._accept)
        self._accept.add_pre_pipe_connect_cb(self._accept_pipe_added)
        self._accept.add_post_pipe_remove_cb(self._accept_pipe_removed)
        try:
            if self._gate is not None and door is not None:
                opened = self._gate.open(host, port, expect=sp_header(_REQ0), hand=door.hand)
                self.address = tcp_address(opened.host, opened.port)
            else:
                self._accept.listen(tcp_address(host, port, _scheme(tls)))
                self.address = _address_of(self._accept, _scheme(tls))
        except (pynng.NNGException, OSError) as exc:
            if self._gate is not None:
                self._gate.close()
            self._accept.close()
            _lib.nng_aio_free(self._receive)
            self._receive = None
            raise TransportError(
                f"cannot listen on {host}: {exc}. Set listen_host to an address of this "
                f"machine that workers can reach (fibrl.init(listen_host=...)).") from exc
        self._dropped = _DropLog(f"listener {self.address}")
        self._peers: dict[int, Peer] = {}
        self._opening: dict[int, Peer] = {}   # authenticated, data connection not yet up
        self._stop = threading.Event()
        self._next_id = 0
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"fibrl-accept-{self.address}")
        self._thread.start()
        self._janitor = threading.Thread(target=self._drop_idle, daemon=True,
                                         name=f"fibrl-idle-{self.address}")
        self._janitor.start()

    def _refused(self, remote: str, reason: str) -> None:
        self._dropped(remote, reason)   # (the log is named once the address is known)

    # -- the accept socket: strangers are answered at once and never waited for ----
    def _accept_pipe_added(self, pipe: pynng.Pipe) -> None:
        # Without TLS the gate admits no more than max_pending; the bound here is for
        # nng's own accepting (TLS), and a margin for hand-offs the gate counted as done.
        limit = self._max_pending + (_Door._MOST if self._gate is not None else 0)
        now = time.monotonic()
        with self._lock:
            self._pipes[pipe.id] = _Pending(pipe, now)
            full = len(self._pipes) > limit
        if not full:
            return
        if self._evict_idle(1, soon=True):
            return
        with self._lock:
            self._pipes.pop(pipe.id, None)
        self._dropped(_remote(pipe), f"{self._max_pending} connections are pending "
                      "authentication and none of them is idle; the new one is refused "
                      "(its peer tries again)")
        _close_pipe(pipe)   # (allowed in this callback: nng reports no removal then)

    def _accept_pipe_removed(self, pipe: pynng.Pipe) -> None:
        with self._lock:
            self._pipes.pop(pipe.id, None)

    def _evict_idle(self, most: int, soon: bool = False) -> int:
        """Close up to ``most`` connections that have been idle for the grace period,
        oldest first, to make room for newer ones; returns how many. Idle: the accept
        thread waits for a request now (none is queued for it) and the connection has
        sent nothing since it connected or since its last answer. ``soon``: called in an
        nng callback, where another pipe is closed by a short-lived thread."""
        now = time.monotonic()
        with self._lock:
            if self._receive is None or not _lib.nng_aio_busy(self._receive):
                return 0   # a request is being answered: others may be queued behind it
            grace = self._idle_grace(now)
            idle = sorted((p for p in self._pipes.values()
                           if not p.answering and now - p.since >= grace),
                          key=lambda p: p.since)[:most]
            for each in idle:
                del self._pipes[each.pipe.id]
        for each in idle:
            self._dropped(_remote(each.pipe), f"sent nothing for {now - each.since:.1f} s "
                          f"while {self._max_pending} connections are pending "
                          "authentication and newer ones wait; it is closed for one of them")
            if soon:
                _call_soon(functools.partial(_close_pipe, each.pipe))
            else:
                _close_pipe(each.pipe)
        return len(idle)

    def _idle_grace(self, now: float) -> float:
        """How long a pending connection may stay silent before it counts as idle (lock
        held): see the module's docstring."""
        lately = [silence for when, silence in self._silences if now - when < _SILENCE_WINDOW]
        return min(self._auth_timeout / 2, max([self._grace] + [2 * s for s in lately]))

    def _drop_idle(self) -> None:
        while not self._stop.wait(self._auth_timeout / 2):
            deadline = time.monotonic() - self._auth_timeout
            with self._lock:
                idle = [p.pipe for p in self._pipes.values() if p.connected < deadline]
                for pipe in idle:
                    self._pipes.pop(pipe.id, None)
            for pipe in idle:
                self._dropped(_remote(pipe), f"idle for auth_timeout={self._auth_timeout} s "
                              "without authenticating")
                _close_pipe(pipe)

    @property
    def pending(self) -> int:
        """Connections to the accept socket now open or being handed to it (none
        authenticated)."""
        door = self._door
        handing = door.in_flight if door is not None else 0
        with self._lock:
            return len(self._pipes) + handing

    def _accept_loop(self) -> None:
        try:
            while True:
                try:
                    data, pipe_id = self._next_request()
                except pynng.NNGException:
                    return  # closed
                with self._lock:
                    held = self._pipes.get(pipe_id)
                    if held is not None:
                        held.answering = True
                        held.silence = max(held.silence, time.monotonic() - held.since)
                reply = self._answer(data, None if held is None else held.pipe)
                try:
                    self._accept.send(reply)
                except pynng.NNGException:
                    if self._closed:
                        return
                if held is not None:
                    now = time.monotonic()
                    with self._lock:
                        held.answering, held.since = False, now
                        if reply.startswith(_ADDR):   # authenticated: how slow it was
                            self._silences.append((now, held.silence))
        finally:
            with self._lock, self._posting:   # (close() may be cancelling it)
                aio, self._receive = self._receive, None
            if not (_nng_down or sys.is_finalizing()):   # (at exit nng may be down)
                _lib.nng_aio_free(aio)

    def _next_request(self) -> tuple[bytes, int]:
        """The next handshake message and the id of the connection it came on."""
        aio = self._receive
        _lib.nng_aio_set_timeout(aio, -1)
        with self._posting:
            if self._closed:
                raise pynng.Closed("closed", _lib.NNG_ECLOSED)
            _lib.nng_recv_aio(self._accept.socket, aio)
        _lib.nng_aio_wait(aio)
        check_err(_lib.nng_aio_result(aio))
        msg = _lib.nng_aio_get_msg(aio)
        try:
            pipe_id = _lib.nng_pipe_id(_lib.nng_msg_get_pipe(msg))
            data: bytes = _ffi.unpack(_ffi.cast(_CHARS, _lib.nng_msg_body(msg)),
                                      _lib.nng_msg_len(msg))
        finally:
            _lib.nng_msg_free(msg)
        return data, pipe_id

    def _answer(self, data: bytes, pipe: Optional[pynng.Pipe]) -> bytes:
        if data.startswith(HELLO) and len(data) == len(HELLO) + _NONCE:
            return self._challenge(data[len(HELLO):])
        if data.startswith(_AUTH) and len(data) == len(_AUTH) + _NONCE + _TICKET + _MAC:
            return self._admit(data[len(_AUTH):], pipe)
        self._dropped(_remote(pipe), f"not a fibrl handshake message ({data[:16]!r}...)")
        return _NO + b"not a fibrl handshake message"

    def _ticket(self, nonce: bytes, stamp: bytes) -> bytes:
        return stamp + hmac.new(self._key, nonce + stamp, hashlib.sha256).digest()[:16]

    def _challenge(self, nonce: bytes) -> bytes:
        stamp = int(time.monotonic() * 1000).to_bytes(8, "big") + os.urandom(8)
        return _CHAL + self._ticket(nonce, stamp) + _mac(self._secret, b"S", nonce)

    def _admit(self, data: bytes, pipe: Optional[pynng.Pipe]) -> bytes:
        nonce, ticket, mac = data[:_NONCE], data[_NONCE:_NONCE + _TICKET], data[-_MAC:]
        issued = int.from_bytes(ticket[:8], "big") / 1000
        now = time.monotonic()
        if not hmac.compare_digest(self._ticket(nonce, ticket[:16]), ticket):
            reason = "a ticket this listener did not issue"
        elif now - issued > self._auth_timeout:
            reason = f"a ticket older than auth_timeout={self._auth_timeout} s"
        elif not hmac.compare_digest(mac, _mac(self._secret, b"C", ticket + nonce)):
            reason = "wrong secret"
        elif not self._use(ticket, issued + self._auth_timeout, now):
            reason = "a replayed handshake (ticket already used)"
        else:
            return self._open_peer(_mac(self._secret, b"D", ticket + nonce), pipe)
        self._dropped(_remote(pipe), reason)
        return _NO + reason.encode()

    def _use(self, ticket: bytes, expires: float, now: float) -> bool:
        # Only peers that know the secret get here, so this stays small.
        with self._lock:
            for old in [t for t, end in self._used.items() if end < now]:
                del self._used[old]
            if ticket in self._used:
                return False
            self._used[ticket] = expires
            return True

    def _open_peer(self, token: bytes, pipe: Optional[pynng.Pipe]) -> bytes:
        with self._lock:
            if self._closed:
                return _NO + b"the listener is closing"
            self._next_id += 1
            peer_id = self._next_id
        try:
            sock = _make(pynng.Pair1, self._secret, self._tls, True, recv_max_size=0)
        except pynng.NNGException as exc:
            return self._refuse_for_lack(pipe, exc)
        peer = Peer(sock, peer_id)
        door = _Door(sock) if self._gate is not None else None
        _OnePipe(sock, self._dropped, peer.close)   # kept alive by the callbacks it registers
        try:
            if self._gate is not None and door is not None:
                # one connection is handed on, then the port stops listening
                peer.port = self._gate.open(self._host, 0, expect=sp_header(_PAIR1),
                                            hand=door.hand, once=True)
                address = tcp_address(peer.port.host, peer.port.port)
            else:
                sock.listen(tcp_address(self._host, 0, _scheme(self._tls)))
                address = _address_of(sock, _scheme(self._tls))
            if self._shared:
                peer._watch()   # (two descriptors): a lack of them is reported here
            else:
                peer.shared = False
        except (pynng.NNGException, OSError) as exc:
            if peer.port is not None:
                peer.port.close()
            peer.close()
            return self._refuse_for_lack(pipe, exc)
        with self._lock:
            self._opening[peer_id] = peer
        peer._new_reader = functools.partial(self._start_reader, peer)
        peer.thread = threading.Thread(target=self._serve, args=(peer, token),
                                       daemon=True, name=f"fibrl-peer-{peer_id}")
        peer.thread.start()
        return _ADDR + address.encode()

    def _refuse_for_lack(self, pipe: Optional[pynng.Pipe], exc: Exception) -> bytes:
        reason = (f"cannot open a connection for an authenticated peer on {self._host} "
                  f"({exc}); ")
        if isinstance(exc, pynng.OutOfFiles) or getattr(exc, "errno", None) == errno.EMFILE:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            reason += (f"this process has used all of its file descriptors (ulimit -n is "
                       f"{soft}, hard limit {hard}); raise it (ulimit -n, or "
                       f"resource.setrlimit) or run fewer workers per parent")
        else:
            reason += "no port or socket left on this machine"
        log.error("%s", reason)
        return _NO + reason.encode()

    # -- one authenticated peer ---------------------------------------------------
    def _serve(self, peer: Peer, token: bytes) -> None:
        good = self._check_token(peer, token)
        if peer.port is not None:
            peer.port.close()   # (closed already once it handed its connection on)
        with self._lock:
            self._opening.pop(peer.id, None)
            keep = good and not self._closed
            if keep:
                self._peers[peer.id] = peer
        if not keep:
            # (never under the lock: the close waits for nng's reaper thread, which may
            # be running the accept socket's pipe callback, which waits for the lock)
            peer.close()
            return
        log.debug("peer %s authenticated on %s", peer.id, self.address)
        self._read(peer, 0)

    def _start_reader(self, peer: Peer, generation: int) -> threading.Thread:
        thread = threading.Thread(target=self._read, args=(peer, generation), daemon=True,
                                  name=f"fibrl-peer-{peer.id}")
        thread.start()
        return thread

    def _read(self, peer: Peer, generation: int) -> None:
        """Read and handle ``peer``'s frames until it goes, or until another thread reads
        them (see :meth:`Peer.offload`); sleep while a caller reads them."""
        try:
            if not self._shared:
                self._read_alone(peer, generation)
                return
            while not peer.closed and peer.wait_readable():
                peer.lead.acquire()
                if not self._run(peer, generation):
                    return   # handed off: the new reader has the peer (and the lead) now
                peer.lead.release()
        except (pynng.NNGException, TransportError):
            pass   # the peer is gone
        except MemoryError:
            log.error("peer %s sent a message larger than this process can allocate; "
                      "dropping it", peer.id)
        finally:
            if peer._reader == generation:
                self._lost(peer)

    def _read_alone(self, peer: Peer, generation: int) -> None:
        """``_read`` for a peer that no other thread reads: wait inside the receive itself
        (one wake-up per frame, no readiness descriptor to signal and drain), holding the
        lead until the peer goes or is handed off."""
        aio = _thread_aio()
        peer.lead.acquire()
        try:
            while not peer.closed:
                data = peer._receive_once(aio, None, peer._is_closed)
                if data is not None and not self._handle(peer, generation, data):
                    return   # handed off: the new reader holds the lead now
        finally:
            if peer._reader == generation:
                peer.lead.release()

    def _run(self, peer: Peer, generation: int) -> bool:
        """Handle every frame already received (lead held); False once handed off to
        another reader (which has the lead then)."""
        try:
            while True:
                data = _recv_frame_nowait(peer)
                if data is None:
                    return True
                if not self._handle(peer, generation, data):
                    return False
        except BaseException:
            if peer._reader == generation:
                peer.lead.release()
            raise

    def _handle(self, peer: Peer, generation: int, data: Frame) -> bool:
        """Run the frame handler on ``data``; False once reader ``generation`` was handed
        off meanwhile (it reads no more)."""
        peer._handling(generation, True)
        try:
            self._on_frame(peer, data)
        finally:
            reading = peer._handling(generation, False)
        return reading

    def _lost(self, peer: Peer) -> None:
        with self._lock:
            self._peers.pop(peer.id, None)
        peer.close()
        log.debug("peer %s of %s disconnected", peer.id, self.address)
        if self._on_lost is not None and not self._closed:
            self._on_lost(peer)

    def _check_token(self, peer: Peer, token: bytes) -> bool:
        try:
            data = peer._receive(self._auth_timeout, _handshake_bytes)
            if data is None:
                raise pynng.Timeout("Timed out", _lib.NNG_ETIMEDOUT)
            if not hmac.compare_digest(data, token):
                pipes = peer._sock.pipes
                self._dropped(_remote(pipes[0] if pipes else None),
                              "wrong token on a data socket")
                return False
            peer._sock.send(_OK)
            return True
        except pynng.Closed:
            # Closed here: the listener is closing (its owner's exit), or the peer's one
            # connection went away (_OnePipe); neither is a peer to report as dropped.
            log.debug("%s: a peer's data socket closed before its token came", self.address)
            return False
        except pynng.NNGException as exc:
            self._dropped("(none)", f"the authenticated peer did not connect to its data "
                          f"socket within auth_timeout ({exc}); it may have exited while "
                          f"it started")
            return False

    def close(self, join: float = 0.0) -> None:
        """Stop accepting and drop every peer, waiting up to ``join`` s for their threads."""
        with self._lock:
            self._closed = True
            peers = list(self._peers.values()) + list(self._opening.values())
        self._stop.set()
        if self._gate is not None:
            self._gate.close()
        with self._posting:   # (the accept thread posts no receive after this)
            if self._receive is not None:
                _lib.nng_aio_cancel(self._receive)
        if threading.current_thread() is not self._thread:
            self._thread.join(_ACCEPT_EXIT_S)   # it frees its aio once out of the receive
        self._accept.close()
        for peer in peers:
            peer.close()
        if join:
            self._thread.join(join)
            for peer in peers:
                thread = peer.thread   # (None: a peer still opening, its thread not made)
                if thread is not None:
                    thread.join(join)


def _close_pipe(pipe: pynng.Pipe) -> None:
    """Close one connection, which may have gone by itself meanwhile: every pipe fibrl
    closes goes through here, so a peer that leaves first logs nothing."""
    _gate_addresses.pop(pipe.id, None)
    try:
        pipe.close()
    except pynng.NNGException:
        pass   # it went away by itself meanwhile


class Channel(_Reading):
    """The client side of an authenticated connection to a :class:`Listener`.

    Frames are sent with :meth:`send` and received with :meth:`recv`; the
    channel never reconnects: once the connection drops it stays closed and
    ``on_lost`` (if given) runs once.
    """

    def __init__(self, sock: pynng.Pair1, address: str) -> None:
        self._sock = sock
        self._handle = sock.socket   # (nng's id of it: pynng makes one per attribute read)
        self.address = address
        self.closed = False
        self._readable_init()
        self._send_lock = threading.Lock()
        self._lost_cb: Optional[Callable[[], None]] = None
        self._lost_once = threading.Lock()
        sock.add_post_pipe_remove_cb(lambda _pipe: _call_soon(self._lost))

    @classmethod
    def connect(cls, address: str, secret: bytes, timeout: float = 30.0) -> "Channel":
        """Connect and authenticate to the listener at ``address``.

        A ``tls+tcp://`` address connects with TLS and the run's certificate.

        Raises:
            AuthenticationError: either side did not know the secret.
            TransportError: nothing listens there, or it did not answer in time.
        """
        tls = address.startswith("tls+tcp://")
        deadline = time.monotonic() + timeout   # the whole connect, both sockets
        data_address, token = _authenticate_retrying(address, secret, timeout, tls)
        sock = _make(pynng.Pair1, secret, tls, False, recv_max_size=0)
        # A listener that dies mid-handshake closes the pipe, but a Pair1 recv does not
        # end with it (nng would wait for a redial): the channel's loss of its pipe
        # closes it, so the handshake fails at once instead of after ``timeout``.
        channel = cls(sock, address)
        try:
            _dial(sock, data_address, _left(deadline))
            channel._present_token(token, _left(deadline))
        except _DialTimeout as exc:
            raise TransportError(f"cannot connect to {address}'s data socket: {exc} "
                                 f"(the process that owns it is too busy, or the network "
                                 f"between drops packets)") from None
        except pynng.NNGException as exc:
            channel.close()
            raise TransportError(f"cannot connect to {address}'s data socket "
                                 f"{data_address}: {exc}") from exc
        except BaseException:
            channel.close()
            raise
        return channel

    def _present_token(self, token: bytes, timeout: float) -> None:
        """Send the data socket's token and wait for the listener's verdict on it."""
        try:
            self._sock.send(token)
            verdict = self._receive(timeout)
        except pynng.Closed as exc:
            raise _closed_in_handshake(self.address) from exc
        if verdict is None:
            raise TransportError(f"{self.address} did not confirm the connection within "
                                 f"the {timeout:.3g} s left of the connect's timeout.")
        if verdict != _OK:
            raise TransportError(f"{self.address} did not accept the connection "
                                 f"(answered {bytes(verdict[:16])!r}).")

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once when the connection drops (now, if it already has)."""
        self._lost_cb = callback
        if self.closed:
            self._lost()

    def _lost(self) -> None:
        if not self._lost_once.acquire(blocking=False):
            return
        self.close()
        if self._lost_cb is not None:
            self._lost_cb()
        else:
            self._lost_once.release()  # let a callback registered later run

    def _gone(self, exc: Exception) -> str:
        return (f"connection to {self.address} is closed ({exc}); the process at the "
                f"other end exited or was killed.")

    def recv(self, timeout: Optional[float] = None) -> Frame:
        """Receive one frame, waiting at most ``timeout`` seconds (None: forever): ``bytes``,
        or for a large one a writable ``memoryview`` of the message (no copy)."""
        try:
            frame = self._receive(timeout)
        except FrameStalled as exc:
            self.close()
            raise ChannelClosed(f"connection to {self.address}: {exc}") from exc
        except pynng.NNGException as exc:
            raise ChannelClosed(
                f"connection to {self.address} is closed ({exc}); the process at the "
                f"other end exited or was killed.") from exc
        if frame is None:
            raise TimeoutError(f"no message from {self.address} within {timeout} s")
        return frame

    # -- read by whichever thread waits (see hub.Client and _Reading) ---------------------
    def watch(self) -> None:
        """Get ready for :meth:`wait_readable`: :class:`TransportError` when this process
        has no file descriptor left for it."""
        try:
            self._watch()
        except pynng.NNGException as exc:
            raise TransportError(f"cannot watch the connection to {self.address}: {exc}; "
                                 f"if this process ran out of file descriptors, raise "
                                 f"ulimit -n") from exc

    def recv_nowait(self) -> Optional[Frame]:
        """The next frame if one is here already, else None; :class:`ChannelClosed` once
        the connection is gone."""
        try:
            return _recv_frame_nowait(self)
        except pynng.NNGException as exc:
            raise ChannelClosed(f"connection to {self.address} is closed ({exc})") from exc

    def recv_here(self, timeout: Optional[float]) -> Optional[Frame]:
        """The next frame, received in this thread, or None after ``timeout`` seconds."""
        try:
            return self._receive(timeout)
        except pynng.NNGException as exc:
            raise ChannelClosed(f"connection to {self.address} is closed ({exc})") from exc

    def __repr__(self) -> str:
        return f"<Channel to {self.address}>"


_soon: set[threading.Thread] = set()   # threads closing sockets now (_call_soon's, _shut_socket)
_soon_lock = threading.Lock()


def _call_soon(fn: Callable[[], None]) -> None:
    # nng runs pipe callbacks on its own threads, where closing the socket
    # deadlocks; hand the work to a short-lived thread.
    def run() -> None:
        try:
            fn()
        finally:
            with _soon_lock:
                _soon.discard(thread)

    thread = threading.Thread(target=run, daemon=True, name="fibrl-pipe-event")
    with _soon_lock:
        _soon.add(thread)
    thread.start()


_nng_down = False   # set at exit, before pynng shuts nng down: nng objects are not freed


@atexit.register   # (after pynng's own: it runs before it)
def _finish_pipe_events() -> None:
    """Let sockets that other threads are closing (on a pipe event; the last receiver of
    a closed connection) finish closing before pynng shuts nng down at exit: nng aborts
    the process when a socket closes during its shutdown.
    From here on, aios are left to the process's end (freeing one after nng's shutdown
    aborts the process too: a listener closed by a finalizer at exit frees its accept
    thread's aio then)."""
    global _nng_down
    with _soon_lock:
        _nng_down = True
        threads = [t for t in _soon if t is not threading.current_thread()]
    deadline = time.monotonic() + 2.0
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _close_on_disconnect(sock: pynng.Socket) -> None:
    """Close ``sock`` when its first pipe goes away: a one-peer socket whose peer left
    is done (nng would keep a send or recv waiting for a redial)."""
    sock.add_post_pipe_remove_cb(lambda _pipe: _call_soon(sock.close))


class _DialTimeout(TransportError):
    """A dial that did not finish within the caller's timeout (:func:`_dial`)."""


def _dial(sock: pynng.Socket, address: str, timeout: float) -> None:
    """``sock.dial(address, block=True)``, given up after ``timeout`` seconds.

    nng's blocking dial waits for the TCP connect (the kernel's limit, minutes, towards
    a host that drops packets) and then up to its own 10 s for the other end to take the
    connection, whatever the caller's timeout. Past ``timeout`` the socket is closed,
    which ends the dial.

    Raises:
        _DialTimeout: not connected within ``timeout`` (``sock`` is closed then).
        pynng.NNGException: the dial failed (refused, nng's negotiation limit, ...).
    """
    claim = threading.Lock()   # taken by the timer or by the dial's end, whichever is first

    def expire() -> None:
        if claim.acquire(blocking=False):
            sock.close()   # (a timer thread of its own: closing may wait for nng's threads)

    timer = threading.Timer(max(0.0, timeout), expire)
    timer.daemon = True
    timer.start()
    failure: Optional[pynng.NNGException] = None
    try:
        sock.dial(address, block=True)
    except pynng.NNGException as exc:
        failure = exc
    finally:
        timer.cancel()
    if not claim.acquire(blocking=False):   # the timer took it: it closed the socket
        raise _DialTimeout(f"{address} did not take the connection within {timeout:.3g} s")
    if failure is not None:
        raise failure


def _authenticate_retrying(address: str, secret: bytes, timeout: float,
                           tls: bool) -> tuple[str, bytes]:
    """:func:`_authenticate`, tried again until ``timeout`` (pausing a little longer each
    time, at most 1 s) when the listener closed our
    connection mid-way (a listener full of strangers closes an idle one for a waiting
    one, and with TLS refuses new ones past its limit), or had not taken it when nng's
    negotiation limit ended it (it waited that long in a full listener's queue). A
    listener that is gone fails the retry at once; the first error is the one raised."""
    start = time.monotonic()
    deadline = start + timeout
    first: Optional[TransportError] = None
    not_taken: Optional[_NotTaken] = None
    for attempt in itertools.count():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            return _authenticate(address, secret, left, tls)
        except _NotTaken as exc:
            not_taken = exc   # waited in a full listener's queue: in line again (a try
            # ends at this connect's timeout when less than nng's limit is left of it)
        except _NotTakenInTime as exc:
            if not_taken is None:   # (else the not-taken summary below says more)
                first = first or exc
            break
        except TransportError as exc:
            first = first or exc
            if not _closed_under_us(exc.__cause__):
                break
        pause = _RETRY_PAUSE * (2 ** min(attempt, 5)) * (0.5 + random.random())
        time.sleep(max(0.0, min(pause, 1.0, deadline - time.monotonic())))
    if first is None and not_taken is not None:
        raise TransportError(
            f"{address} did not take the connection within {time.monotonic() - start:.1f} s "
            f"(timeout {timeout:g} s): it waited in the listener's queue, tried again "
            f"each time nng's {_NEGOTIATION_S:g} s negotiation limit ended a try, as at a "
            f"listener that holds its "
            f"pending-connection limit (max_pending) while it answers others on a busy "
            f"machine (connect with a longer timeout, or raise max_pending), or at a host "
            f"that does not answer at all.") from not_taken
    if first is None:
        raise TransportError(f"no time left to connect to {address} (timeout {timeout} s); "
                             f"give connect a positive timeout")
    raise first


class _NotTaken(TransportError):
    """A handshake connection the listener had not taken when nng's negotiation limit
    ended it (it waited in the queue of a full listener): worth a new try."""


class _NotTakenInTime(TransportError):
    """A handshake connection the listener had not taken by the connect's timeout."""


def _closed_under_us(cause: Optional[BaseException]) -> bool:
    """Whether a handshake failed because the listener closed its connection (and may
    take a new one), not because it is gone or refused us."""
    return isinstance(cause, (pynng.Closed, pynng.ConnectionReset)) or (
        isinstance(cause, pynng.NNGException) and cause.errno == _lib.NNG_ECONNSHUT)


def _authenticate(address: str, secret: bytes, timeout: float,
                  tls: bool) -> tuple[str, bytes]:
    """The handshake on the accept socket: returns the data address and its token."""
    req = _make(pynng.Req0, secret, tls, False, resend_time=-1,
                recv_timeout=int(timeout * 1000), send_timeout=int(timeout * 1000),
                recv_max_size=HANDSHAKE_MAX_SIZE)
    _close_on_disconnect(req)  # (its receives poll its descriptor: see _answer_of)
    nonce = os.urandom(_NONCE)
    deadline = time.monotonic() + timeout
    try:
        try:
            _dial(req, address, timeout)
        except _DialTimeout:
            raise _NotTakenInTime(
                f"{address} did not take the connection within {timeout:.3g} s: no fibrl "
                f"listener answered there (a host that drops packets, a program of another "
                f"kind on that port), or it is too busy to take new connections (connect "
                f"with a longer timeout).") from None
        except pynng.Timeout as exc:
            # TCP connected, but the listener did not take the connection within nng's
            # own negotiation limit (10 s): it waited in the queue of a full listener
            raise _NotTaken(f"{address} did not take the connection within nng's "
                            f"{_NEGOTIATION_S:g} s negotiation limit (a listener busy with "
                            f"other handshakes)") from exc
        req.send(HELLO + nonce)
        challenge = _answer_of(req, deadline)
        ticket = _check_challenge(challenge, secret, nonce, address)
        req.send(_AUTH + nonce + ticket + _mac(secret, b"C", ticket + nonce))
        answer = _answer_of(req, deadline)
    except pynng.Closed as exc:
        raise _closed_in_handshake(address) from exc
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
    return _data_address(answer, address), _mac(secret, b"D", ticket + nonce)


def tcp_silence(local: Optional[str], remote: str) -> Optional[float]:
    """Seconds since the TCP connection of this process from ``local`` (None: any) to
    ``remote`` (``"host:port"``, IPv4) last received data: the kernel's
    ``tcpi_last_data_recv``. None where that cannot be read (not Linux, not IPv4, no
    such connection)."""
    try:
        near = None if local is None else _proc_address(local)
        inode = _tcp_inode(near, _proc_address(remote))
        fd = None if inode is None else _fd_of_socket(inode)
        if fd is None:
            return None
        with socket.socket(fileno=os.dup(fd)) as sock:   # (closing a dup ends nothing)
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    except (OSError, ValueError, AttributeError):
        return None
    if len(info) < _TCP_INFO_SIZE:
        return None
    return int(struct.unpack_from("I", info, _LAST_DATA_RECV)[0]) / 1000


# struct tcp_info (linux/tcp.h): 8 one-byte fields, then 32-bit fields of which
# tcpi_last_data_recv (milliseconds) is the eleventh.
_LAST_DATA_RECV = 52
_TCP_INFO_SIZE = _LAST_DATA_RECV + 4


def _proc_address(address: str) -> str:
    """``host:port`` as /proc/net/tcp writes it (hex of the address in host order)."""
    host, port = address.rsplit(":", 1)
    packed = socket.inet_aton(host)
    return f"{struct.unpack('=I', packed)[0]:08X}:{int(port):04X}"


def _tcp_inode(local: Optional[str], remote: str) -> Optional[str]:
    with open("/proc/self/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[2] == remote and local in (None, fields[1]) and fields[3] == "01":
                return fields[9]   # (state 01: established)
    return None


def _fd_of_socket(inode: str) -> Optional[int]:
    target = f"socket:[{inode}]"
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == target:
                return int(name)
        except OSError:
            continue   # (closed meanwhile)
    return None


def _answer_of(req: pynng.Socket, deadline: float) -> bytes:
    """The listener's answer to the request ``req`` just sent, by ``deadline``. Waits on
    the socket's readiness descriptor (a timed-out receive would abandon the request)
    and checks every ``_HANDSHAKE_CHECK_S`` that the connection still stands: a pipe
    whose socket is no longer connected is closed here, and the handshake fails as
    closed under us (and is tried again) instead of waiting out its timeout."""
    poll = select.poll()
    poll.register(req.recv_fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise pynng.Timeout("Timed out", _lib.NNG_ETIMEDOUT)
        if poll.poll(min(left, _HANDSHAKE_CHECK_S) * 1000):
            try:
                answer: bytes = req.recv(block=False)
                return answer
            except pynng.TryAgain:
                continue   # (readiness seen before the answer could be taken)
        for pipe in req.pipes:
            if not _connected(pipe):
                _close_pipe(pipe)
                raise pynng.Closed("the handshake connection was lost", _lib.NNG_ECLOSED)


def _connected(pipe: pynng.Pipe) -> bool:
    """Whether a pipe's socket still has its peer (a pipe nng has not closed yet may
    have lost it)."""
    try:
        return pipe.remote_address is not None
    except pynng.NNGException:   # not connected any more, or the pipe is gone
        return False


def _check_challenge(challenge: bytes, secret: bytes, nonce: bytes, address: str) -> bytes:
    if not challenge.startswith(_CHAL) or len(challenge) != len(_CHAL) + _TICKET + _MAC:
        raise TransportError(
            f"{address} is not a fibrl listener of this version (answered "
            f"{challenge[:16]!r}). Check the address.")
    ticket, proof = challenge[len(_CHAL):-_MAC], challenge[-_MAC:]
    if not hmac.compare_digest(proof, _mac(secret, b"S", nonce)):
        raise AuthenticationError(
            "the listener did not prove it knows the run's secret: it belongs to another "
            "fibrl run or is not fibrl. Check the address and the authkey/FIBRL_SECRET.")
    return ticket


def _data_address(answer: bytes, address: str) -> str:
    if answer.startswith(_ADDR):
        return answer[len(_ADDR):].decode()
    reason = answer[len(_NO):].decode(errors="replace") if answer.startswith(_NO) else ""
    if reason == "wrong secret":
        raise AuthenticationError(
            "the listener rejected our secret: this process and the listener belong to "
            "different fibrl runs (wrong authkey or FIBRL_SECRET).")
    raise TransportError(f"{address} refused the connection: {reason or answer[:16]!r}")


def _closed_in_handshake(address: str) -> TransportError:
    return TransportError(
        f"{address} closed the connection during the authentication handshake: the fibrl "
        f"process that owns it has exited, or it gave up on this handshake after its "
        f"auth_timeout (a machine too busy to finish one in time; raise auth_timeout).")


def _left(deadline: float) -> float:
    """Seconds left until ``deadline`` (at least a millisecond: nng reads 0 as no wait)."""
    return max(0.001, deadline - time.monotonic())


@dataclass(frozen=True)
class Settings:
    """How this process listens and dials: the transport settings that every listener
    and channel fibrl opens takes (a hub's, a manager server's, the RL envs'), so that
    ``tls``, the handshake timeout and the pending-connection limit hold for all of them.

    :meth:`from_config` is the one place that maps a config to them.

    Example:
        >>> settings = Settings(tls=False)
        >>> lst = settings.listener(b"k", on_frame=lambda p, d: p.send(d))
        >>> ch = settings.connect(lst.address, b"k"); ch.send(b"x"); ch.recv(5)
        b'x'
    """

    host: str = "127.0.0.1"
    tls: bool = False
    auth_timeout: float = 10.0
    connect_timeout: float = 30.0
    max_pending: Optional[int] = None

    @classmethod
    def from_config(cls, config: Any, host: Optional[str] = None) -> "Settings":
        """The settings of a process whose config is ``config``, listening on ``host``
        (default ``config.listen_host``)."""
        return cls(host or config.listen_host, config.tls, config.auth_timeout,
                   config.start_timeout)

    def listener(self, secret: bytes, *, on_frame: FrameHandler,
                 on_lost: Optional[LossHandler] = None, port: int = 0,
                 shared: bool = True) -> Listener:
        """A :class:`Listener` on ``self.host`` that obeys these settings."""
        return Listener(self.host, secret, on_frame=on_frame, on_lost=on_lost,
                        auth_timeout=self.auth_timeout, port=port, tls=self.tls,
                        max_pending=self.max_pending, shared=shared)

    def connect(self, address: str, secret: bytes,
                timeout: Optional[float] = None) -> Channel:
        """A :class:`Channel` to ``address`` (within ``timeout``, default
        ``connect_timeout``). With ``tls`` on, a plaintext ``tcp://`` address is refused
        before anything is sent: this process's traffic stays encrypted."""
        if self.tls and not address.startswith("tls+tcp://"):
            raise TransportError(
                f"tls=True, but {address} is a plaintext address; nothing was sent to it. "
                f"Likely cause: it belongs to a process started with tls=False. Start every "
                f"process of the run with the same tls setting (fibrl.init(tls=...)).")
        return Channel.connect(address, secret,
                               self.connect_timeout if timeout is None else timeout)


# The fault seam of fibrl's own tests (fibrl.wire.faults sets it while a rule is
# installed): None otherwise, which is all a send pays for it.
_faults: Any = None
