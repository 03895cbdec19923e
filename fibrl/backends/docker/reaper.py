"""Start, once per process, the detached reaper that removes this process's containers.

The reaper itself is ``fibrl/backends/_docker_reaper.py``, run by path as a
process of its own (not a child of this one): it waits on a pipe whose write
end only this process holds, and when it reads EOF (this process ended, even
SIGKILLed) it removes the containers labelled with this process as parent.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

from .housekeeping import pid_namespace

__all__ = ["start_reaper", "REAP_WAIT"]

log = logging.getLogger(__name__)

REAP_WAIT = 5.0       # seconds workers of a dead parent get to exit before removal
_reapers: dict = {}   # pid -> write end of the pipe its reaper waits on (one per process)
_reapers_lock = threading.Lock()


def start_reaper() -> None:
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
                        "find leftovers with `fibrl ps --backend docker` and remove them with "
                        "`fibrl stop RUN --backend docker`.", exc)
            return
        finally:
            os.close(read_end)
        _reapers[os.getpid()] = write_end


def _spawn_reaper(read_end: int) -> None:
    env = dict(os.environ)   # the reaper imports this fibrl, wherever it came from
    backends = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../fibrl/backends
    root = os.path.dirname(os.path.dirname(backends))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    script = os.path.join(backends, "_docker_reaper.py")
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
