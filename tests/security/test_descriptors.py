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
    start = time.monotonic()                      # before the victim can see us
    raw = connect(victim.port, timeout=30)        # our own limit: 30 s
    raw.sendall(sp_header("req0"))
    assert raw.recv(8) == sp_header("rep0")
    assert raw.recv(1) == b""                     # EOF: the victim dropped us
    took = time.monotonic() - start
    # not before auth_timeout (exact: the victim's clock for us starts after `start`);
    # due by 7.5 s (auth_timeout and half of it, its check's period), and far below our
    # own 30 s limit, which a victim that never drops idle connections would reach
    assert 5 <= took < 20, f"dropped after {took:.1f} s"
    raw.close()
