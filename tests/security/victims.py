"""The victim of the security tests: a fibrl process the attacker cannot share memory
or descriptors with, and the ``victim_factory`` fixture that starts them.

Not a conftest.py: a second module named ``conftest`` would shadow tests/conftest.py
for every test module collected after it. Test modules import the fixture by name.
"""
import os
import select
import subprocess
import sys

import pytest

import fibrl


class Victim:
    def __init__(self, nofile=None, stderr=None):
        args = [sys.executable, os.path.join(os.path.dirname(__file__), "victim.py")]
        # the fibrl under test, not whichever one is installed
        root = os.path.dirname(os.path.dirname(fibrl.__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + os.environ.get("PYTHONPATH", "").split(os.pathsep)).rstrip(os.pathsep))
        self.proc = subprocess.Popen(args + ([str(nofile)] if nofile else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, stderr=stderr)
        ready = self.proc.stdout.readline().split()
        assert ready and ready[0] == "ready", f"victim did not start: {ready}"
        self.address = ready[1]
        self.port = int(self.address.rsplit(":", 1)[1])
        self.pid = self.proc.pid

    def ask(self, command, timeout=60):
        """The victim's answer to ``command``; "hung" if none came within ``timeout`` s."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().strip() if ready else "hung"

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, OSError):   # hung, or gone
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def victim_factory():
    victims = []

    def make(nofile=None, stderr=None):
        victims.append(Victim(nofile, stderr))
        return victims[-1]

    yield make
    for victim in victims:
        victim.close()
