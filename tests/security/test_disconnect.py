"""Defect: one raw connection to a listening port used to close an authenticated peer's
socket (the manager server died, pool workers exited 255). An attacker now pokes every
port of the parent and its workers, raw and with each nng protocol: nothing breaks."""
import os

import psutil

import fibrl
from attacker import PROTOCOLS, frame, listening_ports, poke, sp_header
from conftest import wait_until


def _attack_every_port(pid):
    ports = listening_ports(pid)
    assert ports, "the victim listens on no port: nothing was attacked"
    for port in ports:
        poke(port)                                   # connect and leave
        poke(port, b"garbage" * 10)
        for protocol in PROTOCOLS:
            poke(port, sp_header(protocol) + frame(b"x" * 64))
    return ports


def _attack_handled(pid, ports) -> bool:
    """Whether the processes ``pid`` (and their children) have taken every connection the
    attack made to ``ports`` and closed those it closed: none waits in a listen backlog,
    none is half-closed (we left, they have not noticed yet)."""
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_CLOSE_WAIT and conn.laddr.port in ports:
                    return False
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return not _backlogged(ports)


def _backlogged(ports) -> bool:
    """Whether a connection to one of the listening ``ports`` waits to be accepted."""
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            port, state = int(fields[1].rsplit(":", 1)[1], 16), fields[3]
            queued = int(fields[4].split(":")[1], 16)   # rx_queue: the accept queue
            if state == "0A" and port in ports and queued:
                return True
    return False


def test_manager_survives_raw_connections_to_every_port():
    with fibrl.Manager() as manager:
        shared = manager.dict(before=1)
        ports = _attack_every_port(os.getpid())
        wait_until(lambda: _attack_handled(os.getpid(), ports), "the attack to be handled")
        shared["after"] = 2      # raised RemoteObjectError when the server was killed
        assert dict(shared) == {"before": 1, "after": 2}
        assert len(ports) >= 2
        proc = fibrl.Process(target=sum, args=([1, 2],))   # and new workers still start
        proc.start()
        proc.join(30)
        assert proc.exitcode == 0


def test_pool_workers_survive_raw_connections_to_every_port():
    with fibrl.Pool(2) as pool:
        assert pool.map(abs, range(-8, 0), chunksize=1) == list(range(8, 0, -1))
        before = _descendants()
        ports = _attack_every_port(os.getpid())
        wait_until(lambda: _attack_handled(os.getpid(), ports), "the attack to be handled")
        assert pool.map(abs, range(-20, 0), chunksize=1) == list(range(20, 0, -1))
        # the same processes: no worker was killed (the pool would replace it quietly)
        assert _descendants() == before


def _descendants():
    return {proc.pid for proc in psutil.Process().children(recursive=True)
            if proc.status() != psutil.STATUS_ZOMBIE}
