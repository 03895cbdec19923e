"""The local backend's fork server: a pre-imported interpreter that forks jobs.

Starting a fresh interpreter and importing a job's modules costs most of its
start time. The zygote pays it once: it is spawned (never forked) by the
parent, imports the modules a job spec names in its ``preload`` (they must
start no thread and no socket at import: nng, for one, cannot survive a fork
once started), and then forks one child per request. A child runs its
``python -m module args...`` command with ``runpy``, as the interpreter would.
It knows nothing of what the module does. Modules a spec names in its ``defer``
get a stand-in while the preload runs: a preloaded module that imports one but
uses it only on demand holds the stand-in, which imports the real module the
first time an attribute of it is read, so a child that never needs it neither
carries nor shares its pages.

Protocol with the parent (private to the two processes): requests are
datagrams on a unix SOCK_SEQPACKET socket carrying the parent's current
stdout and stderr descriptors (so a job prints where the parent prints
*now*, as a spawned child would); replies are JSON lines on a pipe::

    parent -> zygote   {"id": n, "module": m, "argv": [...], "preload": [...],
                        "defer": [...], "env": {...}, "cwd": "..."} + fds 1, 2
    zygote -> parent   {"id": n, "pid": p} | {"id": n, "error": "..."}
    zygote -> parent   {"exit": p, "code": c}          (c < 0: killed by signal -c)

The zygote is single-threaded (threads and fork do not mix): one ``select``
waits on the request pipe and on SIGCHLD through a wakeup fd. It exits when
the parent closes the request pipe; its children notice the parent's loss on
their own connections and exit too.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from typing import Callable

from fibrl.wire.deferred import deferring


def _preload(modules, defer=()) -> None:
    """Import ``modules`` here, once, so every child forked later has them, with the
    top-level modules of ``defer`` standing in until first used."""
    missing = [name for name in modules if name not in sys.modules]
    if not missing:
        return   # (every request after the first: nothing to import, nothing to defer)
    with deferring(defer):
        for name in missing:
            importlib.import_module(name)


def _child(request: dict, stdio: list, keep_fds: tuple) -> None:
    gc.enable()   # the zygote runs without (see main); its objects stay frozen here
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)   # as a spawned child's
    for fd in keep_fds:
        os.close(fd)
    for target, fd in zip((1, 2), stdio):
        os.dup2(fd, target)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("cwd"):
        os.chdir(request["cwd"])
    def body() -> int:
        # As `python -m`: the module runs as __main__ only, not also under its own name.
        sys.modules.pop(request["module"], None)
        sys.argv = [request["module"], *request["argv"]]  # runpy sets argv[0] to its path
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return 0

    run_and_end(body)


def end_process(code: object) -> None:
    """End this process as a forked multiprocessing child ends: the ``atexit``
    handlers (fibrl's own cleanups among them), the standard streams flushed, then
    ``os._exit``, without the interpreter's teardown of every module and object,
    which costs a worker tens of milliseconds of CPU that a pool closing many
    workers at once pays on every core."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        # A program may close sys.stdout or set it to None; as with the stdlib, that
        # is no failure of the process (and an exception here would skip os._exit).
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, ValueError, OSError):
                pass
        os._exit(code if isinstance(code, int) else 1)


def run_and_end(body: Callable[[], object]) -> None:
    """Run ``body``, a process's main code, then end the process (:func:`end_process`)
    with the exit code it returned or raised; an uncaught exception prints its
    traceback and gives 1. Never returns."""
    code: object = 1
    try:
        code = body()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        end_process(code)


def _reap(out) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _write(out, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _write(out, message: dict) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def serve(requests_fd: int, replies_fd: int) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    requests = socket.socket(fileno=requests_fd)
    out = os.fdopen(replies_fd, "w")
    sel = selectors.DefaultSelector()
    sel.register(requests, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj == wake_r:
                    os.read(wake_r, 4096)
                    _reap(out)
                    continue
                data, fds, _, _ = socket.recv_fds(requests, 1 << 20, 2)
                if not data:
                    return  # the parent is gone
                _fork(json.loads(data), fds, out, (requests_fd, replies_fd, wake_r, wake_w))
    except BrokenPipeError:
        # The parent went away while we answered it: nothing is left to do, and a
        # normal exit would only print the same error again when it flushes ``out``.
        os._exit(0)


def _fork(request: dict, stdio: list, out, fds: tuple) -> None:
    try:
        _preload(request.get("preload", ()), request.get("defer", ()))
        gc.freeze()   # see main()
        pid = os.fork()
    except Exception as exc:  # a module that does not import, or no fork
        _write(out, {"id": request["id"], "error": f"{type(exc).__name__}: {exc}"})
        pid = -1
    if pid == 0:
        _child(request, stdio, fds)
    for fd in stdio:
        os.close(fd)
    if pid > 0:
        _write(out, {"id": request["id"], "pid": pid})


def main() -> None:
    # Ctrl-C reaches the whole foreground group, this server included: it is no job and
    # ends when its parent closes the request pipe, so it neither dies of it nor prints a
    # traceback (its children get Python's handler back, see _child).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # What the zygote imported stays shared with its children only while no one writes
    # to it: no collection in the zygote leaves holes for new objects to fill, and
    # gc.freeze() before each fork keeps the children's collections off those objects.
    gc.disable()
    _preload(sys.argv[4:], [name for name in sys.argv[3].split(",") if name])
    requests_fd, replies_fd = int(sys.argv[1]), int(sys.argv[2])
    serve(requests_fd, replies_fd)


if __name__ == "__main__":
    main()
