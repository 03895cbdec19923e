"""``fibrl run --backend docker``: the script runs as a container of the local docker engine.

Owns the parent container of a run: started from the run's image with the
project directory mounted at its own path (so the docker backend's worker
containers, which mount the parent's working directory from the host, see
the same files), the engine's socket mounted (so the parent can start them),
host networking (so they reach it on 127.0.0.1), and the invoking user's
uid:gid. Worker containers are the docker backend's business
(:mod:`fibrl.backends.docker`); here they are listed and removed by label.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any, BinaryIO, Optional

from ..errors import BackendError
from . import Ended, Launcher, RunInfo, RunRequest, age

__all__ = ["DockerLauncher"]

SOCKET = "/var/run/docker.sock"


class DockerLauncher(Launcher):
    """Runs ``fibrl run`` scripts as containers of the engine ``DOCKER_HOST`` names."""

    _client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            from ..backends.docker import connect

            self._client = connect()
        return self._client

    def launch(self, request: RunRequest) -> str:
        name = f"fibrl-run-{request.run_id}"
        try:
            self.client.containers.run(**self._kwargs(request, name))
        except self._errors() as exc:
            raise _launch_error(request.image, exc) from exc
        return name

    def _kwargs(self, request: RunRequest, name: str) -> dict:
        workdir = request.workdir or os.getcwd()
        env = {"FIBRL_BACKEND": "docker", "FIBRL_RUN_ID": request.run_id, "HOME": "/tmp",
               **request.env}
        volumes = {workdir: {"bind": workdir, "mode": "rw"}}
        kwargs = dict(image=request.image, command=list(request.command), name=name,
                      labels={"fibrl.run": request.run_id, "fibrl.role": "parent",
                              "fibrl.backend": "docker"},
                      environment=env, network_mode="host", working_dir=workdir, init=True,
                      user=f"{os.getuid()}:{os.getgid()}", detach=True, auto_remove=False)
        if os.path.exists(SOCKET) and not os.environ.get("DOCKER_HOST"):
            volumes[SOCKET] = {"bind": SOCKET, "mode": "rw"}
            kwargs["group_add"] = [str(os.stat(SOCKET).st_gid)]
        elif os.environ.get("DOCKER_HOST"):
            env["DOCKER_HOST"] = os.environ["DOCKER_HOST"]
        kwargs["volumes"] = volumes
        kwargs.update(self._resources(request))
        return kwargs

    def _resources(self, request: RunRequest) -> dict:
        limits: dict = {}
        if request.cpu:
            limits["nano_cpus"] = int(float(request.cpu) * 1e9)
        if request.memory:
            limits["mem_limit"] = request.memory
        if request.gpu:
            from ..backends.docker import sdk

            limits["device_requests"] = [sdk().types.DeviceRequest(
                count=int(request.gpu), capabilities=[["gpu"]])]
        return limits

    def _errors(self) -> tuple:
        # the backend's SDK import: a docker/ folder of the project does not pass for it
        from ..backends.docker import sdk_errors

        return sdk_errors()

    # -- one run ---------------------------------------------------------------------
    def _containers(self, run_id: Optional[str] = None) -> list:
        from ..backends.docker import list_containers

        return list_containers(run_id, client=self.client)

    def _parent(self, run_id: str) -> Any:
        parents = [c for c in self._containers(run_id) if c.labels.get("fibrl.role") == "parent"]
        if not parents:
            raise BackendError(f"no parent container of run {run_id!r} on the docker engine "
                               f"(see `fibrl ps --backend docker`).")
        return parents[0]

    def wait(self, run_id: str, follow: bool, out: BinaryIO) -> Ended:
        container = self._parent(run_id)
        if follow:
            _copy(container.logs(stream=True, follow=True), out)
        status = int(container.wait()["StatusCode"])
        container.reload()
        state = container.attrs.get("State") or {}
        self._remove_workers(run_id)
        return Ended(status, "OOMKilled" if state.get("OOMKilled") else state.get("Error", ""))

    def _remove_workers(self, run_id: str) -> None:
        # A parent killed in its container takes its reaper with it (the container's
        # processes all end): its workers' containers are removed here instead.
        from ..backends.docker import REAP_WAIT, remove_when_stopped

        workers = [c for c in self._containers(run_id) if c.labels.get("fibrl.role") != "parent"]
        remove_when_stopped(workers, self.client, REAP_WAIT)

    def runs(self) -> list:
        by_run: dict = {}
        for container in self._containers():
            by_run.setdefault(container.labels.get("fibrl.run", "?"), []).append(container)
        return [_run_info(run, containers) for run, containers in sorted(by_run.items())]

    def logs(self, run_id: str, follow: bool, out: BinaryIO, pod: Optional[str] = None) -> None:
        if pod is not None:
            containers = [self.client.containers.get(pod)]
        else:
            parents = [c for c in self._containers(run_id)
                       if c.labels.get("fibrl.role") == "parent"]
            containers = parents or self._containers(run_id)
        if not containers:
            raise BackendError(f"no container of run {run_id!r} (see `fibrl ps --backend docker`).")
        for container in containers:
            if len(containers) > 1:
                out.write(f"==> {container.name} <==\n".encode())
            if follow and len(containers) == 1:
                _copy(container.logs(stream=True, follow=True), out)
            else:
                out.write(container.logs())
                out.flush()

    def stop(self, run_id: str) -> list:
        from ..backends.docker import remove_containers

        return [f"container/{name}" for name in remove_containers(run_id, force=True,
                                                                     client=self.client)]


def _copy(chunks: Any, out: BinaryIO) -> None:
    for chunk in chunks:
        out.write(chunk)
        out.flush()


def _run_info(run_id: str, containers: list) -> RunInfo:
    parents = [c for c in containers if c.labels.get("fibrl.role") == "parent"]
    workers = Counter(c.status for c in containers if c not in parents)
    created = [c.attrs.get("Created", "") for c in containers]
    oldest = min(_timestamp(t) for t in created)
    return RunInfo(run_id, parents[0].name if parents else "-",
                   parents[0].status if parents else "-", dict(workers), age(time.time() - oldest))


def _timestamp(text: str) -> float:
    import datetime as dt

    try:
        return dt.datetime.fromisoformat(text[:26].rstrip("Z") + "+00:00").timestamp()
    except ValueError:
        return time.time()


def _launch_error(image: str, exc: Exception) -> BackendError:
    text = str(exc)
    if "No such image" in text or "not found" in text.lower():
        fix = ("build it (fibrl run --build, with a Dockerfile in the project) or pull it; the "
               "image must contain python and fibrl with its docker extra")
    else:
        fix = "check the image and `docker info`; try `docker run` with the same image"
    return BackendError(f"cannot start the run's parent container from image {image!r}: {text}. "
                        f"Fix: {fix}.")
