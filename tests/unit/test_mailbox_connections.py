"""A queue's two sides when a connection between them drops, with no process and no
socket: a consumer's :class:`Window` on a stand-in connection, and the owner's
:class:`Mailbox` counting what each producer connection put.

* a consumer whose connection to the owner dropped returns none of the items its
  window held (the owner puts them back: returning them would return them twice); only
  items pushed before the owner itself closed the queue are still returned;
* the owner counts the items each named producer connection put, and answers how many
  once that connection has dropped (nothing more can arrive on it).
"""
from __future__ import annotations

import queue
import threading

import pytest

from fibrl.errors import RemoteObjectError
from fibrl.hosting.hub import ReplySink
from fibrl.hosting.mailbox import Mailbox, consumer
from fibrl.hosting.mailbox.consumer import Window
from fibrl.hosting.mailbox.protocol import Run
from fibrl.timers import Timers
from fibrl.wire.serialization import encode

WAIT = 10.0


class Client:
    """A connection to the owner, as a window uses it: it records what the window says
    and lets the test push items, fail the stream, or drop the connection."""

    def __init__(self) -> None:
        self.lost = False
        self.sent: list = []
        self.streams: dict = {}
        self.channel = Channel()

    def stream(self, oid, method, args, on_reply):
        rid = len(self.streams) + 1
        self.streams[rid] = on_reply
        return rid

    def end_stream(self, rid) -> None:
        self.streams.pop(rid, None)

    def send(self, oid, method, args, inline=False) -> None:
        self.sent.append((method, args))

    def push(self, *items) -> None:
        for on_reply in list(self.streams.values()):
            on_reply(True, list(items) if len(items) > 1 else items[0])

    def drop(self) -> None:
        """The connection dropped: every stream on it fails (as ``hub.Client._on_lost``)."""
        self.lost = True
        self.channel.closed = True
        for on_reply in list(self.streams.values()):
            on_reply(False, RemoteObjectError("its connection dropped"))

    def cut(self) -> None:
        """This side closed the connection; its reader thread has not seen it yet."""
        self.channel.closed = True

    def lost_now(self) -> bool:
        if not self.lost and self.channel.closed:
            self.drop()   # (handled here, as ``hub.Client.lost_now`` does)
        return self.lost


class Channel:
    closed = False


class Hub:
    """What a window asks of its hub: a connection (a new one once it dropped), timers."""

    def __init__(self) -> None:
        self.clients: list[Client] = []
        self.timers = Timers()
        self.heartbeat_interval, self.parent_timeout = 0.05, WAIT

    def client(self, address):
        if not self.clients or self.clients[-1].lost:
            self.clients.append(Client())
        return self.clients[-1]

    def ensure_alive(self, address, limit) -> None:
        pass


@pytest.fixture
def hub(monkeypatch):
    hub = Hub()
    monkeypatch.setattr(consumer, "get_hub", lambda: hub)
    yield hub
    hub.timers.close(1.0)


def _window_holding(hub, *items) -> Window:
    """A window whose first get() returned ``items[0]`` and that holds the rest (items
    are bytes here: a str pushed is a marker, "recall" or "resume")."""
    win = Window("tcp://owner:1", "queue-1")
    threading.Timer(0.05, lambda: hub.clients[0].push(*items)).start()
    assert win.get(WAIT) == items[0]
    assert list(win.items) == list(items[1:])
    return win


def test_a_window_whose_connection_dropped_returns_none_of_what_it_held(hub):
    win = _window_holding(hub, b"a", b"b", b"c")
    hub.clients[0].drop()   # the owner, alive, puts "b" and "c" back in the queue
    assert not win.items
    # the next get() opens a new window, over a new connection, and gets what the
    # owner pushes there (the items it put back, among others), each once
    threading.Timer(0.05, lambda: hub.clients[1].push(b"b", b"c")).start()
    assert [win.get(WAIT), win.get(WAIT)] == [b"b", b"c"]
    assert len(hub.clients) == 2 and not hub.clients[1].lost


