"""What an attacker on loopback does: find listening ports, open raw connections.

Shared by the security tests; nothing here knows the run's secret.
"""
import socket
import threading

import psutil

# The first 8 bytes nng exchanges on a tcp connection: "\0SP\0", the protocol, 0, 0.
PROTOCOLS = {"req0": 0x30, "rep0": 0x31, "pair0": 0x10, "pair1": 0x11, "push0": 0x50,
             "pub0": 0x20, "bus0": 0x70, "surveyor0": 0x62}


def sp_header(protocol: str) -> bytes:
    return b"\x00SP\x00" + PROTOCOLS[protocol].to_bytes(2, "big") + b"\x00\x00"


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(8, "big") + payload


def listening_ports(*pids: int) -> list[int]:
    """Every TCP port the processes ``pids`` (and their children) listen on."""
    procs = []
    for pid in pids:
        proc = psutil.Process(pid)
        procs += [proc] + proc.children(recursive=True)
    ports = set()
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.ip == "127.0.0.1":
                    ports.add(conn.laddr.port)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sorted(ports)


def connect(port: int, timeout: float = 30.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def poke(port: int, data: bytes = b"") -> None:
    """One raw connection that sends ``data`` (maybe nothing) and leaves."""
    try:
        with connect(port, timeout=5) as raw:
            if data:
                raw.sendall(data)
    except OSError:
        pass   # refused or reset: the victim defended itself


def in_threads(count: int, fn, *args) -> list[threading.Thread]:
    threads = [threading.Thread(target=fn, args=args, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def half_hello() -> bytes:
    """nng's SP header for a Req0 socket, then the first half of a fibrl hello frame."""
    hello = b"FBHELLO2" + bytes(32)
    return sp_header("req0") + len(hello).to_bytes(8, "big") + hello[:len(hello) // 2]


def churn(port: int, stop: threading.Event, hold: int = 40) -> None:
    """Open connections that send :func:`half_hello` as fast as possible until ``stop``,
    keeping the last ``hold`` of them open (so the listener has many pending and drops
    the oldest, while this closes others)."""
    held: list[socket.socket] = []
    while not stop.is_set():
        try:
            raw = connect(port, timeout=2)
            raw.sendall(half_hello())
            held.append(raw)
        except OSError:
            pass   # refused or reset: the victim defended itself
        while len(held) > hold:
            held.pop(0).close()
    for raw in held:
        raw.close()
