"""Defect: unauthenticated connections were unlimited, so at a low descriptor limit idle
ones made every new connection fail with EMFILE. Now at most max_pending of them are
kept (the oldest is dropped for a new one, any is dropped after auth_timeout), which
leaves the rest of the descriptors to authenticated peers."""
import select
import time

from attacker import connect, sp_header
from conftest import wait_until
from victims import victim_factory  # noqa: F401 (a fixture)

NOFILE = 256


def test_idle_connections_cannot_exhaust_descriptors(victim_factory):
    victim = victim_factory(nofile=NOFILE)
    idle = []
    try:
        for _ in range(NOFILE + 100):
            raw = connect(victim.port, timeout=30)
            raw.sendall(sp_header("req0"))
            idle.append(raw)
        # within a few seconds (nng accepts each connection before the cap drops it,
        # so right after the flood a descriptor may still be taken for a moment)
        wait_until(lambda: victim.ask("connect") == "ok", "the victim to connect", 10,
                   interval=0.2)
        assert victim.ask("connect") == "ok"
        # most of them were closed by the victim, not by us
        assert _closed_by_peer(idle[:NOFILE], within=10) > NOFILE // 2
    finally:
        for raw in idle:
            raw.close()


def _closed_by_peer(sockets, within):
    """How many of ``sockets`` reach EOF within ``within`` seconds (waiting on them)."""
    open_ = set(sockets)
    closed = 0
    deadline = time.monotonic() + within
    while open_ and time.monotonic() < deadline:
        readable, _, _ = select.select(list(open_), [], [], deadline - time.monotonic())
        for raw in readable:
            try:
                ended = not raw.recv(64)    # the SP header first, then EOF
            except ConnectionResetError:
                ended = True                # closed before it read our header: a reset
            if ended:
                closed += 1
                open_.discard(raw)
        if closed > len(sockets) // 2:
            break
    return closed


def test_idle_connections_are_dropped_after_auth_timeout(victim_factory):
    victim = victim_factory()                     # auth_timeout is 5 s there
    raw = connect(victim.port, timeout=30)        # our own limit: 30 s
    raw.sendall(sp_header("req0"))
    start = time.monotonic()
    assert raw.recv(8) == sp_header("rep0")
    assert raw.recv(1) == b""                     # EOF: the victim dropped us
    assert time.monotonic() - start < 5 + 5       # auth_timeout, and its janitor's period
    raw.close()
