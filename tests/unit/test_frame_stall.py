"""A large frame travels in pieces; a sender that stops midway (frozen, cut off) must not
hold a receiver that asked for a timeout forever: the connection is dropped as closed
(the rest of that frame could not be told from what follows)."""
from __future__ import annotations

import time

import pytest

import fibrl.channel as channel
from fibrl.errors import ChannelClosed
from fibrl.wire import transport


def _recv_patiently(ch, timeout: float):
    """``ch.recv(timeout)`` again while nothing at all has come (a loaded machine may
    delay the first message past a short timeout)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return ch.recv(timeout=timeout)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


@pytest.mark.timeout(60)
def test_a_frame_that_stops_midway_closes_the_channel(monkeypatch):
    monkeypatch.setattr(transport, "PIECE_STALL_S", 0.5)
    total = 3 * transport.PIECE

    def half_a_frame(peer, frame):
        # the header of a frame in pieces, and its first piece; then nothing (a frozen
        # sender's connection stays open)
        with peer._send_lock:
            peer._sock.send(transport._LARGE.pack(transport._LARGE_TAG, total))
            peer._sock.send(b"\0" * transport.PIECE)

    listener = channel.listen(half_a_frame)
    ch = channel.connect(listener.address)
    try:
        ch.send(b"go")
        with pytest.raises(ChannelClosed, match="nothing for 0.5 s"):
            _recv_patiently(ch, 0.1)
        assert ch.closed
        with pytest.raises(ChannelClosed):
            ch.recv(timeout=0.1)
    finally:
        ch.close()
        listener.close()


@pytest.mark.timeout(60)
def test_pieces_that_keep_coming_are_waited_for_across_receive_timeouts(monkeypatch):
    """Receive timeouts shorter than the gaps between pieces do not split a frame."""
    monkeypatch.setattr(transport, "PIECE_STALL_S", 30.0)
    total = 2 * transport.PIECE

    def slow_frame(peer, frame):
        with peer._send_lock:
            peer._sock.send(transport._LARGE.pack(transport._LARGE_TAG, total))
            for i in range(2):
                time.sleep(0.3)
                peer._sock.send(bytes([i + 1]) * transport.PIECE)

    listener = channel.listen(slow_frame)
    ch = channel.connect(listener.address)
    try:
        ch.send(b"go")
        frame = _recv_patiently(ch, 0.1)
        assert len(frame) == total and frame[0] == 1 and frame[-1] == 2
    finally:
        ch.close()
        listener.close()
