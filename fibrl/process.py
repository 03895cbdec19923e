"""``fibrl.Process``: the stdlib's process object, started through a backend.

``multiprocessing.process.BaseProcess`` already implements the public surface
(``start``, ``join``, ``is_alive``, ``terminate``, ``kill``, ``close``,
``name``, ``daemon``, ``pid``, ``exitcode``, ``authkey``, ``sentinel``,
subclassing with ``run()``) on top of a Popen object, exactly as the running
Python defines it. This module only plugs fibrl's Popen in, the way a start
method does in the stdlib. ``current_process``, ``parent_process`` and
``active_children`` are the stdlib's: a fibrl worker *is* the unpickled
process object, as with spawn.
"""
from __future__ import annotations

from multiprocessing.process import (BaseProcess, active_children, current_process,
                                     parent_process)
from typing import Any, Optional

__all__ = ["Process", "current_process", "parent_process", "active_children"]


class Process(BaseProcess):
    """A process whose worker runs on the configured backend.

    Same signature as ``multiprocessing.Process``; keyword-only extras:

    Args:
        backend: run this process on another backend than the context's
            (``"local"``, ``"docker"``, ``"kubernetes"``).

    Example:
        >>> import fibrl
        >>> p = fibrl.Process(target=print, args=("hello",))
        >>> p.start(); p.join(); p.exitcode
        0
    """

    _start_method = None  # the stdlib would force one of its own in the worker
    _context_backend: Optional[str] = None  # set by a backend context's subclass

    def __init__(self, group: None = None, target: Any = None, name: Optional[str] = None,
                 args: tuple = (), kwargs: Optional[dict] = None, *,
                 daemon: Optional[bool] = None, backend: Optional[str] = None) -> None:
        super().__init__(group, target, name, args, kwargs or {}, daemon=daemon)
        self._fibrl_backend = backend or self._context_backend
        meta = getattr(target, "__fibrl_meta__", None)
        if meta:
            self._fibrl_meta = dict(meta)

    @staticmethod
    def _Popen(process_obj: "Process"):
        from .popen import Popen
        from .hosting.runtime import current_config

        config = current_config()
        backend = getattr(process_obj, "_fibrl_backend", None) or process_obj._context_backend
        if backend and backend != config.backend:
            config = config.replace(backend=backend)
        return Popen(process_obj, config)
