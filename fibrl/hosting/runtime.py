"""This process's runtime state, owned in one bottom-layer place.

Owns three facts that every layer needs and no layer above may be asked for:

- the **config in force**: resolved lazily from ``FIBRL_*`` variables, a
  ``.fibrlconfig`` file and defaults, replaced by ``fibrl.init(**kw)`` or, in
  a worker, by the parent's config. ``context.DefaultContext`` delegates here.
- the **hub slot**: which hub is this process's (``installed_hub`` /
  ``install_hub``). Building a hub is the hosting layer's business
  (``hub.get_hub`` builds one with ``Hub.from_config`` when the slot is empty);
  this module only keeps it, hands it config changes that it reads while it
  runs (heartbeat timings, transport settings), and closes it at exit.
- the **exit sequence**, as one ordered table::

      CHILDREN     multiprocessing's own exit function: its finalizers of
                   priority >= 0 (a manager's shutdown), then end daemonic
                   children and join the others, which may still use our hub
      CONNECTIONS  dedicated connections and extra hubs (manager lines)
      BACKENDS     what backends clean up once children ended (containers
                   that ended, a kubernetes watch): ``close_at_exit`` of every
                   backend obtained through :func:`backend`
      HUB          the hub: flush the janitor, stop it, close the hub, join the
                   janitor; nothing of ours is inside nng when nng exits

  Steps register with :func:`at_exit`; one ``atexit`` handler, registered
  after pynng's (so it runs first), runs the table in order, each step's
  callbacks in the order they were added. A failing callback is logged and
  the sequence goes on.

It imports nothing from fibrl but ``config`` and ``janitor``, ``backends``
when a backend is first asked for, and ``transport`` when the exit handler is
first registered (so that pynng's own handler comes first and runs last): all
below it. It does not own the hub's behaviour (``hub``), the
factories (``context``) nor how a worker adopts its parent's state
(``bootstrap``).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import janitor
from ..config import Config, resolve

if TYPE_CHECKING:
    from ..backends.base import Backend

__all__ = ["current_config", "install_config", "reset_config", "config_is_set",
           "installed_hub", "install_hub", "at_exit", "backend", "CHILDREN", "CONNECTIONS",
           "BACKENDS", "HUB"]

log = logging.getLogger(__name__)

# -- the config in force -------------------------------------------------------------

_config: Optional[Config] = None
_explicit = False   # set by init()/set_start_method or adopted from a parent
_config_lock = threading.Lock()


def current_config() -> Config:
    """The config in force in this process (resolved on first use)."""
    global _config
    config = _config
    if config is None:
        with _config_lock:
            if _config is None:
                _config = _apply_debug(resolve())
            config = _config
    return config


def install_config(config: Config) -> Config:
    """Put ``config`` in force (``fibrl.init``, or a worker adopting its parent's)."""
    global _config, _explicit
    config = _apply_debug(config)
    with _config_lock:
        _config, _explicit = config, True
    hub = installed_hub()
    if hub is not None:
        hub.use_config(config)   # its timings and the transport settings of what it opens
    return config


def reset_config() -> None:
    """Forget the config in force: the next use resolves it again (``set_start_method(None,
    force=True)``)."""
    global _config, _explicit
    with _config_lock:
        _config, _explicit = None, False


def config_is_set() -> tuple[bool, bool]:
    """``(resolved, explicit)``: whether a config is in force yet, and whether it was set
    on purpose (``init``, a start method, a parent) rather than resolved by default."""
    return _config is not None, _explicit


def _apply_debug(config: Config) -> Config:
    """``debug=True``: fibrl's own log records at DEBUG and above go to stderr.

    Applied when a config comes into force (never at import); workers adopt
    their parent's config, so they log the same way.
    """
    logger = logging.getLogger("fibrl")
    handlers = [h for h in logger.handlers if getattr(h, "fibrl_debug", False)]
    if config.debug and not handlers:
        handler = logging.StreamHandler()
        handler.fibrl_debug = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(
            "[%(levelname)s/%(processName)s/%(process)d] %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    elif not config.debug and handlers:
        for old in handlers:
            logger.removeHandler(old)
        logger.setLevel(logging.NOTSET)
    return config


# -- the hub slot --------------------------------------------------------------------

_hub: Any = None        # a fibrl.hosting.hub.Hub; typed loosely: this layer does not import it
hub_lock = threading.Lock()   # held while a hub is built and installed


def installed_hub() -> Any:
    """This process's hub, or None when none was built here (a forked child has none)."""
    return _hub


def _forget_hub_in_child() -> None:
    # a forked child inherits the parent's hub object, not its threads or sockets
    global _hub
    _hub = None


os.register_at_fork(after_in_child=_forget_hub_in_child)


def install_hub(hub: Any) -> None:
    """Make ``hub`` this process's hub and close it at exit.

    Callers that build the hub on first use hold :data:`hub_lock` around the
    check and the install; a worker installs the one it built from its secret.
    """
    global _hub
    _register_exit()
    _hub = hub
    _listen_within_range(hub)


def _listen_within_range(hub: Any) -> None:
    """A hub that will listen on any port gets a free one of its backend's range instead
    (the kubernetes backend may have one: a NetworkPolicy admits only those). Its
    listener starts on first use, after this."""
    from ..backends import backend_class

    config = current_config()
    if hub.port:
        return
    cls: type[Backend] = backend_class(config.backend)
    if cls.listen_ports_of(config) is None:
        return
    hub.port = backend(config).listen_port(hub.host)


# -- the exit sequence -----------------------------------------------------------------

CHILDREN, CONNECTIONS, BACKENDS, HUB = "children", "connections", "backends", "hub"
_STEPS = (CHILDREN, CONNECTIONS, BACKENDS, HUB)
_exit_table: dict[str, list[Callable[[], Any]]] = {step: [] for step in _STEPS}
_exit_lock = threading.Lock()
_exit_registered = False


def at_exit(step: str, fn: Callable[[], Any]) -> None:
    """Run ``fn()`` at interpreter exit, in ``step`` of the exit sequence (see above)."""
    if step not in _exit_table:
        raise ValueError(f"unknown exit step {step!r}: the steps are {', '.join(_STEPS)}")
    _register_exit()
    with _exit_lock:
        _exit_table[step].append(fn)


def backend(config: Config) -> Any:
    """The backend for ``config`` (``backends.get_backend``), whose ``close_at_exit``
    joins the exit sequence (step BACKENDS) the first time it is used here."""
    from ..backends import get_backend

    found = get_backend(config)
    with _exit_lock:
        known = id(found) in _backends_seen   # backends live as long as the process
        _backends_seen.add(id(found))
    if not known:
        at_exit(BACKENDS, found.close_at_exit)
        _abandon_at_shutdown(found)
    return found


_backends_seen: set[int] = set()   # ids of the backends whose exit is arranged


def _abandon_at_shutdown(found: Any) -> None:
    """Call ``found.abandon_starts()`` as soon as the interpreter begins to exit.

    Pool workers start on the threads of a ``ThreadPoolExecutor``, which the
    interpreter joins before any ``atexit`` handler runs: after Ctrl-C during a start
    the program would wait that start out (an image probe, a pod being scheduled).
    A hook of ``threading``'s own shutdown registered after the executor's runs before
    its join (they run last registered first).
    """
    import concurrent.futures.thread  # noqa: F401  (its hook first, so ours runs before)

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return   # another interpreter: starts are waited out, as before
    try:
        register(lambda: found.abandon_starts())   # (looked up when the exit begins)
    except RuntimeError:
        pass     # the interpreter is exiting already


def _register_exit() -> None:
    global _exit_registered
    if _exit_registered:
        return
    with _exit_lock:
        if _exit_registered:
            return
        import atexit

        from ..wire import transport  # noqa: F401  (pynng registers its exit handler first)

        atexit.register(_run_exit_sequence)
        _exit_registered = True


def _run_exit_sequence() -> None:
    for step in _STEPS:
        with _exit_lock:
            callbacks = list(_exit_table[step])
        for fn in callbacks:
            try:
                fn()
            except Exception:  # one failing cleanup must not keep the others from running
                log.exception("exit step %s: %r failed", step, fn)
    if _ended_by_ctrl_c():
        _die_of_sigint()


def _ended_by_ctrl_c() -> bool:
    """The main script ended with an uncaught KeyboardInterrupt (Python's own error
    printing sets ``sys.last_type``; an interactive session sets it for any error)."""
    import sys

    last = getattr(sys, "last_type", None)
    interactive = sys.flags.interactive or hasattr(sys, "ps1")
    return not interactive and isinstance(last, type) and issubclass(last, KeyboardInterrupt)


def _die_of_sigint() -> None:
    """End as Python ends after an uncaught Ctrl-C: killed by SIGINT (exit status 130
    in a shell). CPython forgets that it should when any thread runs Python code it
    compiles or imports while the interpreter exits (a worker start still under way
    imports lazily), and then exits with status 1; this is its own last step, taken
    once fibrl's cleanups are done."""
    import signal
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass   # closed or replaced by the program
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def _end_children() -> None:
    # The stdlib offers no public way to run its exit sequence early; it must run
    # before the hub closes, because non-daemonic children may still call our hub.
    from multiprocessing import util

    util._exit_function()  # type: ignore[attr-defined]  # private: not in typeshed


def _close_hub() -> None:
    janitor.flush(5.0)  # cleanups of handles collected so far (pipe ends detach, ...)
    janitor.stop()  # what is queued after this is moot once the hub closes
    hub = installed_hub()
    if hub is not None:
        hub.close()  # also ends a remote call the janitor may be waiting on
    janitor.join(1.0)  # nothing of ours may still be inside nng when nng exits


_exit_table[CHILDREN].append(_end_children)
_exit_table[HUB].append(_close_hub)
