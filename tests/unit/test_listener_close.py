"""A listener that closes while an authenticated peer has not yet connected its
data socket says nothing of a dropped peer (it closed that socket itself); a peer
that never connects it within auth_timeout is still reported."""
import logging

from fibrl.wire.transport import Listener

SECRET = b"k" * 32


def _opening_peer(listener):
    """What the handshake does once a peer proved the secret: a data socket waits for
    the peer's token (here, none ever comes)."""
    listener._open_peer(b"t" * 32, None)
    (peer,) = listener._opening.values()
    return peer


def test_closing_with_a_peer_still_opening_logs_no_dropped_peer(caplog):
    listener = Listener("127.0.0.1", SECRET, on_frame=lambda peer, data: None)
    peer = _opening_peer(listener)
    with caplog.at_level(logging.WARNING, logger="fibrl.wire.transport"):
        listener.close(join=10.0)
        assert not peer.thread.is_alive()
    assert "dropped peer" not in caplog.text


def test_a_peer_that_never_connects_its_data_socket_is_still_reported(caplog):
    listener = Listener("127.0.0.1", SECRET, on_frame=lambda peer, data: None,
                        auth_timeout=0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="fibrl.wire.transport"):
            peer = _opening_peer(listener)
            peer.thread.join(10.0)
            assert not peer.thread.is_alive()
        assert "did not connect to its data socket within auth_timeout" in caplog.text
    finally:
        listener.close(join=10.0)
