"""The local backend: workers are processes of this machine.

Nothing to install. Workers inherit the parent's stdout and stderr, so their
output reaches the terminal as with ``multiprocessing``.

By default a ``python -m module ...`` job whose spec names modules to
``preload`` is forked from a *zygote* (``_zygote``), a fresh interpreter
spawned once per parent that has already imported them (for workers: fibrl's
bootstrap, hub and transport, so pynng, but nng is never started there); that
makes a start several times cheaper than a new interpreter while keeping
spawn semantics (the worker rebuilds ``__main__`` and unpickles its process
object, exactly as with ``python -m fibrl.bootstrap``).
``local_fork_server=False`` starts each job as its own interpreter instead.

::

    LocalBackend.create_job
       |-- fork server on:  _ForkServer.spawn --request+fds--> zygote --fork--> worker
       |                    reader thread <--{"pid"}/{"exit"}-- zygote (waitpid on SIGCHLD)
       |                         sets the job's exit code and wakes Job.wait
       +-- fork server off: subprocess.Popen(python -m fibrl.bootstrap ...)
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Optional

from ..errors import BackendError
from .base import Backend, Job, JobSpec, JobStatus

__all__ = ["LocalBackend", "LocalJob", "ForkedJob"]

log = logging.getLogger(__name__)


class LocalJob(Job):
    """A worker running as a child interpreter of this process."""

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
        return _status(self._proc.poll())

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self) -> None:
        _signal(self._proc.pid, self._proc.returncode, signal.SIGTERM)

    def kill(self) -> None:
        _signal(self._proc.pid, self._proc.returncode, signal.SIGKILL)


class ForkedJob(Job):
    """A worker forked by the zygote; its exit code arrives from the zygote."""

    def __init__(self, spec: JobSpec, pid: int) -> None:
        self.spec = spec
        self._pid = pid
        self.returncode: Optional[int] = None
        self._done = threading.Event()

    @property
    def id(self) -> str:
        return str(self._pid)

    @property
    def pid(self) -> int:
        return self._pid

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def status(self) -> JobStatus:
        return _status(self.returncode)

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._done.wait(timeout)
        return self.returncode

    def terminate(self) -> None:
        _signal(self._pid, self.returncode, signal.SIGTERM)

    def kill(self) -> None:
        _signal(self._pid, self.returncode, signal.SIGKILL)


def _status(code: Optional[int]) -> JobStatus:
    if code is None:
        return JobStatus.RUNNING
    return JobStatus.SUCCEEDED if code == 0 else JobStatus.FAILED


def _signal(pid: int, returncode: Optional[int], sig: int) -> None:
    if returncode is None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class _Reply:
    """A spawn request's answer from the zygote: ``msg`` once ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.msg: dict = {}


