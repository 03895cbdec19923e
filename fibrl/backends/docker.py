"""The docker backend: each worker is a container of the engine ``DOCKER_HOST`` names.

Owns turning a :class:`JobSpec` into a container (image, command, env, labels,
limits, the mounted working directory), watching it, relaying its output,
stopping it and removing it, plus label-based listing and cleanup for tests
and the command line. It does not own what runs inside (``fibrl.bootstrap``)
nor how the parent talks to it (``transport``). The docker SDK is imported
only here, when the backend is first used.

Data flow of one job::

    create_job(spec)
      once: engine reachable, image present
      containers.create(host network, cwd mounted, limits, labels)
      attach(stream, demux)  <- before start, so no output is lost
      start
      once per image and mount, while that worker boots: a probe container runs
            ``python -c "import fibrl.bootstrap"`` (BackendError with its output
            if that fails, and the worker is removed; concurrent starts wait)
      follower thread:  frames --> parent's stdout / stderr
                        EOF (container stopped) --> wait API --> inspect
                        --> exit code (128+N -> -N), OOMKilled --> _ended.set()
    Job.wait(timeout) blocks on _ended; Job.remove() keeps a bounded tail of the
    logs, then removes the container (auto-remove is off so logs survive exit).

A worker's own children run as local processes in its container: it has no
access to the engine. Workers exit by themselves when their parent goes away,
and the parent's reaper (:mod:`fibrl.backends._docker_reaper`, a detached
process started with the backend) removes their containers once the parent is
gone, even SIGKILLed. What outlives both (the reaper killed too) is removed by
:func:`remove_containers` (``python -m fibrl.backends.docker rm``), and by the
next docker backend started in the same PID namespace of this machine for
containers whose parent process is gone.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Optional

from ..config import Config
from ..errors import BackendError, describe_exitcode
from .base import Backend, Job, JobSpec, JobStatus

__all__ = ["DockerBackend", "DockerJob", "connect", "container_name", "exit_code",
           "in_worker_container", "list_containers", "pid_namespace", "remove_containers",
           "main"]

log = logging.getLogger(__name__)

LABEL_BACKEND = "fibrl.backend"
LABEL_HOST = "fibrl.host"
LABEL_RUN = "fibrl.run"
LABEL_PARENT = "fibrl.parent"
LABEL_PIDNS = "fibrl.pidns"   # whose pid fibrl.parent is: the parent's PID namespace
LOG_TAIL_LINES = 500  # what logs() keeps of a removed container, and shows in errors
_MAX_SIGNAL = 64
_STOP_TIMEOUT = 10.0  # seconds to wait for a killed container's end to be reported
_LOOPBACK = ("127.", "localhost", "::1")
REAP_WAIT = 5.0       # seconds workers of a dead parent get to exit before removal
_reapers: dict = {}   # pid -> write end of the pipe its reaper waits on (one per process)
_reapers_lock = threading.Lock()


# -- the SDK and the engine ------------------------------------------------------------

def _sdk():
    try:
        import docker
    except ImportError as exc:
        raise _no_sdk() from exc
    if not hasattr(docker, "from_env"):  # a directory named docker/ shadows a missing SDK
        raise _no_sdk()
    return docker


def _no_sdk() -> BackendError:
    return BackendError(
        "the docker backend needs the docker SDK, which is not installed. "
        "Fix: pip install 'fibrl[docker]' (or choose fibrl.init(backend='local')).")


def in_worker_container() -> bool:
    """True in a fibrl worker running inside a container."""
    from multiprocessing import parent_process

    return os.path.exists("/.dockerenv") and parent_process() is not None


def _sdk_errors() -> tuple:
    import requests

    return (_sdk().errors.DockerException, requests.RequestException)


def _engine_address() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(timeout: float = 60.0, pool_size: int = 64):
    """A docker SDK client of the engine in ``DOCKER_HOST``, or a :class:`BackendError`.

    Example:
        >>> client = connect()               # doctest: +SKIP
        >>> client.info()["NCPU"] > 0        # doctest: +SKIP
        True
    """
    docker = _sdk()
    try:
        return docker.from_env(timeout=int(timeout), max_pool_size=pool_size)
    except _sdk_errors() as exc:
        raise BackendError(
            f"cannot reach the docker engine at {_engine_address()} ({exc}). Likely cause: "
            f"dockerd is not running, DOCKER_HOST points to the wrong place, or this user "
            f"may not use the socket. Fix: start dockerd (e.g. `sudo systemctl start "
            f"docker`), check DOCKER_HOST and `docker info`, or run with "
            f"fibrl.init(backend='local').") from exc


# -- names, exit codes, labels ---------------------------------------------------------

def container_name(name: str, suffix: Optional[str] = None) -> str:
    """A valid, unique docker container name derived from a process name.

    Example:
        >>> container_name("Process-1:2", suffix="ab12cd")
        'fibrl-process-1-2-ab12cd'
    """
    base = re.sub(r"[^a-z0-9_.-]+", "-", name.lower()).strip("-_.")
    base = base[:40].rstrip("-_.") or "worker"
    if not base.startswith("fibrl"):
        base = f"fibrl-{base}"
    return f"{base}-{suffix or secrets.token_hex(3)}"


def exit_code(status: int) -> int:
    """Map a container's exit status to a process exit code: ``128+N`` becomes ``-N``.

    A container whose main process was killed by signal N exits with 128+N
    (``docker kill`` gives 137); ``multiprocessing`` reports that as ``-N``.

    Example:
        >>> exit_code(137), exit_code(0), exit_code(255)
        (-9, 0, 255)
    """
    if 128 < status <= 128 + _MAX_SIGNAL:
        return 128 - status
    return status


def _label_filters(run: Optional[str] = None, parent: Optional[int] = None) -> list:
    found = [f"{LABEL_BACKEND}=docker"]
    if run:
        found.append(f"{LABEL_RUN}={run}")
    if parent is not None:
        found.append(f"{LABEL_PARENT}={parent}")
    return found


def list_containers(run: Optional[str] = None, *, running_only: bool = False,
                    parent: Optional[int] = None, client: Any = None) -> list:
    """The fibrl worker containers of the engine (SDK ``Container`` objects).

    Args:
        run: only those of this run id (label ``fibrl.run``).
        running_only: leave out stopped containers.
        parent: only those started by this parent pid (label ``fibrl.parent``).
        client: a docker SDK client (default: :func:`connect`).
    """
    client = client or connect()
    filters = {"label": _label_filters(run, parent)}
    # ignore_removed: a container removed between the listing and its inspection
    # (a reaper at work) is left out instead of failing the whole call with 404
    return client.containers.list(all=not running_only, filters=filters, ignore_removed=True)


def remove_containers(run: Optional[str] = None, *, force: bool = False,
                      client: Any = None) -> list:
    """Remove fibrl worker containers; return the names removed.

    Stopped ones are removed; running ones only with ``force=True`` (killed first).

    Example:
        >>> remove_containers(run="3f2a9c01be77", force=True)   # doctest: +SKIP
        ['fibrl-process-1-ab12cd']
    """
    client = client or connect()
    removed = []
    for container in list_containers(run, client=client):
        if container.status == "running" and not force:
            continue
        if _remove_quietly(container.client.api, container.id):
            removed.append(container.name)
    return removed


def remove_when_stopped(containers: list, client: Any, wait: float) -> list:
    """Give ``containers`` ``wait`` seconds in all to exit by themselves, then remove
    them (killing any still running); return the names removed.

    For workers whose parent is gone: they exit on their own as soon as they notice.
    """
    deadline, removed = time.monotonic() + wait, []
    for container in containers:
        try:  # the request's timeout bounds the wait
            container.wait(timeout=max(0.1, deadline - time.monotonic()))
        except _sdk_errors():
            pass
        if _remove_quietly(client.api, container.id):
            removed.append(container.name)
    return removed


def _remove_quietly(api: Any, container_id: str) -> bool:
    try:
        api.remove_container(container_id, force=True)
        return True
    except _sdk_errors() as exc:
        if getattr(exc, "status_code", None) == 404:
            return False
        log.warning("could not remove container %s: %s", container_id[:12], exc)
        return False


@functools.lru_cache(maxsize=None)
def pid_namespace() -> str:
    """This process's PID namespace, unique on this machine ("" where unknown).

    The boot id and the namespace's inode: a ``fibrl.parent`` pid means something
    only to processes in the same namespace (a parent in a container sees other pids).

    Example:
        >>> pid_namespace()              # doctest: +SKIP
        '5f0c1e0e-8e2b-4c4e-9d0a-3c7f0e6d2b1a-4026531836'
    """
    try:
        inode = os.stat("/proc/self/ns/pid").st_ino
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
    except OSError:
        return ""
    return f"{boot}-{inode}"


def _start_reaper() -> None:
    """Start this process's reaper once: it removes our containers after we are gone."""
    with _reapers_lock:
        if os.getpid() in _reapers or not pid_namespace():
            return
        read_end, write_end = os.pipe()   # not inheritable: only this process writes
        try:
            _spawn_reaper(read_end)
        except (OSError, subprocess.SubprocessError) as exc:
            os.close(write_end)
            log.warning("could not start the container reaper (%s): this process's worker "
                        "containers are removed when it exits, but not if it is killed. Fix: "
                        "remove leftovers with `python -m fibrl.backends.docker rm`.", exc)
            return
        finally:
            os.close(read_end)
        _reapers[os.getpid()] = write_end


