"""Forces the order in which a Listener's data socket is closed while nng's reaper
thread runs the accept socket's pipe-removed callback (see test_listener_deadlock.py).

Usage: python close_race.py. Prints "closed" once the refused peer's socket is closed
and the listener has answered a new peer, "stuck" if its closing thread is still
running after 10 s (then exits at once: a deadlocked nng cannot be shut down).
"""
import faulthandler
import os
import sys
import threading

from fibrl.wire.transport import Channel, ChannelClosed, Listener, TransportError

SECRET = b"race secret".ljust(32, b".")
removing = threading.Event()   # the reaper is inside the accept socket's pipe callback
held = threading.Event()       # the peer's thread holds the listener's lock


class _SpyLock:
    """The listener's lock, saying when a peer's thread (``_serve``) holds it."""

    def __init__(self, lock):
        self._lock = lock

    def __enter__(self):
        self._lock.acquire()
        if threading.current_thread().name.startswith("fibrl-peer-"):
            held.set()
        return self

    def __exit__(self, *exc):
        self._lock.release()


class RacingListener(Listener):
    def _accept_pipe_removed(self, pipe):
        removing.set()
        held.wait(10)        # the peer's thread now holds the lock (or never will)
        super()._accept_pipe_removed(pipe)

    def _check_token(self, sock, token):
        super()._check_token(sock, token)
        removing.wait(10)    # the handshake's connection is being removed by the reaper
        return False         # refuse the peer: its data socket is closed


def main() -> None:
    listener = RacingListener("127.0.0.1", SECRET, on_frame=lambda p, d: p.send(d))
    listener._lock = _SpyLock(listener._lock)
    try:
        Channel.connect(listener.address, SECRET, timeout=5)
    except (ChannelClosed, TransportError):
        pass    # refused, as the listener above decides
    serving = [t for t in threading.enumerate() if t.name.startswith("fibrl-peer-")]
    for thread in serving:
        thread.join(10)
    if any(thread.is_alive() for thread in serving):
        print("stuck", flush=True)
        faulthandler.dump_traceback(sys.stderr)   # (the test shows where it hung)
        os._exit(1)
    removing.set()   # (the next peer's callbacks need not wait)
    held.set()
    RacingListener._check_token = Listener._check_token
    channel = Channel.connect(listener.address, SECRET, timeout=10)
    channel.send(b"x")
    assert channel.recv(10) == b"x"
    channel.close()
    listener.close(join=1.0)
    print("closed", flush=True)


if __name__ == "__main__":
    main()
