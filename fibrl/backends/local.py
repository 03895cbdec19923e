"""The local backend: workers are plain processes of this machine.

Nothing to install. Workers inherit the parent's stdout and stderr, so their
output reaches the terminal as with ``multiprocessing``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional

from ..errors import BackendError
from .base import Backend, Job, JobSpec, JobStatus

__all__ = ["LocalBackend", "LocalJob"]


class LocalJob(Job):
    """A worker running as a child process of this one."""

    def __init__(self, spec: JobSpec, proc: subprocess.Popen) -> None:
        self.spec = spec
        self._proc = proc

    @property
    def id(self) -> str:
        return str(self._proc.pid)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid

    def status(self) -> JobStatus:
        code = self._proc.poll()
        if code is None:
            return JobStatus.RUNNING
        return JobStatus.SUCCEEDED if code == 0 else JobStatus.FAILED

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _signal(self, sig: int) -> None:
        if self._proc.returncode is None:
            try:
                self._proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


class LocalBackend(Backend):
    """Runs each job as ``subprocess.Popen(spec.command)`` with this interpreter."""

    name = "local"

    def python(self) -> str:
        return sys.executable

    def create_job(self, spec: JobSpec) -> Job:
        env = dict(os.environ)
        env.update(spec.env)
        try:
            proc = subprocess.Popen(list(spec.command), env=env, cwd=spec.workdir or None,
                                    stdin=subprocess.DEVNULL, close_fds=True)
        except OSError as exc:
            raise BackendError(
                f"cannot start local worker {spec.command[0]!r}: {exc}. Check that the "
                f"interpreter exists and is executable.") from exc
        return LocalJob(spec, proc)
