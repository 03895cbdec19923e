"""The worker entry point: ``python -m fibrl.bootstrap <parent address> <handover id>``.

Owns the worker's side of a start (see DESIGN.md, "How a worker starts"):
connect back to the parent's hub, prove knowledge of the run's secret (from
``FIBRL_SECRET``), receive the pickled process object with the parent's
config and what spawn needs to rebuild ``__main__``, run it, and exit with its
exit code. The worker also exits by itself when the parent goes away: the
connection drops, or heartbeats stop being answered for ``parent_timeout``.

It imports as little as possible before connecting: start latency matters.
"""
from __future__ import annotations

import os
import sys
import threading


def _parent_lost(reason: str) -> None:
    try:
        sys.stderr.write(f"fibrl worker {os.getpid()}: {reason}; exiting.\n")
        sys.stderr.flush()
    finally:
        os._exit(255)


def _heartbeat(client, interval: float, limit: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        handle = client.call("hub", "ping", ())
        if not handle.wait(limit) and not stop.is_set():
            _parent_lost(f"the parent did not answer a heartbeat within {limit:.0f} s")


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
    from .messages import MAIN_SOURCE

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
        sys.stderr.write(
            f"fibrl worker: could not rebuild __main__ from the parent's script {path} "
            f"({type(exc).__name__}: {exc}); functions and classes defined in it cannot be "
            f"used here. Move them into a module the worker can import.\n")


def _become(start, hub, client, exiting):
    """Adopt the parent's config and state; return the unpickled process object."""
    from multiprocessing import process as mp_process
    from multiprocessing import spawn as mp_spawn

    from . import runtime, serialization

    config = _own_listen_host(start.config)
    hub.host = config.listen_host   # before install: the hub has not listened yet
    hub.auth_timeout = config.auth_timeout
    runtime.install_config(config)  # also hands the hub the parent's heartbeat timings
    hub.tls = config.tls  # for what this worker hosts; its parent's address says its own
    threading.Thread(target=_heartbeat, daemon=True, name="fibrl-heartbeat",
                     args=(client, config.heartbeat_interval, config.parent_timeout,
                           exiting)).start()
    mp_process.current_process()._inheriting = True
    try:
        preparation, main = _visible_main(_keep_own_sys_path(start.preparation))
        mp_spawn.prepare(preparation)
        if main is not None:
            _main_from_source(*main)
        return serialization.loads(start.process)
    finally:
        del mp_process.current_process()._inheriting


def _take_secret() -> str:
    """The run's secret, from where the backend left it: a pipe (FIBRL_SECRET_FD, local
    workers), a 0400 file in a private mount (FIBRL_SECRET_FILE, docker) or the
    environment (a kubernetes Secret; the fork server). Each is dropped after use."""
    fd = os.environ.pop("FIBRL_SECRET_FD", "")
    if fd:
        with os.fdopen(int(fd), "rb") as pipe:
            return pipe.read().decode().strip()
    path = os.environ.pop("FIBRL_SECRET_FILE", "")
    if path:
        with open(path) as file:
            return file.read().strip()
    return os.environ.pop("FIBRL_SECRET", "")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.stderr.write("usage: python -m fibrl.bootstrap <parent address> <handover id>\n")
        return 2
    address, oid = argv[1], argv[2]
    secret_hex = _take_secret()
    if not secret_hex:
        sys.stderr.write("fibrl worker: FIBRL_SECRET is not set; refusing to start.\n")
        return 2

    from multiprocessing import process as mp_process

    from . import runtime
    from .config import Config
    from .hub import Hub

    secret = bytes.fromhex(secret_hex)
    mp_process.current_process().authkey = secret
    # built from defaults: the parent's config arrives over this hub's first connection
    hub = Hub.from_config(Config(), secret, host="127.0.0.1")
    runtime.install_hub(hub)
    client = hub.client(address)
    exiting = threading.Event()
    client.on_lost(lambda: exiting.is_set() or _parent_lost("lost the connection to the parent"))
    try:
        start = client.call(oid, "payload", (os.getpid(),)).get(Config().start_timeout)
        process_obj = _become(start, hub, client, exiting)
    except BaseException:
        exiting.set()  # a failed start is this worker's error, not a lost parent
        raise
    parent_r, parent_w = os.pipe()  # the parent "sentinel": closed only when we exit
    exitcode = process_obj._bootstrap(parent_sentinel=parent_r)
    exiting.set()
    hub.flush(10.0)
    return exitcode


if __name__ == "__main__":
    sys.exit(main(sys.argv))
