"""The worker entry point: ``python -m fibrl.bootstrap <parent address> <handover id>``.

Owns the worker's side of a start (see DESIGN.md, "How a worker starts"):
connect back to the parent's hub, prove knowledge of the run's secret (from
``FIBRL_SECRET``), receive the pickled process object with the parent's
config and what spawn needs to rebuild ``__main__``, run it, and exit with its
exit code. A process that does not unpickle here by reference is asked for
again by value (cloudpickle: functions of the main script that this worker's
``__mp_main__`` lacks); one that cannot be rebuilt at all, or a main script
that starts processes at import (no main guard), is reported to the parent,
which logs it, and the worker exits with code 1. The worker also exits by itself
when the parent goes away: the connection drops, or heartbeats stop being answered
for ``parent_timeout``. As the main process of a docker container it first forks,
and the parent stays as the container's keeper until the worker's own local
children have ended (see ``_keep_container``).

It imports as little as possible before connecting: start latency matters.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional


# How long a worker whose parent is gone goes on: parent_process() already reports
# the parent dead, so code waiting on it (join, is_alive) gets to react, then the
# worker exits by itself, as no worker outlives its parent (DESIGN.md).
PARENT_LOST_GRACE = 3.0

_parent_sentinel_w: list = []   # write end of parent_process().sentinel, until lost


def _parent_lost(reason: str) -> None:
    while _parent_sentinel_w:
        try:
            os.close(_parent_sentinel_w.pop())   # parent_process().join() returns
        except OSError:
            pass
    ending = threading.Timer(PARENT_LOST_GRACE, os._exit, (255,))
    ending.daemon = True
    ending.start()
    try:
        sys.stderr.write(f"fibrl worker {os.getpid()}: {reason}; exiting within "
                         f"{PARENT_LOST_GRACE:.0f} s.\n")
        sys.stderr.flush()
    except (AttributeError, ValueError, OSError):
        pass   # the program closed its stderr


# A container ends when its main process does, and the kernel then kills every process
# left in it. A worker in a container that cannot reach the engine starts its own
# children beside it, in the container: killed with their parent, they could not see
# parent_process() end (join() returning, is_alive() False) as local ones do during
# their PARENT_LOST_GRACE. So the container's main process forks: the worker runs in
# the child, and this process stays, as a child subreaper, until the worker and the
# fibrl processes it left have ended (at most ORPHANS_WAIT after the worker).
ORPHANS_WAIT = PARENT_LOST_GRACE + 2.0
_PR_SET_CHILD_SUBREAPER = 36
_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def _is_container_main() -> bool:
    """The main process of a docker worker container: docker-init (``init=True``) is
    its parent. Not a local worker (its parent is fibrl's), which kill() must end alone."""
    if not os.path.exists("/.dockerenv") or os.getppid() != 1:
        return False
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return os.path.basename(f.read().split(b"\0")[0]) in (b"docker-init", b"tini")
    except OSError:
        return False


def _keep_container() -> int:
    """Fork the worker; in the parent, wait as described above and return 0 there
    (the caller then exits as the worker did, see ``_exit_as``); in the worker, -1."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        return -1   # no prctl: run in this process, as before
    worker = os.fork()
    if worker == 0:
        return -1
    import signal

    for name in _FORWARDED:
        signal.signal(getattr(signal, name), lambda sig, _frame: _send(worker, sig))
    _, status = os.waitpid(worker, 0)
    _wait_for_fibrl_orphans(time.monotonic() + ORPHANS_WAIT)
    _exit_as(status)
    return 0


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_for_fibrl_orphans(deadline: float) -> None:
    """Reap children (orphans reparented here) until no fibrl process is left among
    them or ``deadline`` passes; waits on their pidfds."""
    import select

    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return   # no child left
        left = _fibrl_children()
        remaining = deadline - time.monotonic()
        if not left or remaining <= 0:
            return
        fds = []
        try:
            for pid in left:
                try:
                    fds.append(os.pidfd_open(pid))
                except ProcessLookupError:
                    pass
            if fds:
                select.select(fds, [], [], remaining)
        finally:
            for fd in fds:
                os.close(fd)


def _fibrl_children() -> list:
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == me:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"fibrl" in f.read():
                        found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _exit_as(status: int) -> None:
    """End this process as the worker ended: its exit code, or its signal."""
    import signal

    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):
            pass   # SIGKILL, SIGSTOP: cannot be caught anyway
        os.kill(os.getpid(), -code)
        code = 128 - code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Heartbeat:
    """Pings the parent every ``interval`` seconds on the hub's timer thread (no thread
    of its own: an idle worker runs few); the parent is lost when a ping stays
    unanswered for ``limit`` seconds. The ping goes through the connection's feeder
    thread, so a send that waits (a large frame going out) never holds up the timers."""

    def __init__(self, timers, client, interval: float, limit: float,
                 stop: threading.Event) -> None:
        self._timers, self._client, self._stop = timers, client, stop
        self._interval, self._limit = interval, limit
        self._ping = None       # the ping in flight
        self._deadline = 0.0    # when it is late
        timers.call_at(time.monotonic() + interval, self._beat)

    def _beat(self) -> None:
        if self._stop.is_set():
            return
        now = time.monotonic()
        if self._ping is not None and not self._ping.ready():
            if now >= self._deadline:
                from .hosting.hub import silence_left

                left = silence_left(self._client.channel, self._limit)
                if left <= 0:
                    _parent_lost(f"the parent did not answer a heartbeat within "
                                 f"{self._limit:.0f} s")
                    return
                self._deadline = now + left
        else:
            self._ping = self._client.call("hub", "ping", (), inline=False)
            self._deadline = now + self._limit
        self._timers.call_at(min(now + self._interval, self._deadline), self._beat)


def _keep_own_sys_path(preparation: dict) -> dict:
    # spawn replaces sys.path with the parent's; a container's interpreter has its
    # standard library elsewhere, so its own entries follow the parent's.
    parent = preparation.get("sys_path")
    if parent is None:
        return preparation
    return dict(preparation, sys_path=list(parent) + [p for p in sys.path if p not in parent])


def _own_listen_host(config):
    # Where a process can be reached belongs to its own machine: a pod's
    # FIBRL_LISTEN_HOST (its pod IP, from the downward API) wins over the parent's.
    host = os.environ.get("FIBRL_LISTEN_HOST")
    return config.replace(listen_host=host) if host and host != config.listen_host else config


def _visible_main(preparation: dict) -> tuple:
    """``(preparation for spawn, (path, source) or None)``.

    The parent's main script may not exist here (a container or pod that does
    not mount it). Then it is rebuilt from the source the parent sent; without
    one (a launcher such as the ``pytest`` script, too big a file), as for an
    interactive parent, __main__ is not rebuilt.
    """
    from .wire.messages import MAIN_SOURCE

    preparation = dict(preparation)
    source = preparation.pop(MAIN_SOURCE, None)
    path = preparation.get("init_main_from_path")
    if path and not os.path.isfile(path):
        del preparation["init_main_from_path"]
        return preparation, ((path, source) if source is not None else None)
    return preparation, None


def _main_from_source(path: str, source: bytes) -> None:
    """What spawn's ``init_main_from_path`` does, from the parent's copy of the script:
    run it as ``__mp_main__`` (its ``if __name__ == "__main__"`` part stays out)."""
    import types

    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    try:
        exec(compile(source, path, "exec"), module.__dict__)
    except Exception as exc:
        sys.modules.pop("__mp_main__", None)
        if previous is not None:
            sys.modules["__main__"] = previous
        if _starts_at_import(exc):
            raise   # nothing works in this worker: the parent says why
        sys.stderr.write(
            f"fibrl worker: could not rebuild __main__ from the parent's script {path} "
            f"({type(exc).__name__}: {exc}); functions and classes defined in it cannot be "
            f"used here. Move them into a module the worker can import.\n")


def _become(start, hub, client, exiting, oid):
    """Adopt the parent's config and state; return the unpickled process object."""
    from multiprocessing import process as mp_process
    from multiprocessing import spawn as mp_spawn

    from .hosting import runtime

    config = _own_listen_host(start.config)
    hub.use_settings(config)   # before it listens: what this worker hosts obeys them too
    runtime.install_config(config)  # also hands the hub the parent's heartbeat timings
    _Heartbeat(hub.timers, client, config.heartbeat_interval, config.parent_timeout, exiting)
    mp_process.current_process()._inheriting = True
    try:
        preparation, main = _visible_main(_keep_own_sys_path(start.preparation))
        mp_spawn.prepare(preparation)
        if main is not None:
            _main_from_source(*main)
        process_obj = _load(start.process, client, oid, config.start_timeout)
        client.send(oid, "loaded", ())   # the parent drops the copy it kept for _load
        return process_obj
    finally:
        del mp_process.current_process()._inheriting


