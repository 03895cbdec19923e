"""A fault seam in the transport, for fibrl's own tests: never for programs.

Owns the faults a test asks the frames of this process to suffer on their way out:
dropped, delayed, duplicated, held back (a network partition, later healed) or cut
(the connection closed). It does not own the transport, and adds nothing to it
while off: :mod:`.transport` checks one module global per frame sent
(``_faults is not None``) and calls the seam only while a rule is installed.

Faults act where frames are sent (:meth:`transport._Reading.send`, the one way
out of every authenticated connection, a hub's or a ``fibrl.channel``'s), so a
fault between two processes is the sum of what each does to its own sends: a
partition holds both sides' frames, each side installing its half.

How a test switches it on:

- in its own process: :func:`install` (and :func:`clear` afterwards);
- in a worker started later: ``FIBRL_TEST_FAULTS``, a JSON list of rules (or one
  rule), read when the worker imports :mod:`fibrl.wire`. Local workers inherit the
  parent's environment (a fork server started before the variable was set does not:
  turn ``local_fork_server`` off); docker containers and pods do not;
- in a running worker, from inside a task it runs: :func:`install` there.

Data flow (one releaser thread, started with the first held frame)::

    send(frame) --> take(conn, frame) --> rule matched?  no --> sent as usual
                                            | drop: gone      | duplicate: sent twice
                                            | cut: conn closed, frame gone
                                            v delay / hold
                    per-connection FIFO (later frames of that connection queue behind,
                    whatever their rule, so order holds) --> releaser sends each frame
                    when due (a hold: at heal() or after its seconds)

Example (this process's half of a 2 s partition from every process it dialled):
    >>> from fibrl.wire import faults
    >>> faults.install(faults.Rule("hold", side="channel", seconds=2.0))  # doctest: +SKIP
    >>> faults.counts()["held"]  # doctest: +SKIP
    3
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Optional

from ..errors import ChannelClosed
from . import messages

if TYPE_CHECKING:
    from .transport import _Reading

__all__ = ["Rule", "install", "clear", "heal", "counts", "endpoints", "kind_of", "ENV"]

#: The environment variable a worker reads its rules from when it imports the transport.
ENV = "FIBRL_TEST_FAULTS"

_ACTIONS = ("drop", "delay", "duplicate", "cut", "hold")
_SIDES = (None, "channel", "peer")
_COUNTERS = ("matched", "dropped", "delayed", "duplicated", "cut", "held", "released",
             "lost")


@dataclass(frozen=True)
class Rule:
    """What to do to the frames this process sends that match.

    Args:
        action: ``"drop"`` (the frame vanishes), ``"delay"`` (sent ``seconds`` later),
            ``"duplicate"`` (sent twice), ``"cut"`` (the connection is closed instead
            of sending it) or ``"hold"`` (a partition: kept until :func:`heal`, or for
            ``seconds`` after :func:`install` when they are more than 0).
        side: ``"channel"``: connections this process dialled (a worker's to its
            parent); ``"peer"``: ones it accepted (a parent's from its workers);
            None: both.
        address: only connections with an end at this ``host:port`` (or ``host``),
            local or remote (see :func:`endpoints`).
        kind: only frames carrying this message: a call's method (``"alive"``,
            ``"next"``, ``"ping"``, ``"put"``...) or ``"reply"``.
        after: let this many matching frames through first (cut after N frames).
        count: act on at most this many frames (None: every one that matches).
        seconds: the delay, or how long a hold lasts.
    """

    action: str
    side: Optional[str] = None
    address: Optional[str] = None
    kind: Optional[str] = None
    after: int = 0
    count: Optional[int] = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ValueError(f"fault action {self.action!r} is not one of {_ACTIONS}")
        if self.side not in _SIDES:
            raise ValueError(f"fault side {self.side!r} is not one of {_SIDES}")
        if self.after < 0 or (self.count is not None and self.count < 0) or self.seconds < 0:
            raise ValueError(f"{self}: after, count and seconds cannot be negative")

    def aims_at(self, conn: Any) -> bool:
        """Whether this rule's ``side`` and ``address`` select the connection ``conn``
        (a :class:`~fibrl.wire.transport.Channel` or :class:`~fibrl.wire.transport.Peer`)."""
        side, local, remote = _ends(conn)
        if self.side is not None and self.side != side:
            return False
        return self.address is None or _names(self.address, (local, remote))

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> "Rule":
        """The rule a JSON object describes (its keys are this class's fields)."""
        known = {f.name for f in fields(cls)}
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"{ENV}: unknown fault rule keys {sorted(unknown)}; valid keys "
                             f"are {sorted(known)}")
        return cls(**spec)


