"""The TCP door in front of a listener's nng sockets: strangers hold little, for little time.

nng holds a TCP connection that never sends its 8-byte protocol header for a fixed 10 s,
and no nng callback sees it in that time, so a stranger who opens hundreds of such
connections could take every descriptor of the process. A :class:`Gate` owns the
listening TCP sockets instead: one thread accepts, counts and times each connection, and
hands it to nng (``hand``) only once its header has arrived whole and names the protocol
the nng socket behind it speaks. What a stranger can hold is then bounded at every step:

- at most ``max_pending`` connections are held before they authenticate (those waiting
  for their header here, and what ``others()`` reports the nng side holds for the same
  listener). At that limit the gate stops accepting: newer connections wait in the
  kernel's listen backlog, which costs this process no descriptor, and are accepted as
  the held ones finish. A held connection that is *idle* (no complete header here
  within ``grace`` seconds, or what ``evict(n)`` finds idle on the nng side) is
  closed for a waiting one, so idle strangers cannot keep the slots from others; a
  connection that is only queued behind the others (its header arrived, nng has not
  taken it yet) is never closed for a newer one;
- each waits at most ``header_timeout`` seconds for its header;
- a connection is refused at once (accepted and closed) while fewer than ``reserve``
  descriptors of ``ulimit -n`` are left, so the process's own work keeps those (not on a
  ``once`` port: its one peer has authenticated already);
- a port opened with ``once=True`` (a data port, meant for one authenticated peer) stops
  listening as soon as it has handed one connection on. Its connections do not count
  against ``max_pending`` and are never closed to make room for the accept port's: each
  finishes a handshake already made, and there is one such port per authenticated
  peer. At most ``ONCE_WAITING`` of them wait for their header (the oldest is closed).

::

    accept port ready --> room? (held < max_pending, or an idle one closed) --no--> pause:
         |                                                    the port leaves the selector;
         | yes: accept, time the header                       every PAUSE_TICK s, back
         v                                                    once room is made
    header complete --> hand(sock) --False: nng busy--> offered again every RETRY s
         |
         v True: nng owns it (counted by ``others()`` until it authenticates or goes)

This module knows nothing of nng or of what the header's bytes after the protocol mean:
:mod:`fibrl.wire.transport` builds the gate, says which protocol each port expects, and turns
a handed descriptor into an nng connection.
"""
from __future__ import annotations

import collections
import logging
import os
import resource
import select
import selectors
import socket
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["Gate", "Port", "sp_header"]

log = logging.getLogger(__name__)

HEADER_SIZE = 8
_ACCEPTS_PER_WAKE = 32   # connections accepted per readiness event of a listening socket
_RETRY = 0.005           # s between tries of a hand-off nng could not take yet
PAUSE_TICK = 0.02        # s between looks at a port that waits for room
ONCE_WAITING = 4         # connections to one data port waiting for their header, at most
# The listen backlog of a port: where connections to an accept port wait while the gate
# holds max_pending (the kernel caps it at net.core.somaxconn). Deeper would make a
# legitimate connection wait behind more idle strangers; shallower makes a burst of
# connections retry their SYN (a second or more) instead of waiting in line.
BACKLOG = 128


def sp_header(protocol: int) -> bytes:
    """The 8 bytes an nng peer of ``protocol`` (its 16-bit SP protocol number) sends first.

    Example:
        >>> sp_header(0x30)
        b'\\x00SP\\x00\\x000\\x00\\x00'
    """
    return b"\x00SP\x00" + protocol.to_bytes(2, "big") + b"\x00\x00"


