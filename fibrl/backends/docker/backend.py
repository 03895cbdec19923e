"""The docker backend: turn a :class:`JobSpec` into a container and report on it.

Data flow of one job::

    create_job(spec)
      once: engine reachable, image present
      containers.create(host network, cwd mounted, limits, labels)
      attach(stream, demux)  <- before start, so no output is lost
      start
      once per image and mount, while that worker boots: a probe container runs
            the spec's probe command (BackendError with its output
            if that fails, and the worker is removed; concurrent starts wait)
      DockerJob follows it (``job``)
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
import time
import weakref
from typing import Any, Optional

from ...config import Config
from ...errors import BackendError, BackendUnavailableError, describe_exitcode
from .. import base
from ..base import LABEL_BACKEND, LABEL_ROLE, Backend, Job, JobSpec
from .engine import (LABEL_HOST, LABEL_PIDNS, LOG_TAIL_LINES, _engine_address, sdk, sdk_errors,
                     connect, container_name, engine_down, exit_code, in_worker_container,
                     wait_for_engine)
from .housekeeping import _remove_quietly, collect_orphans, pid_namespace, remove_containers
from .job import DockerJob
from .reaper import start_reaper

__all__ = ["DockerBackend"]

log = logging.getLogger(__name__)

_LOOPBACK = ("127.", "localhost", "::1")
_PROBE_SLICE = 0.5   # s: an exiting program waits at most this long for a probe to notice


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
    exit_report_s = 10.0   # the engine's wait answer trails the connection's end under load

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._client: Any = None
        self._lock = threading.Lock()
        self._images: set = set()
        self._checks: dict[tuple, _Check] = {}
        self._jobs: weakref.WeakSet = weakref.WeakSet()
        self._ncpu: Optional[int] = None
        self._nested: Optional[bool] = None
        self._local_backend: Optional[Backend] = None
        self._abandoned = threading.Event()   # the program exits: starts end, none begin

    @property
    def client(self) -> Any:
        """The docker SDK client (connects, and cleans up orphans, on first use)."""
        with self._lock:
            client = self._client
            if client is None:
                self._client = client = _engine_client()
        start_reaper()   # once per process (its own lock); a forked child starts its own
        return client

    def cpu_count(self) -> int:
        if self._nested_locally():
            return self._local().cpu_count()
        if self._ncpu is None:
            try:
                self._ncpu = int(self.client.info()["NCPU"])
            except sdk_errors() as exc:
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
        job = self._start_waiting_for_engine(spec, image, kwargs)
        try:
            # The first start of an image and mount probes it, while this worker boots
            # (not before: two container starts overlap instead of adding up).
            self._check_image_runs(image, spec, kwargs)
            self._refuse_if_abandoned()
        except BaseException:
            job.remove()   # kills the worker that could not run either
            raise
        with self._lock:
            self._jobs.add(job)
        return job

    def _start_waiting_for_engine(self, spec: JobSpec, image: str, kwargs: dict) -> DockerJob:
        """Start the container; while the engine does not answer (dockerd restarting),
        wait for it, until ``start_timeout`` from now."""
        deadline = time.monotonic() + self.config.start_timeout
        while True:
            try:
                self._require_image(image)
                self._refuse_if_abandoned()
                return self._start(spec, image, kwargs)
            except BackendError as exc:
                if not engine_down(exc.__cause__ or exc):
                    raise
                log.warning("the docker engine at %s does not answer (%s); a worker's start "
                            "waits for it, up to %.0f s (start_timeout)", _engine_address(),
                            exc.__cause__ or exc, max(0.0, deadline - time.monotonic()))
                if not wait_for_engine(self.client, deadline, self._abandoned.is_set):
                    self._refuse_if_abandoned()
                    raise BackendUnavailableError(
                        f"the docker engine at {_engine_address()} did not answer for "
                        f"{self.config.start_timeout:.0f} s (start_timeout), so a worker "
                        f"could not start: {exc.__cause__ or exc}. Likely cause: dockerd "
                        f"stopped or is restarting. Fix: start it (`sudo systemctl start "
                        f"docker`) and check `docker info`; to wait longer for it, raise "
                        f"start_timeout.") from exc

    def abandon_starts(self) -> None:
        self._abandoned.set()   # an image probe stops waiting within _PROBE_SLICE

    def _refuse_if_abandoned(self) -> None:
        if self._abandoned.is_set():
            raise BackendError("the program is exiting: a docker worker's start was "
                               "abandoned (its container is removed)")

    def _nested_locally(self) -> bool:
        """A worker container cannot reach the engine (nothing of the host is mounted
        but the working directory): the processes it starts run beside it."""
        if self._nested is None:
            self._nested = in_worker_container() and not self._engine_reachable()
        return self._nested

    def _engine_reachable(self) -> bool:
        try:
            _ = self.client   # connects, or raises
        except BackendError:
            return False
        return True

    def _local(self) -> Backend:
        if self._local_backend is None:
            from ..local import LocalBackend

            self._local_backend = LocalBackend(self.config)
        return self._local_backend

    def cleanup(self, run_id: Optional[str] = None, *, force: bool = True) -> list:
        """Remove the containers of ``run_id`` (default: this program's run); return names."""
        return remove_containers(run_id or base.run_id(), force=force, client=self.client)

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
        env = dict(spec.env)
        secret = env.pop("FIBRL_SECRET", None) is not None
        if secret:   # written to its stdin once started: _start
            env["FIBRL_SECRET_STDIN"] = "1"
        kwargs = dict(
            image=image, command=list(spec.command), environment=env,
            labels=labels, network_mode=self.config.docker_network, init=True,
            working_dir=self._workdir(spec), volumes=self._volumes(spec),
            user=f"{os.getuid()}:{os.getgid()}", security_opt=["no-new-privileges"],
            stdin_open=secret, tty=False, auto_remove=False)
        kwargs.update(_resources(spec))
        return kwargs

    def _workdir(self, spec: JobSpec) -> Optional[str]:
        if self.config.docker_workdir:
            return self.config.docker_workdir
        return spec.workdir if self.config.docker_mount_cwd and spec.workdir else None

    def import_hint(self, spec: JobSpec) -> str:
        if self._nested_locally():
            return ""
        try:
            mounted = sorted(self._volumes(spec))
        except BackendError:
            mounted = []
        where = ", ".join(mounted) or "no directory (docker_mount_cwd=False)"
        return (f"A docker worker sees only what its image {spec.image or self.config.image!r} "
                f"holds and the host directories mounted into it at the same paths: "
                f"{where}. A module elsewhere (a PYTHONPATH entry outside them, a package "
                f"installed only on this host) is missing there. Fix: run from a directory "
                f"that holds your code, move the module under one of those directories, or "
                f"install it in the image.")

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
            volumes.update(_code_volumes(spec))
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
            if check is None:
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
        docker = sdk()
        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound as exc:
            raise BackendError(
                f"the worker image {image!r} does not exist on the docker engine at "
                f"{_engine_address()}. Fix: build it with docker/build-image.sh (or "
                f"`docker build -t {image} .` in the fibrl source tree), pull it, or set "
                f"image=... (fibrl.init(image=...) or FIBRL_IMAGE).") from exc
        except sdk_errors() as exc:
            raise BackendError(f"cannot look up image {image!r} on the docker engine at "
                               f"{_engine_address()}: {exc}. Check `docker info`.") from exc
        self._images.add(image)

    def _probe(self, image: str, spec: JobSpec, kwargs: dict) -> None:
        """Run the spec's probe command in the worker's set-up, once."""
        if not spec.probe:
            return
        probe = dict(kwargs, command=list(spec.probe), environment={},
                     name=container_name("probe"))
        probe["labels"] = dict(kwargs["labels"], **{LABEL_ROLE: "probe"})
        for key in ("nano_cpus", "mem_limit", "memswap_limit", "device_requests"):
            probe.pop(key, None)
        container = self._create(probe, image)
        try:
            container.start()
            status = self._wait_for_probe(container)
            output = container.logs(tail=LOG_TAIL_LINES).decode("utf-8", "replace")
        except sdk_errors() as exc:
            raise _start_error(image, exc) from exc
        finally:
            _remove_quietly(self.client.api, container.id)
        if status != 0:
            raise _unusable_image(image, kwargs["working_dir"], status, output, spec.probe)

    def _wait_for_probe(self, container: Any) -> int:
        """The probe's exit status, waited for in slices so that an exiting program
        (:meth:`abandon_starts`) need not wait the probe out."""
        import requests

        deadline = time.monotonic() + self.config.start_timeout
        while True:
            self._refuse_if_abandoned()
            left = deadline - time.monotonic()
            try:
                return container.wait(timeout=max(0.1, min(_PROBE_SLICE, left)))["StatusCode"]
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                if left <= _PROBE_SLICE:
                    raise

    # -- starting ---------------------------------------------------------------------
    def _create(self, kwargs: dict, image: str) -> Any:
        try:
            return self.client.containers.create(**kwargs)
        except sdk().errors.ImageNotFound as exc:
            self._images.discard(image)  # removed since it was checked
            self._require_image(image)
            raise _start_error(image, exc) from exc
        except sdk_errors() as exc:
            raise _start_error(image, exc) from exc

    def _start(self, spec: JobSpec, image: str, kwargs: dict) -> DockerJob:
        name = container_name(spec.name)
        container = self._create(dict(kwargs, name=name), image)
        api = self.client.api
        try:
            secret = spec.env.get("FIBRL_SECRET")
            stdin = None if secret is None else api.attach_socket(
                container.id, params={"stdin": 1, "stream": 1})
            stream = api.attach(container.id, stdout=True, stderr=True, stream=True,
                                logs=True, demux=True)
            api.start(container.id)
            if stdin is not None and secret is not None:   # stdin: only with a secret
                _hand_secret(stdin, secret)
        except (OSError, *sdk_errors()) as exc:
            _remove_quietly(api, container.id)
            raise _start_error(image, exc) from exc
        job = DockerJob(spec, api, container.id, name, stream, self.config.start_timeout)
        job._begin()
        return job

    def close_at_exit(self) -> None:
        """Remove the containers of jobs that ended but were not removed yet."""
        with self._lock:
            jobs = [job for job in self._jobs if job._ended.is_set()]
        for job in jobs:
            job.remove()

    def python(self) -> str:
        return "python"


# One client per engine for the process, shared by the backends of every config: each
# config has a backend of its own (its timings, its image), and a client each would
# multiply the kept-alive connections to the engine (up to the pool's size per client)
# and the sweeps for a previous run's containers. Keyed by pid too: a forked child
# must not share its parent's connections.
_clients: dict[tuple[int, str], Any] = {}
_clients_lock = threading.Lock()


def _engine_client() -> Any:
    """The shared client of the engine in ``DOCKER_HOST``; its first use in this
    process also sweeps a previous run's containers, in the background."""
    key = (os.getpid(), _engine_address())
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = connect()
            threading.Thread(target=collect_orphans, args=(client,), daemon=True,
                             name="fibrl-docker-orphans").start()
    return client


def _hand_secret(stdin: Any, secret: str) -> None:
    """Write the run's secret to the started worker's stdin, then close it.

    It goes from this process through the engine's API into the worker's pipe (so it
    works from a parent that is itself a container): not into the container's
    environment, which ``docker inspect`` shows, nor into a file, which would sit in
    the container's writable layer on the host's disk until the container is removed.
    """
    raw = getattr(stdin, "_sock", stdin)   # docker's attach socket: a SocketIO around it
    try:
        raw.sendall(secret.encode() + b"\n")
    finally:
        stdin.close()
        raw.close()


def _resources(spec: JobSpec) -> dict:
    limits: dict = {}
    if spec.cpu:
        limits["nano_cpus"] = int(float(spec.cpu) * 1e9)
    if spec.memory:
        limits["mem_limit"] = limits["memswap_limit"] = spec.memory  # no swap: OOM kills
    if spec.gpu:
        docker = sdk()
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


def _shell(command: tuple) -> str:
    if not command:
        return "its probe command"
    return "`" + " ".join(f'"{part}"' if " " in part else part for part in command) + "`"


def _code_volumes(spec: JobSpec) -> dict:
    """The main script's folder, read-only at the same path: a script run from outside
    the working directory imports its neighbours (``sys.path[0]``) there as here."""
    volumes = {}
    for path in spec.code_dirs:
        path = os.path.abspath(path)
        inside = os.path.commonpath([path, os.path.abspath(spec.workdir)])
        if path == "/" or inside == os.path.abspath(spec.workdir) or not os.path.isdir(path):
            continue  # the host's root is never mounted; the working directory already is
        volumes[path] = {"bind": path, "mode": "ro"}
    return volumes


def _unusable_image(image: str, workdir: Optional[str], status: int,
                    output: str, probe: tuple = ()) -> BackendError:
    if status == 127 or ("exec" in output and "failed" in output):
        cause = "the image has no `python` on its PATH"
    elif "No module named" in output:
        cause = "fibrl is not installed in the image (nor importable from the mounted directory)"
    else:
        cause = "python or fibrl is broken in the image"
    return BackendError(
        f"the worker image {image!r} cannot run fibrl workers: {_shell(probe)} exited "
        f"with {describe_exitcode(exit_code(status))} in it "
        f"(working directory {workdir or 'the image default'}). Likely cause: {cause}. "
        f"Fix: build the image with docker/build-image.sh (it installs fibrl), or pip "
        f"install fibrl in your image, or set image=... Container output:\n{output.strip()}")