class _Active:
    """An installed rule and what it did so far."""

    __slots__ = ("rule", "seen", "acted", "until")

    def __init__(self, rule: Rule, now: float) -> None:
        self.rule = rule
        self.seen = 0     # matching frames so far
        self.acted = 0    # frames it acted on
        self.until = now + rule.seconds if rule.action == "hold" and rule.seconds else math.inf


_lock = threading.Condition()
_rules: list[_Active] = []
_counts = dict.fromkeys(_COUNTERS, 0)
# Frames of one connection waiting to go out, in order: [due time, held, frame]; the
# frames of a hold without seconds are due at math.inf until heal().
_queues: "weakref.WeakKeyDictionary[_Reading, deque[list[Any]]]" = weakref.WeakKeyDictionary()
_releaser: Optional[threading.Thread] = None
_passing = threading.local()   # set while the seam itself sends: no rule applies


def install(*rules: Rule) -> None:
    """Add ``rules`` to those in force in this process and switch the seam on."""
    from . import transport

    now = time.monotonic()
    with _lock:
        _rules.extend(_Active(rule, now) for rule in rules)
    transport._faults = _Seam


def heal() -> None:
    """End every hold now: what was held goes out, in order, and the hold rules go."""
    with _lock:
        _rules[:] = [a for a in _rules if a.rule.action != "hold"]
        for queue in _queues.values():
            for entry in queue:
                if entry[1]:
                    entry[0] = 0.0
        _lock.notify_all()


def clear(timeout: float = 10.0) -> None:
    """Remove every rule, send what is held or delayed (waiting at most ``timeout``
    seconds for it to leave), reset the counts and switch the seam off."""
    from . import transport

    heal()
    with _lock:
        _rules.clear()
        _lock.wait_for(lambda: not _queues, timeout)
        transport._faults = None
        _counts.update(dict.fromkeys(_COUNTERS, 0))


def counts() -> dict[str, int]:
    """What the seam did in this process since it was switched on: frames ``matched``
    by a rule, ``dropped``, ``delayed``, ``duplicated``, ``cut`` (connections closed),
    ``held``, ``released`` (held or delayed frames sent at last) and ``lost`` (held or
    delayed frames whose connection closed first)."""
    with _lock:
        return dict(_counts)


def endpoints(conn: Any) -> str:
    """``"<side> <local host:port> -> <remote host:port>"`` of a connection (``side``:
    channel or peer; ``?`` for an end nng cannot tell), what a rule's ``address`` is
    matched against. A worker's channel to its parent and the parent's peer for that
    worker show the worker's end alike: a test learns it in one process and names
    it in the other's rule."""
    return "{} {} -> {}".format(*_ends(conn))


def _ends(conn: Any) -> tuple[str, str, str]:
    from . import transport

    side = "channel" if isinstance(conn, transport.Channel) else "peer"
    try:
        pipe = conn._sock.pipes[0]
    except (IndexError, AttributeError):
        return side, "?", "?"   # (not connected, or closed)
    ends = []
    for address in (pipe.local_address, pipe.remote_address):
        text = str(address)
        ends.append("?" if text.startswith("nng_sockaddr") else text)   # (family unknown)
    if ends[1] == "?":   # a connection a gate handed to nng: the gate knows its peer
        ends[1] = transport._remote(pipe)
    return side, ends[0], ends[1]


def kind_of(frame: Any) -> set[str]:
    """The kinds of the messages in ``frame`` (a call's method, ``"reply"``); empty for
    a frame that is not a hub message (a ``fibrl.channel`` frame of a program's own)."""
    parts = frame if type(frame) is list else [frame]
    data = b"".join(p if type(p) is bytes else memoryview(p).cast("B").tobytes()
                    for p in parts)
    try:
        message = messages.unpack(data)
    except Exception:   # (a program's own frame may hold anything)
        return set()
    found = message if type(message) is list else [message]
    return {m.method if isinstance(m, messages.Call) else "reply" for m in found}


class _Seam:
    """What :mod:`.transport` calls while a rule is installed (its ``_faults``)."""

    @staticmethod
    def take(conn: "_Reading", frame: Any) -> bool:
        """True when the seam dealt with ``frame`` (dropped, queued, cut); False: the
        caller sends it as usual (after its copy, when duplicated)."""
        if getattr(_passing, "on", False):
            return False
        now = time.monotonic()
        with _lock:
            active = _match(conn, frame, now)
            action = None if active is None else active.rule.action
            if action == "drop":
                _counts["dropped"] += 1
                return True
            if action == "cut":
                pass   # (counted below, once closed)
            elif conn in _queues or action in ("hold", "delay"):
                _enqueue(conn, frame, active, now)   # (order: behind what waits)
                if action == "duplicate":
                    _counts["duplicated"] += 1
                    _enqueue(conn, frame, None, now)
                return True
            elif action is None:
                return False
            else:
                _counts["duplicated"] += 1
        if action == "cut":
            conn.close()
            with _lock:   # (a cut counted is one closed: a test that sees it, sees that)
                _counts["cut"] += 1
            return True
        _send(conn, frame)   # the copy first: both are the same bytes
        return False


