"""The local backend's fork server: a pre-imported interpreter that forks workers.

Starting a fresh interpreter and importing fibrl and pynng costs most of a
worker's start time. The zygote pays it once: it is spawned (never forked)
by the parent, imports what workers need *without* starting nng (nng cannot
survive a fork once started), and then forks one child per request. A child
runs ``fibrl.bootstrap.main`` exactly as ``python -m fibrl.bootstrap`` would.

Protocol with the parent (private to the two processes): requests are
datagrams on a unix SOCK_SEQPACKET socket carrying the parent's current
stdout and stderr descriptors (so a worker prints where the parent prints
*now*, as a spawned child would); replies are JSON lines on a pipe::

    parent -> zygote   {"id": n, "argv": [...], "env": {...}, "cwd": "..."} + fds 1, 2
    zygote -> parent   {"id": n, "pid": p} | {"id": n, "error": "..."}
    zygote -> parent   {"exit": p, "code": c}          (c < 0: killed by signal -c)

The zygote is single-threaded (threads and fork do not mix): one ``select``
waits on the request pipe and on SIGCHLD through a wakeup fd. It exits when
the parent closes the request pipe; its children notice the parent's loss on
their own connections and exit too.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys


def _preload() -> None:
    # Import what every worker imports, but create no socket: nng starts lazily.
    import fibrl.bootstrap  # noqa: F401
    import fibrl.hub  # noqa: F401
    import fibrl.popen  # noqa: F401
    import fibrl.transport  # noqa: F401


def _child(request: dict, stdio: list, keep_fds: tuple) -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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
    from fibrl import bootstrap

    code = 1
    try:
        code = bootstrap.main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


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


def _fork(request: dict, stdio: list, out, fds: tuple) -> None:
    try:
        pid = os.fork()
    except OSError as exc:
        _write(out, {"id": request["id"], "error": str(exc)})
        pid = -1
    if pid == 0:
        _child(request, stdio, fds)
    for fd in stdio:
        os.close(fd)
    if pid > 0:
        _write(out, {"id": request["id"], "pid": pid})


def main() -> None:
    _preload()
    requests_fd, replies_fd = int(sys.argv[1]), int(sys.argv[2])
    serve(requests_fd, replies_fd)


if __name__ == "__main__":
    main()
