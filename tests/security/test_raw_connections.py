"""Defect: raw TCP connections that never send nng's header were not counted (nng holds
each for 10 s before any pipe callback sees it): at ulimit -n 1024 a flood of them held
every descriptor and Process starts failed with EMFILE. Now a listener whose process
runs low on descriptors closes every connection to its accept port that has not
authenticated, keeping an eighth of the limit for the process's own work."""
import threading

from attacker import connect, in_threads
from victims import victim_factory  # noqa: F401 (a fixture)

NOFILE = 1024


def _hold_raw(port: int, stop: threading.Event, hold: int) -> None:
    """Open raw connections that send nothing, keeping the last ``hold`` of them."""
    held = []
    while not stop.is_set():
        try:
            held.append(connect(port, timeout=2))
        except OSError:
            pass   # refused or reset: the victim defended itself
        while len(held) > hold:
            held.pop(0).close()
    for raw in held:
        raw.close()


def test_raw_connections_leave_descriptors_for_starts_and_calls(victim_factory):
    victim = victim_factory(nofile=NOFILE)
    hub_port = int(victim.ask("hub").rsplit(":", 1)[1])
    stop = threading.Event()
    threads = (in_threads(2, _hold_raw, victim.port, stop, NOFILE // 2)
               + in_threads(1, _hold_raw, hub_port, stop, NOFILE // 2))
    try:
        answers = [victim.ask(command) for command in ("start", "connect") * 3]
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert answers == ["ok"] * 6, answers
