"""A peer that waits in a full listener's queue longer than nng's negotiation limit.

Defect: a connect whose TCP connection waited in the queue of a listener full of
pending handshakes (``max_pending``) for more than nng's fixed 10 s negotiation limit
failed after those 10 s with "did not answer within <its whole timeout> s", and was not
tried again: under a burst of connects on a loaded machine, a few of them failed though
the listener would have served them a moment later. Now such a connect starts again
until its own timeout, also when less than nng's limit is left of it (the new try ends
at the connect's timeout, not at nng's limit).
"""
import threading
import time

import pytest
from conftest import echo_once

from fibrl.wire import transport
from fibrl.wire.transport import Listener

SECRET = b"n" * 32
HOLD_S = transport._NEGOTIATION_S + 2   # the one slot is busy longer than nng waits


@pytest.mark.slow
@pytest.mark.timeout(120)
# 60 s: time for several tries; HOLD_S + 3: after nng's limit ends the first try, less
# than that limit is left for the second, which the listener takes once its slot frees
@pytest.mark.parametrize("timeout", [60, HOLD_S + 3])
def test_a_peer_queued_past_nngs_negotiation_limit_tries_again(caplog, timeout):
    listener = Listener("127.0.0.1", SECRET, on_frame=lambda p, d: p.send(d),
                        max_pending=1, auth_timeout=60)
    answer, answering = listener._answer, threading.Event()

    def first_slowly(data, pipe):   # the first handshake message holds the one slot
        if not answering.is_set():
            answering.set()
            time.sleep(HOLD_S)
        return answer(data, pipe)

    listener._answer = first_slowly
    first: list = []
    queued: list = []
    try:
        holder = threading.Thread(target=echo_once, args=(listener.address, SECRET, 60, first))
        holder.start()
        assert answering.wait(30)
        # the listener is full and busy: this one waits in its queue past nng's limit
        echo_once(listener.address, SECRET, timeout, queued)
        holder.join(70)
        assert first == ["ok"], first
        assert queued == ["ok"], queued
        drops = [r.getMessage() for r in caplog.records if "dropped peer" in r.getMessage()]
        assert not drops, drops
    finally:
        listener.close(join=1.0)
