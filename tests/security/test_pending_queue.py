"""A full listener is a queue: peers queued behind others wait; idle strangers make room.

Defect: past ``max_pending`` a listener closed its oldest pending connection for each
new one, even when that one was only waiting for the listener to answer it. A burst of
peers that all knew the secret lost some of their handshakes ("Connection shutdown").
Now a new connection waits (in the kernel's listen backlog) while the pending ones make
progress, and only a connection that sends nothing while the listener waits for it
(idle for a grace period) is closed for a waiting one: an unauthenticated flood still
holds at most ``max_pending`` connections.
"""
import logging
import socket
import threading
import time

import pytest

from attacker import sp_header
from conftest import echo_once, require_module, wait_until
from fibrl.wire import transport
from fibrl.wire.transport import Channel, Listener

SECRET = b"q" * 32


def _connect_all(address: str, count: int, timeout: float) -> list:
    results: list = []

    threads = [threading.Thread(target=echo_once, args=(address, SECRET, timeout, results))
               for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return results


def _slowly(answer, seconds: float):
    """The listener's answer to a handshake message, ``seconds`` late: every peer's
    message waits in line behind the others'."""
    def late(data, pipe):
        time.sleep(seconds)
        return answer(data, pipe)
    return late


def test_peers_queued_behind_a_slow_listener_wait_and_are_not_dropped(caplog):
    listener = Listener("127.0.0.1", SECRET, on_frame=lambda p, d: p.send(d),
                        max_pending=2)
    # longer than the idle grace: a queued peer is not idle however long it waits
    listener._answer = _slowly(listener._answer, transport.IDLE_GRACE + 0.1)
    try:
        with caplog.at_level(logging.WARNING, logger="fibrl.wire"):
            results = _connect_all(listener.address, 4, timeout=60)
        assert results == ["ok"] * 4, results
        assert "dropped peer" not in caplog.text, caplog.text[:2000]
    finally:
        listener.close(join=1.0)


def test_an_idle_connection_gives_its_slot_to_a_waiting_peer(caplog):
    listener = Listener("127.0.0.1", SECRET, on_frame=lambda p, d: p.send(d),
                        max_pending=1, auth_timeout=60)
    host, port = listener.address[len("tcp://"):].rsplit(":", 1)
    idle = socket.create_connection((host, int(port)), timeout=30)
    idle.sendall(sp_header("req0"))          # speaks nng, then nothing
    try:
        assert idle.recv(8) == sp_header("rep0")   # it holds the one slot now
        # in within 20 s, so not by the idle one's auth_timeout (60 s) running out
        with caplog.at_level(logging.WARNING, logger="fibrl.wire"):
            ch = Channel.connect(listener.address, SECRET, timeout=20)
        ch.send(b"x")
        assert ch.recv(10) == b"x"
        assert idle.recv(1) == b""               # the listener closed the idle one
        assert "sent nothing for" in caplog.text, caplog.text
        assert listener.pending <= 1
        ch.close()
    finally:
        idle.close()
        listener.close(join=1.0)


def test_idle_strangers_that_wait_in_line_are_held_at_most_max_pending():
    """20 connections that send nng's header and nothing more, to a listener that holds
    3: it never holds more than 3 of them, and a peer still gets in."""
    listener = Listener("127.0.0.1", SECRET, on_frame=lambda p, d: p.send(d),
                        max_pending=3, auth_timeout=60)
    host, port = listener.address[len("tcp://"):].rsplit(":", 1)
    idle = []
    try:
        for _ in range(20):
            raw = socket.create_connection((host, int(port)), timeout=30)
            raw.sendall(sp_header("req0"))
            idle.append(raw)
        most = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            most = max(most, listener.pending)
            time.sleep(0.01)
        assert 1 <= most <= 3
        ch = Channel.connect(listener.address, SECRET, timeout=30)
        ch.close()
    finally:
        for raw in idle:
            raw.close()
        listener.close(join=1.0)


def test_with_tls_a_full_listener_refuses_a_busy_slot_and_the_peer_tries_again(caplog):
    """With TLS nng accepts by itself: past the limit the new connection is refused
    while the pending one is not idle yet, and the peer starts its handshake again."""
    require_module("cryptography")
    listener = Listener("127.0.0.1", SECRET, on_frame=lambda p, d: p.send(d),
                        max_pending=1, auth_timeout=60, tls=True)
    holder = transport._make(transport.pynng.Req0, SECRET, True, False)
    try:
        holder.dial(listener.address, block=True)   # a TLS peer that says nothing
        # (the listener learns of it a moment after the dial returned: a new connection
        # that came first would have the slot, and the holder would be the one refused)
        wait_until(lambda: listener.pending == 1, "the listener to hold the silent peer")
        # in within 20 s, so not by the holder's auth_timeout (60 s) running out
        with caplog.at_level(logging.WARNING, logger="fibrl.wire"):
            ch = Channel.connect(listener.address, SECRET, timeout=20)
        ch.send(b"x")
        assert ch.recv(10) == b"x"
        assert "the new one is refused" in caplog.text, caplog.text
        assert "sent nothing for" in caplog.text, caplog.text
        ch.close()
    finally:
        holder.close()
        listener.close(join=1.0)


@pytest.mark.parametrize("cause", ["closed", "shutdown", "refused"])
def test_a_handshake_closed_under_the_peer_is_tried_again_but_not_a_refusal(cause):
    import pynng

    lib = pynng.lib
    error = {"closed": pynng.Closed("Object closed", lib.NNG_ECLOSED),
             "shutdown": pynng.NNGException("Connection shutdown", lib.NNG_ECONNSHUT),
             "refused": pynng.ConnectionRefused("Connection refused", lib.NNG_ECONNREFUSED),
             }[cause]
    assert transport._closed_under_us(error) is (cause != "refused")


def test_a_handshake_whose_connection_died_unnoticed_fails_as_closed_at_once(monkeypatch):
    """nng's TLS transport can keep a pipe whose socket the listener closed as it
    arrived (past its limit): the request then waited its whole timeout (20 s in the
    full-listener test above, under load). The wait checks the connection and fails as
    closed under us, which the handshake tries again."""
    import pynng

    silent = pynng.Rep0(listen="tcp://127.0.0.1:0")   # takes requests, never answers
    req = transport._make(pynng.Req0, SECRET, False, False, resend_time=-1)
    try:
        req.dial(transport._address_of(silent, "tcp"), block=True)
        req.send(b"hello")
        dead = req.pipes[0]
        assert transport._connected(dead)
        monkeypatch.setattr(transport, "_connected", lambda pipe: pipe is not dead)
        with pytest.raises(pynng.Closed) as caught:
            transport._answer_of(req, time.monotonic() + 120)   # (past the test's time limit)
        assert transport._closed_under_us(caught.value)
        monkeypatch.undo()
        wait_until(lambda: dead not in req.pipes, "the dead pipe to be closed")
    finally:
        req.close()
        silent.close()


def test_the_handshake_wait_returns_the_answer_and_keeps_its_deadline():
    import pynng

    with pynng.Rep0(listen="tcp://127.0.0.1:0") as rep:
        req = transport._make(pynng.Req0, SECRET, False, False, resend_time=-1)
        try:
            req.dial(transport._address_of(rep, "tcp"), block=True)
            req.send(b"ping")
            assert rep.recv() == b"ping"
            with pytest.raises(pynng.Timeout):   # nothing answered yet
                transport._answer_of(req, time.monotonic() + 0.3)
            req.send(b"again")
            assert rep.recv() == b"again"
            rep.send(b"pong")
            assert transport._answer_of(req, time.monotonic() + 60) == b"pong"
        finally:
            req.close()
