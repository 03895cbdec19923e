"""The leak check of tests/conftest.py (``no_leaks``) counts exactly: one thread or one
nng socket a test leaves is found, the long-lived exceptions hold only within their
bound, and what a test closes again is not reported."""
from __future__ import annotations

import threading

import pynng

from conftest import LongLived, Resources, leaked


def _leaked_after(before: Resources, **kwargs) -> list:
    return leaked(before, Resources.now(), **kwargs)


def test_a_thread_left_running_is_found_and_one_that_ended_is_not():
    before = Resources.now()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-behind", daemon=True)
    thread.start()
    try:
        assert _leaked_after(before) == ["thread left-behind"]
    finally:
        stop.set()
        thread.join(10)
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
    for _ in range(200):
        if not _leaked_after(before):
            break
        threading.Event().wait(0.05)
    assert _leaked_after(before) == []


def test_a_long_lived_rule_excuses_only_up_to_its_bound():
    rules = (LongLived(r"pool-\d+", 1, "a pool of one"),)
    before = Resources.now()
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, name=f"pool-{n}", daemon=True)
               for n in range(2)]
    threads[0].start()
    try:
        assert _leaked_after(before, thread_rules=rules) == []
        threads[1].start()
        assert sorted(_leaked_after(before, thread_rules=rules)) == ["thread pool-0",
                                                                     "thread pool-1"]
        assert _leaked_after(before, thread_rules=rules, allowed_threads=2) == []
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)


def test_what_a_process_wide_object_holds_is_not_counted():
    before = Resources.now()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="held", daemon=True)
    thread.start()
    try:
        assert _leaked_after(before, held=(set(), {thread})) == []
    finally:
        stop.set()
        thread.join(10)
