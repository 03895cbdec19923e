"""One worker container: watch it, relay its output, stop it, keep its logs, remove it.

Data flow::

    follower thread:  attach stream frames --> parent's stdout / stderr
                      EOF (container stopped) --> wait API --> inspect
                      --> exit code (128+N -> -N), OOMKilled --> _ended.set()
    Job.wait(timeout) blocks on _ended; Job.remove() keeps a bounded tail of the
    logs, then removes the container (auto-remove is off so logs survive exit).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Optional

from ...errors import BackendError, describe_exitcode
from ..base import Job, JobSpec, JobStatus
from .engine import LOG_TAIL_LINES, engine_down, exit_code, sdk_errors, wait_for_engine
from .housekeeping import _remove_quietly

__all__ = ["DockerJob"]

log = logging.getLogger(__name__)

_STOP_TIMEOUT = 10.0  # seconds to wait for a killed container's end to be reported
# One removal at a time: when a pool's containers end together, the engine reports
# their ends sooner with no burst of removals competing (Pool(32)'s close: 0.1 s).
_removing = threading.Lock()


# -- one container ---------------------------------------------------------------------

class DockerJob(Job):
    """A worker running as a docker container."""

    def __init__(self, spec: JobSpec, api: Any, container_id: str, name: str,
                 stream: Any, engine_wait: float = 120.0) -> None:
        self.spec = spec
        self._engine_wait = engine_wait   # s to wait for an engine that stopped answering
        self.name = name
        self._api = api
        self._id = container_id
        self._ended = threading.Event()
        self._code: Optional[int] = None
        self._state: dict = {}
        self._lock = threading.Lock()
        self._removed = False
        self._final_logs = ""
        self._pending_signal: Optional[str] = None   # asked for while the engine was down
        self._follower = threading.Thread(target=self._follow, args=(stream,), daemon=True,
                                          name=f"fibrl-docker-{name}")

    def _begin(self) -> None:
        self._follower.start()

    @property
    def id(self) -> str:
        return self._id

    # The follower: relay output until the container stops (or the engine, restarting,
    # ends the stream: with live-restore the container runs on, its output no longer
    # relayed), then collect its end.
    def _follow(self, stream: Any) -> None:
        try:
            _relay(stream)
        except Exception as exc:  # a broken stream must not hide the exit code
            log.debug("output stream of %s ended: %s", self.name, exc)
        finally:
            _close_quietly(stream)
        self._collect_end()

    def _send_pending_signal(self) -> None:
        sig, self._pending_signal = self._pending_signal, None
        if sig is not None:
            try:
                self._signal(sig)
            except BackendError as exc:   # the end is collected all the same
                log.warning("%s", exc)

    def _collect_end(self) -> None:
        import requests   # (with the SDK: this module imports without it)

        deadline = time.monotonic() + self._engine_wait
        while True:
            try:
                self._send_pending_signal()
                status = self._api.wait(self._id)["StatusCode"]
                if status != 0:   # why it failed (OOMKilled, an engine error): one more call
                    self._state = self._api.inspect_container(self._id)["State"]
                break
            except sdk_errors() as exc:
                # dockerd restarting: its answer comes once it is back (the container
                # ran on with live-restore, or was stopped with the engine)
                if engine_down(exc) and wait_for_engine(self._api, deadline):
                    continue
                if isinstance(exc, requests.exceptions.ReadTimeout):
                    continue   # it runs on (its stream ended with a live-restored engine)
                status = 255
                self._state = {"Error": f"lost track of the container: {exc}"}
                break
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
        except sdk_errors():
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
        except sdk_errors() as exc:  # 404 gone, 409 not running: nothing to stop
            if engine_down(exc):     # dockerd restarting: the follower sends it once back
                self._pending_signal = sig
                log.debug("%s for container %s waits for the engine: %s", sig, self.name, exc)
                return
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
        except sdk_errors() as exc:
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
        with self._lock, _removing:
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
