"""Housekeeping by label: list and remove fibrl's containers, collect orphans.

Owns finding containers by their labels (``backends.base`` names them, plus
this backend's host and PID namespace), removing them once stopped, and the
collection, by a newly started backend, of stopped containers whose parent
process no longer exists in this PID namespace. Used by the backend, its
reaper, ``fibrl ps`` / ``fibrl stop`` and the tests.
"""
from __future__ import annotations

import functools
import logging
import os
import socket
import time
from typing import Any, Optional

from ..base import LABEL_BACKEND, LABEL_PARENT, LABEL_RUN
from .engine import LABEL_HOST, LABEL_PIDNS, sdk_errors, connect

__all__ = ["label_filters", "list_containers", "remove_containers", "remove_when_stopped",
           "pid_namespace", "collect_orphans"]

log = logging.getLogger(__name__)


def label_filters(run: Optional[str] = None, parent: Optional[int] = None) -> list:
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
    filters = {"label": label_filters(run, parent)}
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
        except sdk_errors():
            pass
        if _remove_quietly(client.api, container.id):
            removed.append(container.name)
    return removed


def _remove_quietly(api: Any, container_id: str) -> bool:
    try:
        api.remove_container(container_id, force=True)
        return True
    except sdk_errors() as exc:
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def collect_orphans(client: Any) -> None:
    """Remove stopped containers left by parents that no longer exist (their reaper died too).

    Only those of parents in this process's PID namespace: elsewhere (a parent in a
    container, or this one in a container) the same pid is another process.
    """
    namespace = pid_namespace()   # "" without /proc (Docker Desktop's host side)
    filters = {"label": label_filters() + [f"{LABEL_HOST}={socket.gethostname()}"],
               "status": "exited"}
    try:
        for container in client.containers.list(all=True, filters=filters,
                                                ignore_removed=True):
            if container.labels.get(LABEL_PIDNS, "") != namespace:
                continue   # its parent's pid means another process here
            parent = container.labels.get(LABEL_PARENT, "")
            if parent.isdigit() and not _pid_alive(int(parent)):
                _remove_quietly(client.api, container.id)
    except sdk_errors() as exc:
        log.debug("orphan container cleanup skipped: %s", exc)
