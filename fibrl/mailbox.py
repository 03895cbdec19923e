"""The hosted FIFO behind queues and pipe ends.

A :class:`Mailbox` lives in the hub of the process that created it and holds
serialized items (never unpickled here). ``get`` requests that cannot be
answered are parked in arrival order, so an item goes to whichever consumer
asked first and no consumer prefetches more than it asked for. Deadlines are
the mailbox's: when a parked ``get`` times out the mailbox answers ``Empty``
itself, so an item is never handed to a getter that stopped waiting.

A consumer in another process reads through a *window* (:class:`Window`, one
per process and queue): the owner pushes items ahead into it, on one stream
call, while that process calls ``get()``. The window's size adapts on the
consumer's side: it starts at one item, doubles each time a ``get()`` finds it
empty, up to ``WINDOW_ITEMS``, and halves when recalled. The owner bounds it in
bytes (``WINDOW_BYTES``) and, while several consumers share the queue, to twice
the smallest window (at least ``FAIR_MIN``, at most ``SHARED_ITEMS``). Items
pushed go to consumers waiting in ``get()`` first, one each in turn, then to
the windows holding fewest (each an even share of what is stored, as far as it
has room). The consumer counts the items its ``get()`` returned and sends that
count (its *acknowledgement*) on its next request to the owner, or within
``ACK_DELAY`` seconds. A window that holds items while other consumers wait,
and whose consumer has been silent for ``RECALL_GAPS`` times its usual gap
between messages (``RECALL_MIN`` to ``RECALL_IDLE`` seconds), is *recalled*:
the consumer drops what it has not returned, answers with its count, and the
owner puts those items back in the queue at their place (merged by the order
they were first pushed, whichever window gives back first). Every window stays
in queue order too: an item given back is pushed only to a window that holds
nothing newer, so no consumer reaches a stop sentinel while an item put before
it is still on its way.

    consumer (Window)                          owner (Mailbox)
    get(): open(size) ---------------------->  op_window: stream; push items
           <-------- item, item, ... -------   (up to size items / WINDOW_BYTES held)
    get(): returned++; want(returned, size) ->  op_want: forget returned ones, push more
           <----------- "recall" ----------   (others wait, this one is idle)
    returned(count) ----------------------->  op_returned: the rest -> back in the queue
           <----------- "resume" ----------   (pushes before it were given back too)
                                               drop_peer: everything held -> back in the queue

An item handed to another process stays *unacknowledged* until that process
confirms it was returned by ``get()``. When the process's connection drops
first (it died, or the answer could not be delivered), its unacknowledged
items go back to the front of the queue, in order. So no item is ever lost,
and an item is returned by more than one ``get()`` only when the process
whose ``get()`` returned it died before its acknowledgement reached the
owner. A request/reply ``get`` (the owner's own, a pipe's) is acknowledged
the same way by :func:`take`.

Besides the queue operations it counts the open *writer* handles of a pipe
end (per peer, so a dead process's handles close with it) to raise
``EOFError`` like a closed pipe.
"""
from __future__ import annotations

import os
import pickle
import queue
import threading
import time
from array import array
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

from .errors import ChannelClosed
from .hub import Handle, LocalReply, ReplySink, SharedService, get_hub
from .messages import Call, Reply, blob, pack
from .serialization import OOB_THRESHOLD, Encoded

if TYPE_CHECKING:
    from .transport import Peer

__all__ = ["Mailbox", "PipeBox", "Window", "EMPTY", "take"]

EMPTY = object()

#: Most items a consumer's window holds (pushed, not yet acknowledged). It must outlast
#: an acknowledgement's trip and the push it frees at the consumer's rate, or get() runs
#: dry: 256 items (1.7 ms at 150k items/s) did not on a busy 2-core machine.
# What a consumer's window says with each acknowledgement (its ``waiting`` argument):
IDLE = 0      # no get() of that process waits
WAITING = 1   # a get() waits: the next item stored goes to it
ASKING = 2    # a non-blocking get() asks now: push an item stored, then answer it
WINDOW_ITEMS = 4096
#: Most bytes a window holds; one item always fits, however large. 4 MiB (four 1 MB items)
#: ran dry between acknowledgements at 800 MB/s.
WINDOW_BYTES = 16 << 20
#: A consumer acknowledges what its get() returned at the latest this late.
ACK_DELAY = 0.002
#: A window whose consumer was silent this long is recalled while others wait...
RECALL_IDLE = 0.05
#: ...or sooner: after RECALL_GAPS of its consumer's usual silences, but not before this.
RECALL_MIN = 0.002
RECALL_GAPS = 2
#: With several consumers, no window holds more than twice the smallest, or this...
FAIR_MIN = 4
#: ...nor more than this: what a consumer that stops early holds, the others wait for
#: until it is recalled.
SHARED_ITEMS = 256
#: Pushes closer together than this are a burst: sent by a thread of their own, batched.
BURST_GAP = 0.0005


def _size(payload: Any) -> int:
    if type(payload) is Encoded:
        return payload.nbytes
    return memoryview(payload).nbytes


class _Parked:
    __slots__ = ("reply", "payload", "timer", "token")

    def __init__(self, reply: ReplySink, payload: Any = None, token: Any = None) -> None:
        self.reply = reply
        self.payload = payload
        self.timer: Optional[list] = None   # the timers' entry of its deadline
        self.token = token