def _free_descriptors() -> Optional[int]:
    """Descriptors this process may still open (None where it cannot be told)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        return soft - len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


_last_shortage: Optional[tuple[float, int]] = None   # (monotonic time, reserve) of the last refusal


def descriptor_shortage(within: float = 60.0) -> Optional[str]:
    """Why a gate of this process last refused a connection for want of descriptors,
    if it did in the last ``within`` seconds; else None.

    A worker whose connection was refused that way exits before it connects back, and
    its own report says only "connection shutdown": the pool adds this as the cause.
    """
    last = _last_shortage
    if last is None or time.monotonic() - last[0] > within:
        return None
    return f"fewer than {last[1]} file descriptors are left (ulimit -n)"


def descriptor_room() -> Optional[tuple[int, int]]:
    """``(room, reserve)``: how many more descriptors this process may open before its
    gates refuse connections (negative once they do), and the reserve they keep then
    (:func:`_reserve_for`); None where that cannot be told."""
    free = _free_descriptors()
    if free is None:
        return None
    reserve = _reserve_for()
    return free - reserve, reserve


def _reserve_for(soft: Optional[int] = None) -> int:
    """Descriptors kept for the process's own work: an eighth of ``ulimit -n``, at least 32."""
    if soft is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 32
    return max(32, soft // 8)


class Port:
    """One listening TCP socket of a :class:`Gate` (see :meth:`Gate.open`)."""

    def __init__(self, gate: "Gate", sock: socket.socket, expect: bytes,
                 hand: Callable[[socket.socket, str], bool], once: bool) -> None:
        self._gate = gate
        self.sock = sock
        self.expect = expect
        self.hand = hand
        self.once = once
        self.closed = False
        host, port = sock.getsockname()[:2]
        self.host, self.port = host, port

    def close(self) -> None:
        """Stop listening (connections already handed on are not touched)."""
        self._gate._call(self._gate._close_port, self)


class _Waiting:
    __slots__ = ("sock", "address", "port", "since", "deadline", "ready")

    def __init__(self, sock: socket.socket, address: str, port: Port, since: float,
                 deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.port = port
        self.since = since         # when it was accepted
        self.deadline = deadline   # for its header; once ready, for nng to take it
        self.ready = False         # the header arrived; waits for nng to take it


class Gate:
    """Accepts TCP connections for nng sockets and hands on only those that sent a header.

    Why one class of this size: one thread and one selector serve every port of a
    process, and what it decides for one connection (take it, pause a port, evict an
    idle one, drop the oldest waiting) depends on how many the others hold and how
    many descriptors are left; its state is only ever touched from that thread.

    Args:
        where: names the owner in log lines and the thread's name.
        refused: ``refused(address, reason)`` for every connection closed unserved.
        max_pending: connections held before they authenticate, at most (with ``others``).
        others: connections the owner holds already that count against ``max_pending``.
        evict: ``evict(n)`` closes up to ``n`` idle connections of those the owner holds
            (``others``), to make room for waiting ones; returns how many it closed.
        header_timeout: seconds a connection may take to send its header.
        grace: seconds a connection without a complete header is kept while newer ones
            wait for room.
        reserve: descriptors a new connection must leave free (None: an eighth of
            ``ulimit -n``, at least 32).
    """

    def __init__(self, where: str, *, refused: Callable[[str, str], None], max_pending: int,
                 others: Callable[[], int] = lambda: 0,
                 evict: Callable[[int], int] = lambda n: 0, header_timeout: float = 5.0,
                 grace: float = 0.5, reserve: Optional[int] = None) -> None:
        self._where = where
        self._refused = refused
        self._max_pending = max_pending
        self._others = others
        self._evict = evict
        self._header_timeout = header_timeout
        self._grace = min(grace, header_timeout)
        self._reserve = _reserve_for() if reserve is None else reserve
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._ops: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]]
        self._ops = collections.deque()   # (op, args) to run in the gate's thread
        self._waiting: dict[socket.socket, _Waiting] = {}   # oldest first
        self._held = 0   # of them, those that count against max_pending (not a data port's)
        self._ports: set[Port] = set()
        self._paused: set[Port] = set()   # accept ports out of the selector: no room
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"fibrl-gate-{where}")
        self._thread.start()

    # -- called from any thread ---------------------------------------------------------
    def open(self, host: str, port: int, *, expect: bytes,
             hand: Callable[[socket.socket, str], bool], once: bool = False) -> Port:
        """Listen on ``host:port`` (0: any free port) for peers whose header is ``expect``.

        ``hand(sock, address)`` is called in the gate's thread with each connection whose
        header arrived (still unread, so nng sees it); it returns False when it cannot
        take the connection yet (it is offered again shortly), and owns ``sock`` once it
        returns True. Raises ``OSError`` when the address cannot be bound.
        """
        bare = host[1:-1] if host.startswith("[") else host
        family, kind, proto, _, address = socket.getaddrinfo(
            bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        opened = Port(self, sock, expect, hand, once)
        self._call(self._add_port, opened)
        return opened

    def close(self, join: float = 1.0) -> None:
        """Stop listening on every port and close every connection not handed on."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(join)

    def _call(self, op: Callable[..., None], *args: Any) -> None:
        self._ops.append((op, args))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass   # already woken (buffer full), or closing

    # -- the gate's thread ------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select(self._next_timeout()):
                    if key.data is None:
                        self._drain_wake()
                    elif isinstance(key.data, Port):
                        self._accept(key.data)
                    else:
                        self._read_header(key.data)
                self._expire()
                self._retry_ready()
                self._look_at_paused()
        except Exception:   # never silently: a dead gate would refuse every peer
            log.exception("%s: the connection gate failed; no new peer can connect",
                          self._where)
        finally:
            self._shut()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._ops:
            op, args = self._ops.popleft()
            op(*args)

    def _next_timeout(self) -> Optional[float]:
        with self._lock:
            if not self._waiting:
                return PAUSE_TICK if self._paused else None
            if any(w.ready for w in self._waiting.values()):
                return _RETRY
            soonest = min(w.deadline for w in self._waiting.values())
        wait = max(0.0, soonest - time.monotonic())
        return min(wait, PAUSE_TICK) if self._paused else wait

    def _add_port(self, port: Port) -> None:
        if self._closed:
            port.sock.close()
            return
        self._ports.add(port)
        self._selector.register(port.sock, selectors.EVENT_READ, port)

    def _close_port(self, port: Port) -> None:
        if port.closed:
            return
        port.closed = True
        self._ports.discard(port)
        if port in self._paused:
            self._paused.discard(port)
        else:
            try:
                self._selector.unregister(port.sock)
            except (KeyError, ValueError):
                pass
        port.sock.close()

    # -- the limit: a full gate leaves new connections in the kernel's backlog ------------
    def _room(self) -> bool:
        """Whether one more connection to an accept port may be taken now: fewer than
        ``max_pending`` are held, or an idle one was closed to make room."""
        others = self._others()   # (not under the gate's lock: it takes the owner's)
        if self._held + others < self._max_pending:
            return True
        if self._drop_idle_waiting() or self._evict(1) > 0:
            return self._held + self._others() < self._max_pending
        return False

    def _drop_idle_waiting(self) -> bool:
        """Make room by closing the oldest connection that sent no complete header
        within ``grace`` seconds (an nng peer sends it at once); True once one went."""
        now = time.monotonic()
        with self._lock:
            old = [w for w in self._waiting.values()
                   if not w.port.once and not w.ready and now - w.since >= self._grace]
        for waiting in old:
            self._read_header(waiting)   # (its header may have come since the last look)
            with self._lock:
                gone = waiting.sock not in self._waiting
            if gone:
                return True   # handed on, or closed: room either way
            if waiting.ready:
                continue      # queued for nng, not idle
            self._drop(waiting, f"sent no complete header within {self._grace:g} s while "
                       f"{self._max_pending} connections are pending authentication and "
                       "newer ones wait; it is closed for one of them")
            return True
        return False

    def _pause(self, port: Port) -> None:
        """No room: stop watching ``port`` (its connections wait in the kernel's backlog)."""
        if port not in self._paused:
            self._selector.unregister(port.sock)
            self._paused.add(port)

    def _look_at_paused(self) -> None:
        """Watch a paused port again once nobody waits on it, or accept there once there
        is room (each look at most every PAUSE_TICK: a held connection that finishes is
        not signalled here)."""
        for port in list(self._paused):
            if port.closed:
                self._paused.discard(port)
                continue
            waiting = _readable(port.sock)
            if waiting and not self._room():
                continue
            self._paused.discard(port)
            self._selector.register(port.sock, selectors.EVENT_READ, port)
            if waiting:
                self._accept(port)

    def _accept(self, port: Port) -> None:
        global _last_shortage
        for _ in range(_ACCEPTS_PER_WAKE):
            if port.closed:
                return
            if not port.once and not self._room():
                self._pause(port)
                return
            try:
                sock, peer = port.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE/ENFILE: nothing left to accept with; the kernel keeps the
                # connection queued until a descriptor is free (or the peer gives up).
                log.warning("%s: cannot accept a connection (%s)", self._where, exc)
                return
            address = _address(peer)
            # A data port is exempt: it takes one connection, for a peer that has
            # authenticated already; refusing it would waste that whole handshake.
            free = None if port.once else _free_descriptors()
            if free is not None and free < self._reserve:
                sock.close()
                _last_shortage = (time.monotonic(), self._reserve)
                self._refused(address, f"only {free} file descriptors are left (ulimit -n); "
                              f"the last {self._reserve} are kept for this process's own "
                              "work")
                continue
            if port.once:
                self._make_room_at(port)
            # nng sets TCP_NODELAY on the connections it makes itself, not on those
            # handed to it: without it, a reply sent right behind another waits for the
            # peer's delayed ACK (Nagle), about 40 ms for every pipelined call
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass   # (a peer that reset already: the header read drops it)
            sock.setblocking(False)
            now = time.monotonic()
            waiting = _Waiting(sock, address, port, now, now + self._header_timeout)
            with self._lock:
                self._waiting[sock] = waiting
                if not port.once:
                    self._held += 1
            self._selector.register(sock, selectors.EVENT_READ, waiting)

    def _make_room_at(self, port: Port) -> None:
        """A data port keeps at most ONCE_WAITING connections waiting for their header."""
        with self._lock:
            mine = [w for w in self._waiting.values() if w.port is port and not w.ready]
        if len(mine) >= ONCE_WAITING:
            self._drop(mine[0], f"{ONCE_WAITING} connections to one data port are waiting "
                       "for their header; the oldest is closed for the new one")

    def _read_header(self, waiting: _Waiting) -> None:
        try:
            head = waiting.sock.recv(HEADER_SIZE, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(waiting, None)
            return
        if not head:
            self._drop(waiting, None)   # it left without a word: nothing to report
            return
        if head != waiting.port.expect[:len(head)]:
            self._drop(waiting, f"not a fibrl peer (its first bytes were {head!r})")
            return
        if len(head) < HEADER_SIZE:
            return   # the rest of the header is on its way
        self._selector.unregister(waiting.sock)
        waiting.ready = True
        # queued here now, not idle: it waits for nng as long as a header may take
        waiting.deadline = time.monotonic() + self._header_timeout
        self._offer(waiting)

    def _offer(self, waiting: _Waiting) -> None:
        port = waiting.port
        try:
            taken = port.hand(waiting.sock, waiting.address)
        except Exception as exc:
            log.exception("%s: could not hand a connection on", self._where)
            self._drop(waiting, f"could not be handed on ({exc})", unregister=False)
            return
        if not taken:
            return   # offered again by _retry_ready
        with self._lock:
            self._forget(waiting)
        if port.once:
            self._close_port(port)

    def _retry_ready(self) -> None:
        with self._lock:
            ready = [w for w in self._waiting.values() if w.ready]
        for waiting in ready:
            self._offer(waiting)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [w for w in self._waiting.values() if w.deadline <= now]
        for waiting in late:
            if waiting.ready:
                self._drop(waiting, f"the listener could not take it within "
                           f"{self._header_timeout:g} s of its header", unregister=False)
            else:
                self._drop(waiting, f"sent no complete header within "
                           f"{self._header_timeout:g} s")

    def _forget(self, waiting: _Waiting) -> bool:
        """Stop counting ``waiting`` (lock held); False if it was not counted any more."""
        if self._waiting.pop(waiting.sock, None) is None:
            return False
        if not waiting.port.once:
            self._held -= 1
        return True

    def _drop(self, waiting: _Waiting, reason: Optional[str], unregister: bool = True) -> None:
        with self._lock:
            if not self._forget(waiting):
                return
        if unregister and not waiting.ready:
            try:
                self._selector.unregister(waiting.sock)
            except (KeyError, ValueError):
                pass
        waiting.sock.close()
        if reason is not None:
            self._refused(waiting.address, reason)

    def _shut(self) -> None:
        for port in list(self._ports):
            self._close_port(port)
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
            self._held = 0
        for each in waiting:
            each.sock.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


def _readable(sock: socket.socket) -> bool:
    """Whether a connection waits in the backlog of the listening socket ``sock``."""
    poll = select.poll()   # (not select.select: no limit on the descriptor's number)
    try:
        poll.register(sock, select.POLLIN)
        return bool(poll.poll(0))
    except (OSError, ValueError):
        return False   # closed meanwhile


def _address(peer: tuple[str, int] | tuple[str, int, int, int]) -> str:
    host, port = peer[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
