"""The owner's side of a mailbox: :class:`Mailbox`, the FIFO a queue is, hosted by
the hub of the process that created it.

It holds serialized items (never unpickled here), parks the ``get`` requests it
cannot answer in arrival order and answers ``Empty`` at their deadlines itself,
pushes items ahead into the windows of consumers in other processes (see the
package docstring for the conversation), recalls the windows of idle consumers
while others wait, and puts back, in order, what a window or a dead consumer
gives back.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Hashable, MutableSequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from ...errors import ChannelClosed
from ..hub import ReplySink, SharedService
from ...wire.messages import Reply, pack
from ...wire.serialization import Encoded
from .protocol import ASKING, EMPTY, IDLE, WINDOW_ITEMS, Run

if TYPE_CHECKING:
    from ...wire.transport import Peer

__all__ = ["Mailbox"]

log = logging.getLogger(__name__)

#: Most bytes a window holds; one item always fits, however large. 4 MiB (four 1 MB items)
#: ran dry between acknowledgements at 800 MB/s.
WINDOW_BYTES = 16 << 20
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
#: Counts of producers' connections that dropped, kept for them to ask (the newest).
KEPT_TALLIES = 4096
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
        self.timer: Optional[list[Any]] = None   # the timers' entry of its deadline
        self.token = token


class _Win:
    """The owner's side of one consumer's window: what was pushed and not yet
    acknowledged (``held``, oldest first), and how much more may be pushed."""

    __slots__ = ("sink", "peer", "size", "held", "nbytes", "base", "top", "waiting",
                 "heard", "recalling", "recalled", "cut", "gap")

    def __init__(self, sink: ReplySink, peer: Peer, size: int) -> None:
        self.sink = sink
        self.peer = peer         # sink's: a window's consumer is another process
        self.size = size
        self.held: deque[tuple[int, Any]] = deque()   # (push number, item), oldest first
        self.nbytes = 0
        self.base = 0            # how many items of this stream were acknowledged
        self.top = -1            # the newest push number its consumer acknowledged
        self.waiting = True      # its consumer is inside get() with nothing to return
        self.heard = time.monotonic()
        self.recalling = False
        self.recalled = 0.0      # when the recall now unanswered was sent
        self.cut = False         # its connection was closed for leaving it unanswered
        self.gap = RECALL_IDLE / RECALL_GAPS   # its consumer's usual silence (average)

    def heard_from(self, now: float) -> None:
        """Its consumer sent a message: learn how long it usually stays silent."""
        self.gap += 0.25 * (min(now - self.heard, RECALL_IDLE) - self.gap)
        self.heard = now

    def recall_due(self) -> float:
        return self.heard + min(RECALL_IDLE, max(RECALL_MIN, RECALL_GAPS * self.gap))

    def take_held(self) -> list[tuple[int, Any]]:
        """Forget everything held (it goes back to the queue); (push number, item) pairs."""
        held, self.held = list(self.held), deque()
        self.nbytes = 0
        return held

    def room(self, cap: int = WINDOW_ITEMS, number: Optional[int] = None) -> bool:
        """Whether the item of push number ``number`` (None: a new one) may be pushed
        here. Every window stays in queue order: an item given back does not go
        behind a newer one (its consumer could stop at a sentinel first), neither one
        the window holds nor one its consumer already returned, unless that consumer
        waits in ``get()`` now (it did not stop there)."""
        held = self.held
        if self.recalling or len(held) >= min(self.size, cap):
            return False
        if not held:
            return number is None or number > self.top or self.waiting
        return self.nbytes < WINDOW_BYTES and (number is None or held[-1][0] < number)

    def ack(self, returned: int) -> int:
        """Forget the items its consumer returned; how many were forgotten."""
        n = min(returned - self.base, len(self.held))
        number = -1
        for _ in range(n):
            number, payload = self.held.popleft()   # (in push order: the last is newest)
            self.nbytes -= _size(payload)
        if n > 0:
            self.base += n
            if number > self.top:
                self.top = number
        return max(n, 0)


class Mailbox(SharedService):
    """A FIFO of serialized items with parked getters, putters, joiners and pollers.

    Why one class of this size: the items, the parked requests and the consumers'
    windows change together under one lock (an item goes to a parked getter, or into a
    window, or stays; a recalled window's items go back in order among the stored
    ones). The consumer's side (:mod:`.consumer`), the pipe's writer counts
    (:mod:`.pipe`) and the vocabulary (:mod:`.protocol`) are elsewhere."""

    _ordered = True   # give-backs are merged by push number (see _requeue)

    def __init__(self, maxsize: int = 0, joinable: bool = False, pipe_end: bool = False) -> None:
        self.maxsize = maxsize if maxsize > 0 else 0
        self._items: deque[Any] = deque()   # serialized items, as they came
        self._getters: deque[_Parked] = deque()
        self._putters: deque[_Parked] = deque()
        self._pollers: list[_Parked] = []
        self._joiners: list[ReplySink] = []
        self._unfinished = 0 if joinable else None
        self._lock = threading.RLock()
        # the process that put last (None: this one): a getter in this process reads
        # that process's frames itself while it waits (see take)
        self.feeder: Optional[Peer] = None
        self._writers: Optional[dict[Hashable, int]] = {} if pipe_end else None  # owner -> count
        self._eof = False
        self._unacked: dict[int, dict[int, Any]] = {}  # peer id -> {rid: item}, in order
        # what producers in other processes put, per connection (see .producer): peer id
        # -> [its token, items received]; then, once it dropped, token -> items received;
        # and the asks for a connection whose drop is not yet seen here
        self._tallies: dict[int, list[Any]] = {}
        self._delivered: dict[str, int] = {}
        self._asked: dict[str, list[ReplySink]] = {}
        self._windows: dict[int, _Win] = {}  # peer id -> its consumer window
        self._held = 0                       # items in windows, not acknowledged
        self._pushed = 0                     # push number of the next item first pushed
        # push numbers of the items at the front of _items that went back from a
        # window (the first len(_redo) items): a give-back is merged in by them, so
        # the queue keeps its order whichever window gives back first
        self._redo: deque[int] = deque()
        self._turn = 0                       # where the next push starts looking
        self._recall_timer: Optional[list[Any]] = None   # the timers' entry of the next check
        self._recall_at = 0.0
        # window -> what to push to it, in order: items, "recall"/"resume", answers (a sink)
        self._outgoing: dict[_Win, list[Any]] = {}
        self._send_lock = threading.Lock()   # one thread sends what is outgoing
        self._last_push = 0.0
        self._sender: Optional[threading.Thread] = None
        self._sender_wake: Optional[threading.Event] = None
        self.retired = False   # closed: no longer hosted (see closed())

    # -- helpers ---------------------------------------------------------------
    def _park(self, where: MutableSequence[_Parked], parked: _Parked, timeout: Optional[float],
              on_timeout: Callable[[ReplySink], object]) -> None:
        where.append(parked)
        if timeout is not None:
            parked.timer = self.hub.timers.call_at(
                time.monotonic() + max(timeout, 0.0), lambda: self._expire(where, parked,
                                                                            on_timeout))

    def _expire(self, where: MutableSequence[_Parked], parked: _Parked,
                on_timeout: Callable[[ReplySink], object]) -> None:
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
    def _fair_cap(self, wins: list[_Win]) -> int:
        """Most items any of ``wins`` may hold: no window grows past twice the smallest
        open one (a consumer that drains slowly keeps the others' lead over it small),
        nor past ``SHARED_ITEMS`` when several consumers share the queue."""
        sizes = [w.size for w in wins if w.size > 0]
        if len(wins) < 2 or not sizes:
            return WINDOW_ITEMS
        return min(SHARED_ITEMS, max(FAIR_MIN, 2 * min(sizes)))

    def _pick(self, wins: list[_Win], cap: int, number: Optional[int] = None) -> Optional[_Win]:
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
        pushed: dict[_Win, list[Any]] = {}
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
        the next one would be, or when a recall sent goes unanswered for
        ``parent_timeout`` (lock held; see :meth:`_recall_check`)."""
        if self._items or not self._waiters():
            return
        now = time.monotonic()
        later = None
        for win in list(self._windows.values()):
            if not win.held or win.waiting or win.cut:
                continue   # (a cut one goes once its reader sees the close: drop_peer)
            if win.recalling:
                due = win.recalled + self.hub.parent_timeout
            else:
                due = win.recall_due()
                if due <= now:
                    win.recalling, win.recalled = True, now
                    self._outgoing.setdefault(win, []).append("recall")
                    due = now + self.hub.parent_timeout
            if later is None or due < later:
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
        """Send the recalls due; and cut the connection of a consumer that left one
        unanswered for ``parent_timeout`` while others wait: its process is frozen, or
        its machine or network is gone (a consumer that is merely busy answers from its
        reader thread). The cut puts what its window held back for the others now, as
        the loss of its process would (see :meth:`drop_peer`), instead of when TCP gives
        up on the connection, minutes later or never; a consumer that comes back finds
        its connection closed, as after any lost connection."""
        with self._lock:
            self._recall_timer = None
            limit = self.hub.parent_timeout
            now = time.monotonic()
            silent = [win for win in self._windows.values()
                      if win.recalling and win.held and not win.cut
                      and now >= win.recalled + limit and self._waiters() and not self._items]
            for win in silent:
                win.cut = True
            self._plan_recall()
        for win in silent:
            log.warning("queue %s: a consumer holding %d items did not answer for %.0f s "
                        "(parent_timeout): its process is frozen or its machine or network "
                        "is gone. Its connection is closed and the items go to other "
                        "consumers; any it returned from get() just before may come again.",
                        self.oid, len(win.held), limit)
            win.peer.close()
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
        while not self.retired:
            wake.wait()
            wake.clear()
            time.sleep(0)  # let a producer that is putting add more to this frame
            self._send_outgoing()

    def dispatch(self, method: str, args: tuple[Any, ...], reply: ReplySink) -> None:
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

    def _requeue(self, held: list[tuple[int, Any]]) -> None:
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

    def _popleft(self) -> tuple[Any, Optional[int]]:
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
            if self._tallies:
                self._tally(reply, 1)
            self._put(reply, payload, timeout)

    def _put(self, reply: ReplySink, payload: Any, timeout: Optional[float]) -> None:
        """Store ``payload``, or park its putter until there is room (lock held)."""
        if not self._full():
            self._accept(payload)
            reply(None)
        elif timeout is not None and timeout <= 0:
            raise queue.Full
        else:
            self._park(self._putters, _Parked(reply, payload), timeout,
                       lambda r: r.fail(queue.Full()))

    def op_put_run(self, reply: ReplySink, run: "Run") -> None:
        """Items one process put one after another (one-way ``put`` calls that its
        connection sent together, see :func:`merge_puts`), in order."""
        self.feeder = reply.peer
        with self._lock:
            items = run.items()
            if self._tallies:
                self._tally(reply, len(items))
            for payload in items:
                self._put(reply, payload, None)

    # -- producers' counts (see .producer) -----------------------------------------
    def op_producer(self, reply: ReplySink, token: str) -> None:
        """The calling connection's puts from now on are counted under ``token``."""
        if reply.peer is not None:
            with self._lock:
                self._tallies[reply.peer.id] = [token, 0]
        reply(None)

    def _tally(self, reply: ReplySink, n: int) -> None:
        if reply.peer is not None:
            tally = self._tallies.get(reply.peer.id)
            if tally is not None:
                tally[1] += n

    def op_delivered(self, reply: ReplySink, token: str) -> None:
        """How many items the connection named ``token`` put here, answered once it has
        dropped (nothing more can come on it); 0 for a connection never named here."""
        with self._lock:
            received = self._delivered.get(token)
            if received is None and any(t[0] == token for t in self._tallies.values()):
                self._asked.setdefault(token, []).append(reply)   # answered by drop_peer
                return
        reply(received or 0)

    def _tally_dropped(self, peer: Peer) -> list[tuple[ReplySink, int]]:
        """Keep the count of a producer's connection that dropped; the asks it answers
        (lock held)."""
        tally = self._tallies.pop(peer.id, None)
        if tally is None:
            return []
        token, received = tally
        self._delivered[token] = received
        if len(self._delivered) > KEPT_TALLIES:
            del self._delivered[next(iter(self._delivered))]   # (the oldest)
        return [(asker, received) for asker in self._asked.pop(token, ())]

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

    def _take(self, owner: Hashable) -> None:
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
    def drop_peer(self, peer: Peer) -> None:
        with self._lock:
            answers = self._tally_dropped(peer) if self._tallies else []
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
            # (mypy takes pop's default for a bool here, from the ``and``: a false alarm)
            if self._writers is not None and self._writers.pop(("peer", peer.id), None):  # type: ignore[arg-type]
                self._check_eof()
        for asker, received in answers:
            asker(received)
        if self._outgoing:
            self._send_outgoing()

    def closed(self) -> None:
        from ...errors import object_gone

        err = object_gone(self.oid, "its process", "closed")
        self.retired = True
        if self._sender_wake is not None:
            self._sender_wake.set()
        with self._lock:
            parked = list(self._getters) + list(self._putters) + self._pollers
            asked = [r for replies in self._asked.values() for r in replies]
            self._asked = {}
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
        for sink in answers + asked + [win.sink for win in wins]:
            sink.fail(err)


def _push(win: _Win, values: list[Any]) -> None:
    """Send ``values`` down ``win``'s stream as one frame (by the one sending thread, so
    pushes and recalls to one consumer never overtake each other). A consumer whose
    connection dropped gets nothing: ``drop_peer`` puts back what it held."""
    peer, rid = win.peer, win.sink.rid
    if peer.closed:
        return
    replies: list[Reply] = []
    run: list[Any] = []   # items in a row travel as one reply: the consumer takes them at once
    for value in values:
        if type(value) is str or isinstance(value, ReplySink):   # a marker, an answer
            if run:
                replies.append(Reply(rid, True, Run.of(run)))
                run = []
            replies.append(Reply(value.rid, True, None) if isinstance(value, ReplySink)
                           else Reply(rid, True, value))
        else:
            run.append(value)
    if run:
        replies.append(Reply(rid, True, Run.of(run)))
    try:
        peer.send(pack(replies[0] if len(replies) == 1 else replies))
    except ChannelClosed:
        pass


def _clamp(size: Any) -> int:
    return max(1, min(int(size), WINDOW_ITEMS))


def _owner(reply: ReplySink, key: Optional[Hashable]) -> Hashable:
    if key is not None and key != "peer":
        return key
    return ("peer", reply.peer.id) if reply.peer is not None else "local"