class _Win:
    """The owner's side of one consumer's window: what was pushed and not yet
    acknowledged (``held``, oldest first), and how much more may be pushed."""

    __slots__ = ("sink", "peer", "size", "held", "nbytes", "base", "waiting", "heard",
                 "recalling", "gap")

    def __init__(self, sink: ReplySink, peer: Peer, size: int) -> None:
        self.sink = sink
        self.peer = peer         # sink's: a window's consumer is another process
        self.size = size
        self.held: deque = deque()   # (push number, item), oldest first
        self.nbytes = 0
        self.base = 0            # how many items of this stream were acknowledged
        self.waiting = True      # its consumer is inside get() with nothing to return
        self.heard = time.monotonic()
        self.recalling = False
        self.gap = RECALL_IDLE / RECALL_GAPS   # its consumer's usual silence (average)

    def heard_from(self, now: float) -> None:
        """Its consumer sent a message: learn how long it usually stays silent."""
        self.gap += 0.25 * (min(now - self.heard, RECALL_IDLE) - self.gap)
        self.heard = now

    def recall_due(self) -> float:
        return self.heard + min(RECALL_IDLE, max(RECALL_MIN, RECALL_GAPS * self.gap))

    def take_held(self) -> list:
        """Forget everything held (it goes back to the queue); (push number, item) pairs."""
        held, self.held = list(self.held), deque()
        self.nbytes = 0
        return held

    def room(self, cap: int = WINDOW_ITEMS, number: Optional[int] = None) -> bool:
        """Whether the item of push number ``number`` (None: a new one) may be pushed
        here. Every window stays in queue order: an item given back does not go
        behind a newer one (its consumer could stop at a sentinel first)."""
        held = self.held
        return not self.recalling and len(held) < min(self.size, cap) and (
            not held or (self.nbytes < WINDOW_BYTES
                         and (number is None or held[-1][0] < number)))

    def ack(self, returned: int) -> int:
        """Forget the items its consumer returned; how many were forgotten."""
        n = min(returned - self.base, len(self.held))
        for _ in range(n):
            self.nbytes -= _size(self.held.popleft()[1])
        if n > 0:
            self.base += n
        return max(n, 0)


