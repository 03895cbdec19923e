"""The backend interface: what every place that runs workers must provide.

A backend turns a :class:`JobSpec` (command, image, env, resources, labels,
name) into a running :class:`Job` and reports on it. Everything above the
backends talks to workers over ``transport``; backends only start, watch,
stop and log.

It also owns the facts every backend and the tools around them share: the
labels that mark a job as fibrl's (:data:`LABEL_RUN` ...) and this program
run's id (:func:`run_id`). The backend names belong to the config
(:data:`fibrl.config.BACKENDS`), which validates them; they are re-exported here.
"""
from __future__ import annotations

import abc
import enum
import os
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from ..config import BACKENDS, CLUSTER_BACKENDS

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["Backend", "Job", "JobSpec", "JobStatus", "BACKENDS", "CLUSTER_BACKENDS",
           "LABEL_RUN", "LABEL_PARENT", "LABEL_ROLE", "LABEL_BACKEND", "job_labels", "run_id"]

# Labels of every job fibrl starts (containers and pods carry them; local jobs keep them
# in their spec). A backend may add its own (docker: host, PID namespace; kubernetes: owner).
LABEL_RUN = "fibrl.run"          # the program run (run_id), shared by its processes
LABEL_PARENT = "fibrl.parent"    # the pid of the process that started the job
LABEL_ROLE = "fibrl.role"        # process, pool worker, manager, probe...
LABEL_BACKEND = "fibrl.backend"  # the backend that created it

_run_id: Optional[str] = None


def run_id() -> str:
    """Identifier shared by every process of this program run (labels its jobs).

    A worker inherits it from its parent through ``FIBRL_RUN_ID``.
    """
    global _run_id
    if _run_id is None:
        _run_id = os.environ.get("FIBRL_RUN_ID") or secrets.token_hex(6)
    return _run_id


def job_labels(role: str) -> dict:
    """The labels of a job this process starts in ``role``."""
    return {LABEL_RUN: run_id(), LABEL_PARENT: str(os.getpid()), LABEL_ROLE: role}


class JobStatus(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class JobSpec:
    """What to run and with which resources.

    Attributes:
        command: argv of the worker, e.g. ``("python", "-m", "fibrl.bootstrap", addr)``.
        image: container image (ignored by the local backend).
        env: extra environment variables (the run's secret among them).
        cpu, memory, gpu: resource limits (0 / "" / 0: none).
        volumes: ``(host_path, container_path, read_only)`` triples.
        labels: key/value tags that identify the run, parent and role.
        name: a human-readable job name (backends sanitize it).
        workdir: working directory of the worker ("": backend default).
        probe: a command that exits 0 when ``image`` can run this job; a container
            backend runs it once per image and mount, and reports its output if
            it fails (``()``: no probe).
        preload: modules a fork server may import ahead of time for a
            ``python -m module ...`` command, to start it faster (local backend).
        defer: modules that the preloaded ones import but use only on demand: while
            it preloads, a fork server gives them a stand-in that imports the real
            module on first use, so a job that never uses them does not carry them.
        code_dirs: host directories of the program's code besides ``workdir`` (the
            main script's folder, which spawn puts on ``sys.path``); a container
            backend that mounts the working directory mounts these too, read-only.
    """

    command: tuple
    image: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    cpu: float = 0.0
    memory: str = ""
    gpu: int = 0
    volumes: tuple = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    name: str = "fibrl-worker"
    workdir: str = ""
    probe: tuple = ()
    preload: tuple = ()
    defer: tuple = ()
    code_dirs: tuple = ()


class Job(abc.ABC):
    """One started worker, as its backend sees it."""

    spec: JobSpec

    @property
    @abc.abstractmethod
    def id(self) -> str:
        """Backend identifier (pid, container id, pod name)."""

    @property
    def pid(self) -> Optional[int]:
        """Process id when it is meaningful on this machine, else None."""
        return None

    @abc.abstractmethod
    def status(self) -> JobStatus:
        """Current state, without blocking long."""

    @abc.abstractmethod
    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Block until the job ends; return its exit code (negative: killed by
        that signal), or None when ``timeout`` passed first."""

    @abc.abstractmethod
    def terminate(self) -> None:
        """Ask the job to stop (SIGTERM)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop the job now (SIGKILL)."""

    def when_running(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the job's process runs (at once here: most jobs run
        from creation). Popen counts ``start_timeout`` from then, so a backend whose jobs
        wait before they run (a pod waiting for a node or its image) must bound that wait
        itself and say why it gave up (kubernetes_pending_timeout)."""
        callback()

    def logs(self) -> str:
        """Whatever the job printed, when the backend keeps it ("" otherwise)."""
        return ""

    def failure_reason(self) -> str:
        """Why the job ended badly in the backend's words (e.g. "OOMKilled"), or ""."""
        return ""

    def remove(self) -> None:
        """Free what the backend keeps for an ended job."""
        return None   # a hook: by default the backend keeps nothing


class Backend(abc.ABC):
    """Starts jobs. One instance per process and config."""

    name: str = ""
    #: Seconds a job's exit status may take to arrive after its connection dropped; a
    #: pool waits this long before it calls the worker lost with its status unknown.
    exit_report_s: float = 2.0
    #: Seconds after a worker's connection ended with no exit reported at which its
    #: Popen ends the job itself (the worker exits when its connection ends; a node that
    #: went down with it reports nothing). None: the backend always reports an exit.
    silent_exit_s: Optional[float] = None

    def __init__(self, config: Config) -> None:
        self.config = config

    @abc.abstractmethod
    def create_job(self, spec: JobSpec) -> Job:
        """Start ``spec``; raise :class:`fibrl.errors.BackendError` with the fix if impossible."""

    def cpu_count(self) -> int:
        """How many CPUs this backend offers a Pool (``Pool(processes=None)``)."""
        import os

        return os.cpu_count() or 1

    def python(self) -> str:
        """The interpreter command that workers of this backend run."""
        return "python"

    def close_at_exit(self) -> None:
        """Free what outlives this process's jobs (ended containers, a watch, pods left).

        Called once at interpreter exit, after this process's children ended and
        before its hub closes (``runtime``'s exit sequence, step BACKENDS). A
        backend registers nothing at exit by itself.
        """
        return None   # a hook: by default nothing outlives the jobs

    def abandon_starts(self) -> None:
        """The program is exiting: end the starts under way soon, and refuse new ones.

        Called once when the interpreter begins to exit, before it joins the threads
        that start pool workers. A start that waits on something slow (an image
        probe, a pod that is not running yet) raises :class:`BackendError` instead of
        waiting it out, and removes what it made. The default waits for nothing.
        """
        return None   # a hook: by default no start waits

    def import_hint(self, spec: JobSpec) -> str:
        """Where a job of ``spec`` finds this host's modules, said when one could not
        import a module ("": the same files as here)."""
        return ""

    def listen_host(self) -> str:
        """Address the parent must listen on so workers can reach it."""
        return self.config.listen_host

    @classmethod
    def listen_ports_of(cls, config: Config) -> Optional[tuple]:
        """``(first, last)``: the ports a parent under ``config`` must listen on (None: any
        port). A class method, so that a process that only hosts objects can ask without
        making a backend (which may connect to a cluster)."""
        return None

    def listen_port(self, host: str) -> int:
        """A free port of :meth:`listen_ports_of` on ``host`` to listen on (0: any port)."""
        return 0
