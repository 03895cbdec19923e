"""What a reader of loopback traffic sees: every TCP payload byte that crosses ``lo``.

A raw packet socket (``AF_PACKET``) on the loopback interface, read on a thread,
reassembled per connection direction. Pure Python; it needs CAP_NET_RAW (root in a
container), and :func:`available` says whether this process has it.
"""
import collections
import socket
import struct
import threading
import time

_ETH_P_ALL = 0x0003
_PACKET_OUTGOING = 4   # lo shows each packet twice (out, then in): keep one copy
_ETH_HEADER = 14
# getsockopt(SOL_PACKET, PACKET_STATISTICS): struct tpacket_stats {packets, drops}, read
# and reset by the kernel
_SOL_PACKET, _PACKET_STATISTICS = 263, 6


def available() -> bool:
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL)).close()
        return True
    except (PermissionError, OSError, AttributeError):
        return False


class Sniffer:
    """Records the TCP payloads on ``lo`` from :meth:`start` to :meth:`stop`."""

    def __init__(self):
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        # a busy loopback overflows the default buffer (the kernel then drops packets
        # unseen): as root, force 64 MiB past net.core.rmem_max
        force = getattr(socket, "SO_RCVBUFFORCE", 33)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, force, 64 << 20)
        except PermissionError:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._stopped_at = 0.0
        self.dropped = 0   # packets the kernel dropped because the reader fell behind
        self.streams = collections.defaultdict(bytearray)   # (src, sport, dst, dport) -> bytes
        self._thread = threading.Thread(target=self._read, daemon=True, name="sniffer")

    def start(self) -> "Sniffer":
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stopped_at = time.monotonic()
        self._stop.set()
        self._thread.join(120)   # (what is queued: up to the 64 MiB buffer)
        self.dropped += self._drops()
        self._sock.close()
        return self.streams

    def _drops(self) -> int:
        _, drops = struct.unpack("II", self._sock.getsockopt(_SOL_PACKET, _PACKET_STATISTICS, 8))
        return drops

    def _read(self):
        # after stop(), on until the buffer is empty: a reader that fell behind (a busy
        # machine) still has the last packets queued, and they are the run's last words
        # (bounded: a loopback that others keep busy never goes quiet)
        while True:
            try:
                packet, where = self._sock.recvfrom(1 << 17)
            except socket.timeout:
                if self._stop.is_set():
                    return
                continue
            if self._stop.is_set() and time.monotonic() > self._stopped_at + 60:
                return
            if where[2] != _PACKET_OUTGOING:
                self._record(packet)

    def _record(self, packet: bytes):
        ip = packet[_ETH_HEADER:]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != socket.IPPROTO_TCP:
            return   # only IPv4 TCP: fibrl listens on 127.0.0.1
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[(ip[0] & 0x0F) * 4:total]
        sport, dport = struct.unpack("!HH", tcp[:4])
        payload = tcp[(tcp[12] >> 4) * 4:]
        if payload:
            self.streams[(ip[12:16], sport, ip[16:20], dport)] += payload


def forms(secret: bytes) -> list:
    """The ways a secret could be written into a payload: raw, hex, base64."""
    import base64

    return [secret, secret.hex().encode(), secret.hex().upper().encode(),
            base64.b64encode(secret), base64.urlsafe_b64encode(secret),
            base64.b64encode(secret).rstrip(b"=")]
