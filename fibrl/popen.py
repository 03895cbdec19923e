"""One Popen over every backend: start a worker, hand it its process, watch it.

Owns the parent's side of a worker's life. Data flow::

    Process.start()
      -> Popen(process_obj, config)
           pickles the process (spawn rules: AuthenticationString allowed)
           hosts a _Handover service on this process's hub
           backend.create_job(JobSpec(python -m fibrl.bootstrap <hub address> <oid>))
           watcher thread: job.wait() -> returncode, closes the sentinel's write end
      worker (fibrl.bootstrap) connects, authenticates, calls _Handover.payload
      (then, if it cannot unpickle that, _Handover.by_value; if it still cannot,
      _Handover.load_failed, which logs the worker's error here), runs the
      process and exits; the backend reports the exit code.

It has the surface of ``multiprocessing``'s Popen objects: ``pid``,
``sentinel``, ``returncode``, ``poll``, ``wait``, ``terminate``, ``kill``,
``close``. The backend owns how jobs run; ``bootstrap`` owns the worker side.
"""
from __future__ import annotations

import copy
import logging
import os
import sys
import threading
import time
import weakref
from multiprocessing import context as mp_context
from multiprocessing import spawn as mp_spawn
from typing import Any, Optional

from .hosting import runtime
from .wire import serialization
from .wire.deferred import TRANSPORT_DEFERRABLE
from .backends import Job, JobSpec
from .backends.base import LABEL_ROLE, job_labels, run_id
from .config import Config
from .errors import BackendError
from .hosting.hub import ReplySink, Service, get_hub
from .wire.messages import MAIN_SOURCE, MISSING_MAIN_GUARD, WorkerStart

__all__ = ["Popen", "WorkerStart", "run_id"]

log = logging.getLogger(__name__)

class _Handover(Service):
    """Gives the pickled process to the worker that connects for it, once; sends it
    again by value when the worker cannot load it by reference; hears why a worker
    could not load it at all."""

    def __init__(self, popen: "Popen", start: WorkerStart, process_obj: Any) -> None:
        self._popen = popen
        self._start: Optional[WorkerStart] = start
        # Kept until the worker has loaded it, as it is now: start() drops the target
        # and arguments from the process object once its Popen exists.
        self._process: Any = copy.copy(process_obj)
        self._peer = None   # the worker's connection, once it took the payload

    def op_payload(self, reply: ReplySink, pid: Optional[int] = None) -> None:
        start, self._start = self._start, None
        if start is None:
            raise BackendError("this worker's process object was already handed over")
        self._peer = getattr(reply, "peer", None)   # the worker's connection to this hub
        self._popen._connected(pid)
        reply(start)

    def peer_lost(self, peer) -> None:
        # A worker exits when its connection to the parent ends; if its backend then
        # reports no exit (a node that went down with it), Popen ends the job itself.
        if peer is not None and peer is self._peer:
            self._popen._connection_lost()

    def op_by_value(self, reply: ReplySink) -> None:
        # A function of the main script that the worker's __mp_main__ lacks (defined
        # under `if __name__ == "__main__":`, or the script is not visible there):
        # cloudpickle sends __main__'s functions and classes by value.
        process_obj, self._process = self._process, None
        if process_obj is None:
            raise BackendError("this worker's process object was already sent by value")
        reply(self._popen._pickle(process_obj, by_value=True))

    def op_loaded(self, reply: ReplySink) -> None:
        self._process = None
        reply(None)

    def op_load_failed(self, reply: ReplySink, error: str, kind: str = "") -> None:
        self._process = None
        self._popen._load_failed(error, kind)
        reply(None)


