"""Launchers: run a whole script as the parent of a run, on a cluster or a docker engine.

``fibrl run`` (:mod:`fibrl.cli`) decides *what* to launch; a launcher owns
*how* on one backend: start the script as the run's parent (a kubernetes Job,
or a docker container), wait for it (streaming its output when asked), list
runs, show logs and delete everything a run created (by its ``fibrl.run``
label). Launchers import their client library when first used::

    fibrl.cli --RunRequest--> get_launcher("kubernetes" | "docker", config)
                                 .launch(request)        -> where it runs
                                 .wait(run, follow, out) -> Ended(exit status, reason)
                                 .runs()                 -> [RunInfo]
                                 .logs(run, follow, out, pod)
                                 .stop(run)              -> names deleted
"""
from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from typing import BinaryIO, Mapping, Optional

from ..config import Config
from ..errors import ConfigError

__all__ = ["Launcher", "RunRequest", "RunInfo", "Ended", "get_launcher", "LAUNCHERS"]

LAUNCHERS = {"kubernetes": "fibrl.launch.kubernetes:KubernetesLauncher",
             "docker": "fibrl.launch.docker:DockerLauncher"}


@dataclass(frozen=True)
class RunRequest:
    """What ``fibrl run`` launches.

    Attributes:
        run_id: the run's id (label ``fibrl.run``; workers inherit it).
        command: argv of the script, e.g. ``("python", "train.py", "--steps", "10")``.
        image: container image that holds the script and fibrl.
        cpu, memory, gpu: resources of the parent (workers take theirs from config).
        env: extra environment of the parent.
        service_account: kubernetes service account of the parent.
        workdir: working directory of the script (docker: the mounted project).
    """

    run_id: str
    command: tuple
    image: str
    cpu: float = 0.0
    memory: str = ""
    gpu: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    service_account: str = ""
    workdir: str = ""


@dataclass(frozen=True)
class Ended:
    """How a run's parent ended: its exit status (as a shell sees it) and, if it ended
    badly for a reason other than its own code, that reason (``"OOMKilled"``...)."""

    status: int
    reason: str = ""


@dataclass(frozen=True)
class RunInfo:
    """One run as ``fibrl ps`` shows it."""

    run_id: str
    parent: str            # job / container of the parent ("-" when it runs elsewhere)
    status: str            # the parent's phase, or "-"
    workers: Mapping[str, int]   # worker phase -> count
    age: str


class Launcher(abc.ABC):
    """Starts and manages ``fibrl run`` runs on one backend."""

    def __init__(self, config: Config) -> None:
        self.config = config

    @abc.abstractmethod
    def launch(self, request: RunRequest) -> str:
        """Start the script; return where it runs (job or container name)."""

    @abc.abstractmethod
    def wait(self, run_id: str, follow: bool, out: BinaryIO) -> "Ended":
        """Block until the run's parent ends; stream its output to ``out`` if ``follow``."""

    @abc.abstractmethod
    def runs(self) -> list:
        """The runs this backend knows, as :class:`RunInfo`."""

    @abc.abstractmethod
    def logs(self, run_id: str, follow: bool, out: BinaryIO, pod: Optional[str] = None) -> None:
        """Write the run's parent's output (or ``pod``'s, or all workers') to ``out``."""

    @abc.abstractmethod
    def stop(self, run_id: str) -> list:
        """Delete everything labelled with ``run_id``; return what was deleted."""


def get_launcher(backend: str, config: Config) -> Launcher:
    """The launcher of ``backend`` (imported now)."""
    try:
        path = LAUNCHERS[backend]
    except KeyError:
        raise ConfigError(f"`fibrl run` launches on {' or '.join(LAUNCHERS)}, not {backend!r}. "
                          f"Fix: --backend kubernetes (or docker).") from None
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)(config)


def age(seconds: float) -> str:
    """``95`` -> ``"1m35s"`` (the way kubectl shows ages, roughly).

    Example:
        >>> age(5), age(95), age(7300), age(200000)
        ('5s', '1m35s', '2h1m', '2d7h')
    """
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600}h"
