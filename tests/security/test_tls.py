"""TLS: a round trip over tls+tcp, and the ways in without the run's certificate."""
import pytest

from fibrl.errors import AuthenticationError, TransportError
from fibrl.wire.transport import Channel, Listener

SECRET = b"t" * 32


@pytest.fixture
def tls_listener():
    listener = Listener("127.0.0.1", SECRET, on_frame=lambda p, d: p.send(d),
                        auth_timeout=2.0, tls=True)
    yield listener
    listener.close(join=1.0)


def test_tls_round_trip(tls_listener):
    assert tls_listener.address.startswith("tls+tcp://127.0.0.1:")
    channel = Channel.connect(tls_listener.address, SECRET, timeout=10)
    payload = bytes(range(256)) * 4096
    channel.send(payload)
    assert channel.recv(10) == payload
    channel.close()


def test_plain_tcp_client_is_refused_by_a_tls_listener(tls_listener):
    plain = tls_listener.address.replace("tls+tcp://", "tcp://")
    with pytest.raises(TransportError):
        Channel.connect(plain, SECRET, timeout=3)
    channel = Channel.connect(tls_listener.address, SECRET, timeout=10)   # still serving
    channel.close()


def test_tls_client_of_another_run_cannot_connect(tls_listener):
    # its certificate is derived from another secret: the TLS handshake itself fails
    with pytest.raises((TransportError, AuthenticationError)):
        Channel.connect(tls_listener.address, b"another run".ljust(32), timeout=3)
