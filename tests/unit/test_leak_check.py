"""The leak check of tests/conftest.py (``no_leaks``) counts exactly: one thread or one
nng socket a test leaves is found, the long-lived exceptions hold only within their
bound, and what a test closes again is not reported."""
from __future__ import annotations

import contextlib
import threading
import time

import pynng

from conftest import LongLived, Resources, leaked


def _leaked_after(before: Resources, **kwargs) -> list:
    return leaked(before, Resources.now(), **kwargs)


@contextlib.contextmanager
def _running(*names: str):
    """Threads of these names, running until the block ends (then joined)."""
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, name=name, daemon=True) for name in names]
    for thread in threads:
        thread.start()
    try:
        yield threads
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)


def test_a_thread_left_running_is_found_and_one_that_ended_is_not():
    before = Resources.now()
    with _running("left-behind"):
        assert _leaked_after(before) == ["thread left-behind"]
    assert _leaked_after(before) == []


def test_an_nng_socket_left_open_is_found_by_its_descriptors():
    before = Resources.now()
    listener = pynng.Pair1(listen="tcp://127.0.0.1:0")
    address = str(listener.listeners[0].local_address)   # (its .port is byte-swapped)
    dialer = pynng.Pair1(dial=f"tcp://{address}", block_on_dial=True)
    try:
        found = _leaked_after(before)
        assert any(f"listening local={address} " in entry for entry in found), found
        assert any(f"peer={address} " in entry for entry in found), found
    finally:
        dialer.close()
        listener.close()
    # nng closes its descriptors from its own threads, shortly after close() returns
    deadline = time.monotonic() + 10
    while _leaked_after(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _leaked_after(before) == []


def test_a_long_lived_rule_excuses_only_up_to_its_bound():
    rules = (LongLived(r"pool-\d+", 1, "a pool of one"),)
    before = Resources.now()
    with _running("pool-0"):
        assert _leaked_after(before, thread_rules=rules) == []
        with _running("pool-1"):
            past = " [one of 2 open like it, bound 1]"   # (said: a pool that grew)
            assert sorted(_leaked_after(before, thread_rules=rules)) == [
                "thread pool-0" + past, "thread pool-1" + past]
            assert _leaked_after(before, thread_rules=rules, allowed_threads=2) == []


def test_what_a_process_wide_object_holds_is_not_counted():
    before = Resources.now()
    with _running("held") as (thread,):
        assert _leaked_after(before, held=(set(), {thread})) == []
        assert _leaked_after(before) == ["thread held"]


def test_a_handshake_in_progress_on_the_hub_is_its_listeners_not_the_tests():
    # A worker killed between its handshake and its data connection (a pool's worker
    # whose start returned after terminate()) leaves the hub's listener waiting for its
    # token, up to auth_timeout: that thread and readiness pipe are the listener's.
    from conftest import _held_by_the_process
    from fibrl.hosting.hub import get_hub

    hub = get_hub()
    _ = hub.address   # (the hub listens from its first use on)
    listener = hub._listener
    before = Resources.now()
    listener._open_peer(b"t" * 32, None)   # (what an accepted handshake does)
    (peer,) = listener._opening.values()
    try:
        assert _leaked_after(before, held=_held_by_the_process()) == []
        found = _leaked_after(before)
        assert f"thread fibrl-peer-{peer.id}" in found, found
        assert any("pipe:[" in entry for entry in found), found
    finally:
        peer.close()   # (its thread then ends at once: the token can no longer come)
        peer.thread.join(10)
    assert not peer.thread.is_alive()
