"""Defect: 4 threads saying hello to the accept socket stopped a new Process from
starting (the accept thread waited for a handshake slot, each held up to auth_timeout).
Now the accept socket answers every hello at once and keeps no state for it: a new
worker starts within a few seconds during such a flood."""
import os
import threading
import time

import pynng
import pytest

import fibrl
from fibrl.hosting.hub import get_hub

OLD_HELLO = b"FBHELLO1"


def _flood(address, stop, sent):
    while not stop.is_set():
        try:
            with pynng.Req0(recv_timeout=2000, send_timeout=2000, resend_time=-1) as req:
                req.dial(address, block=True)
                for hello in (OLD_HELLO, b"FBHELLO2" + os.urandom(32)):
                    req.send(hello)
                    req.recv()
                    sent.append(1)
        except pynng.NNGException:
            pass    # refused or timed out: keep flooding


@pytest.mark.alone   # a timing: the start within 5 s while four threads flood
def test_new_worker_starts_during_a_hello_flood():
    address = get_hub().address
    stop, sent = threading.Event(), []
    flooders = [threading.Thread(target=_flood, args=(address, stop, sent), daemon=True)
                for _ in range(4)]
    for thread in flooders:
        thread.start()
    try:
        time.sleep(1.0)            # let the flood fill whatever it can fill
        proc = fibrl.Process(target=sum, args=([1, 2],))
        started = threading.Thread(target=lambda: (proc.start(), proc.join(20)), daemon=True)
        start = time.monotonic()
        started.start()
        started.join(15)
        took = time.monotonic() - start
        assert proc.exitcode == 0, f"worker not done after {took:.1f} s of flood"
        assert took < 5
        assert len(sent) > 100, "the flood did not flood"
    finally:
        stop.set()
        for thread in flooders:
            thread.join(5)
