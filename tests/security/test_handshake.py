"""The handshake as an attacker sees it: garbage and code-running pickles of every nng
protocol are refused and never unpickled, a recorded handshake cannot be replayed, and
every refusal is logged once with the remote address, rate-limited."""
import hashlib
import hmac
import logging
import os
import pickle
import time

import pynng
import pytest

from attacker import PROTOCOLS, frame, listening_ports, poke, sp_header
from conftest import PickleCanary
from fibrl.wire import serialization
from fibrl.errors import AuthenticationError
from fibrl.wire.transport import HELLO, Channel, Listener

SECRET = b"s" * 32


@pytest.fixture
def echo():
    frames = []

    def on_frame(peer, data):
        frames.append(data)
        peer.send(data)

    listener = Listener("127.0.0.1", SECRET, on_frame=on_frame, auth_timeout=2.0)
    yield listener, frames
    listener.close(join=1.0)


def _sockets_of_every_protocol():
    return [pynng.Req0, pynng.Pair0, pynng.Pair1, pynng.Push0, pynng.Pub0, pynng.Bus0,
            pynng.Surveyor0]


def test_pickles_and_garbage_of_every_protocol_are_never_unpickled(echo, tmp_path):
    listener, frames = echo
    resident = Channel.connect(listener.address, SECRET, timeout=10)
    canary = tmp_path / "pwned"
    payloads = [pickle.dumps(PickleCanary(str(canary))),
                serialization.dumps(PickleCanary(str(canary))), os.urandom(200), b""]
    for port in listening_ports(os.getpid()):
        for kind in _sockets_of_every_protocol():
            with kind(send_timeout=200, recv_timeout=200) as sock:
                try:
                    # (not block=True: a port of a server of another kind that another
                    # test left in this process can hold a blocking dial for good)
                    sock.dial(f"tcp://127.0.0.1:{port}", block=False)
                    for payload in payloads:
                        sock.send(payload)
                except pynng.NNGException:
                    pass        # refused: fine
        for protocol in PROTOCOLS:
            for payload in payloads:
                poke(port, sp_header(protocol) + frame(payload))
    resident.send(b"still here")
    assert resident.recv(10) == b"still here"
    assert frames == [b"still here"]     # nothing else reached the frame handler
    assert not canary.exists()
    resident.close()


def test_a_recorded_handshake_cannot_be_replayed(echo):
    listener, _ = echo
    nonce = os.urandom(32)
    with pynng.Req0(recv_timeout=10_000, send_timeout=10_000, resend_time=-1) as req:
        req.dial(listener.address, block=True)
        req.send(HELLO + nonce)
        ticket = req.recv()[len(b"FBCHAL2"):-32]
        recorded = b"FBAUTH2" + nonce + ticket + hmac.new(
            SECRET, b"C" + ticket + nonce, hashlib.sha256).digest()
        req.send(recorded)
        assert req.recv().startswith(b"FBADDR2")     # the legitimate use
    with pynng.Req0(recv_timeout=10_000, send_timeout=10_000, resend_time=-1) as req:
        req.dial(listener.address, block=True)
        req.send(recorded)                           # the replay
        assert req.recv() == b"FBNOa replayed handshake (ticket already used)"


def test_wrong_secret_and_forged_tickets_are_refused(echo):
    listener, _ = echo
    with pytest.raises(AuthenticationError):
        Channel.connect(listener.address, b"wrong", timeout=10)
    with pynng.Req0(recv_timeout=10_000, send_timeout=10_000, resend_time=-1) as req:
        req.dial(listener.address, block=True)
        nonce, ticket = os.urandom(32), os.urandom(32)
        req.send(b"FBAUTH2" + nonce + ticket + hmac.new(
            SECRET, b"C" + ticket + nonce, hashlib.sha256).digest())
        assert req.recv() == b"FBNOa ticket this listener did not issue"


def test_refused_peers_are_logged_with_address_and_reason_rate_limited(echo, caplog):
    listener, _ = echo

    def garbage(i):
        with pynng.Req0(recv_timeout=10_000, send_timeout=10_000, resend_time=-1) as req:
            req.dial(listener.address, block=True)
            req.send(b"garbage %d" % i)
            assert req.recv().startswith(b"FBNO")

    refusals = 150
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fibrl.wire.transport"):
        for i in range(refusals):
            garbage(i)
        Channel.connect(listener.address, SECRET, timeout=10).close()
    took = time.monotonic() - start
    dropped = [r.getMessage() for r in caplog.records if "dropped peer" in r.getMessage()]
    assert dropped, "no refusal was logged"
    assert all("127.0.0.1:" in line for line in dropped)
    assert all("not a fibrl handshake message" in line for line in dropped)
    # at most 20 lines per 10 s window: the window open when we began (it opened with
    # the listener), and one more per 10 s we took, however slow this machine is
    windows = int(took // 10) + 2
    assert len(dropped) <= 20 * windows + 5, \
        f"{len(dropped)} of {refusals} refusals logged in {took:.1f} s"
