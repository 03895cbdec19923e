"""Container runtimes: how the fake kubelet really runs a container.

* :class:`ProcessContainer` runs ``command + args`` as a local process in its
  own process group (the "container"), with the pod's environment;
* :class:`DockerContainer` runs the image with ``docker run -d --network
  host`` (labelled ``fibrl.fake-apiserver=1``), waits with ``docker wait``
  and reads ``docker inspect`` for the exit code and OOM kills.

Both pump the container's merged stdout/stderr into a :class:`LogBuffer`,
which log readers (``follow=true`` included) block on.
"""
from __future__ import annotations

import bisect
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from ._meta import rfc3339

DOCKER_LABEL = "fibrl.fake-apiserver"
_PYTHON = re.compile(r"python(3(\.\d+)?)?")


class LogBuffer:
    """Everything one container run wrote; readers wait on a condition for more."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._closed = False
        self._cond = threading.Condition()
        self._starts: list[int] = []     # offset where each line starts
        self._stamps: list[int] = []     # when that line's first byte came (ns since the epoch)

    def append(self, chunk: bytes) -> None:
        with self._cond:
            now = time.time_ns()
            begin = len(self._data)
            if chunk and (begin == 0 or self._data[-1:] == b"\n"):
                self._starts.append(begin)
                self._stamps.append(now)
            for i, byte in enumerate(chunk[:-1]):
                if byte == 0x0A:
                    self._starts.append(begin + i + 1)
                    self._stamps.append(now)
            self._data += chunk
            self._cond.notify_all()

    def line_stamp(self, offset: int) -> int:
        """When the line holding byte ``offset`` was written (ns since the epoch)."""
        with self._cond:
            index = bisect.bisect_right(self._starts, offset) - 1
            return self._stamps[max(index, 0)] if self._stamps else time.time_ns()

    def offset_since(self, since_ns: int) -> int:
        """Offset of the first line written at or after ``since_ns`` (as sinceTime selects)."""
        with self._cond:
            index = bisect.bisect_left(self._stamps, since_ns)
            return self._starts[index] if index < len(self._starts) else len(self._data)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def snapshot(self) -> bytes:
        with self._cond:
            return bytes(self._data)

    def read_from(self, offset: int) -> tuple[bytes, bool]:
        """Block until there are bytes past ``offset`` or the run ended; (bytes, ended)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._data) > offset or self._closed)
            return bytes(self._data[offset:]), self._closed and len(self._data) <= offset


class StartError(Exception):
    """The runtime could not start the container (exit code 128, reason StartError)."""


@dataclass
class ContainerConfig:
    pod_key: str                  # "namespace/name"
    name: str
    image: str
    command: list | None          # None: the image's entrypoint
    args: list | None
    env: dict
    working_dir: str | None
    server: str = ""              # the fake server instance (docker label)
    memory_limit: int | None = None   # bytes
    cpu_limit: float | None = None


@dataclass
class ExitInfo:
    exit_code: int
    reason: str                   # Completed | Error | OOMKilled | StartError
    started_at: str
    finished_at: str
    message: str = ""
    signal: int | None = field(default=None)


def _reason(exit_code: int) -> str:
    return "Completed" if exit_code == 0 else "Error"


def _pump(stream, log: LogBuffer) -> None:
    try:
        while chunk := stream.read1(65536):
            log.append(chunk)
    except (OSError, ValueError):
        pass
    finally:
        log.close()


