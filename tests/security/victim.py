"""A process that hosts a fibrl Listener with one authenticated peer, for the attacks
that need the victim in a process of its own (memory, descriptor limit).

Usage: python victim.py [NOFILE]. Prints "ready <accept address>", then answers each
line on stdin: "connect" -> "ok" or "fail <error>" (a new authenticated round trip),
"rss" -> "rss <peak RSS in KiB>", "quit".
"""
import resource
import sys

from fibrl.transport import Channel, Listener

SECRET = b"victim secret".ljust(32, b".")


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))


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
        if command == "connect":
            try:
                channel = Channel.connect(listener.address, SECRET, timeout=10)
                channel.send(b"x")
                assert channel.recv(10) == b"x"
                resident.send(b"y")
                assert resident.recv(10) == b"y"
                channel.close()
                print("ok", flush=True)
            except Exception as exc:  # reported to the test, which fails with it
                print("fail", type(exc).__name__, str(exc).replace("\n", " "), flush=True)
        elif command == "rss":
            print("rss", _peak_rss_kib(), flush=True)
        elif command == "quit":
            break
    resident.close()
    listener.close(join=1.0)


if __name__ == "__main__":
    main()