class Mailbox(SharedService):
    """A FIFO of serialized items with parked getters, putters, joiners and pollers."""

    _ordered = True   # give-backs are merged by push number (see _requeue)

    def __init__(self, maxsize: int = 0, joinable: bool = False, pipe_end: bool = False) -> None:
        import threading

        self.maxsize = maxsize if maxsize > 0 else 0
        self._items: deque = deque()
        self._getters: deque[_Parked] = deque()
        self._putters: deque[_Parked] = deque()
        self._pollers: list[_Parked] = []
        self._joiners: list[ReplySink] = []
        self._unfinished = 0 if joinable else None
        self._lock = threading.RLock()
        # the process that put last (None: this one): a getter in this process reads
        # that process's frames itself while it waits (see take)
        self.feeder: Any = None
        self._writers: Optional[dict] = {} if pipe_end else None  # peer key -> count
        self._eof = False
        self._unacked: dict[int, dict[int, Any]] = {}  # peer id -> {rid: item}, in order
        self._windows: dict[int, _Win] = {}  # peer id -> its consumer window
        self._held = 0                       # items in windows, not acknowledged
        self._pushed = 0                     # push number of the next item first pushed
        # push numbers of the items at the front of _items that went back from a
        # window (the first len(_redo) items): a give-back is merged in by them, so
        # the queue keeps its order whichever window gives back first
        self._redo: deque = deque()
        self._turn = 0                       # where the next push starts looking
        self._recall_timer: Optional[list] = None   # the timers' entry of the next check
        self._recall_at = 0.0
        self._outgoing: dict = {}            # window -> what to push to it, in order
        self._send_lock = threading.Lock()   # one thread sends what is outgoing
        self._last_push = 0.0
        self._sender: Optional[threading.Thread] = None
        self._sender_wake: Optional[threading.Event] = None
        self._retired = False

    # -- helpers ---------------------------------------------------------------
    def _park(self, where, parked: _Parked, timeout: Optional[float], on_timeout) -> None:
        where.append(parked)
        if timeout is not None:
            parked.timer = self.hub.timers.call_at(
                time.monotonic() + max(timeout, 0.0), lambda: self._expire(where, parked,
                                                                            on_timeout))

    def _expire(self, where, parked: _Parked, on_timeout) -> None:
        with self._lock:
            try:
                where.remove(parked)
            except ValueError:
                return  # answered meanwhile
        on_timeout(parked.reply)

    def _unpark(self, parked: _Parked) -> None:
        if parked.timer is not None:
            self.hub.timers.cancel(parked.timer)

    def _full(self) -> bool:
        return self.maxsize > 0 and len(self._items) + self._held >= self.maxsize

    def _count(self) -> int:
        """Items not yet returned by a get(): stored, or held in a window."""
        return len(self._items) + self._held

    def _hand(self, reply: ReplySink, payload: Any) -> bool:
        """Answer a getter with ``payload``; a remote one holds it unacknowledged (lock held)."""
        if not reply(payload):
            return False
        if reply.peer is not None and reply.wanted:
            self._unacked.setdefault(reply.peer.id, {})[reply.rid] = payload
        return True

    def _deliver(self, payload: Any) -> None:
        """Give ``payload`` to the oldest live getter, or store it (lock held)."""
        while self._getters:
            parked = self._getters.popleft()
            self._unpark(parked)
            if self._hand(parked.reply, payload):
                return
        self._items.append(payload)
        # with items stored before it and none given back, the last fill found no
        # window with room for the first of them, and this one does not go ahead of it
        if self._windows and (len(self._items) == 1 or self._redo):
            self._fill()
        if self._pollers and self._items:
            self._wake_pollers(True)

    # -- windows ---------------------------------------------------------------------
    def _fair_cap(self, wins: list) -> int:
        """Most items any of ``wins`` may hold: no window grows past twice the smallest
        open one (a consumer that drains slowly keeps the others' lead over it small),
        nor past ``SHARED_ITEMS`` when several consumers share the queue."""
        sizes = [w.size for w in wins if w.size > 0]
        if len(wins) < 2 or not sizes:
            return WINDOW_ITEMS
        return min(SHARED_ITEMS, max(FAIR_MIN, 2 * min(sizes)))

    def _pick(self, wins: list, cap: int, number: Optional[int] = None) -> Optional[_Win]:
        """The window of ``wins`` the next item (push number ``number``; None: never
        pushed) goes to: a waiting consumer's, in turn, else the one with room that
        holds fewest, among those it may go behind (lock held)."""
        if len(wins) == 1:   # one consumer: no turn, no fairness cap
            return wins[0] if wins[0].room(WINDOW_ITEMS, number) else None
        n = len(wins)
        best = None
        for i in range(n):
            win = wins[(self._turn + i) % n]
            if not win.room(cap, number):
                continue
            if win.waiting:
                self._turn = (self._turn + i + 1) % n
                return win
            if best is None or len(win.held) < len(best.held):
                best = win
        return best

    def _fill(self) -> None:
        """Push stored items into windows with room, in order (lock held)."""
        if len(self._windows) == 1 and not self._redo:
            self._fill_one()
            return
        pushed: dict = {}
        wins = list(self._windows.values())   # (neither they nor their sizes change here)
        cap = self._fair_cap(wins)
        while self._items:
            # an item given back waits, and the items behind it with it, until a window
            # holds nothing newer (it drains: no new item is pushed meanwhile)
            win = self._pick(wins, cap, self._redo[0] if self._redo else None)
            if win is None:
                break
            # a waiting consumer gets one item, in turn; else the window holding fewest
            # takes an even share of what is stored at once (as much as it has room for)
            share = 1 if win.waiting or self._redo else len(self._items) // len(wins)
            win.waiting = False   # the next item goes to another waiting consumer
            out = pushed.get(win)
            if out is None:
                out = pushed[win] = []
            while True:
                payload, number = self._popleft()
                if number is None:
                    number, self._pushed = self._pushed, self._pushed + 1
                win.held.append((number, payload))
                win.nbytes += _size(payload)
                self._held += 1
                out.append(payload)
                share -= 1
                if share <= 0 or not self._items or not win.room(cap):
                    break
        for win, payloads in pushed.items():
            self._outgoing.setdefault(win, []).extend(payloads)
        if self._getters or len(self._windows) > 1:   # (else nobody else waits)
            self._plan_recall()

    def _fill_one(self) -> None:
        """:meth:`_fill` for one consumer and no item given back (the usual case): no
        window to choose, every item gets the next push number (lock held)."""
        (win,) = self._windows.values()
        items, out = self._items, None
        while items and win.room():
            payload = items.popleft()
            win.held.append((self._pushed, payload))
            self._pushed += 1
            win.nbytes += _size(payload)
            self._held += 1
            if out is None:
                out = self._outgoing.setdefault(win, [])
                win.waiting = False
            out.append(payload)
        if self._getters:
            self._plan_recall()

    def _waiters(self) -> bool:
        return bool(self._getters) or any(w.waiting for w in self._windows.values())

    def _close_window(self, win: _Win) -> None:
        """Put what ``win`` held back in front, in order (lock held)."""
        if self._windows.get(win.peer.id) is win:
            del self._windows[win.peer.id]
        self._take_back(win)

    def _take_back(self, win: _Win) -> bool:
        """Put everything ``win`` holds back in the queue; False: it held nothing (lock held)."""
        held = win.take_held()
        self._held -= len(held)
        if held:
            self._requeue(held)
        return bool(held)

    def _plan_recall(self) -> None:
        """Recall windows silent for RECALL_IDLE while others wait; check again when
        the next one would be (lock held)."""
        if self._items or not self._waiters():
            return
        now = time.monotonic()
        later = None
        for win in list(self._windows.values()):
            if not win.held or win.recalling or win.waiting:
                continue
            due = win.recall_due()
            if due <= now:
                win.recalling = True
                self._outgoing.setdefault(win, []).append("recall")
            elif later is None or due < later:
                later = due
        if later is None:
            return
        if self._recall_timer is not None and self._recall_at <= later:
            return
        if self._recall_timer is not None:
            self.hub.timers.cancel(self._recall_timer)
        self._recall_at = later
        self._recall_timer = self.hub.timers.call_at(later, self._recall_check)

    def _recall_check(self) -> None:
        with self._lock:
            self._recall_timer = None
            self._plan_recall()
        self._send_outgoing()

    def _send_outgoing(self) -> None:
        """Send what was queued for windows, after the lock is released: a send that
        waits (a consumer slow to read, a dead one not yet noticed) holds up no other
        operation. One thread at a time sends, in the order things were queued."""
        while self._outgoing:
            if not self._send_lock.acquire(False):
                return  # the thread sending now sends ours too
            try:
                with self._lock:
                    outgoing, self._outgoing = self._outgoing, {}
                for win, values in outgoing.items():
                    _push(win, values)
            finally:
                self._send_lock.release()

    def _kick(self) -> None:
        """Have what is outgoing sent: by this thread when no push went out just now
        (latency), else by the mailbox's sender thread, which sends what piled up
        meanwhile as one frame per consumer (throughput)."""
        now = time.monotonic()
        if now - self._last_push > BURST_GAP and not self._send_lock.locked():
            self._last_push = now
            self._send_outgoing()
            return
        self._last_push = now
        wake = self._sender_wake
        if wake is None:
            wake = self._sender_wake = threading.Event()
            self._sender = threading.Thread(target=self._send_loop, args=(wake,), daemon=True,
                                            name=f"fibrl-push-{self.oid}")
            self._sender.start()
        if not wake.is_set():
            wake.set()

    def _send_loop(self, wake: threading.Event) -> None:
        while not self._retired:
            wake.wait()
            wake.clear()
            time.sleep(0)  # let a producer that is putting add more to this frame
            self._send_outgoing()

    def dispatch(self, method: str, args: tuple, reply: ReplySink) -> None:
        super().dispatch(method, args, reply)
        if self._outgoing:
            self._kick()

    def op_window(self, reply: ReplySink, size: int) -> None:
        """A consumer in another process opens its window: items are pushed to it as
        replies of this call (see :class:`Window`)."""
        peer = reply.peer
        if peer is None or not reply.wanted:
            raise RuntimeError("a window is opened by a consumer in another process")
        with self._lock:
            old = self._windows.get(peer.id)
            if old is not None:
                self._close_window(old)
            self._windows[peer.id] = _Win(reply, peer, _clamp(size))
            if self._items:
                self._fill()
            else:
                self._plan_recall()

    def op_want(self, reply: ReplySink, returned: int, size: int, waiting: int) -> None:
        """The window's consumer returned ``returned`` items so far and wants ``size``
        held. ``waiting``: :data:`IDLE`, :data:`WAITING`, or :data:`ASKING` (a
        non-blocking get() waits for this reply only: an item stored is pushed first)."""
        with self._lock:
            win = self._windows.get(reply.peer.id) if reply.peer is not None else None
            if win is not None:
                self._acked(win, returned)
                win.size, win.waiting = _clamp(size), bool(waiting)
                win.heard_from(time.monotonic())
                if self._items:
                    self._fill()
                else:
                    self._plan_recall()   # its silence restarts; another may wait
                if waiting == ASKING:
                    win.waiting = False
                    # answered behind what was pushed, in the same frame: the get()
                    # that waits for this answer finds a stored item already there
                    self._outgoing.setdefault(win, []).append(reply)
                    return
        reply(None)

    def op_returned(self, reply: ReplySink, returned: int, size: int = 0,
                    waiting: int = IDLE) -> None:
        """The window's consumer returned ``returned`` items so far and dropped the
        rest it held (recalled, or closing): those go back to the queue, in order. It
        wants ``size`` held from now on (0: none until it asks), and waits or not.

        Items pushed before this arrived are dropped by the consumer too, so a
        ``"resume"`` marker goes ahead of the next push: from there on, what comes
        is the consumer's again."""
        with self._lock:
            win = self._windows.get(reply.peer.id) if reply.peer is not None else None
            if win is not None:
                self._acked(win, returned)
                win.base = returned   # what it held went back: counting restarts here
                win.recalling = False
                win.heard_from(time.monotonic())
                win.waiting, win.size = bool(waiting), max(0, min(int(size), WINDOW_ITEMS))
                self._outgoing.setdefault(win, []).append("resume")
                if not self._take_back(win) and self._items:
                    self._fill()
        reply(None)

    def _acked(self, win: _Win, returned: int) -> None:
        n = win.ack(returned)
        if n:
            self._held -= n
            if self._putters:
                self._admit_putters()

    def _requeue(self, held: list) -> None:
        """Put items handed out and never acknowledged back, in order (lock held).

        ``held``: (push number, item) pairs, oldest first; -1 for an item that
        no window held (it goes first). They are merged with what earlier
        give-backs put in front, by push number: an item given back late still
        comes before items put after it (a consumer's stop sentinel, say)."""
        if self._ordered:
            # a window's items came in push order, but one may hold an item given back
            # earlier, and earlier give-backs wait in front: merge all by push number
            front = [(self._redo.popleft(), self._items.popleft())
                     for _ in range(len(self._redo))]
            held = sorted(front + list(held), key=lambda pair: pair[0])
        rest: deque[tuple[int, Any]] = deque()
        for number, payload in held:
            while self._getters and not rest:
                parked = self._getters.popleft()
                self._unpark(parked)
                if self._hand(parked.reply, payload):
                    break
            else:
                rest.append((number, payload))
        if not rest:
            return
        self._items.extendleft(payload for _, payload in reversed(rest))
        if self._ordered:
            self._redo.extendleft(number for number, _ in reversed(rest))
        if self._windows:
            self._fill()
        if self._items:
            self._wake_pollers(True)

    def _popleft(self) -> tuple:
        """The first item stored, and its push number (None: never pushed) (lock held)."""
        return self._items.popleft(), (self._redo.popleft() if self._redo else None)

    def _pushleft(self, payload: Any, number: Optional[int]) -> None:
        """Undo :meth:`_popleft` (lock held)."""
        self._items.appendleft(payload)
        if number is not None:
            self._redo.appendleft(number)

    def _wake_pollers(self, value: bool) -> None:
        pollers, self._pollers = self._pollers, []
        for parked in pollers:
            self._unpark(parked)
            parked.reply(value)

    def _admit_putters(self) -> None:
        while self._putters and not self._full():
            parked = self._putters.popleft()
            self._unpark(parked)
            self._accept(parked.payload)
            parked.reply(None)

    def _accept(self, payload: Any) -> None:
        if self._unfinished is not None:
            self._unfinished += 1
        self._deliver(payload)

    # -- fast paths for the owner process (no handle, no event) ------------------------
    def give(self, payload: Any) -> None:
        """Store ``payload``; an unbounded queue's ``put`` in the owner process."""
        with self._lock:
            self._accept(payload)
        if self._outgoing:
            self._kick()

    def take_nowait(self) -> Any:
        """Pop an item if one is there, else return :data:`EMPTY` (owner process only)."""
        with self._lock:
            if not self._items:
                return EMPTY
            payload, _ = self._popleft()
            if self._putters:
                self._admit_putters()
        if self._outgoing:
            self._send_outgoing()
        return payload

    # -- queue operations ----------------------------------------------------------
    def op_put(self, reply: ReplySink, payload: Any, timeout: Optional[float] = None) -> None:
        self.feeder = reply.peer
        with self._lock:
            if not self._full():
                self._accept(payload)
                reply(None)
            elif timeout is not None and timeout <= 0:
                raise queue.Full
            else:
                self._park(self._putters, _Parked(reply, payload), timeout,
                           lambda r: r.fail(queue.Full()))

    def op_put_run(self, reply: ReplySink, run: "_Run") -> None:
        """Items one process put one after another (one-way ``put`` calls that its
        connection sent together, see :func:`merge_puts`), in order."""
        with self._lock:
            for payload in run.items():
                self.op_put(reply, payload, None)

    def op_get(self, reply: ReplySink, timeout: Optional[float] = None) -> None:
        with self._lock:
            if self._items:
                payload, number = self._popleft()
                if not self._hand(reply, payload):
                    self._pushleft(payload, number)
                    return
                self._admit_putters()
            elif self._eof:
                raise EOFError("the other end of the pipe was closed")
            elif timeout is not None and timeout <= 0:
                raise queue.Empty
            else:
                self._park(self._getters, _Parked(reply), timeout,
                           lambda r: r.fail(queue.Empty()))
                if self._windows:
                    self._plan_recall()

    def op_ack(self, reply: ReplySink, rid: int) -> None:
        """The calling process received the item it asked for with call ``rid``."""
        peer = reply.peer
        if peer is not None:   # (a call of this process gets its item unacknowledged)
            with self._lock:
                held = self._unacked.get(peer.id)
                if held is not None:
                    held.pop(rid, None)
                    if not held:
                        del self._unacked[peer.id]
        reply(None)

    def op_poll(self, reply: ReplySink, timeout: Optional[float] = 0.0, token: Any = None) -> None:
        with self._lock:
            if self._items or self._eof:
                reply(True)
            elif timeout is not None and timeout <= 0:
                reply(False)
            else:
                self._park(self._pollers, _Parked(reply, token=token), timeout,
                           lambda r: r(False))

    def op_unpoll(self, reply: ReplySink, token: Any) -> None:
        with self._lock:
            keep = [p for p in self._pollers if p.token != token or p.reply.peer != reply.peer]
            dropped = [p for p in self._pollers if p not in keep]
            self._pollers = keep
        for parked in dropped:
            self._unpark(parked)
            parked.reply(False)
        reply(None)

    def op_qsize(self, reply: ReplySink) -> None:
        reply(self._count())

    def op_empty(self, reply: ReplySink) -> None:
        reply(not self._count())

    def op_full(self, reply: ReplySink) -> None:
        reply(self._full())

    def op_task_done(self, reply: ReplySink) -> None:
        with self._lock:
            if not self._unfinished:
                raise ValueError("task_done() called too many times")
            self._unfinished -= 1
            if self._unfinished == 0:
                joiners, self._joiners = self._joiners, []
                for joiner in joiners:
                    joiner(None)
        reply(None)

    def op_join(self, reply: ReplySink) -> None:
        with self._lock:
            if not self._unfinished:
                reply(None)
            else:
                self._joiners.append(reply)

    # -- pipe end bookkeeping ------------------------------------------------------
    def op_attach(self, reply: ReplySink, key: Any = None) -> None:
        """Count one more open writer handle, owned by ``key`` or the calling peer."""
        writers = self._writers
        assert writers is not None   # (a pipe end's operation)
        with self._lock:
            owner = _owner(reply, key)
            writers[owner] = writers.get(owner, 0) + 1
        reply(None)

    def op_adopt(self, reply: ReplySink) -> None:
        """Move one in-flight handle (pickled, now unpickled) to the calling peer."""
        writers = self._writers
        assert writers is not None   # (a pipe end's operation)
        with self._lock:
            self._take("inflight")
            owner = _owner(reply, None)
            writers[owner] = writers.get(owner, 0) + 1
        reply(None)

    def op_detach(self, reply: ReplySink) -> None:
        with self._lock:
            self._take(_owner(reply, None))
            self._check_eof()
        reply(None)

    def _take(self, owner: Any) -> None:
        writers = self._writers
        assert writers is not None   # (a pipe end's operation)
        count = writers.get(owner, 0)
        if count <= 1:
            writers.pop(owner, None)
        else:
            writers[owner] = count - 1

    def _check_eof(self) -> None:
        if self._writers or self._eof:
            return
        self._eof = True
        getters, self._getters = self._getters, deque()
        for parked in getters:
            self._unpark(parked)
            parked.reply.fail(EOFError("the other end of the pipe was closed"))
        self._wake_pollers(True)

    # -- lifecycle -------------------------------------------------------------------
    def drop_peer(self, peer) -> None:
        with self._lock:
            held = self._unacked.pop(peer.id, None)
            win = self._windows.get(peer.id)
            if win is not None:
                self._close_window(win)
            for where in (self._getters, self._putters, self._pollers):
                for parked in [p for p in where if p.reply.peer is peer]:
                    where.remove(parked)
                    self._unpark(parked)
            self._joiners = [j for j in self._joiners if j.peer is not peer]
            if held:
                self._requeue([(-1, payload) for payload in held.values()])
            if self._writers is not None and self._writers.pop(("peer", peer.id), None):
                self._check_eof()
        if self._outgoing:
            self._send_outgoing()

    def closed(self) -> None:
        from .errors import object_gone

        err = object_gone(self.oid, "its process", "closed")
        self._retired = True
        if self._sender_wake is not None:
            self._sender_wake.set()
        with self._lock:
            parked = list(self._getters) + list(self._putters) + self._pollers
            self._getters.clear()
            self._putters.clear()
            self._pollers.clear()
            wins, self._windows = list(self._windows.values()), {}
            # answers that were to follow pushes (a non-blocking get's)
            answers = [v for values in self._outgoing.values() for v in values
                       if isinstance(v, ReplySink)]
            self._outgoing = {}
            if self._recall_timer is not None:
                self.hub.timers.cancel(self._recall_timer)
                self._recall_timer = None
        for p in parked:
            self._unpark(p)
            p.reply.fail(err)
        for sink in answers + [win.sink for win in wins]:
            sink.fail(err)


