"""The docker backend: each worker is a container of the engine ``DOCKER_HOST`` names.

Owns turning a :class:`~fibrl.backends.base.JobSpec` into a container (image,
command, env, labels, limits, the mounted working directory), watching it,
relaying its output, stopping it and removing it, plus label-based listing and
cleanup for ``fibrl ps`` / ``fibrl stop`` and the tests. It does not own what
runs inside (the spec's command) nor how the parent talks to it
(``transport``). The docker SDK is imported only here, when the backend is
first used. Its modules:

    engine        the SDK, the connection, container names, exit codes
    housekeeping  list and remove containers by label; collect orphans
    reaper        start the detached process that removes a dead parent's
                  containers (``fibrl/backends/_docker_reaper.py``)
    job           one container: follow, stop, logs, remove
    backend       DockerBackend: checks, probe, create and start

A worker's own children run as local processes in its container: it has no
access to the engine. Workers exit by themselves when their parent goes away,
and the parent's reaper removes their containers once the parent is gone,
even SIGKILLed. What outlives both (the reaper killed too) is removed by
``fibrl stop RUN --backend docker`` (:func:`remove_containers`), and by the
next docker backend started in the same PID namespace of this machine for
containers whose parent process is gone.
"""
from __future__ import annotations

from .backend import DockerBackend
from .engine import (LABEL_HOST, LABEL_PIDNS, LOG_TAIL_LINES, connect, container_name, exit_code,
                     in_worker_container, sdk, sdk_errors)
from .housekeeping import (collect_orphans, label_filters, list_containers, pid_namespace,
                           remove_containers, remove_when_stopped)
from .job import DockerJob
from .reaper import REAP_WAIT, start_reaper

__all__ = ["DockerBackend", "DockerJob", "connect", "container_name", "exit_code",
           "in_worker_container", "list_containers", "pid_namespace", "remove_containers",
           "remove_when_stopped", "label_filters", "collect_orphans", "start_reaper",
           "REAP_WAIT", "LABEL_HOST", "LABEL_PIDNS", "LOG_TAIL_LINES", "sdk", "sdk_errors"]
