"""Defect: before authentication a peer could make the listener take frames of any
size (a 300-500 MB frame added 0.6-1 GB to its RSS). Now nothing a stranger sends is
buffered beyond a few KiB: the victim's peak RSS stays flat under big frames sent to
every port it listens on, with the protocol each port speaks."""
import threading

from attacker import connect, frame, listening_ports, sp_header
from victims import victim_factory  # noqa: F401 (a fixture)

FRAME = 128 * 1024 * 1024


def _stream_big_frame(port, protocol, out):
    """Claims a FRAME-byte message and sends it all, 1 MiB at a time."""
    chunk = b"\xab" * (1 << 20)
    try:
        with connect(port, timeout=30) as raw:
            raw.sendall(sp_header(protocol) + FRAME.to_bytes(8, "big"))
            for _ in range(FRAME // len(chunk)):
                raw.sendall(chunk)
            out.append("sent all")
    except OSError:
        out.append("dropped")          # the victim closed the connection: what we want


def _data_address_without_secret(port):
    """The old protocol gave a data address to anyone who said hello."""
    with connect(port, timeout=30) as raw:
        raw.sendall(sp_header("req0") + frame(b"\x80\x00\x00\x01" + b"FBHELLO1"))
        raw.recv(8)
        answer = raw.recv(4096)
    marker = answer.find(b"tcp://")
    return int(answer[marker:].decode().rsplit(":", 1)[1]) if marker >= 0 else None


def test_big_frames_before_authentication_are_not_buffered(victim_factory):
    victim = victim_factory()
    before = int(victim.ask("rss").split()[1])
    targets = [(victim.port, "req0")] * 2
    targets += [(port, "pair1") for port in listening_ports(victim.pid) if port != victim.port]
    handed = _data_address_without_secret(victim.port)
    if handed:
        targets += [(handed, "pair1")] * 2
    results = []
    threads = [threading.Thread(target=_stream_big_frame, args=(port, proto, results))
               for port, proto in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    grown_mib = (int(victim.ask("rss").split()[1]) - before) / 1024
    assert grown_mib < 64, f"victim's peak RSS grew {grown_mib:.0f} MiB ({results})"
    assert victim.ask("connect") == "ok"
