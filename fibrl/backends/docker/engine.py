"""Reaching the docker engine: the SDK (imported here, on first use), names, exit codes.

Owns the connection to the engine ``DOCKER_HOST`` names (:func:`connect`),
whether this process runs in a worker container, the container names fibrl
gives and how a container's status maps to an exit code. Nothing here starts
or removes a container.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import time
from typing import Any, Callable, Optional

from ...errors import BackendError, BackendUnavailableError

__all__ = ["connect", "container_name", "engine_down", "exit_code", "in_worker_container",
           "wait_for_engine", "LABEL_HOST", "LABEL_PIDNS", "LOG_TAIL_LINES"]

log = logging.getLogger(__name__)

LABEL_HOST = "fibrl.host"
LABEL_PIDNS = "fibrl.pidns"   # whose pid fibrl.parent is: the parent's PID namespace
LOG_TAIL_LINES = 500  # what logs() keeps of a removed container, and shows in errors
_MAX_SIGNAL = 64
_PING_EVERY = 0.5     # s between two pings of an engine that does not answer


# -- the SDK and the engine ------------------------------------------------------------

def sdk():
    """The docker SDK module, or a BackendUnavailableError saying how to install it (a
    project's own ``docker/`` folder does not pass for the SDK)."""
    try:
        import docker
    except ImportError as exc:
        raise _no_sdk() from exc
    if not hasattr(docker, "from_env"):  # a directory named docker/ shadows a missing SDK
        raise _no_sdk()
    return docker


def _no_sdk() -> BackendError:
    return BackendUnavailableError(
        "the docker backend needs the docker SDK, which is not installed. "
        "Fix: pip install 'fibrl[docker]' (or choose fibrl.init(backend='local')).")


def in_worker_container() -> bool:
    """True in a fibrl worker running inside a container."""
    from multiprocessing import parent_process

    return os.path.exists("/.dockerenv") and parent_process() is not None


def sdk_errors() -> tuple:
    """The exceptions a call to the engine raises (the SDK's and its HTTP layer's)."""
    import requests

    return (sdk().errors.DockerException, requests.RequestException)


def engine_down(exc: BaseException) -> bool:
    """True when ``exc`` says the engine did not answer at all (dockerd stopped, or
    restarting: its socket is gone or refuses), rather than answering with an error."""
    import requests

    return isinstance(exc, requests.exceptions.ConnectionError)


def wait_for_engine(client: Any, deadline: float,
                    give_up: Callable[[], bool] = lambda: False) -> bool:
    """Ping the engine until it answers (True), ``deadline`` (a ``time.monotonic()``
    value) passes or ``give_up()`` is true (False)."""
    while not give_up():
        try:
            client.ping()
            return True
        except sdk_errors():
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(_PING_EVERY, left))
    return False


def _engine_address() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(timeout: float = 60.0, pool_size: int = 64):
    """A docker SDK client of the engine in ``DOCKER_HOST``, or a :class:`BackendError`.

    Example:
        >>> client = connect()               # doctest: +SKIP
        >>> client.info()["NCPU"] > 0        # doctest: +SKIP
        True
    """
    docker = sdk()
    try:
        return docker.from_env(timeout=int(timeout), max_pool_size=pool_size)
    except sdk_errors() as exc:
        raise BackendUnavailableError(
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