def test_a_window_whose_connection_was_closed_here_returns_none_of_what_it_held(hub):
    """Closed on this side (a fault seam's cut, in any thread), the loss not yet handled
    by the connection's reader: what the window holds is dropped all the same."""
    win = _window_holding(hub, b"a", b"b", b"c")
    hub.clients[0].cut()
    threading.Timer(0.05, lambda: hub.clients[1].push(b"b", b"c")).start()
    assert [win.get(WAIT), win.get(WAIT)] == [b"b", b"c"]
    assert len(hub.clients) == 2, "returned from the window of the closed connection"
    assert hub.clients[0].lost and not hub.clients[1].lost


def test_a_get_waiting_when_the_connection_drops_raises_it(hub):
    win = _window_holding(hub, b"a")
    threading.Timer(0.05, hub.clients[0].drop).start()
    with pytest.raises(RemoteObjectError, match="connection dropped"):
        win.get(WAIT)


def test_items_pushed_before_the_owner_closed_the_queue_are_still_returned(hub):
    win = _window_holding(hub, b"a", b"b", b"c")
    owner = hub.clients[0]

    def closed():   # the owner ends the stream itself, over a live connection
        for on_reply in list(owner.streams.values()):
            on_reply(False, RemoteObjectError("queue-1 was closed"))

    closed()   # it put nothing back: what was pushed here is this process's
    assert [win.get(WAIT), win.get(WAIT)] == [b"b", b"c"]
    threading.Timer(0.05, closed).start()   # (the next get() asks again: refused)
    with pytest.raises(RemoteObjectError, match="closed"):
        win.get(WAIT)


# -- the owner's count of what each producer connection put --------------------------------

class Peer:
    _ids = iter(range(1, 1 << 30))

    def __init__(self) -> None:
        self.id = next(Peer._ids)
        self.closed = False

    def send(self, frame) -> None:
        pass


class Reply(ReplySink):
    __slots__ = ("rid", "values", "event")

    def __init__(self, peer=None, rid: int = 0) -> None:
        self.peer, self.rid = peer, rid
        self.values: list = []
        self.event = threading.Event()

    def __call__(self, value=None) -> bool:
        self.values.append(value)
        self.event.set()
        return True

    def fail(self, exc) -> bool:
        self.values.append(exc)
        self.event.set()
        return True


@pytest.fixture
def box():
    box = Mailbox()
    box.hub = Hub()
    box.oid = "queue-1"
    yield box
    box.hub.timers.close(1.0)


def test_the_owner_counts_what_a_named_connection_put_and_says_once_it_dropped(box):
    producer, other = Peer(), Peer()
    box.dispatch("put", (encode(-1),), Reply(producer))   # before it was named: not counted
    box.dispatch("producer", ("t1",), Reply(producer))
    box.dispatch("put", (encode(0),), Reply(producer))
    run = Run.of([encode(i) for i in range(1, 5)])
    box.dispatch("put_run", (run,), Reply(producer))
    box.dispatch("put", (encode(99),), Reply(other))      # another connection's
    ask = Reply(Peer(), rid=7)
    box.dispatch("delivered", ("t1",), ask)
    assert not ask.event.is_set(), "answered while more could still arrive"
    box.peer_lost(producer)
    assert ask.event.wait(WAIT) and ask.values == [5]
    again = Reply(Peer(), rid=8)
    box.dispatch("delivered", ("t1",), again)
    assert again.values == [5]
    never = Reply(Peer(), rid=9)
    box.dispatch("delivered", ("never named",), never)
    assert never.values == [0]
    assert box._count() == 7 and not box._tallies


def test_an_ask_parked_when_the_queue_closes_fails(box):
    producer = Peer()
    box.dispatch("producer", ("t1",), Reply(producer))
    ask = Reply(Peer(), rid=7)
    box.dispatch("delivered", ("t1",), ask)
    assert not ask.event.is_set(), "answered while more could still arrive"
    box.closed()
    assert ask.event.wait(WAIT) and isinstance(ask.values[0], RemoteObjectError)


def test_a_window_drops_what_a_dropped_connection_brought_even_when_empty_later(hub):
    """Each get() after the drop goes to the new window: a get() that finds nothing
    there waits and times out; it never falls back on the old items."""
    win = _window_holding(hub, b"a", b"b")
    hub.clients[0].drop()
    with pytest.raises(queue.Empty):
        win.get(0.2)