def _take_secret() -> str:
    """The run's secret, from where the backend left it: a pipe (FIBRL_SECRET_FD, local
    workers), stdin (FIBRL_SECRET_STDIN, docker: the parent writes one line through
    the engine's API, and nothing of it is on disk) or the environment (a kubernetes
    Secret; the fork server). Each is dropped after use."""
    fd = os.environ.pop("FIBRL_SECRET_FD", "")
    if fd:
        with os.fdopen(int(fd), "rb") as pipe:
            return pipe.read().decode().strip()
    if os.environ.pop("FIBRL_SECRET_STDIN", ""):
        # One line, written by the parent right after the start (a parent that fails
    # first removes the container; start_timeout ends a worker that waits on).
        return sys.stdin.buffer.readline(4096).decode().strip()
    return os.environ.pop("FIBRL_SECRET", "")


class _LoadError(Exception):
    """The process object cannot be rebuilt here, by reference nor by value."""


def _load(frame: bytes, client, oid: str, timeout: float):
    """Unpickle the process; if that fails, ask the parent for a copy by value
    (cloudpickle), which carries the main script's functions and classes along."""
    from .wire import serialization
    from .errors import SerializationError

    try:
        return serialization.loads(frame)
    except SerializationError as by_reference:
        try:
            frame = client.call(oid, "by_value", ()).get(timeout)
        except Exception:
            raise by_reference from by_reference.__cause__
        try:
            return serialization.loads(frame)
        except SerializationError as exc:
            raise _LoadError(_not_loadable(exc, by_reference)) from exc


