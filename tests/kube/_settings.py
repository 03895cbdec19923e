"""Knobs of the fake API server (all keyword arguments of ``FakeApiServer``)."""
from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass, field

# Host variables a local-process "container" inherits so that Python and
# coverage keep working; everything else comes from the pod spec.
DEFAULT_HOST_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH",
                    "VIRTUAL_ENV", "COVERAGE_PROCESS_START", "SYSTEMROOT")


@dataclass
class Settings:
    # --- API
    user: str = "system:serviceaccount:default:fibrl"
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    require_token: bool = True
    history_limit: int = 1000          # watch events kept; older resourceVersions get 410
    watch_default_timeout: float = 1800.0
    bookmark_interval: float = 60.0    # seconds of quiet between BOOKMARKs (0: only at the end)
    # Events a watcher may fall behind by (its buffer in the API server's watch cache): a
    # watcher further behind (it does not read, so the server's writes block) is closed
    # without an ERROR, as a real API server forces an unresponsive watcher closed; the
    # client watches again from the last resourceVersion it got. 0: never closed.
    watcher_buffer: int = 100
    strict_namespaces: bool = False     # False: any namespace exists; True: only known/created ones
    namespaces: tuple = ("default", "kube-system", "kube-public", "kube-node-lease")
    record_events: bool = True          # emit core/v1 Events (Scheduled, Started, FailedScheduling ...)
    # --- node / kubelet
    runtime: str = "process"            # "process" | "docker" | "auto"
    node_name: str = "fake-node"
    node_labels: dict = field(default_factory=lambda: {
        "kubernetes.io/hostname": "fake-node", "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"})
    node_capacity: dict = field(default_factory=lambda: {
        "cpu": str(os.cpu_count() or 1), "memory": "64Gi", "pods": "110"})
    max_grace_seconds: float = 2.0      # SIGTERM -> SIGKILL delay is min(pod grace, this)
    image_pull_backoff_seconds: float = 0.3   # ErrImagePull -> ImagePullBackOff
    # Image name prefixes a pull can fetch (the fake's "registries"); a pod whose pull policy
    # is Always (the default for :latest and untagged images) fails ErrImagePull for any
    # other image, as on a cluster where the image was only loaded into the node. None:
    # every pull succeeds.
    registry: tuple | None = ("python:", "docker.io/library/python:")
    pod_ip: str = "127.0.0.1"           # podIP / hostIP of every pod ("::1" for IPv6)
    crash_backoff_seconds: float = 0.5  # first container restart delay (doubles, capped at 5 s)
    job_backoff_seconds: float = 0.0    # delay before replacing a failed Job pod (real: 10 s doubling)
    image_commands: dict = field(default_factory=dict)  # image -> argv when a pod gives no command
    # image -> local docker image the node has under that name (as `kind load` would tag it)
    node_images: dict = field(default_factory=dict)
    image_env: dict = field(default_factory=lambda: {"PYTHONUNBUFFERED": "1",
                                                     "PYTHONDONTWRITEBYTECODE": "1"})
    host_env: tuple = DEFAULT_HOST_ENV
    workdir: str | None = None          # process cwd when the pod has no workingDir (None: os.getcwd())
    python: str = sys.executable        # what "python"/"python3" commands run in process mode
    instance: str = field(default_factory=lambda: secrets.token_hex(6))  # docker label of this server
