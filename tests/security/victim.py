"""A process that hosts a fibrl Listener with one authenticated peer, for the attacks
that need the victim in a process of its own (memory, descriptor limit).

Usage: python victim.py [NOFILE]. Prints "ready <accept address>", then answers each
line on stdin: "connect" -> "ok" or "fail <error>" (a new authenticated round trip),
"rss" -> "rss <peak RSS in KiB>", "hub" -> "hub <accept address of the process's hub>"
(the one Process uses), "start" -> "ok" or "fail <error>" (a fibrl.Process started and
joined), "fds" -> "fds <descriptors open>", "quit".
"""
import os
import resource
import sys

import fibrl
from fibrl.hosting.hub import get_hub
from fibrl.wire.transport import Channel, Listener

SECRET = b"victim secret".ljust(32, b".")


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))


def _start() -> str:
    proc = fibrl.Process(target=os.getpid)
    proc.start()
    proc.join(30)
    return "ok" if proc.exitcode == 0 else f"fail exitcode {proc.exitcode}"


def _connect(listener: Listener, resident: Channel) -> None:
    channel = Channel.connect(listener.address, SECRET, timeout=10)
    channel.send(b"x")
    assert channel.recv(10) == b"x"
    resident.send(b"y")
    assert resident.recv(10) == b"y"
    channel.close()


def _answer(command: str, listener: Listener, resident: Channel) -> str:
    try:
        if command == "connect":
            _connect(listener, resident)
            return "ok"
        if command == "start":
            return _start()
    except Exception as exc:  # reported to the test, which fails with it
        return " ".join(["fail", type(exc).__name__, str(exc).replace("\n", " ")])
    if command == "rss":
        return f"rss {_peak_rss_kib()}"
    if command == "hub":
        return f"hub {get_hub().address}"
    if command == "fds":
        return f"fds {len(os.listdir('/proc/self/fd'))}"
    return f"fail unknown command {command!r}"


def main() -> None:
    if len(sys.argv) > 1:
        limit = int(sys.argv[1])
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))
    listener = Listener("127.0.0.1", SECRET, on_frame=lambda p, d: p.send(d),
                        auth_timeout=5.0)
    resident = Channel.connect(listener.address, SECRET, timeout=10)
    print("ready", listener.address, flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        print(_answer(command, listener, resident), flush=True)
    resident.close()
    listener.close(join=1.0)


if __name__ == "__main__":
    main()
