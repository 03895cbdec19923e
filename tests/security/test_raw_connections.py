"""Defect: TCP connections that never sent nng's 8-byte header were held by nng for its
fixed 10 s negotiation, unseen by any callback and uncounted, so a few hundred of them
took a process's descriptors (at ``ulimit -n 1024`` every Process start failed with
EMFILE). Now a gate in front of each plaintext listener counts them with the pending
ones (``max_pending``, 64 at most), closes each that sent no header within 5 s, refuses
new ones while the last eighth of ``ulimit -n`` is all that is left, and a data port
stops listening once its one peer connected."""
import threading
import time

from attacker import connect, in_threads, sp_header
from victims import victim_factory  # noqa: F401 (a fixture)

from fibrl.wire.transport import MAX_PENDING


def _hub_port(victim) -> int:
    answer = victim.ask("hub")
    assert answer.startswith("hub "), answer
    return int(answer.rsplit(":", 1)[1])


def _fds(victim) -> int:
    answer = victim.ask("fds")
    assert answer.startswith("fds "), answer
    return int(answer.split()[1])


def _ended(sock) -> bool:
    """Whether the victim closed ``sock`` (a reset too: it had not read what we sent)."""
    try:
        return sock.recv(8) == b""
    except ConnectionResetError:
        return True


def _open(port: int, count: int) -> list:
    opened = []
    for _ in range(count):
        try:
            opened.append(connect(port, timeout=30))
        except OSError:
            break   # refused: the victim defends itself (the test checks what it holds)
    return opened


def test_raw_connections_hold_a_bounded_number_of_descriptors(victim_factory):
    victim = victim_factory()
    hub_port = _hub_port(victim)
    before = _fds(victim)
    raw = []
    try:
        raw += _open(victim.port, 300)   # the accept port of a listener
        raw += _open(hub_port, 200)      # and of the hub's, which Process starts use
        time.sleep(1.0)                  # (the victim has accepted what it will accept)
        held = _fds(victim) - before
        # two listeners, each at most max_pending connections without a header; a few
        # more for what the victim itself opened meanwhile (the hub's worker sockets)
        assert held <= 2 * MAX_PENDING + 16, f"{held} descriptors held by 500 raw connections"
        assert victim.ask("connect") == "ok"
    finally:
        for sock in raw:
            sock.close()


def test_a_connection_without_a_header_is_closed_within_seconds(victim_factory):
    victim = victim_factory()
    raw = connect(victim.port, timeout=30)   # our own limit: 30 s
    start = time.monotonic()
    try:
        assert _ended(raw)                  # the victim closed it
        assert time.monotonic() - start < 5 + 2
    finally:
        raw.close()


def test_a_half_header_is_closed_and_a_wrong_protocol_at_once(victim_factory):
    victim = victim_factory()
    half = connect(victim.port, timeout=30)
    half.sendall(sp_header("req0")[:5])
    wrong = connect(victim.port, timeout=30)
    start = time.monotonic()
    wrong.sendall(sp_header("pair1"))        # nng's header, but not what a Rep0 takes
    try:
        assert _ended(wrong)
        assert time.monotonic() - start < 2
        assert _ended(half)
        assert time.monotonic() - start < 5 + 2
        assert victim.ask("connect") == "ok"
    finally:
        half.close()
        wrong.close()


def test_raw_floods_at_ulimit_1024_leave_starts_and_calls_working(victim_factory):
    """1,100 raw connections held open, plus connect-and-close loops from three threads:
    with ``ulimit -n 1024`` every Process start and authenticated round trip still works."""
    victim = victim_factory(nofile=1024)
    hub_port = _hub_port(victim)
    raw = _open(victim.port, 550) + _open(hub_port, 550)
    stop = threading.Event()

    def connect_and_close(port: int) -> None:
        while not stop.is_set():
            try:
                connect(port, timeout=5).close()
            except OSError:
                time.sleep(0.01)

    threads = (in_threads(2, connect_and_close, hub_port)
               + in_threads(1, connect_and_close, victim.port))
    try:
        answers = [victim.ask("start") for _ in range(3)]
        answers += [victim.ask("connect") for _ in range(3)]
        assert answers == ["ok"] * 6, answers
        assert _fds(victim) < 1024 - 100
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        for sock in raw:
            sock.close()
