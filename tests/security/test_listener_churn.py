"""Defect: a listener closed a refused peer's data socket while holding its lock; the
close waits for nng's reaper thread, which could be running the accept socket's
pipe-removed callback, which waits for that lock. Under a churn of half-finished
handshakes (while authenticated peers failed their data connection) the process
deadlocked: its ports never answered again and no Process could start. Now no lock that
a pipe callback takes is held while fibrl calls into nng.

Defect: dropping the oldest pending connection closed its pipe without handling a pipe
that had gone meanwhile: each such race printed a traceback, past the promised rate
limit of the drop log. Now every pipe is closed by one helper that handles it."""
import os
import re
import subprocess
import sys
import threading
import time

import pynng
import pytest

import fibrl
from attacker import churn, in_threads
from fibrl.wire.transport import TransportError, _authenticate
from victims import victim_factory  # noqa: F401 (a fixture)

SECRET = b"victim secret".ljust(32, b".")   # victim.py's
CHURN_S = 20


def _failing_peers(address: str, stop: threading.Event) -> None:
    """Authenticated peers whose data connection fails at once (a worker that dies
    while it starts): each makes the listener close the peer's data socket."""
    while not stop.is_set():
        try:
            data_address, _token = _authenticate(address, SECRET, 5, False)
            with pynng.Pair1(send_timeout=2000) as pair:
                pair.dial(data_address, block=True)
                pair.send(b"not the token")
        except (pynng.NNGException, TransportError):
            pass   # crowded out by the churn: try again


def _attack(victim, seconds: float) -> None:
    hub_port = int(victim.ask("hub").rsplit(":", 1)[1])
    stop = threading.Event()
    threads = (in_threads(2, churn, victim.port, stop) + in_threads(1, churn, hub_port, stop)
               + in_threads(1, _failing_peers, victim.address, stop))
    stop.wait(seconds)   # (the attack's duration; nothing here waits for the victim)
    stop.set()
    for thread in threads:
        thread.join(30)


@pytest.mark.timeout(180)   # 15-60 s measured on a loaded two-core machine
def test_listener_survives_a_churn_of_half_handshakes(victim_factory):
    victim = victim_factory()
    _attack(victim, CHURN_S)
    assert victim.ask("connect", timeout=60) == "ok"
    assert victim.ask("start", timeout=60) == "ok"


def test_closing_never_waits_for_a_pipe_callback_that_waits_for_the_lock():
    """The order that deadlocked, forced: the accept socket's pipe-removed callback
    runs on nng's reaper thread while a refused peer's socket is being closed."""
    root = os.path.dirname(os.path.dirname(fibrl.__file__))
    script = os.path.join(os.path.dirname(__file__), "close_race.py")
    env = dict(os.environ, PYTHONPATH=root)
    try:
        done = subprocess.run([sys.executable, script], env=env, capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the race script hung: {exc.stdout!r} {exc.stderr!r}") from exc
    assert done.stdout.strip() == "closed", done.stdout + done.stderr


def test_a_churn_logs_within_the_rate_limit_and_no_traceback(victim_factory, tmp_path):
    log_path = tmp_path / "victim.log"
    with open(log_path, "w") as log_file:
        victim = victim_factory(stderr=log_file)
        start = time.monotonic()
        _attack(victim, CHURN_S / 2)
        assert victim.ask("connect", timeout=60) == "ok"
        took = time.monotonic() - start
    log = log_path.read_text()
    assert "Traceback" not in log, log[:3000]
    windows = int(took // 10) + 2   # (a window may begin before the attack does)
    for where, lines in _drops_by_listener(log).items():
        assert lines <= 20 * windows, f"{where} logged {lines} drops in {took:.0f} s"


def _drops_by_listener(log: str) -> dict:
    counts: dict = {}
    for where in re.findall(r"^(listener \S+): dropped peer", log, re.MULTILINE):
        counts[where] = counts.get(where, 0) + 1
    return counts
