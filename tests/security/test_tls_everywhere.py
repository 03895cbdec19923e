"""TLS covers every listener fibrl opens: a program with ``tls=True`` that runs a Pool,
a Manager, a Queue, a RemoteVectorEnv with local workers and a ``fibrl.channel`` listener
is scanned for listening TCP sockets (its own and its workers'), and each one is sent what
a plaintext client sends first.

"Refuses plaintext" means, for each listening socket: a client that sends nng's SP
header (Req0) and a fibrl hello in the clear gets the connection closed within
``PROBE_S`` seconds, and the bytes it received before the close neither begin with
nng's plaintext SP header (``\\0SP\\0``) nor hold a fibrl handshake answer (``FB``...).
A plaintext
nng listener sends its SP header as soon as a connection opens and then answers the
hello with a challenge; a TLS listener reads the bytes as a broken TLS record, sends
at most a TLS alert and closes.
"""
import contextlib
import os
import socket
import subprocess
import sys

import psutil
import pytest

import fibrl
from fibrl.wire.transport import HELLO

from attacker import frame, sp_header

pytest.importorskip("cryptography")   # fibrl[tls]; installed with the test extras

PROBE_S = 10.0      # how long a listener has to close a plaintext connection
START_S = 240.0     # how long the program has to start its Pool, Manager, Queue and envs


@contextlib.contextmanager
def _program(*args):
    """The program of tls_program.py (with ``args``), running until the block ends."""
    root = os.path.dirname(os.path.dirname(fibrl.__file__))   # the fibrl under test
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + os.environ.get("PYTHONPATH", "").split(os.pathsep)).rstrip(os.pathsep))
    for name in [n for n in env if n.startswith("FIBRL_")]:
        del env[name]   # the program's own settings, not the test run's
    script = os.path.join(os.path.dirname(__file__), "tls_program.py")
    proc = subprocess.Popen([sys.executable, script, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        yield proc, _read_until_ready(proc)
    finally:
        proc.stdin.write("quit\n")
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def _read_until_ready(proc) -> dict:
    """The program's report lines, by first word, up to "ready" (bounded: its own
    steps time out, and a program that dies ends the output)."""
    lines = {}
    while "ready" not in lines:
        line = proc.stdout.readline()
        assert line, f"the TLS program ended before it was ready (exit code {proc.poll()})"
        word, *rest = line.split()
        lines[word] = rest
    return lines


def _listening(pid: int) -> dict:
    """``{(ip, port): pid}`` for every listening TCP socket of ``pid`` and its children."""
    root = psutil.Process(pid)
    found = {}
    for proc in [root] + root.children(recursive=True):
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found[(conn.laddr.ip, conn.laddr.port)] = proc.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass   # a worker that ended since: it listens no more
    return found


def _probe(ip: str, port: int) -> tuple:
    """Send nng's plaintext SP header and a fibrl hello; return (bytes received,
    whether the listener closed the connection within PROBE_S)."""
    received = b""
    with socket.create_connection(("127.0.0.1" if ip == "0.0.0.0" else ip, port),
                                  timeout=PROBE_S) as raw:
        # a Req0 message: a request id (high bit set), then fibrl's hello and a nonce
        raw.sendall(sp_header("req0") + frame(b"\x80\x00\x00\x01" + HELLO + os.urandom(32)))
        try:
            while len(received) < 65536:
                chunk = raw.recv(4096)
                if not chunk:
                    return received, True
                received += chunk
        except (ConnectionResetError, BrokenPipeError):
            return received, True
        except socket.timeout:
            return received, False
    return received, False


# 25 s with the machine to itself; a Pool, a Manager and env workers each making TLS
# handshakes beside three other tests took over 300 s on two cores
@pytest.mark.timeout(180)   # 15-60 s measured on a loaded two-core machine
@pytest.mark.alone
def test_every_listener_of_a_tls_program_refuses_plaintext():
    with _program("all") as (proc, lines):
        _check_listeners(proc, lines)


def _check_listeners(proc, lines) -> None:
    sockets = _listening(proc.pid)
    scanned = {proc.pid} | {child.pid for child in psutil.Process(proc.pid).children(True)}
    reported = {int(pid) for pid in lines["ready"]}
    env_workers = {int(pid) for pid in lines["envs"]}
    # the scan reached every process the program reported, and found the listeners that
    # must be there (the hub's, the vector env's and the channel's in the program, each
    # env worker's own): a process the scan missed cannot make this test pass
    assert reported <= scanned, f"processes not found under the program: {reported - scanned}"
    listeners = list(sockets.values())
    assert listeners.count(proc.pid) >= 3, f"the program's listeners: {sockets}"
    assert env_workers <= set(listeners), f"env workers {env_workers}; listeners {sockets}"
    channel_port = int(lines["channel"][0])
    assert any(port == channel_port and pid == proc.pid for (_, port), pid in sockets.items()), \
        f"the fibrl.channel listener (port {channel_port}) was not found: {sockets}"
    policy_port = int(lines["policy"][0])
    assert any(port == policy_port and pid == proc.pid for (_, port), pid in sockets.items()), \
        f"the PolicyStore listener (port {policy_port}) was not found: {sockets}"
    answered = []
    for (ip, port), pid in sorted(sockets.items()):
        received, closed = _probe(ip, port)
        if b"\x00SP\x00" in received[:8] or b"FB" in received or not closed:
            answered.append(f"{ip}:{port} of pid {pid}: received {received[:24]!r}, "
                            f"{'closed' if closed else f'still open after {PROBE_S} s'}")
    assert not answered, ("listeners that did not refuse a plaintext client with tls=True:\n"
                          + "\n".join(answered))


def test_remote_vector_env_resets_and_steps_with_tls():
    with _program("envs") as (proc, lines):
        assert lines["stepped"] == ["5"]