class Popen:
    """Starts ``process_obj`` as a job of the configured backend."""

    method = "fibrl"

    def __init__(self, process_obj: Any, config: Config) -> None:
        self.returncode: Optional[int] = None
        self.missing_main_guard = False   # the worker said: the main script has no guard
        self.load_error = ""   # the worker said: it could not load its process (summary)
        self.config = config
        self._done = threading.Event()
        self._closed = False
        self._stopped = False    # terminate()/kill() asked for the end
        self._backend = runtime.backend(config)
        if config.backend == "kubernetes":
            _say_if_code_is_not_in_image(config)
        self._spec_name = process_obj.name
        hub = get_hub()
        start = WorkerStart(self._pickle(process_obj), config,
                            _preparation(process_obj, config.backend != "local"), hub.address)
        self._oid = hub.register(_Handover(self, start, process_obj))
        self._read_fd, self._write_fd = os.pipe()
        self.sentinel = self._read_fd
        # The sentinel stays open after the job ends (join() may be followed by a wait
        # on it) and is closed by close() or, as the stdlib's Popen does, when this
        # object is collected: a Process started and joined without close() leaks nothing.
        self._close_sentinel = weakref.finalize(self, os.close, self._read_fd)
        # Not at interpreter exit: a watcher thread may still write its byte then.
        self._close_sentinel.atexit = False
        self._started = threading.Event()
        self.pid: Optional[int] = None
        self._job: Optional[Job] = None   # None only while create_job runs
        self._deadline: Optional[list] = None
        self._silence: Optional[list] = None   # armed when the worker's connection ends
        try:
            self._job_spec = self._spec(process_obj, hub.address)
            self._job = self._backend.create_job(self._job_spec)
        except BaseException:
            self._release()
            self._close_sentinel()
            os.close(self._write_fd)
            raise
        log.debug("%s started as %s job %s", process_obj.name, self._backend.name,
                  self._job.id)
        if self._job.pid is not None:
            self.pid = self._job.pid
        self._job.when_running(self._arm_start_deadline)
        watcher = threading.Thread(target=self._watch, daemon=True,
                                   name=f"fibrl-watch-{process_obj.name}")
        _watching(watcher)
        watcher.start()

    def _pickle(self, process_obj: Any, by_value: bool = False) -> bytes:
        # lets the authkey travel, as spawn does; typeshed admits only the stdlib's Popen
        # classes, though any object with duplicate_for_child serves
        mp_context.set_spawning_popen(self)  # type: ignore[arg-type]
        try:
            return serialization.dumps(process_obj, spawning=True, by_value=by_value)
        finally:
            mp_context.set_spawning_popen(None)

    def duplicate_for_child(self, fd: int) -> int:
        # Called by multiprocessing objects pickled under set_spawning_popen.
        raise BackendError(
            "a multiprocessing object that holds a file descriptor (a stdlib Queue, Pipe "
            "or Lock) was passed to a fibrl process; use fibrl.Queue / fibrl.Pipe / "
            "fibrl.Lock instead, which work across machines.")

    def _spec(self, process_obj: Any, address: str) -> JobSpec:
        config = self.config
        meta = getattr(process_obj, "_fibrl_meta", None) or {}
        python = self._backend.python()
        return JobSpec(
            command=(python, "-m", "fibrl.bootstrap", address, self._oid),
            image=config.image,
            env={"FIBRL_SECRET": bytes(process_obj.authkey).hex(), "FIBRL_RUN_ID": run_id()},
            cpu=meta.get("cpu", config.cpu), memory=meta.get("memory", config.memory),
            gpu=meta.get("gpu", config.gpu),
            labels=job_labels(getattr(process_obj, "_fibrl_role", "process")),
            name=process_obj.name, workdir=os.getcwd(),
            probe=(python, "-c", "import fibrl.bootstrap"), preload=WORKER_PRELOAD,
            defer=WORKER_DEFER, code_dirs=_main_dirs())

    def _connected(self, pid: Optional[int]) -> None:
        log.debug("job %s connected back (pid %s)", getattr(self._job, "id", "?"), pid)
        self._started.set()
        if self.pid is None:
            self.pid = pid
        self._backend_timers_cancel()

    def _backend_timers_cancel(self) -> None:
        for timer in (self._deadline, self._silence):
            if timer is not None:
                get_hub().timers.cancel(timer)

    def _connection_lost(self) -> None:
        grace = self._backend.silent_exit_s
        if grace is None or self._done.is_set() or self._stopped:
            return
        self._silence = get_hub().timers.call_at(time.monotonic() + grace, self._no_exit_report,
                                                 blocking=True)   # kill() may call an API

    def _no_exit_report(self) -> None:
        """The worker's connection ended ``silent_exit_s`` ago and its backend has said
        nothing since: its machine or node went with it (a kubelet that stopped reports
        no exit, and the pod would show Running for minutes). End the job, so that
        join() returns, with SIGKILL's exit code."""
        if self._done.is_set() or self._stopped or self._job is None:
            return
        log.warning("worker %s (%s): its connection to this process ended %.0f s ago and the "
                    "%s backend has reported no exit since; its machine or node is likely gone "
                    "or cut off. Ending it (exit code -9).", self._job.id, self._spec_name,
                    self._backend.silent_exit_s, self._backend.name)
        self._stopped = True
        self._job.kill()

    def _arm_start_deadline(self) -> None:
        # From when the job runs: a pod still waiting for a node is its backend's to
        # report with the scheduler's reason, not a worker that failed to connect.
        if not (self._started.is_set() or self._done.is_set()):
            self._deadline = get_hub().timers.call_at(
                time.monotonic() + self.config.start_timeout, self._start_timed_out,
                blocking=True)  # reads the backend's logs and kills the job

    def _start_timed_out(self) -> None:
        if self._started.is_set() or self._done.is_set() or self._job is None:
            return
        log.error("worker %s did not connect back within %.0f s (start_timeout); killing it. "
                  "Backend logs:\n%s", self._job.id, self.config.start_timeout,
                  self._job.logs()[-4000:])
        self._job.kill()

    @property
    def _created_job(self) -> Job:
        """The backend's job, for what runs once ``__init__`` returned (the watcher,
        terminate, kill): only the hub's calls to the handover may come before."""
        assert self._job is not None, "the job of this Popen was not created"
        return self._job

    def _watch(self) -> None:
        job = self._created_job
        code = job.wait()
        code = code if code is not None else 1
        log.debug("job %s ended with exit code %s", job.id, code)
        if code != 0 and not self._started.is_set() and not self._stopped:
            self._explain_early_exit(code)   # not when we ended it (a pool's terminate)
        self.returncode = code
        self._release()
        # A byte, not only EOF: a process forked meanwhile (a "fork" multiprocessing
        # pool, say) holds a copy of the write end, and EOF would never come.
        os.write(self._write_fd, b"x")
        os.close(self._write_fd)
        self._done.set()
        job.remove()

    def _load_failed(self, error: str, kind: str) -> None:
        # The worker exits with code 1 right after telling us; its error is logged here,
        # where the user looks, whatever the backend keeps of its output.
        if kind == MISSING_MAIN_GUARD:
            self.missing_main_guard = True   # read by a pool: it stops starting workers
            _log_missing_guard_once(error)
            return
        summary = _error_summary(error)
        hint = self._import_hint(summary)
        self.load_error = f"{summary}. {hint}" if hint else summary   # read by a pool
        repeat = False
        if self._job_spec.labels.get(LABEL_ROLE) == "pool-worker":
            # a pool's workers failing alike: the traceback once, the others at debug level
            said = (self._spec_name.rsplit("-worker-", 1)[0], summary)
            with _guard_lock:
                repeat = said in _load_errors_said
                _load_errors_said.add(said)
        worker = getattr(self._job, "id", None) or self.pid
        if repeat:
            log.debug("worker %s (%s) could not load its process either (%s); it exits with "
                      "code 1", worker, self._spec_name, summary)
            return
        log.error("worker %s (%s) could not load its process and exits with code 1:\n%s%s",
                  worker, self._spec_name, error, f"\n{hint}" if hint else "")

    def _import_hint(self, summary: str) -> str:
        if "ImportError" not in summary and "ModuleNotFoundError" not in summary:
            return ""
        try:
            return self._backend.import_hint(self._job_spec)   # _job may not be set yet
        except Exception:   # a hint only: the error itself is what matters
            return ""

    def _explain_early_exit(self, code: int) -> None:
        from .errors import describe_exitcode

        job = self._created_job
        reason = job.failure_reason()
        output = job.logs()[-4000:]
        # Many pool workers failing alike (a parent out of descriptors, a broken image)
        # are told in full once; the others at debug level.
        last = next((line for line in reversed(output.splitlines()) if line.strip()), "")
        repeat = False
        if job.spec.labels.get(LABEL_ROLE) == "pool-worker":
            with _guard_lock:
                repeat = (code, reason, last) in _early_exits_said
                _early_exits_said.add((code, reason, last))
        log.log(
            logging.DEBUG if repeat else logging.ERROR,
            "worker %s (%s) ended before it connected back to this process: %s%s. Likely "
            "cause: its interpreter could not import fibrl or reach %s. Its output:\n%s%s",
            job.id, job.spec.name, describe_exitcode(code),
            f" ({reason})" if reason else "", get_hub().address,
            output or "(none kept by the backend)",
            "" if repeat else "\n(Other workers that end the same way are logged at debug "
            "level.)")

    def _release(self) -> None:
        hub = get_hub()
        hub.unregister(self._oid)
        self._backend_timers_cancel()

    # -- the multiprocessing Popen surface ----------------------------------------
    def poll(self, flag: int = os.WNOHANG) -> Optional[int]:
        if flag == 0:
            return self.wait()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._done.wait(timeout)
        return self.returncode

    def terminate(self) -> None:
        if self.returncode is None:
            self._stopped = True
            self._created_job.terminate()

    def kill(self) -> None:
        if self.returncode is None:
            self._stopped = True
            self._created_job.kill()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close_sentinel()

    @property
    def job(self):
        """The backend's :class:`~fibrl.backends.Job` of this worker."""
        return self._job

    @property
    def backend(self):
        """The :class:`~fibrl.backends.Backend` that runs this worker."""
        return self._backend