def _not_loadable(exc: Exception, by_reference: Exception) -> str:
    def reason(error: Exception) -> str:
        cause = error.__cause__ or error
        return f"{type(cause).__name__}: {cause}"

    cause = exc.__cause__
    text = reason(exc)
    if reason(by_reference) != text:
        text = f"by reference: {reason(by_reference)}; by value: {text}"
    if isinstance(cause, AttributeError) and "__mp_main__" in str(cause):
        return (f"the process's target (or an argument) is a function or class of the "
                f"main script that the worker cannot find by name, and it could not be "
                f"sent by value either ({text}). It is probably defined inside "
                f"`if __name__ == \"__main__\":` or inside another function. Fix: move "
                f"the function to the module's top level.")
    return (f"cannot rebuild the process object in the worker, by reference nor by "
            f"value ({text}). The worker must be able to import every module the target "
            f"and its arguments use: check that they are on its sys.path (for a "
            f"container or pod: in its image, or under the mounted working directory).")


_GUARD_TEMPLATE = """the main script {path} starts processes when it is imported: it has \
no `if __name__ == "__main__":` guard. Each worker imports the main script to find its \
functions (as the stdlib's spawn does), so every worker would start processes again; \
they all fail instead. Fix: put the code that starts processes (and what it needs at \
run time only) under the guard, at the bottom of the script:

    if __name__ == "__main__":
        main()
"""


def _starts_at_import(exc: BaseException) -> bool:
    """multiprocessing.spawn._check_not_importing_main's RuntimeError: a process was
    started while this worker was still rebuilding its state (importing __main__),
    possibly behind another error (a Pool that could not start its workers)."""
    seen = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, RuntimeError) and "bootstrapping phase" in str(current):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _report_load_failure(client, oid: str, start, exc: BaseException) -> bool:
    """Tell the parent why this worker cannot run its process; True if it heard."""
    import traceback

    from .wire.messages import MISSING_MAIN_GUARD

    kind, text = "", "".join(traceback.format_exception(exc)).rstrip()
    if _starts_at_import(exc):
        path = start.preparation.get("init_main_from_path", "(the main script)")
        kind, text = MISSING_MAIN_GUARD, _GUARD_TEMPLATE.format(path=path)
    elif isinstance(exc, _LoadError):
        text = str(exc)
    try:
        client.call(oid, "load_failed", (text, kind)).get(10.0)
        return True
    except Exception:
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.stderr.write("usage: python -m fibrl.bootstrap <parent address> <handover id>\n")
        return 2
    address, oid = argv[1], argv[2]
    if _is_container_main() and _keep_container() == 0:
        return 0   # not reached: the keeper exits as its worker did
    secret_hex = _take_secret()
    if not secret_hex:
        sys.stderr.write("fibrl worker: FIBRL_SECRET is not set; refusing to start.\n")
        return 2

    from multiprocessing import process as mp_process

    from .wire.deferred import TRANSPORT_DEFERRABLE, deferring

    with deferring(TRANSPORT_DEFERRABLE):   # (no other thread runs yet)
        from .hosting import runtime
        from .config import Config
        from .hosting.hub import Hub
        from .wire.transport import WORKER_NNG_THREADS, set_nng_threads

    set_nng_threads(WORKER_NNG_THREADS)   # before the first socket: a light worker
    secret = bytes.fromhex(secret_hex)
    mp_process.current_process().authkey = secret
    # built from defaults: the parent's config arrives over this hub's first connection
    hub = Hub.from_config(Config(), secret, host="127.0.0.1")
    runtime.install_hub(hub)
    # parent_process().sentinel: readable once the parent is gone (see _parent_lost)
    parent_r, parent_w = os.pipe()
    _parent_sentinel_w.append(parent_w)
    client = hub.client(address)
    exiting = threading.Event()

    def on_lost() -> None:
        if not exiting.is_set():
            _parent_lost("lost the connection to the parent")

    client.on_lost(on_lost)
    start = None
    try:
        start = client.call(oid, "payload", (os.getpid(),)).get(Config().start_timeout)
        process_obj = _become(start, hub, client, exiting, oid)
    except BaseException as exc:
        exiting.set()  # a failed start is this worker's error, not a lost parent
        if (start is not None and isinstance(exc, Exception)
                and _report_load_failure(client, oid, start, exc)):
            return 1   # the parent logs the error, where the user looks
        raise
    exitcode = process_obj._bootstrap(parent_sentinel=parent_r)
    exiting.set()
    hub.flush(10.0)   # (what this process sent is processed before its parent sees it exit)
    return exitcode


if __name__ == "__main__":
    from .backends._zygote import run_and_end

    run_and_end(lambda: main(sys.argv))