class ProcessContainer:
    """A container emulated by a local process group."""

    runtime = "process"

    def __init__(self, config: ContainerConfig, python: str, default_workdir: str):
        self.config = config
        self.log = LogBuffer()
        self._python = python
        self._workdir = config.working_dir or default_workdir
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._started_at = rfc3339()
        self.container_id = ""

    def _argv(self) -> list[str]:
        argv = list(self.config.command or []) + list(self.config.args or [])
        if not argv:
            raise StartError(f'no command for image "{self.config.image}": the fake runs containers as '
                             f'local processes; give the container a command or set image_commands')
        if _PYTHON.fullmatch(os.path.basename(argv[0])):
            argv[0] = self._python
        return argv

    def start(self) -> None:
        argv = self._argv()
        try:
            self._proc = subprocess.Popen(argv, env=self.config.env, cwd=self._workdir, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            self.log.close()
            raise StartError(f'failed to create containerd task: failed to create shim task: OCI runtime '
                             f'create failed: runc create failed: unable to start container process: exec: '
                             f'"{argv[0]}": {exc.strerror}: unknown') from None
        self._started_at = rfc3339()
        self.container_id = f"containerd://{os.urandom(32).hex()}"
        self._reader = threading.Thread(target=_pump, args=(self._proc.stdout, self.log),
                                        name=f"log {self.config.pod_key}/{self.config.name}", daemon=True)
        self._reader.start()

    def wait(self) -> ExitInfo:
        code = self._proc.wait()
        self._signal_group(signal.SIGKILL)      # the container dies with its main process
        self._reader.join(timeout=5)
        self._proc.stdout.close()
        exit_code = 128 - code if code < 0 else code
        return ExitInfo(exit_code, _reason(exit_code), self._started_at, rfc3339(),
                        signal=-code if code < 0 else None)

    def terminate(self, grace: float) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds (non-blocking)."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._signal_group(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        if grace > 0:
            threading.Thread(target=self._kill_after, args=(grace,), daemon=True,
                             name=f"kill {self.config.pod_key}").start()

    def _kill_after(self, grace: float) -> None:
        try:
            self._proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# --------------------------------------------------------------------------- docker


def docker(*args: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def docker_engine_answers() -> bool:
    """Whether a docker engine answers (the CLI alone is not enough)."""
    try:
        return docker("info", "--format", "{{.ServerVersion}}", timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def docker_image_exists(image: str) -> bool:
    try:
        return docker("image", "inspect", "--format", "{{.Id}}", image, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def docker_leaked_containers(server: str | None = None) -> list[str]:
    """IDs of containers (running or not) fake API servers (or the one ``server`` instance) left behind."""
    label = f"{DOCKER_LABEL}.server={server}" if server else f"{DOCKER_LABEL}=1"
    try:
        out = docker("ps", "-aq", "--filter", f"label={label}", timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split()


class DockerContainer:
    """A container run by the local docker engine on the host network."""

    runtime = "docker"

    def __init__(self, config: ContainerConfig):
        self.config = config
        self.log = LogBuffer()
        self.container_id = ""
        self._id = ""
        self._logs: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()

    def _run_args(self) -> list[str]:
        cfg = self.config
        name = re.sub(r"[^a-zA-Z0-9_.-]", "-", f"fibrl-fake-{cfg.pod_key}-{cfg.name}-{os.urandom(3).hex()}")
        args = ["run", "-d", "--network", "host", "--name", name, "--label", f"{DOCKER_LABEL}=1",
                "--label", f"{DOCKER_LABEL}.pod={cfg.pod_key}", "--label", f"{DOCKER_LABEL}.server={cfg.server}"]
        for key, value in cfg.env.items():
            args += ["-e", f"{key}={value}"]
        if cfg.working_dir:
            args += ["-w", cfg.working_dir]
        if cfg.memory_limit:
            # The kubelet gives containers no swap (memory.swap.max=0 unless the node opts in);
            # docker's default lets a container swap as much again as its limit, so on a host
            # with swap a process over its limit thrashes for minutes instead of being OOM-killed.
            args += ["--memory", str(cfg.memory_limit), "--memory-swap", str(cfg.memory_limit)]
        if cfg.cpu_limit:
            args += ["--cpus", f"{cfg.cpu_limit:g}"]
        command = list(cfg.command or [])
        if command:
            args += ["--entrypoint", command[0]]
        return args + [cfg.image] + command[1:] + list(cfg.args or [])

    def start(self) -> None:
        result = docker(*self._run_args(), timeout=120)
        if result.returncode != 0:
            self.log.close()
            raise StartError(result.stderr.strip() or "docker run failed")
        with self._lock:
            self._id = result.stdout.strip()
        self.container_id = f"docker://{self._id}"
        self._logs = subprocess.Popen(["docker", "logs", "-f", self._id], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._reader = threading.Thread(target=_pump, args=(self._logs.stdout, self.log), daemon=True,
                                        name=f"docker logs {self.config.pod_key}/{self.config.name}")
        self._reader.start()

    def wait(self) -> ExitInfo:
        docker("wait", self._id, timeout=None)
        state = docker("inspect", "--format",
                       "{{.State.ExitCode}} {{.State.OOMKilled}} {{.State.StartedAt}} {{.State.FinishedAt}}",
                       self._id, timeout=60).stdout.split()
        self._reader.join(timeout=10)
        self._logs.kill()
        self._logs.wait()
        self._logs.stdout.close()
        docker("rm", "-f", self._id, timeout=60)
        exit_code, oom = int(state[0]), state[1] == "true"
        reason = "OOMKilled" if oom else _reason(exit_code)
        return ExitInfo(exit_code, reason, _docker_time(state[2]), _docker_time(state[3]))

    def terminate(self, grace: float) -> None:
        with self._lock:
            container = self._id
        if container:
            threading.Thread(target=docker, args=("stop", "-t", str(int(round(grace))), container),
                             kwargs={"timeout": grace + 30}, daemon=True).start()


def _docker_time(value: str) -> str:
    """Docker's RFC 3339 nano timestamp at seconds precision."""
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", value)
    return match.group(1) + "Z" if match else rfc3339(time.time())