_images_checked: set = set()


def _say_if_code_is_not_in_image(config: Config) -> None:
    """Warn once per image, before any pod starts, when the program imports modules of
    its own that the worker image cannot hold: the stock image has only fibrl."""
    with _guard_lock:
        if config.image in _images_checked:
            return
        _images_checked.add(config.image)
    message = code_not_in_image(config)
    if message:
        log.warning("%s", message)


def code_not_in_image(config: Config) -> Optional[str]:
    """Why the kubernetes workers of ``config`` will not find this program's modules,
    or None: the parent runs in a pod (``fibrl run``: workers share its image), or
    the image is one the user chose, or the program imports no module of its own."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") or config.image != _STOCK_IMAGE:
        return None
    mine = _own_modules()
    if not mine:
        return None
    shown = ", ".join(sorted(mine)[:5]) + (", ..." if len(mine) > 5 else "")
    return (f"kubernetes workers run the image {config.image}, which holds fibrl but not "
            f"this program's code: the modules it imports from "
            f"{', '.join(sorted(set(mine.values())))} ({shown}) will be missing in the pods, "
            f"and a worker whose target or arguments need them fails with ModuleNotFoundError "
            f"(functions of the main script itself travel with it). Fix: launch the program "
            f"with `fibrl run --build -- python {_script_name()}` (it builds this directory "
            f"into the image the parent and workers run), or build an image holding your code "
            f"and pass it as image= (fibrl.init(image=...) or FIBRL_IMAGE).")


_STOCK_IMAGE = Config.__dataclass_fields__["image"].default


def _own_modules() -> dict:
    """``{module name: folder}`` for imported modules that live in the working
    directory or the main script's folder (fibrl itself aside)."""
    roots = {os.path.abspath(os.getcwd()), *_main_dirs()}
    found = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name == "__main__" or name.split(".")[0] in ("fibrl", "__mp_main__"):
            continue
        path = os.path.abspath(path)
        for root in roots:
            if path.startswith(root + os.sep) and "site-packages" not in path:
                found[name.split(".")[0]] = root
    return found