def _match(conn: "_Reading", frame: Any, now: float) -> Optional[_Active]:
    """The first rule in force that acts on ``frame`` (lock held), its counts updated."""
    if not _rules:
        return None
    kinds: Optional[set[str]] = None
    for active in _rules:
        rule = active.rule
        if rule.action == "hold" and now >= active.until:
            continue
        if rule.action == "cut" and conn.closed:
            continue   # cut already: its sends fail as any closed connection's do
        if (rule.side is not None or rule.address is not None) and not rule.aims_at(conn):
            continue
        if rule.kind is not None:
            kinds = kind_of(frame) if kinds is None else kinds
            if rule.kind not in kinds:
                continue
        active.seen += 1
        _counts["matched"] += 1
        if active.seen <= rule.after:
            continue
        if rule.count is not None and active.acted >= rule.count:
            continue
        active.acted += 1
        return active
    return None


def _names(address: str, ends: tuple[str, ...]) -> bool:
    """Whether ``address`` (``host:port`` or ``host``) is one of ``ends``."""
    return any(address in (end, end.rsplit(":", 1)[0].strip("[]")) for end in ends)


def _enqueue(conn: "_Reading", frame: Any, active: Optional[_Active], now: float) -> None:
    """Queue ``frame`` behind what ``conn`` has queued (lock held)."""
    global _releaser
    queue = _queues.get(conn)
    if queue is None:
        queue = _queues[conn] = deque()
    held = active is not None and active.rule.action == "hold"
    due = now
    if held:
        assert active is not None
        due = active.until
        _counts["held"] += 1
    elif active is not None and active.rule.action == "delay":
        due = now + active.rule.seconds
        _counts["delayed"] += 1
    if queue:
        due = max(due, queue[-1][0])   # never ahead of what waits before it
        held = held or queue[-1][1]    # (and healed with it)
    queue.append([due, held, frame])
    if _releaser is None:
        _releaser = threading.Thread(target=_release, daemon=True, name="fibrl-faults")
        _releaser.start()
    _lock.notify_all()


def _release() -> None:
    """The releaser thread: send each queued frame when it is due, in order; it ends
    when nothing is queued."""
    global _releaser
    while True:
        with _lock:
            batch = _due(time.monotonic())
            while not batch:
                if not _queues:
                    _releaser = None
                    _lock.notify_all()   # (clear() waits for the queues to empty)
                    return
                _lock.wait(_next_wait())
                batch = _due(time.monotonic())
        for conn, frame in batch:
            sent = _send(conn, frame)
            with _lock:
                _counts["released" if sent else "lost"] += 1
                queue = _queues.get(conn)
                if queue is not None:   # sent: now the next frame of conn may go
                    queue.popleft()
                    if not queue:
                        del _queues[conn]


def _due(now: float) -> list[tuple["_Reading", Any]]:
    """The first frame of each connection, where it is due (lock held). It stays first
    in its queue while it is sent, so later frames of its connection queue behind."""
    return [(conn, queue[0][2]) for conn, queue in list(_queues.items()) if queue[0][0] <= now]


def _next_wait() -> Optional[float]:
    soonest = min((queue[0][0] for queue in _queues.values()), default=math.inf)
    return None if soonest == math.inf else max(0.0, soonest - time.monotonic())


def _send(conn: "_Reading", frame: Any) -> bool:
    """Send past the seam; False when the connection closed meanwhile."""
    _passing.on = True
    try:
        conn.send(frame)
        return True
    except ChannelClosed:
        return False
    finally:
        _passing.on = False


def install_from_env() -> None:
    """Install the rules of ``FIBRL_TEST_FAULTS`` (called when :mod:`fibrl.wire` is
    imported, only when the variable is set)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{ENV}={text!r} is not JSON ({exc}); set it to a list of "
                         f"fault rules such as '[{{\"action\": \"drop\", \"kind\": "
                         f"\"alive\"}}]', or unset it") from None
    specs = spec if isinstance(spec, list) else [spec]
    if not all(isinstance(s, dict) for s in specs):
        raise ValueError(f"{ENV}={text!r}: each fault rule must be a JSON object")
    install(*(Rule.from_dict(s) for s in specs))
