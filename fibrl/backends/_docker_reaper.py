"""Removes a docker parent's worker containers once that parent is gone, however it ended.

The docker backend starts one reaper per parent process, when it first uses the
engine. The reaper holds the read end of a pipe whose only write end the parent
holds (it is never inherited by spawned processes), so EOF on its stdin means
the parent exited: normally, by an exception, or SIGKILLed. Then it gives the
parent's workers a few seconds to exit by themselves (they see the connection
drop at once) and removes their containers, killing any still running::

    parent ──pipe (write end)──> reaper stdin: read() blocks ... EOF
    reaper: containers labelled fibrl.parent=<pid>, fibrl.pidns=<namespace>
            --> wait for each (one shared deadline) --> remove (force)

It forks once at start, so that it is nobody's child (a test's leak check, a
shell's job control) and survives its parent's process group being killed; its
output goes to /dev/null. After a normal exit the parent has removed its
containers itself, so the reaper finds none. A forked (not spawned) child of the
parent holds the write end too: the reaper then runs when the last of them exits.
What it cannot cover (the whole machine or container going down) is left to
``fibrl stop RUN --backend docker`` (``fibrl ps --backend docker`` lists runs).

Usage (private to :mod:`fibrl.backends.docker.reaper`), run by path and without ``site``
so that starting it costs milliseconds (the parent waits for the fork); ``site``,
fibrl and the docker SDK are loaded only once the parent is gone::

    python -S .../fibrl/backends/_docker_reaper.py PARENT_PID PID_NAMESPACE WAIT_SECONDS < pipe
"""
from __future__ import annotations

import os
import sys
from typing import Optional


def main(argv: Optional[list] = None) -> int:
    parent, namespace, wait = _arguments(sys.argv[1:] if argv is None else argv)
    if os.fork():
        os._exit(0)   # the spawning parent waits for this first process only
    os.setsid()
    sys.stdin.buffer.read()   # the parent never writes: this returns at EOF, when it is gone
    _reap(parent, namespace, wait)
    return 0


def _arguments(argv: list) -> tuple:
    if len(argv) != 3 or not argv[0].isdigit() or not argv[1]:
        raise SystemExit("usage: python -S _docker_reaper.py PARENT_PID "
                         "PID_NAMESPACE WAIT_SECONDS < pipe")
    return int(argv[0]), argv[1], float(argv[2])


def _reap(parent: int, namespace: str, wait: float) -> None:
    if sys.flags.no_site:   # started with -S: site-packages (the docker SDK) only now
        import site

        site.main()
    from fibrl.backends.base import LABEL_PARENT
    from fibrl.backends.docker import LABEL_PIDNS, connect, label_filters, remove_when_stopped

    filters = {"label": label_filters() + [f"{LABEL_PARENT}={parent}",
                                           f"{LABEL_PIDNS}={namespace}"]}
    try:
        client = connect(timeout=30, pool_size=2)
        containers = client.containers.list(all=True, filters=filters, ignore_removed=True)
        remove_when_stopped(containers, client, wait)
    except Exception:  # engine gone too: nothing this process can do
        return


if __name__ == "__main__":
    # Run by path, this directory comes first on sys.path, and its docker.py would
    # shadow the docker SDK.
    if os.path.dirname(os.path.abspath(__file__)) == os.path.abspath(sys.path[0] or "."):
        del sys.path[0]
    sys.exit(main())