def _script_name() -> str:
    main = sys.modules.get("__main__")
    spec, path = getattr(main, "__spec__", None), getattr(main, "__file__", None)
    if spec is not None:
        return "-m " + spec.name.removesuffix(".__main__")
    if not path:
        return "your_script.py"
    path = os.path.abspath(path)
    inside = path.startswith(os.path.abspath(os.getcwd()) + os.sep)
    return os.path.relpath(path) if inside else path


_guard_lock = threading.Lock()
_guard_said = False


_early_exits_said: set = set()   # (exit code, reason, last output line) logged in full
_load_errors_said: set = set()   # (pool, error summary) whose traceback was logged


def _error_summary(error: str) -> str:
    """A worker's traceback in one line: its exception and the line that raised it."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if not lines:
        return "(no error text)"
    frames = [line for line in lines if line.startswith('File "')]
    return f"{lines[-1]} ({frames[-1]})" if frames else lines[-1]


def _log_missing_guard_once(error: str) -> None:
    """Every worker of a script without the guard fails the same way: say it once."""
    global _guard_said
    with _guard_lock:
        said, _guard_said = _guard_said, True
    if not said:
        log.error("%s", error)


# What a worker imports before it connects, and what a pool worker or a process with a
# Queue imports after (a fork server imports it once, and its children share those pages
# instead of each building them again: about 6 MB less private memory per pool worker;
# importing transport loads pynng but starts no nng thread, and none of these starts a
# thread or opens a socket, so forking afterwards is safe). Not bootstrap itself: it
# runs as __main__, as with `python -m`.
WORKER_PRELOAD = ("fibrl.hosting.hub", "fibrl.wire.messages", "fibrl.wire.transport",
                  "fibrl.pool.worker", "fibrl.queues", "multiprocessing.spawn")
# What the transport imports and fibrl does not use (asyncio, and with it ssl and
# OpenSSL): a worker forked from the fork server imports it only if its own code does.
WORKER_DEFER = TRANSPORT_DEFERRABLE

def _preparation(process_obj: Any, elsewhere: bool) -> dict:
    """What spawn needs to rebuild this process's state in the worker.

    ``elsewhere``: the worker runs in a container or pod, which may not see the
    main script (only the working directory is mounted, or not even that). Its
    source then travels along, so that functions and classes defined in the
    script can be unpickled there as with spawn (see ``bootstrap._visible_main``).
    """
    data = mp_spawn.get_preparation_data(process_obj._name)
    data.pop("start_method", None)  # the stdlib's own start method is not ours to change
    # Never sent: the worker proved it knows the key, and sets it from what it holds.
    del data["authkey"]
    path = data.get("init_main_from_path")
    if path and (sys.flags.interactive or not os.path.isfile(path)):
        del data["init_main_from_path"]
    elif path and elsewhere:
        source = _main_source(os.path.abspath(path))
        if source is not None:
            data[MAIN_SOURCE] = source
    return data


# Watcher threads still running. A watcher goes on after its process ended (it
# removes the job: a container, a pod delete over HTTP), and a daemon thread that
# wakes from a socket call while the interpreter finalizes aborts the process, so
# the exit sequence waits for them once the children have ended.
_watchers: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_WATCHERS_AT_EXIT = 10.0   # seconds, for all of them together


_watchers_joined_at_exit = False


def _watching(thread: threading.Thread) -> None:
    global _watchers_joined_at_exit
    if not _watchers_joined_at_exit:   # once: the join sees every watcher
        _watchers_joined_at_exit = True
        runtime.at_exit(runtime.CHILDREN, _join_watchers)
    _watchers.add(thread)


def _join_watchers() -> None:
    deadline = time.monotonic() + _WATCHERS_AT_EXIT
    for thread in list(_watchers):
        thread.join(max(0.0, deadline - time.monotonic()))


def _main_dirs() -> tuple:
    """The main script's folder, which spawn puts first on a worker's ``sys.path``."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if (not path or sys.flags.interactive or not os.path.isfile(path)
            or getattr(main, "__spec__", None) is not None):
        return ()   # `python -m module` puts the working directory first, not its folder
    folder = os.path.dirname(os.path.abspath(path))
    installed = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if any(folder == p or folder.startswith(p + os.sep) for p in installed):
        return ()   # an installed launcher's folder: the image has its own
    return (folder,)


_MAIN_SOURCE_LIMIT = 1 << 20


def _main_source(path: str) -> Optional[bytes]:
    try:
        if os.path.getsize(path) > _MAIN_SOURCE_LIMIT:
            return None  # not a script one writes by hand: it must be in the image
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None