class _ForkServer:
    """The parent's side of the zygote: requests (with our stdio), pids, exit codes."""

    def __init__(self, preload: tuple = (), defer: tuple = ()) -> None:
        self._requests, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._rep_r, rep_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "fibrl.backends._zygote", str(theirs.fileno()),
                 str(rep_w), ",".join(defer), *preload],
                pass_fds=(theirs.fileno(), rep_w), stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
            os.close(rep_w)
        self.pid = self._proc.pid
        self.owner = os.getpid()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Reply] = {}
        self._jobs: dict[int, ForkedJob] = {}
        self._early: dict[int, int] = {}
        self.alive = True
        threading.Thread(target=self._read, daemon=True, name="fibrl-forkserver").start()

    def spawn(self, spec: JobSpec, env: dict, timeout: float) -> ForkedJob:
        request_id = next(self._ids)
        slot = _Reply()
        with self._lock:
            if not self.alive:
                raise BackendError("the local fork server exited")
            self._waiting[request_id] = slot
        request = json.dumps({"id": request_id, "module": spec.command[2],
                              "argv": list(spec.command[3:]), "preload": list(spec.preload),
                              "defer": list(spec.defer), "env": env, "cwd": spec.workdir}).encode()
        with self._lock:
            socket.send_fds(self._requests, [request], [1, 2])  # our stdout/stderr now
        if not slot.done.wait(timeout):
            raise BackendError(f"the local fork server did not answer within {timeout} s")
        reply = slot.msg
        if "pid" not in reply:
            raise BackendError(f"the local fork server could not fork: {reply.get('error')}")
        return self._register(ForkedJob(spec, reply["pid"]))

    def _register(self, job: ForkedJob) -> ForkedJob:
        with self._lock:
            code = self._early.pop(job.pid, None)
            if code is None:
                self._jobs[job.pid] = job
        if code is not None:
            job._exited(code)
        return job

    def _read(self) -> None:
        with os.fdopen(self._rep_r, "r") as replies:
            for line in replies:
                self._handle(json.loads(line))
        self._died()

    def _handle(self, msg: dict) -> None:
        with self._lock:
            if "exit" in msg:
                job = self._jobs.pop(msg["exit"], None)
                if job is None:
                    self._early[msg["exit"]] = msg["code"]
            else:
                job = None
                slot = self._waiting.pop(msg["id"], None)
        if "exit" in msg:
            if job is not None:
                job._exited(msg["code"])
        elif slot is not None:
            slot.msg = msg
            slot.done.set()

    def _died(self) -> None:
        with self._lock:
            self.alive = False
            jobs, self._jobs = list(self._jobs.values()), {}
            slots, self._waiting = list(self._waiting.values()), {}
        self._proc.wait()
        if jobs:
            log.error("the local fork server exited (%s); killing its %d workers",
                      self._proc.returncode, len(jobs))
        for job in jobs:
            job.kill()
            job._exited(-signal.SIGKILL)
        for slot in slots:
            slot.msg = {"error": "fork server exited"}
            slot.done.set()


class LocalBackend(Backend):
    """Runs each job as a process of this machine, with this interpreter."""

    name = "local"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._server: Optional[_ForkServer] = None
        self._lock = threading.Lock()

    def python(self) -> str:
        # set_executable()'s choice, kept where the stdlib keeps it (sys.executable by
        # default); another interpreter than ours is spawned, not forked from ours.
        from multiprocessing import spawn

        return os.fsdecode(spawn.get_executable() or sys.executable)

    def create_job(self, spec: JobSpec) -> Job:
        env = dict(os.environ)
        env.update(spec.env)
        if self.config.local_fork_server and _forkable(spec):
            return self._fork_server(spec).spawn(spec, env, self.config.start_timeout)
        secret_fd = _secret_through_pipe(env)
        try:
            proc = subprocess.Popen(list(spec.command), env=env, cwd=spec.workdir or None,
                                    stdin=subprocess.DEVNULL, close_fds=True,
                                    pass_fds=() if secret_fd is None else (secret_fd,))
        except OSError as exc:
            raise BackendError(
                f"cannot start local worker {spec.command[0]!r}: {exc}. Check that the "
                f"interpreter exists and is executable.") from exc
        finally:
            if secret_fd is not None:
                os.close(secret_fd)
        return LocalJob(spec, proc)

    def _fork_server(self, spec: JobSpec) -> _ForkServer:
        with self._lock:
            if self._server is None or not self._server.alive \
                    or self._server.owner != os.getpid():
                self._server = _ForkServer(spec.preload, spec.defer)
            return self._server


def _forkable(spec: JobSpec) -> bool:
    """``python -m module ...`` with this interpreter, whose spec names what to preload:
    a spec without a preload list did not ask for a fork server."""
    return bool(spec.preload) and len(spec.command) >= 3 \
        and tuple(spec.command[:2]) == (sys.executable, "-m")


def _secret_through_pipe(env: dict) -> Optional[int]:
    """Move FIBRL_SECRET out of ``env`` into a pipe the worker reads (FIBRL_SECRET_FD):
    a process's initial environment stays readable in /proc/<pid>/environ."""
    secret = env.pop("FIBRL_SECRET", None)
    if secret is None:
        return None
    read_fd, write_fd = os.pipe()   # 64 hex digits: far below the pipe's buffer
    try:
        os.write(write_fd, secret.encode())
    finally:
        os.close(write_fd)
    env["FIBRL_SECRET_FD"] = str(read_fd)
    return read_fd