def _spawn_reaper(read_end: int) -> None:
    import fibrl

    env = dict(os.environ)   # the reaper imports this fibrl, wherever it came from
    root = os.path.dirname(os.path.dirname(os.path.abspath(fibrl.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_docker_reaper.py")
    first = subprocess.Popen(
        [sys.executable, "-S", script, str(os.getpid()), pid_namespace(), f"{REAP_WAIT:g}"],
        stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        close_fds=True, cwd="/")
    try:
        code = first.wait(30)   # it exits as soon as it has forked the reaper
    except subprocess.TimeoutExpired:
        # Killed before our write end closes: a reaper forked later would see EOF at
        # once and remove the containers of this live process.
        first.kill()
        first.wait()
        raise
    if code != 0:
        raise subprocess.SubprocessError(f"the reaper's launcher exited {code}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _collect_orphans(client: Any) -> None:
    """Remove stopped containers left by parents that no longer exist (their reaper died too).

    Only those of parents in this process's PID namespace: elsewhere (a parent in a
    container, or this one in a container) the same pid is another process.
    """
    namespace = pid_namespace()   # "" without /proc (Docker Desktop's host side)
    filters = {"label": _label_filters() + [f"{LABEL_HOST}={socket.gethostname()}"],
               "status": "exited"}
    try:
        for container in client.containers.list(all=True, filters=filters,
                                                ignore_removed=True):
            if container.labels.get(LABEL_PIDNS, "") != namespace:
                continue   # its parent's pid means another process here
            parent = container.labels.get(LABEL_PARENT, "")
            if parent.isdigit() and not _pid_alive(int(parent)):
                _remove_quietly(client.api, container.id)
    except _sdk_errors() as exc:
        log.debug("orphan container cleanup skipped: %s", exc)


# -- one container ---------------------------------------------------------------------

class DockerJob(Job):
    """A worker running as a docker container."""

    def __init__(self, spec: JobSpec, api: Any, container_id: str, name: str,
                 stream: Any) -> None:
        self.spec = spec
        self.name = name
        self._api = api
        self._id = container_id
        self._ended = threading.Event()
        self._code: Optional[int] = None
        self._state: dict = {}
        self._lock = threading.Lock()
        self._removed = False
        self._final_logs = ""
        self._follower = threading.Thread(target=self._follow, args=(stream,), daemon=True,
                                          name=f"fibrl-docker-{name}")

    def _begin(self) -> None:
        self._follower.start()

    @property
    def id(self) -> str:
        return self._id

    # The follower: relay output until the container stops, then collect its end.
    def _follow(self, stream: Any) -> None:
        try:
            _relay(stream)
        except Exception as exc:  # a broken stream must not hide the exit code
            log.debug("output stream of %s ended: %s", self.name, exc)
        finally:
            _close_quietly(stream)
        self._collect_end()

    def _collect_end(self) -> None:
        try:
            status = self._api.wait(self._id)["StatusCode"]
            self._state = self._api.inspect_container(self._id)["State"]
        except _sdk_errors() as exc:
            status = 255
            self._state = {"Error": f"lost track of the container: {exc}"}
        self._code = exit_code(status)
        self._report_end()
        self._ended.set()

    def _report_end(self) -> None:
        if self._state.get("OOMKilled"):
            log.warning(
                "worker container %s was killed by the kernel's OOM killer (%s, memory "
                "limit %s). Fix: raise the limit with @fibrl.meta(memory=...) or "
                "fibrl.init(memory=...), or make the worker use less memory.",
                self.name, describe_exitcode(self._code), self.spec.memory or "none")

    def status(self) -> JobStatus:
        if self._ended.is_set():
            return JobStatus.SUCCEEDED if self._code == 0 else JobStatus.FAILED
        try:
            state = self._api.inspect_container(self._id)["State"]
        except _sdk_errors():
            return JobStatus.FAILED
        if state.get("Status") == "created":
            return JobStatus.PENDING
        if state.get("Running"):
            return JobStatus.RUNNING
        return JobStatus.SUCCEEDED if state.get("ExitCode") == 0 else JobStatus.FAILED

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._ended.wait(timeout)
        return self._code

    def _signal(self, sig: str) -> None:
        if self._ended.is_set():
            return
        try:
            self._api.kill(self._id, signal=sig)
        except _sdk_errors() as exc:  # 404 gone, 409 not running: nothing to stop
            if getattr(exc, "status_code", None) not in (404, 409):
                raise BackendError(f"cannot send {sig} to container {self.name}: {exc}. "
                                   f"Check `docker info` and `docker ps -a`.") from exc

    def terminate(self) -> None:
        self._signal("SIGTERM")

    def kill(self) -> None:
        self._signal("SIGKILL")

    def logs(self) -> str:
        """The last ``LOG_TAIL_LINES`` lines the container printed (stdout and stderr)."""
        with self._lock:
            if self._removed:
                return self._final_logs
            return self._fetch_logs()

    def _fetch_logs(self) -> str:
        try:
            raw = self._api.logs(self._id, stdout=True, stderr=True, tail=LOG_TAIL_LINES)
        except _sdk_errors() as exc:
            return f"<logs of container {self.name} unavailable: {exc}>"
        return raw.decode("utf-8", "replace")

    def failure_reason(self) -> str:
        if self._state.get("OOMKilled"):
            return "OOMKilled"
        return self._state.get("Error", "")

    def remove(self) -> None:
        """Keep the logs' tail, then remove the container (killing it if it still runs)."""
        if not self._ended.is_set():
            self.kill()
            self._ended.wait(_STOP_TIMEOUT)
        self._follower.join(_STOP_TIMEOUT)
        with self._lock:
            if self._removed:
                return
            self._final_logs = self._fetch_logs()
            self._removed = True
        _remove_quietly(self._api, self._id)


def _relay(stream: Any) -> None:
    for out, err in stream:
        _write(sys.stdout, out)
        _write(sys.stderr, err)


def _write(target: Any, data: Optional[bytes]) -> None:
    if not data or target is None:
        return
    try:
        target.write(data.decode("utf-8", "replace"))
        target.flush()
    except (ValueError, OSError):  # closed at interpreter exit: drop the output
        pass


def _close_quietly(stream: Any) -> None:
    try:
        stream.close()
    except Exception:  # closing a finished stream may fail in many SDK ways
        pass


# -- the backend -----------------------------------------------------------------------

class _Check:
    """One run of a check that concurrent callers share; they all see its error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: Optional[BackendError] = None

    def run(self, check: Any) -> None:
        try:
            check()
        except BackendError as exc:
            self.error = exc
        finally:
            self._done.set()

    def raise_error(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise BackendError(str(self.error)) from self.error.__cause__


class DockerBackend(Backend):
    """Runs each job as a container of the local (or ``DOCKER_HOST``) docker engine.

    Containers use host networking (workers reach the parent on 127.0.0.1),
    see the parent's working directory at the same path (read-only unless
    ``docker_mount_readonly=False``) and nothing else of the host, run as the
    parent's uid:gid with ``no-new-privileges``, and carry the labels of
    their run plus ``fibrl.backend=docker``.

    Example:
        >>> import fibrl
        >>> fibrl.init(backend="docker", image="fibrl:latest")   # doctest: +SKIP
        >>> p = fibrl.Process(target=print, args=("hi",)); p.start(); p.join()  # doctest: +SKIP
    """

    name = "docker"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._client: Any = None
        self._lock = threading.Lock()
        self._images: set = set()
        self._checks: dict = {}
        self._jobs: weakref.WeakSet = weakref.WeakSet()
        self._ncpu: Optional[int] = None
        self._nested: Optional[bool] = None
        self._local_backend: Optional[Backend] = None

    @property
    def client(self) -> Any:
        """The docker SDK client (connects, and cleans up orphans, on first use)."""
        with self._lock:
            client = self._client
            if client is None:
                self._client = client = connect()
                threading.Thread(target=_collect_orphans, args=(client,), daemon=True,
                                 name="fibrl-docker-orphans").start()
                atexit.register(self._remove_ended)
        _start_reaper()   # once per process (its own lock); a forked child starts its own
        return client

    def cpu_count(self) -> int:
        if self._nested_locally():
            return self._local().cpu_count()
        if self._ncpu is None:
            try:
                self._ncpu = int(self.client.info()["NCPU"])
            except _sdk_errors() as exc:
                raise BackendError(f"cannot ask the docker engine at {_engine_address()} "
                                   f"for its CPU count: {exc}. Check `docker info`.") from exc
        return self._ncpu

    def create_job(self, spec: JobSpec) -> Job:
        if self._nested_locally():
            command = (sys.executable,) + tuple(spec.command[1:])  # this container's python
            return self._local().create_job(dataclasses.replace(spec, command=command))
        self._check_network()
        image = spec.image or self.config.image
        kwargs = self._container_kwargs(spec, image)
        self._require_image(image)
        job = self._start(spec, image, kwargs)
        try:
            # The first start of an image and mount probes it, while this worker boots
            # (not before: two container starts overlap instead of adding up).
            self._check_image_runs(image, spec, kwargs)
        except BaseException:
            job.remove()   # kills the worker that could not run either
            raise
        with self._lock:
            self._jobs.add(job)
        return job

    def _nested_locally(self) -> bool:
        """A worker container cannot reach the engine (nothing of the host is mounted
        but the working directory): the processes it starts run beside it."""
        if self._nested is None:
            self._nested = in_worker_container() and not self._engine_reachable()
        return self._nested

    def _engine_reachable(self) -> bool:
        try:
            self.client
        except BackendError:
            return False
        return True

    def _local(self) -> Backend:
        if self._local_backend is None:
            from .local import LocalBackend

            self._local_backend = LocalBackend(self.config)
        return self._local_backend

    def cleanup(self, run_id: Optional[str] = None, *, force: bool = True) -> list:
        """Remove the containers of ``run_id`` (default: this program's run); return names."""
        if run_id is None:
            from ..popen import run_id as current_run

            run_id = current_run()
        return remove_containers(run_id, force=force, client=self.client)

    # -- building the container ------------------------------------------------------
    def _check_network(self) -> None:
        network, host = self.config.docker_network, self.listen_host()
        if network != "host" and host.startswith(_LOOPBACK):
            raise BackendError(
                f"docker_network={network!r} but the parent listens on {host}, which "
                f"containers on that network cannot reach. Fix: keep docker_network='host' "
                f"(the default), or set listen_host to an address of this machine that the "
                f"network reaches (e.g. the docker0 bridge address).")

    def _container_kwargs(self, spec: JobSpec, image: str) -> dict:
        labels = dict(spec.labels)
        labels.update({LABEL_BACKEND: "docker", LABEL_HOST: socket.gethostname(),
                       LABEL_PIDNS: pid_namespace()})
        volumes = self._volumes(spec)
        kwargs = dict(
            image=image, command=list(spec.command),
            environment=_secret_to_file(dict(spec.env), volumes),
            labels=labels, network_mode=self.config.docker_network, init=True,
            working_dir=self._workdir(spec), volumes=volumes,
            user=f"{os.getuid()}:{os.getgid()}", security_opt=["no-new-privileges"],
            stdin_open=False, tty=False, auto_remove=False)
        kwargs.update(_resources(spec))
        return kwargs

    def _workdir(self, spec: JobSpec) -> Optional[str]:
        if self.config.docker_workdir:
            return self.config.docker_workdir
        return spec.workdir if self.config.docker_mount_cwd and spec.workdir else None

    def _volumes(self, spec: JobSpec) -> dict:
        volumes = {}
        if self.config.docker_mount_cwd and spec.workdir:
            if os.path.abspath(spec.workdir) == "/":
                raise BackendError(
                    "refusing to mount the host's root directory into worker containers: "
                    "the parent's working directory is '/'. Fix: run from your project "
                    "directory, or set docker_mount_cwd=False.")
            mode = "ro" if self.config.docker_mount_readonly else "rw"
            volumes[spec.workdir] = {"bind": spec.workdir, "mode": mode}
        for host_path, container_path, read_only in spec.volumes:
            volumes[host_path] = {"bind": container_path, "mode": "ro" if read_only else "rw"}
        return volumes

    # -- checks done once per image and working directory ----------------------------
    def _check_image_runs(self, image: str, spec: JobSpec, kwargs: dict) -> None:
        """Probe once per image and mount; concurrent callers wait for that one probe."""
        key = (image, kwargs["working_dir"], repr(kwargs["volumes"]))
        with self._lock:
            check = self._checks.get(key)
            mine = check is None
            if mine:
                check = self._checks[key] = _Check()
        if mine:
            check.run(lambda: self._probe(image, spec, kwargs))
            if check.error is not None:
                with self._lock:
                    del self._checks[key]  # retried next time: the image may be rebuilt
        check.raise_error()

    def _require_image(self, image: str) -> None:
        if image in self._images:
            return
        docker = _sdk()
        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound as exc:
            raise BackendError(
                f"the worker image {image!r} does not exist on the docker engine at "
                f"{_engine_address()}. Fix: build it with docker/build-image.sh (or "
                f"`docker build -t {image} .` in the fibrl source tree), pull it, or set "
                f"image=... (fibrl.init(image=...) or FIBRL_IMAGE).") from exc
        except _sdk_errors() as exc:
            raise BackendError(f"cannot look up image {image!r} on the docker engine at "
                               f"{_engine_address()}: {exc}. Check `docker info`.") from exc
        self._images.add(image)

    def _probe(self, image: str, spec: JobSpec, kwargs: dict) -> None:
        """Run ``python -c "import fibrl.bootstrap"`` in the worker's set-up, once."""
        probe = dict(kwargs, command=[spec.command[0], "-c", "import fibrl.bootstrap"],
                     environment={}, name=container_name("probe"))
        probe["labels"] = dict(kwargs["labels"], **{"fibrl.role": "probe"})
        for key in ("nano_cpus", "mem_limit", "memswap_limit", "device_requests"):
            probe.pop(key, None)
        container = self._create(probe, image)
        try:
            container.start()
            status = container.wait(timeout=self.config.start_timeout)["StatusCode"]
            output = container.logs(tail=LOG_TAIL_LINES).decode("utf-8", "replace")
        except _sdk_errors() as exc:
            raise _start_error(image, exc) from exc
        finally:
            _remove_quietly(self.client.api, container.id)
        if status != 0:
            raise _unusable_image(image, kwargs["working_dir"], status, output)

    # -- starting ---------------------------------------------------------------------
    def _create(self, kwargs: dict, image: str) -> Any:
        try:
            return self.client.containers.create(**kwargs)
        except _sdk().errors.ImageNotFound as exc:
            self._images.discard(image)  # removed since it was checked
            self._require_image(image)
            raise _start_error(image, exc) from exc
        except _sdk_errors() as exc:
            raise _start_error(image, exc) from exc

    def _start(self, spec: JobSpec, image: str, kwargs: dict) -> DockerJob:
        name = container_name(spec.name)
        container = self._create(dict(kwargs, name=name), image)
        api = self.client.api
        try:
            stream = api.attach(container.id, stdout=True, stderr=True, stream=True,
                                logs=True, demux=True)
            api.start(container.id)
        except _sdk_errors() as exc:
            _remove_quietly(api, container.id)
            raise _start_error(image, exc) from exc
        job = DockerJob(spec, api, container.id, name, stream)
        job._begin()
        return job

    def _remove_ended(self) -> None:
        """At exit: remove the containers of jobs that ended but were not removed yet."""
        with self._lock:
            jobs = [job for job in self._jobs if job._ended.is_set()]
        for job in jobs:
            job.remove()

    def python(self) -> str:
        return "python"


def _resources(spec: JobSpec) -> dict:
    limits: dict = {}
    if spec.cpu:
        limits["nano_cpus"] = int(float(spec.cpu) * 1e9)
    if spec.memory:
        limits["mem_limit"] = limits["memswap_limit"] = spec.memory  # no swap: OOM kills
    if spec.gpu:
        docker = _sdk()
        limits["device_requests"] = [docker.types.DeviceRequest(count=int(spec.gpu),
                                                                capabilities=[["gpu"]])]
    return limits


def _start_error(image: str, exc: Exception) -> BackendError:
    text = str(exc)
    if "device driver" in text or "nvidia" in text.lower():
        fix = ("GPUs were requested but the engine has no GPU runtime: install the NVIDIA "
               "container toolkit, or request gpu=0.")
    elif "memory" in text.lower() or "parse" in text.lower():
        fix = "check the memory limit: a size such as memory='512m' or '2g'."
    else:
        fix = "check the image, the limits and `docker info`; try `docker run` with the image."
    return BackendError(f"cannot start a worker container from image {image!r} on the docker "
                        f"engine at {_engine_address()}: {text}. Fix: {fix}")


def _unusable_image(image: str, workdir: Optional[str], status: int,
                    output: str) -> BackendError:
    if status == 127 or ("exec" in output and "failed" in output):
        cause = "the image has no `python` on its PATH"
    elif "No module named" in output:
        cause = "fibrl is not installed in the image (nor importable from the mounted directory)"
    else:
        cause = "python or fibrl is broken in the image"
    return BackendError(
        f"the worker image {image!r} cannot run fibrl workers: `python -c \"import "
        f"fibrl.bootstrap\"` exited with {describe_exitcode(exit_code(status))} in it "
        f"(working directory {workdir or 'the image default'}). Likely cause: {cause}. "
        f"Fix: build the image with docker/build-image.sh (it installs fibrl), or pip "
        f"install fibrl in your image, or set image=... Container output:\n{output.strip()}")


# -- command line ------------------------------------------------------------------------

def main(argv: Optional[list] = None) -> int:
    """``python -m fibrl.backends.docker {ls,rm} [RUN] [--force]``: list or remove workers.

    ``rm`` removes stopped worker containers (all of them, or those of RUN);
    ``--force`` also kills and removes running ones.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fibrl.backends.docker",
                                     description="List or remove fibrl worker containers.")
    parser.add_argument("action", choices=("ls", "rm"))
    parser.add_argument("run", nargs="?", help="only the containers of this run id")
    parser.add_argument("--force", action="store_true", help="rm: also running containers")
    args = parser.parse_args(argv)
    if args.action == "rm":
        names = remove_containers(args.run, force=args.force)
    else:
        names = [f"{c.name}\t{c.status}\t{c.labels.get(LABEL_RUN, '')}"
                 for c in list_containers(args.run)]
    sys.stdout.write("".join(f"{name}\n" for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())


_SECRET_MOUNT = "/run/fibrl-secret"
_secret_dir: Optional[str] = None


def _secret_to_file(env: dict, volumes: dict) -> dict:
    """Move FIBRL_SECRET out of ``env`` into a 0400 file in a 0700 directory of this
    process, mounted read-only into the container (FIBRL_SECRET_FILE names it): a
    container's environment is shown by ``docker inspect``, a mount's content is not."""
    global _secret_dir
    secret = env.pop("FIBRL_SECRET", None)
    if secret is None:
        return env
    if _secret_dir is None or not os.path.isdir(_secret_dir):
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None   # not on disk
        _secret_dir = tempfile.mkdtemp(prefix="fibrl-secret-", dir=shm)
        atexit.register(shutil.rmtree, _secret_dir, True)
    path = os.path.join(_secret_dir, hashlib.sha256(secret.encode()).hexdigest()[:16])
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "w") as file:
            file.write(secret)
    volumes[path] = {"bind": _SECRET_MOUNT, "mode": "ro"}
    env["FIBRL_SECRET_FILE"] = _SECRET_MOUNT
    return env
