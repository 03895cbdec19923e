"""How a process reaches manager servers: dedicated lines, hubs per authkey, decrefs.

A *line* is one thread's own authenticated connection to one manager server,
as in ``multiprocessing.managers`` (a thread-local ``Connection``). A
synchronous proxy call is one frame out and one frame back on the caller's
thread: no reader thread, no hand-off, and the server runs it in the
connection's own thread, so a method that blocks (``queue.get``,
``lock.acquire``) blocks only the thread that called it, and thread-owned
objects (``threading.RLock``) see one server thread per client thread.
A :class:`PipelinedLine` is a line that its owner keeps (an async proxy's
object, or a proxy that pipelines), with several calls in flight and the
replies read back by whichever thread waits for one, without a hub's threads;
a burst of calls is packed into few frames by its feeder thread. An async
proxy's calls go on its object's line (``proxies``); ``_call_async`` goes
through the process's hub instead (request ids, replies in any order), to a
hub keyed by the manager's authkey.

Data flow::

    thread T1 -- line(T1, addr) ==== Call(rid) / Reply(rid) ==== server peer thread (T1's)
    thread T2 -- line(T2, addr) ==== ...                     ==== server peer thread (T2's)
    any thread -- hub_for(authkey).call_async ==== Client (one per process) ==== peer thread
                                                     -> ManagerService lanes (worker threads)
    a proxy's pipelined line ==== Call(rid1), Call(rid2) / replies in order ==== peer thread
    an object's line (its async proxies) ==== "acall"s, bursts packed by its feeder
                                   ==== peer thread, holding the object's lock
    proxy finalizer -> pending decrefs (a deque) -> sent with the next call to that address

While a reply takes long, a line pings the server between slices of
``heartbeat_interval``: a server that is gone (even on a vanished node)
raises :class:`RemoteObjectError` within ``parent_timeout``.
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from typing import Any, Optional

from ..hosting import runtime
from ..wire import serialization
from ..errors import ChannelClosed, RemoteObjectError, TransportError, owner_gone
from ..hosting.hub import Hub, get_hub
from ..janitor import Finalizer
from ..wire.messages import Call, pack, unpack, wrap_args
from ..wire.serialization import Encoded

__all__ = ["Line", "PipelinedLine", "ReplyTimeout", "line_for", "hub_for", "close_lines",
           "note_decref", "take_decrefs", "lost_error", "MANAGER_OID"]

MANAGER_OID = "manager"

_local = threading.local()
_all_lines: "weakref.WeakSet[Line]" = weakref.WeakSet()
_hubs: dict[bytes, Hub] = {}
_hubs_lock = threading.Lock()
_decrefs: dict[str, deque] = {}
_exit_hooked = False


def lost_error(address: str, detail: Any = "", in_flight: bool = False) -> RemoteObjectError:
    """The manager server at ``address`` is gone (``errors.owner_gone``'s wording)."""
    return owner_gone(address, detail, owner="manager server", hosted="managed objects",
                      in_flight=in_flight)


class Line:
    """One thread's dedicated connection to the manager server at ``address``."""

    def __init__(self, address: str, authkey: bytes) -> None:
        hub = hub_for(authkey)
        self._slice, self._limit = hub.heartbeat_interval, hub.parent_timeout
        self.address = address
        self.authkey = authkey
        self.broken = False
        self._rids = itertools.count(1)
        try:
            self._channel = hub.open_channel(address)   # hub_for: its secret is authkey
            hub.client(address)  # liveness pings go this way: connect now, not when stuck
        except TransportError as exc:
            raise lost_error(address, exc) from exc
        Finalizer(self, self._channel.close)
        _all_lines.add(self)
        self.call("hello")

    def call(self, method: str, *args: Any) -> Any:
        """Send one call and wait for its reply on this thread."""
        if self.broken:
            raise lost_error(self.address)
        rid = next(self._rids)
        sent = False
        try:
            self._channel.send(_frame(rid, method, args))
            sent = True
            reply = self._receive(rid)
        except ChannelClosed as exc:
            self.close()
            raise lost_error(self.address, in_flight=sent) from exc
        except BaseException:
            self.close()  # a reply may still come: this line can no longer be trusted
            raise
        return _value(reply)

    def _receive(self, rid: int):
        while True:
            reply = self._next_reply(self._slice)
            if reply is not None and reply.rid == rid:
                return reply

    def _next_reply(self, timeout: float) -> Any:
        """The next reply, or None when none came within ``timeout`` (after a whole
        slice without one, the server is pinged: a vanished one raises)."""
        try:
            return unpack(self._channel.recv(timeout))
        except TimeoutError:
            if timeout >= self._slice:
                hub_for(self.authkey).ensure_alive(self.address, self._limit)
            return None

    @property
    def closed(self) -> bool:
        """The connection dropped (its server went away) even if no call failed on it."""
        return self._channel.closed

    def close(self) -> None:
        self.broken = True
        self._channel.close()


class ReplyTimeout(TimeoutError):
    """:meth:`PipelinedLine.result` waited ``timeout`` seconds; the call is still awaited."""


class PipelinedLine(Line):
    """A line whose calls may be in flight together, for a caller that asks for the
    next result before it needs it (a replay learner's next batch).

    :meth:`submit` sends a call and returns its request id at once; :meth:`result`
    waits for that call's reply on the calling thread. The server runs a line's calls
    one at a time in the order they arrive, so replies come back in that order; a
    reply read while waiting for another is kept for its own caller. Like a
    :class:`Line`, it costs no reader thread and no hand-over between threads. Any
    thread may use it. It is not in the per-thread map: its owner keeps it, so a
    call that blocks on it (a sample held back by a rate limiter) holds up no other
    calls of that thread.
    """

    def __init__(self, address: str, authkey: bytes) -> None:
        self._sending = threading.Lock()   # held while a frame is sent
        self._outbox_lock = threading.Lock()   # (taken after _sending, when both are)
        self._reading = threading.Lock()
        # signalled when a reading thread keeps a reply or stops reading, for the
        # threads waiting behind it (counted: nobody to wake costs nothing)
        self._news = threading.Condition(threading.Lock())
        self._waiters = 0
        self._kept: dict = {}         # request id -> reply read for it
        self._awaited: set = set()    # request ids sent and not yet taken or forgotten
        self._outbox: list = []       # calls for the feeder thread to send, in order
        self._feeder: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self._users_lock = threading.Lock()
        self._users = 0               # proxies that send on it (an object's line)
        self._released: list = []    # their objects' ids, once collected
        self.retiring = False
        self._ended = False           # retired for good: no proxy adopts it again
        self._sent = self._answered = 0   # calls sent on it, replies read (any)
        super().__init__(address, authkey)

    def submit(self, method: str, *args: Any, batch: bool = False) -> int:
        """Send ``method(*args)`` to the server's manager service; its request id.

        ``batch``: while an earlier call of this line is unanswered, hand the call to
        the line's feeder thread, which packs the calls made meanwhile into one frame
        (a burst costs a few frames). Such a call never waits for a send: while the
        feeder's send waits for the server to read, and the server's replies wait for
        this side to read, the caller goes on to read them. A call made when nothing
        is unanswered is sent at once from this thread either way.
        """
        with self._outbox_lock:
            if self.broken:
                raise lost_error(self.address)
            rid = next(self._rids)
            call = _call(rid, method, args)
            owed = self._sent - self._answered
            self._awaited.add(rid)
            self._sent += 1
            if batch and (owed or self._outbox):
                for arg in call.args:
                    if type(arg) is Encoded:
                        arg.own()   # sent later: the caller may change what it views
                self._outbox.append(call)
                if self._feeder is None:
                    self._feeder = threading.Thread(target=self._feed, daemon=True,
                                                    name=f"fibrl-line-feeder-{self.address}")
                    self._feeder.start()
                self._wake.set()
                return rid
        with self._sending:
            with self._outbox_lock:   # (calls queued before this one go first)
                calls, self._outbox = self._outbox, []
            calls.append(call)
            self._send(calls)
        return rid

    def _send(self, calls: list) -> None:
        """Send ``calls`` as one frame (``self._sending`` held)."""
        try:
            self._channel.send(pack(calls[0] if len(calls) == 1 else calls))
        except ChannelClosed as exc:
            self.close()
            raise lost_error(self.address) from exc

    def _feed(self) -> None:
        """Send what the outbox holds, as it comes; ends after a second with nothing,
        or with the line (whatever ends it: no call waits in the outbox unsent while
        the line stays open)."""
        idle = False
        try:
            while True:
                woken = self._wake.wait(1.0)
                with self._sending:
                    with self._outbox_lock:
                        self._wake.clear()
                        calls, self._outbox = self._outbox, []
                        if not calls and (not woken or self.broken):
                            self._feeder = None
                            idle = True
                            return
                    if calls and not self.broken:
                        self._send(calls)
        except RemoteObjectError:
            pass   # (_send closed the line: its callers' waits raise)
        finally:
            if not idle:
                self.close()
                with self._outbox_lock:
                    self._feeder = None

    def ready(self, rid: int) -> bool:
        """Whether the reply to ``rid`` is in (reads what has arrived, without waiting)."""
        if rid in self._kept:
            return True
        if not self._reading.acquire(blocking=False):
            return False
        try:
            while rid not in self._kept and self._read_one(0.001):
                pass
        except RemoteObjectError:
            return True   # result() raises at once
        finally:
            self._done_reading()
        return rid in self._kept

    def result(self, rid: int, timeout: Optional[float] = None) -> Any:
        """The value call ``rid`` returned (re-raising what it raised).

        Raises:
            ReplyTimeout: no reply within ``timeout`` seconds (None: no limit); the
                call stays awaited, so asking again keeps waiting.
            RemoteObjectError: the server is gone.
        """
        return _value(self.reply(rid, timeout))

    def reply(self, rid: int, timeout: Optional[float] = None) -> Any:
        """The reply to call ``rid`` as it came (see :meth:`result`); with ``timeout``
        0, what has arrived is read once. While another thread reads the line, this
        one takes its reply from what that thread keeps, woken as it keeps one: a
        reply is never held up behind a slower one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        looked = False
        while True:
            reply = self._kept.pop(rid, None)
            if reply is not None:
                self._awaited.discard(rid)
                return reply
            if self.broken:
                raise lost_error(self.address, in_flight=True)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                if looked:
                    raise ReplyTimeout(f"no reply from {self.address} within {timeout} s")
                looked = True
                self.ready(rid)   # one look at what has arrived
                continue
            if not self._reading.acquire(blocking=False):
                self._wait_news(rid, self._slice if left is None else min(left, self._slice))
                continue
            try:
                while rid not in self._kept:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._read_one(self._slice if left is None else min(self._slice, left))
            finally:
                self._done_reading()

    def _wait_news(self, rid: int, timeout: float) -> None:
        """Wait until the thread reading now keeps ``rid``'s reply or stops reading."""
        with self._news:
            self._waiters += 1
            try:
                if rid not in self._kept and self._reading.locked():
                    self._news.wait(timeout)
            finally:
                self._waiters -= 1

    def _done_reading(self) -> None:
        """Stop reading (``self._reading`` held): a waiting thread may read now."""
        self._reading.release()
        if self._waiters:
            with self._news:
                self._news.notify_all()

    def forget(self, rid: int) -> None:
        """Nobody will ask for ``rid``'s reply: drop it when it comes."""
        self._awaited.discard(rid)
        self._kept.pop(rid, None)

    def _read_one(self, timeout: float) -> bool:
        """Read one reply (``self._reading`` held); False when none came in ``timeout``,
        after checking that the server is alive."""
        if self.broken:
            raise lost_error(self.address, in_flight=True)
        try:
            reply = self._next_reply(timeout)
        except ChannelClosed as exc:
            self.close()
            raise lost_error(self.address, in_flight=True) from exc
        except RemoteObjectError:
            self.close()   # (silent past parent_timeout: its other calls fail at once too)
            raise
        if reply is None:
            return False
        self._keep(reply)
        return True

    # -- an object's line: used by the async proxies of one object in this process ----
    def adopt(self) -> bool:
        """Count one more proxy that sends on this line (one that is retiring carries
        on: its calls go after the decrefs already sent); False once it is closed."""
        with self._users_lock:
            if self.broken or self.closed or self._ended:
                return False
            self._users += 1
            return True

    def release(self, ident: str) -> None:
        """A proxy that sent on this line was collected (called on the janitor thread):
        its decref goes on this line, after every call it sent here, so none of them
        finds its object gone; the last one retires the line. On a line that is lost
        the decref goes the usual way, with the next call to the server."""
        with self._users_lock:
            self._users -= 1
            lost = self.broken or self.closed
            if not lost:
                self._released.append(ident)
                if self._users > 0 or self.retiring:
                    return
                self.retiring = True
        if lost:
            note_decref(self.address, ident)
            return
        threading.Thread(target=self._retire, daemon=True,
                         name=f"fibrl-line-retire-{self.address}").start()

    def drop(self) -> None:
        """A proxy that used this line, now lost, goes on with another: one user fewer;
        the decrefs of those collected meanwhile go the usual way."""
        with self._users_lock:
            self._users -= 1
            left, self._released = (self._released, []) if self._users <= 0 else ([], [])
        for ident in left:
            note_decref(self.address, ident)

    @property
    def usable(self) -> bool:
        """Open, and not retired for good."""
        return not (self.broken or self.closed or self._ended)

    def _retire(self) -> None:
        """Retire the line (see :meth:`_retiring`); close it unless a proxy adopted it
        meanwhile. Decrefs it could not send go the usual way."""
        carry_on = False
        try:
            carry_on = self._retiring()
        except (RemoteObjectError, TransportError):
            pass   # (the server is gone or went silent: the line is closed)
        finally:
            with self._users_lock:
                if carry_on:
                    self.retiring = False
                    left: list = []
                else:
                    self._ended = True
                    left, self._released = self._released, []
            if not carry_on:
                for ident in left:
                    note_decref(self.address, ident)
                self.close()

    def _retiring(self) -> bool:
        """Send the collected proxies' decrefs and wait for their answer (the calls
        before them have run by then), and read the replies still owed to calls whose
        handles were dropped, so that closing cuts none of them off. True when a proxy
        adopted the line meanwhile (it carries on)."""
        while True:
            with self._users_lock:
                idents, self._released = self._released, []
            if idents:
                try:
                    self.result(self.submit("decref", tuple(idents), batch=True))
                except BaseException:
                    with self._users_lock:
                        self._released[:0] = idents   # (sent the usual way, see _retire)
                    raise
            while self._sent - self._answered > 0:
                if self._users:
                    return True
                self._reading.acquire()
                try:
                    self._read_one(self._slice)
                finally:
                    self._done_reading()
            with self._users_lock:
                if self._users:
                    return True
                if not self._released:
                    self._ended = True   # (checked with the count: no adoption after it)
                    return False

    def _keep(self, reply: Any) -> None:
        """Keep each reply of a frame that someone awaits (``self._reading`` held)."""
        for one in reply if type(reply) is list else (reply,):   # (a burst's replies)
            self._answered += 1
            rid = one.rid
            if rid in self._awaited:
                self._kept[rid] = one
                if rid not in self._awaited:   # forgotten meanwhile: nobody takes it
                    self._kept.pop(rid, None)
        if self._waiters:
            with self._news:
                self._news.notify_all()


def _call(rid: int, method: str, args: tuple) -> Call:
    """Call ``rid`` to the server's manager service."""
    return Call(rid, MANAGER_OID, method, wrap_args(args))


def _frame(rid: int, method: str, args: tuple) -> list:
    """The frame of call ``rid`` to the server's manager service."""
    return pack(_call(rid, method, args))


def _value(reply: Any) -> Any:
    """What a reply carries; raises what the call raised (with the server's traceback
    as ``__cause__``, as unpickling gives it)."""
    value = serialization.loads(reply.value) if reply.encoded else reply.value
    if not reply.ok:
        raise value
    return value


def line_for(address: str, authkey: bytes) -> Line:
    """This thread's line to ``address`` (connected on first use, again after a loss)."""
    lines = getattr(_local, "lines", None)
    if lines is None:
        lines = _local.lines = {}
    line = lines.get(address)
    if line is None or line.broken or line.closed or line.authkey != authkey:
        _hook_exit()
        line = lines[address] = Line(address, authkey)
    return line


def close_lines(address: Optional[str] = None) -> None:
    """Close this process's lines (to ``address`` only, if given)."""
    for line in list(_all_lines):
        if address is None or line.address == address:
            line.close()


def hub_for(authkey: bytes) -> Hub:
    """The hub whose connections authenticate with ``authkey`` (the process hub if it is its)."""
    hub = get_hub()
    if bytes(authkey) == hub.secret:
        return hub
    with _hubs_lock:
        other = _hubs.get(bytes(authkey))
        if other is None:
            other = _hubs[bytes(authkey)] = Hub.from_config(runtime.current_config(), authkey,
                                                              host=hub.host)
            _hook_exit()
    return other


def note_decref(address: str, ident: str) -> None:
    """Remember that a proxy of ``ident`` died. Called by finalizers: must not block."""
    pending = _decrefs.get(address)
    if pending is not None:
        pending.append(ident)


def decref_queue(address: str) -> deque:
    """The deque of pending decrefs for ``address`` (created by the first proxy)."""
    return _decrefs.setdefault(address, deque())


def take_decrefs(address: str) -> tuple:
    """Pending decrefs for ``address``, sent along with the next call to it."""
    pending = _decrefs.get(address)
    if not pending:
        return ()
    taken = []
    while pending:
        try:
            taken.append(pending.popleft())
        except IndexError:
            break
    return tuple(taken)


def _hook_exit() -> None:
    """Close lines and extra hubs at exit, after managers shut down and children ended,
    before the process hub closes."""
    global _exit_hooked
    if not _exit_hooked:
        runtime.at_exit(runtime.CONNECTIONS, _close_everything)
        _exit_hooked = True


def _close_everything() -> None:
    close_lines()
    with _hubs_lock:
        hubs = list(_hubs.values())
        _hubs.clear()
    for hub in hubs:
        hub.close()