def take(hub: Any, address: Optional[str], oid: str, timeout: Optional[float]) -> Any:
    """``get`` from the mailbox ``oid`` at ``address`` and acknowledge what arrived.

    The acknowledgement is a one-way message sent before this returns, so the
    owner re-queues the item only if this process dies in between.
    """
    handle = hub.call_async(address, oid, "get", timeout)
    if not handle.ready() and hub.is_local(address):
        feeder = getattr(hub.service(oid), "feeder", None)
        if feeder is not None:   # another process put last: read its frames here
            hub.wait_reading(handle, feeder)
    payload = hub.wait(handle, address, None)
    if handle.rid:
        hub.send(address, oid, "ack", handle.rid, inline=True)
    return payload


class Window:
    """This process's window on a queue that another process owns: the items its
    owner pushed ahead, and what ``get()`` returned of them (see the module doc).

    One per process and queue, shared by the process's handles and threads. The
    stream that carries the items is opened by the first ``get()``; the owner
    pushes only while the window has room, and room comes from what ``get()``
    returned, so a process that stops calling ``get()`` receives at most one
    window more, which is recalled as soon as another consumer waits for it.
    """

    _registry: dict = {}
    _registry_lock = threading.Lock()
    _hooked = False   # close_all runs at this process's exit
    epoch = 0         # one more in each forked child: windows found before are not its own
    #: windows whose owner was not yet told all that get() returned
    unreported: set = set()

    def __init__(self, address: str, oid: str) -> None:
        self.address, self.oid = address, oid
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)   # (get() takes the lock itself: faster)
        self.items: deque = deque()
        self.stream: Optional[object] = None   # the open stream's token; None: closed
        self.rid = 0
        self.client: Any = None  # the connection the stream is on (never a new one)
        self.size = 1          # items this process asks the owner to hold for it
        self.returned = 0      # items get() returned from this stream
        self.reported = 0      # the count the owner was last told
        self.waiters = 0       # threads of this process waiting in get()
        self.error: Optional[BaseException] = None
        self.timer: Optional[list] = None   # the timers' entry that acknowledges
        # "resume" markers still due: the owner pushed before it saw this process
        # give its items back, so what arrives until then went back too and is dropped
        self.stale = 0

    @classmethod
    def of(cls, address: str, oid: str) -> "Window":
        """This process's window on the queue ``oid`` at ``address`` (made on first use)."""
        key = (address, oid)
        win = cls._registry.get(key)
        if win is None:
            with cls._registry_lock:
                if not cls._hooked:
                    from . import runtime

                    runtime.at_exit(runtime.CONNECTIONS, cls.close_all)
                    cls._hooked = True
                win = cls._registry.get(key)
                if win is None:
                    win = cls._registry[key] = cls(address, oid)
                    # what get() returned is acknowledged ahead of this process's other
                    # requests, so the owner's empty() and qsize() count it as taken
                    get_hub().before_send(_acks_ahead)
        return win

    @classmethod
    def find(cls, address: str, oid: str) -> Optional["Window"]:
        return cls._registry.get((address, oid))

    @classmethod
    def _forget_in_child(cls) -> None:
        """A forked child starts with no window (its parent's streams are not its own)."""
        cls._registry, cls.unreported, cls._hooked = {}, set(), False
        cls.epoch += 1
        cls._registry_lock = threading.Lock()

    @classmethod
    def sync_to(cls, address: str) -> None:
        """Acknowledge to the process at ``address`` what get() returned of its queues,
        ahead of another message to it (so the owner's counts follow what it is told)."""
        for win in list(cls.unreported):
            if win.address == address:
                win.sync()

    @classmethod
    def close_all(cls) -> None:
        """At exit: tell each owner what get() returned; the rest goes back."""
        for win in list(cls._registry.values()):
            win.close()

    # -- talking to the owner (cond held) ---------------------------------------------
    def _open(self, hub: Any) -> None:
        token = object()
        self.stream, self.returned, self.reported, self.error = token, 0, 0, None
        self.items.clear()
        self.stale = 0
        self.client = hub.client(self.address)
        rid = self.client.stream(
            self.oid, "window", (self.size,), lambda ok, value: self._on_reply(token, ok, value))
        if self.stream is token:
            self.rid = rid

    def _send(self, method: str, *args: Any) -> None:
        """A one-way message to the owner on the stream's connection (cond held).

        Sent from this thread when nothing waits to go (else by the connection's
        feeder, behind what waits): an acknowledgement that ``_pop`` sends leaves
        before ``get()`` returns, so the item is not delivered again when this
        process dies right after."""
        try:
            self.client.send(self.oid, method, args, inline=True)
        except Exception as exc:
            self._lost(exc)

    def _want(self, hub: Any, waiting: int) -> None:
        self.reported = self.returned
        Window.unreported.discard(self)
        if self.stream is None:
            return
        if waiting != ASKING:
            self._send("want", self.returned, self.size, waiting)
            return
        handle = self.client.call(self.oid, "want", (self.returned, self.size, ASKING))
        self.cond.release()
        try:
            hub.wait(handle, self.address, None)
        except Exception as exc:
            self.cond.acquire()
            self._lost(exc)
        else:
            self.cond.acquire()

    def _lost(self, exc: BaseException) -> None:
        if self.rid and self.client is not None:
            self.client.end_stream(self.rid)
        self.stream, self.rid = None, 0
        self.error = exc
        self.cond.notify_all()

    def _on_reply(self, token: object, ok: bool, value: Any) -> None:
        with self.cond:
            if token is not self.stream:
                return  # a stream closed meanwhile
            if not ok:
                self._lost(value)
            elif type(value) is not str:   # an item, or items pushed in a row
                if not self.stale:
                    kind = type(value)
                    batch = (value.items() if kind is _Run else value if kind is list
                             else (value,))
                    self.items.extend(batch)
                    self.cond.notify(len(batch))
            elif value == "resume":   # what comes from here on is this process's again
                self.stale = max(0, self.stale - 1)
            else:   # "recall": others wait for what this one holds
                self.size = max(1, self.size // 2)  # it did not drain: shrink
                # a get() that waits stays in line, with a window of one
                if self.waiters:
                    self._give_back(1, WAITING)
                else:
                    self._give_back(0, IDLE)

    def _flush_acks(self) -> None:
        with self.cond:
            self.timer = None
            self.sync()

    def sync(self) -> None:
        """Acknowledge what get() returned, ahead of another request to the owner."""
        with self.cond:   # (reentrant: _flush_acks holds it)
            if self.stream is not None and self.returned != self.reported:
                self._want(get_hub(), WAITING if self.waiters and not self.items else IDLE)

    def close(self) -> None:
        """Give back what get() has not returned (this process closes its handle, or exits)."""
        with self.cond:
            if self.stream is None:
                return
            self.size = 1
            self._give_back(0, IDLE)

    def _give_back(self, size: int, waiting: int) -> None:
        """Drop what get() has not returned; the owner puts it back (cond held)."""
        self.items.clear()
        self.stale += 1
        self.reported = self.returned
        Window.unreported.discard(self)
        self._send("returned", self.returned, size, waiting)

    # -- get -----------------------------------------------------------------------------
    def _pop(self) -> Any:
        payload = self.items.popleft()
        self.returned += 1
        Window.unreported.add(self)
        if self.returned - self.reported >= max(1, self.size // 4):
            self._want(get_hub(), IDLE)  # a quarter of the window was returned: room for more
        elif self.timer is None:
            hub = get_hub()
            self.timer = hub.timers.call_at(time.monotonic() + ACK_DELAY, self._flush_acks)
        return payload

    def get(self, timeout: Optional[float]) -> Any:
        """Return the next item pushed here; ``queue.Empty`` after ``timeout`` seconds."""
        with self.lock:
            if self.items:
                return self._pop()
            hub = get_hub()
            if self.error is not None and self.stream is None:
                self.error = None  # a new stream: the owner may be back (a reconnect)
            if self.stream is None:
                self._open(hub)
            elif self.size < WINDOW_ITEMS:
                self.size *= 2  # it ran dry: ask for more ahead
            if timeout is not None and timeout <= 0:
                self._want(hub, ASKING)  # the owner pushes an item stored, then answers
                if self.items:
                    payload = self._pop()
                    if self.returned != self.reported:
                        self._want(hub, IDLE)  # a request went to the owner anyway: ack now
                    return payload
                self._raise_error()
                raise queue.Empty
            self._want(hub, WAITING)
            deadline = None if timeout is None else time.monotonic() + timeout
            self.waiters += 1
            try:
                while not self.items:
                    self._raise_error()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        if self.waiters == 1:
                            self._want(hub, IDLE)  # stopped waiting: what comes stays here
                        raise queue.Empty
                    step = hub.heartbeat_interval if left is None else min(
                        left, hub.heartbeat_interval)
                    if not self.cond.wait(step) and not self.items and (
                            left is None or left > step):
                        self.cond.release()
                        try:  # a vanished owner closes no socket: ping it
                            hub.ensure_alive(self.address, hub.parent_timeout)
                        finally:
                            self.cond.acquire()
            finally:
                self.waiters -= 1
            return self._pop()

    def _raise_error(self) -> None:
        if self.error is not None and not self.items:
            raise self.error


os.register_at_fork(after_in_child=Window._forget_in_child)


def _push(win: _Win, values: list) -> None:
    """Send ``values`` down ``win``'s stream as one frame (by the one sending thread, so
    pushes and recalls to one consumer never overtake each other). A consumer whose
    connection dropped gets nothing: ``drop_peer`` puts back what it held."""
    peer, rid = win.peer, win.sink.rid
    if peer.closed:
        return
    replies: list = []
    run: list = []   # items in a row travel as one reply: the consumer takes them at once
    for value in values:
        if type(value) is str or isinstance(value, ReplySink):   # a marker, an answer
            if run:
                replies.append(Reply(rid, True, _Run.of(run)))
                run = []
            replies.append(Reply(value.rid, True, None) if isinstance(value, ReplySink)
                           else Reply(rid, True, value))
        else:
            run.append(value)
    if run:
        replies.append(Reply(rid, True, _Run.of(run)))
    try:
        peer.send(pack(replies[0] if len(replies) == 1 else replies))
    except ChannelClosed:
        pass


class _Run:
    """Small items pushed in a row, as one ``bytes`` and their lengths: pickled one by
    one, their wrappers cost more than the items (a 100 B item: 1 us of ~8 per item)."""

    __slots__ = ("data", "sizes")

    def __init__(self, data: bytes, sizes: bytes) -> None:
        self.data = data
        self.sizes = sizes

    @staticmethod
    def of(items: list) -> Any:
        """The value to push for ``items``: a run when every one is a small pickle
        (no out-of-band buffer, under ``OOB_THRESHOLD``), else the items (a lone one
        by itself: a large one travels out of band, uncopied)."""
        if len(items) > 1 and all(type(i) is Encoded and not i.buffers for i in items):
            data = [i.data for i in items]
            sizes = [len(d) if type(d) is bytes else memoryview(d).nbytes for d in data]
            if max(sizes) < OOB_THRESHOLD:
                return _Run(b"".join(data), array("Q", sizes).tobytes())
        items = [blob(i) for i in items]
        return items if len(items) > 1 else items[0]

    def items(self) -> list:
        """The items again, each an :class:`Encoded` viewing this run's ``data``."""
        data, out, at = memoryview(self.data), [], 0
        for size in memoryview(self.sizes).cast("Q"):
            out.append(Encoded(data[at:at + size]))
            at += size
        return out

    def __reduce__(self):
        data = self.data   # a long run goes out of band, as a large item would
        return (_Run, (pickle.PickleBuffer(data) if len(data) >= OOB_THRESHOLD else data,
                       self.sizes))


def merge_puts(oid: str, calls: list) -> Optional[Call]:
    """One ``put_run`` call for one-way puts of small items that follow each other on a
    connection (their Call and wrapper cost more than a 100 B item); None: as they are.
    A process that puts into a queue or pipe owned elsewhere declares it to its hub
    (:meth:`~fibrl.hub.Hub.merge_calls`)."""
    if any(not c.args or c.args[1:] not in ((), (None,)) for c in calls):
        return None   # (a put with a timeout: it may wait, it goes alone)
    run = _Run.of([c.args[0] for c in calls])
    return Call(0, oid, "put_run", (run,)) if type(run) is _Run else None


def _acks_ahead(address: str) -> None:
    if Window.unreported:
        Window.sync_to(address)


def _clamp(size: Any) -> int:
    return max(1, min(int(size), WINDOW_ITEMS))


def _owner(reply: ReplySink, key: Any) -> Any:
    if key is not None and key != "peer":
        return key
    return ("peer", reply.peer.id) if reply.peer is not None else "local"


class PipeBox(Mailbox):
    """One direction of a pipe: a mailbox that pushes to the process reading it.

    The first ``recv``/``poll`` of a reader in another process *subscribes*:
    from then on every message is pushed to that process as it arrives (one
    frame per ``send``, no request per ``recv``), after whatever was stored.
    A reader elsewhere that asks (a ``get``, ``poll`` or its own subscription)
    *revokes* the subscriber, which gives back what it holds unread; until it
    has, nothing is handed out, so messages keep their order. Messages pushed
    to a reader that dies before reading them die with it, as data in a dead
    reader's OS pipe does.

    It also counts open *reader* handles (like writers): once none is left,
    ``watch`` answers its writers and their ``send`` raises ``BrokenPipeError``.

    ::

        writer  --put-->  PipeBox  --Reply(rid of subscribe)-->  reader's inbox
                          revoke  --------------------------->   giveback(items)
    """

    _ordered = False  # one reader at a time: a giveback goes in front as it is

    def __init__(self) -> None:
        super().__init__(pipe_end=True)
        self._sub: Optional[ReplySink] = None     # the subscribed reader's stream
        self._revoking: set = set()               # peer ids whose giveback is due
        self._readers: dict = {}
        self._broken = False
        self._watchers: list[ReplySink] = []

    # -- pushing ----------------------------------------------------------------------
    def _deliver(self, payload: Any) -> None:
        if self._revoking:
            self._items.append(payload)  # after what the revoked reader gives back
        elif not self._getters and self._sub is not None:
            if not self._sub(payload):
                self._sub = None  # its connection dropped: keep it for another reader
                super()._deliver(payload)
        else:
            super()._deliver(payload)

    def _flush(self) -> None:
        """Hand stored messages out, in order, once no giveback is due (lock held)."""
        if self._revoking:
            return
        while self._items and self._getters:
            parked = self._getters.popleft()
            self._unpark(parked)
            payload = self._items.popleft()
            if not self._hand(parked.reply, payload):
                self._items.appendleft(payload)
        while self._items and self._sub is not None:
            if not self._sub(self._items[0]):
                self._sub = None
                break
            self._items.popleft()
        if self._items:
            self._wake_pollers(True)
        if self._eof:
            self._finish_eof()

    def _finish_eof(self) -> None:
        if self._sub is not None:
            self._sub("eof")
        if not self._items:
            self._check_eof_now()

    def _revoke_other(self, reply: ReplySink) -> None:
        """A reader other than the subscriber asks: take the subscription back."""
        sub = self._sub
        if sub is not None and (reply.peer is None or sub.peer is not reply.peer):
            self._sub = None
            if sub("revoke"):
                peer = sub.peer
                assert peer is not None   # (only another process subscribes)
                self._revoking.add(peer.id)

    def op_subscribe(self, reply: ReplySink) -> None:
        if reply.peer is None:
            raise RuntimeError("the process that owns a pipe reads it without subscribing")
        with self._lock:
            self._revoke_other(reply)
            self._sub = reply
            self._flush()
            reply("ready")

    def op_giveback(self, reply: ReplySink, items: list) -> None:
        """A revoked or closing subscriber returns the messages it did not read."""
        with self._lock:
            if reply.peer is not None:
                self._revoking.discard(reply.peer.id)
                if self._sub is not None and self._sub.peer is reply.peer:
                    self._sub = None
            self._items.extendleft(reversed(items))
            self._flush()
        reply(None)

    def op_get(self, reply: ReplySink, timeout: Optional[float] = None) -> None:
        with self._lock:
            self._revoke_other(reply)
            if self._revoking:
                self._park(self._getters, _Parked(reply), timeout,
                           lambda r: r.fail(queue.Empty()))
            else:
                super().op_get(reply, timeout)

    def op_poll(self, reply: ReplySink, timeout: Optional[float] = 0.0, token: Any = None) -> None:
        with self._lock:
            self._revoke_other(reply)
            if self._revoking and (timeout is None or timeout > 0):
                self._park(self._pollers, _Parked(reply, token=token), timeout,
                           lambda r: r(False))
            else:
                super().op_poll(reply, 0.0 if self._revoking else timeout, token)

    def give(self, payload: Any) -> None:
        if not self._broken:   # (see op_put)
            super().give(payload)

    def take_here(self) -> Any:
        """``recv()`` in the owner process: what is stored, else wait for the next
        message while reading the connection of the process that sent last (it likely
        sends the next one too); no call and no dispatch. A reader elsewhere that holds
        the subscription, or a giveback that is due, takes the general way."""
        with self._lock:
            if self._sub is not None or self._revoking or self._eof and not self._items:
                handle = None
            elif self._items:
                return self._popleft()[0]
            else:
                handle, feeder = Handle(), self.feeder
                self._getters.append(_Parked(LocalReply(handle)))
        if handle is None:
            return take(self.hub, None, self.oid, None)
        if feeder is not None:
            self.hub.wait_reading(handle, feeder)
        return handle.get()

    def op_put(self, reply: ReplySink, payload: Any, timeout: Optional[float] = None) -> None:
        if self._broken:
            # no reader is left: the sender raises BrokenPipeError once its watch is
            # answered; what it sent meanwhile goes nowhere, as into a widowed OS pipe
            reply(None)
            return
        super().op_put(reply, payload, timeout)

    def _check_eof(self) -> None:
        if self._writers or self._eof:
            return
        self._eof = True
        if not self._revoking:
            self._finish_eof()

    def _check_eof_now(self) -> None:
        """Fail parked getters with EOFError, wake pollers (nothing is left to read)."""
        getters, self._getters = self._getters, deque()
        for parked in getters:
            self._unpark(parked)
            parked.reply.fail(EOFError("the other end of the pipe was closed"))
        self._wake_pollers(True)

    # -- readers, and the writers' watch --------------------------------------------------
    def op_attach_reader(self, reply: ReplySink, key: Any = None) -> None:
        with self._lock:
            owner = _owner(reply, key)
            self._readers[owner] = self._readers.get(owner, 0) + 1
        reply(None)

    def op_adopt_reader(self, reply: ReplySink) -> None:
        with self._lock:
            _take_one(self._readers, "inflight")
            owner = _owner(reply, None)
            self._readers[owner] = self._readers.get(owner, 0) + 1
        reply(None)

    def op_detach_reader(self, reply: ReplySink) -> None:
        with self._lock:
            _take_one(self._readers, _owner(reply, None))
            self._check_broken()
        reply(None)

    def op_watch(self, reply: ReplySink) -> None:
        """Answer True once no reader handle is left (the pipe is broken)."""
        with self._lock:
            if self._broken:
                reply(True)
            else:
                self._watchers.append(reply)

    def _check_broken(self) -> None:
        if self._readers or self._broken:
            return
        self._broken = True
        self._items.clear()
        self._redo.clear()
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            watcher(True)

    def drop_peer(self, peer) -> None:
        with self._lock:
            self._revoking.discard(peer.id)  # what it held died with it
            if self._sub is not None and self._sub.peer is peer:
                self._sub = None
            self._watchers = [w for w in self._watchers if w.peer is not peer]
            if self._readers.pop(("peer", peer.id), None):
                self._check_broken()
            super().drop_peer(peer)
            self._flush()

    def closed(self) -> None:
        with self._lock:
            watchers, self._watchers = self._watchers, []
            sub, self._sub = self._sub, None
        for watcher in watchers:
            watcher(False)  # retired, not broken: a later send reports the owner's answer
        if sub is not None:
            from .errors import object_gone

            sub.fail(object_gone(self.oid, "its process", "closed"))
        super().closed()


def _take_one(counts: dict, owner: Any) -> None:
    count = counts.get(owner, 0)
    if count <= 1:
        counts.pop(owner, None)
    else:
        counts[owner] = count - 1
