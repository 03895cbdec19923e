"""``fibrl.channel``: the public point-to-point connection, between processes of a run."""
import threading

import numpy as np
import pytest

import fibrl.channel as channel
from fibrl.errors import AuthenticationError, ChannelClosed, TransportError
from fibrl.wire.transport import Channel

from conftest import join_all, run_process


def _ask(address, ask):
    """In a worker: connect to ``address``, send each item of ``ask`` and check the answer
    (an echo of the object's repr, and the array doubled)."""
    ch = channel.connect(address, timeout=60)
    for item in ask:
        ch.send(channel.dumps(item))
        text, doubled = channel.loads(ch.recv(timeout=60))
        assert text == repr(item["name"]), text
        np.testing.assert_array_equal(doubled, item["array"] * 2)
    ch.close()


def test_a_worker_connects_to_a_listener_by_address_and_objects_round_trip(ctx):
    seen, lost = [], threading.Event()

    def answer(peer, frame):
        item = channel.loads(frame)
        seen.append((peer, item["name"]))
        peer.send(channel.dumps((repr(item["name"]), item["array"] * 2)))

    listener = channel.listen(answer, on_lost=lambda peer: lost.set())
    try:
        # one small, one large (out-of-band buffers) array
        ask = [{"name": "small", "array": np.arange(5)},
               {"name": ("big", 1), "array": np.ones(3 << 20, dtype=np.float32)}]
        join_all(run_process(ctx, _ask, listener.address, ask), timeout=120)
        assert [name for _, name in seen] == ["small", ("big", 1)]
        assert seen[0][0] is seen[1][0]   # one peer: one connection
        assert lost.wait(30), "on_lost did not run when the worker's channel closed"
    finally:
        listener.close()


def test_a_process_without_the_run_secret_is_refused():
    frames = []
    listener = channel.listen(lambda peer, frame: frames.append(frame))
    try:
        with pytest.raises(AuthenticationError):
            Channel.connect(listener.address, b"not the run's secret" * 2, timeout=10)
        assert frames == []
    finally:
        listener.close()


def test_loss_is_reported_on_both_sides():
    lost = threading.Event()
    listener = channel.listen(lambda peer, frame: peer.send(frame), on_lost=lambda p: lost.set())
    ch = channel.connect(listener.address, timeout=30)
    ch.send(b"x")
    assert ch.recv(timeout=30) == b"x"
    gone = threading.Event()
    ch.on_lost(gone.set)
    listener.close()
    assert gone.wait(30), "the channel's on_lost did not run when its listener closed"
    with pytest.raises(ChannelClosed):
        ch.send(b"after")
    with pytest.raises(ChannelClosed):
        ch.recv(timeout=5)
    ch.close()


def test_connect_names_what_is_wrong_with_an_address(configure):
    listener = channel.listen(lambda peer, frame: None)
    address = listener.address
    listener.close()
    with pytest.raises(TransportError):
        channel.connect(address, timeout=2)   # nothing listens there any more
    configure(tls=True)
    with pytest.raises(TransportError, match="plaintext address; nothing was sent"):
        channel.connect(address, timeout=2)
