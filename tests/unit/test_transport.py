"""The authenticated transport: handshake, refusal of strangers, no unpickling before auth."""
import pickle
import socket
import threading
import time

import pynng
import pytest

from fibrl import serialization
from fibrl.errors import AuthenticationError, TransportError
from fibrl.hub import Hub
from fibrl.transport import HELLO, Channel, Listener

SECRET = b"s" * 32


class _CreatesFile:
    """Unpickling this creates a file: the canary of the security tests."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def echo():
    received = []
    lost = threading.Event()

    def on_frame(peer, data):
        received.append(data)
        peer.send(data)

    listener = Listener("127.0.0.1", SECRET, on_frame=on_frame, on_lost=lambda p: lost.set(),
                        auth_timeout=1.0)
    yield listener, received, lost
    listener.close(join=1.0)


def test_round_trip_and_loss_notification(echo):
    listener, _, lost = echo
    channel = Channel.connect(listener.address, SECRET, timeout=5)
    channel.send(b"ping")
    assert channel.recv(5) == b"ping"
    channel.close()
    assert lost.wait(5)


def test_wrong_secret_is_rejected_and_listener_keeps_serving(echo):
    listener, received, _ = echo
    with pytest.raises(AuthenticationError):
        Channel.connect(listener.address, b"wrong", timeout=5)
    assert received == []
    good = Channel.connect(listener.address, SECRET, timeout=5)
    good.send(b"ok")
    assert good.recv(5) == b"ok"
    good.close()


def test_client_refuses_listener_with_other_secret(echo):
    listener, _, _ = echo
    with pytest.raises(AuthenticationError, match="did not prove"):
        Channel.connect(listener.address, b"other", timeout=5)


def _raw_pair_for(address):
    req = pynng.Req0(recv_timeout=5000, send_timeout=5000)
    req.dial(address, block=True)
    req.send(HELLO)
    data_address = req.recv()[len(b"FBADDR1"):].decode()
    req.close()
    sock = pynng.Pair1(recv_timeout=3000, send_timeout=3000)
    sock.dial(data_address, block=True)
    return sock


def test_malicious_pickle_from_unauthenticated_peer_is_never_unpickled(tmp_path):
    canary = tmp_path / "pwned"
    hub = Hub(SECRET)
    hub_address = hub.address
    try:
        evil = pickle.dumps(_CreatesFile(str(canary)))
        framed = serialization.dumps(_CreatesFile(str(canary)))
        # 1. straight at the accept socket
        req = pynng.Req0(recv_timeout=3000, send_timeout=3000)
        req.dial(hub_address, block=True)
        req.send(evil)
        assert req.recv() == b"FBNO"
        req.close()
        # 2. on a data socket, instead of the handshake, raw and framed
        for payload in (evil, framed):
            sock = _raw_pair_for(hub_address)
            sock.send(payload)
            with pytest.raises(pynng.NNGException):
                sock.recv()   # dropped: no answer, the pipe is closed
            sock.close()
        assert not canary.exists()
        # 3. the hub still serves real peers
        other = Hub(SECRET)
        assert other.call(hub_address, "hub", "ping", timeout=5) > 0
        other.close()
    finally:
        hub.close()
    assert not canary.exists()


def test_garbage_after_authentication_does_not_kill_the_listener():
    hub = Hub(SECRET)
    try:
        channel = Channel.connect(hub.address, SECRET, timeout=5)
        channel.send(b"\x00garbage")          # not a frame: dropped with an error log
        other = Hub(SECRET)
        assert other.call(hub.address, "hub", "ping", timeout=5) > 0
        other.close()
        channel.close()
    finally:
        hub.close()


def test_silent_peer_is_dropped_after_auth_timeout(echo):
    listener, _, _ = echo
    sock = _raw_pair_for(listener.address)   # connects, never says hello
    start = time.monotonic()
    with pytest.raises(pynng.NNGException):
        sock.recv()                            # closed by the listener after auth_timeout
    assert time.monotonic() - start < 3.5
    sock.close()


def test_nothing_listening_is_a_clear_error():
    with pytest.raises(TransportError, match="nothing listens|did not answer"):
        Channel.connect("tcp://127.0.0.1:9", SECRET, timeout=2)


def test_peers_that_never_authenticate_cannot_pile_up(echo, monkeypatch):
    """Each handshake holds a socket and a thread: past the limit, the next waits for a
    slot (freed by auth_timeout at the latest) instead of opening more."""
    import fibrl.transport as transport

    listener, received, _ = echo
    monkeypatch.setattr(transport, "MAX_AUTHENTICATING", 2)
    silent = [_raw_pair_for(listener.address) for _ in range(2)]   # hold both slots
    assert listener._authenticating == 2
    start = time.monotonic()
    good = Channel.connect(listener.address, SECRET, timeout=10)
    waited = time.monotonic() - start
    good.send(b"after the flood")
    assert good.recv(5) == b"after the flood"
    assert 0.5 < waited < 5, waited          # auth_timeout is 1 s in the fixture
    assert received == [b"after the flood"]
    good.close()
    for sock in silent:
        sock.close()


def test_listener_dying_mid_handshake_fails_the_connect_at_once():
    """A parent killed while its worker authenticates: the worker must not wait out
    its whole connect timeout (nng keeps a Pair1 recv waiting for a redial)."""
    data = pynng.Pair1(recv_timeout=10_000)
    data_address = "tcp://" + str(data.listen("tcp://127.0.0.1:0").local_address)
    rep = pynng.Rep0(recv_timeout=10_000, send_timeout=10_000)
    address = "tcp://" + str(rep.listen("tcp://127.0.0.1:0").local_address)

    def fake_listener():
        try:
            assert rep.recv() == HELLO
            rep.send(b"FBADDR1" + data_address.encode())
            data.recv()  # the client's hello: then die without answering
        finally:
            data.close()
            rep.close()

    _connect_fails_at_once(address, fake_listener, "went away during the authentication")


def test_listener_dying_before_it_gives_its_data_address_fails_at_once(monkeypatch):
    """The connection is up (SP headers exchanged), then the listener is gone before the
    hello is sent: a Req0 send would wait for a redial until its timeout."""
    dial = pynng.Req0.dial

    def dial_then_lose_the_pipe(sock, *args, **kwargs):
        gone = threading.Event()
        sock.add_post_pipe_remove_cb(lambda _pipe: gone.set())
        dial(sock, *args, **kwargs)
        gone.wait(5)  # nng removes the pipe on its own threads

    monkeypatch.setattr(pynng.Req0, "dial", dial_then_lose_the_pipe)
    server = socket.create_server(("127.0.0.1", 0))
    address = "tcp://127.0.0.1:%d" % server.getsockname()[1]

    def fake_listener():
        conn, _ = server.accept()
        server.close()  # nothing to redial to
        conn.recv(8)  # the client's SP header; answer as a Rep0, then die
        conn.sendall(b"\x00SP\x00" + (0x31).to_bytes(2, "big") + b"\x00\x00")
        conn.close()

    _connect_fails_at_once(address, fake_listener, "went away|cannot connect")


def _connect_fails_at_once(address, fake_listener, match):
    """Connect (timeout 30 s) to a listener played by ``fake_listener`` that dies on
    the way: the connect must fail within 10 s."""
    thread = threading.Thread(target=fake_listener, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(TransportError, match=match):
        Channel.connect(address, SECRET, timeout=30)
    assert time.monotonic() - start < 10
    thread.join(10)
