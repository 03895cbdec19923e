"""Modules imported on first use: :func:`deferring` lets the modules imported in its
block bind a stand-in for a module they import but use only on demand.

pynng imports asyncio (and with it ``ssl`` and OpenSSL) for an async API fibrl never
calls: :data:`TRANSPORT_DEFERRABLE`. A worker imports fibrl's transport under
``deferring(TRANSPORT_DEFERRABLE)`` (the local fork server when it preloads, a worker
started on its own in ``bootstrap``), so it carries asyncio only once its own code
imports it; then it is the real module, and pynng's async API, which holds the
stand-in, uses that one.

Only where no other thread imports: while the block runs, ``sys.modules`` holds the
stand-ins. Stdlib only, and imports nothing of fibrl's: the fork server uses it.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any, Iterable, Iterator, Optional

__all__ = ["TRANSPORT_DEFERRABLE", "OnFirstUse", "deferring"]

# What fibrl's transport (pynng) imports and fibrl does not use.
TRANSPORT_DEFERRABLE = ("asyncio",)


class OnFirstUse(types.ModuleType):
    """What a module imported under :func:`deferring` gets for a deferred one.

    It carries the real module's spec and file, so reading them or its repr imports
    nothing. Any other attribute read (``__path__`` too: an import of a submodule
    reads it first) imports the real module through the import system, which waits
    for a thread importing it now; from then on every read answers from that module.
    Only the modules imported meanwhile hold a stand-in: it leaves ``sys.modules`` when
    :func:`deferring` ends, so a later ``import`` finds the real module."""

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        super().__init__(spec.name)
        self.__spec__, self.__loader__ = spec, spec.loader
        self.__package__ = spec.parent
        if spec.has_location:
            self.__file__ = spec.origin

    def __getattribute__(self, attr: str) -> Any:
        # (not __getattr__: that one runs after a failed lookup, whose AttributeError
        # costs microseconds on every read through the stand-in)
        own = types.ModuleType.__getattribute__(self, "__dict__")
        real = own.get(_REAL)
        if real is None:
            if attr in own or attr in _OWN:
                return types.ModuleType.__getattribute__(self, attr)
            real = own[_REAL] = _real(self)
        return getattr(real, attr)


_REAL = "__fibrl_real_module__"   # where a stand-in keeps the module once it found it
_OWN = frozenset({"__dict__", "__class__"})   # a stand-in's own until then, as its spec


def _real(stand_in: OnFirstUse) -> types.ModuleType:
    """The module ``stand_in`` stands for, imported now if need be (under :func:`deferring`
    it replaces the stand-in in ``sys.modules``). A function, not a method: every
    attribute of a stand-in but its module dunders is the real module's."""
    name = stand_in.__name__
    if sys.modules.get(name) is stand_in:
        del sys.modules[name]
    return importlib.import_module(name)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on ``sys.meta_path`` under :func:`deferring`. ``import name.sub`` of a
    deferred ``name`` reads the stand-in's ``__path__``, which imports the real
    module; when that import loaded ``name.sub`` already, the import system would
    load it a second time (it looked before): this answers with the loaded one."""

    def __init__(self, deferred: Iterable[str]) -> None:
        self.deferred = frozenset(deferred)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        top = fullname.partition(".")[0]
        if top == fullname or top not in self.deferred or fullname not in sys.modules:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self)
        spec.loader_state = sys.modules[fullname].__spec__   # (see exec_module)
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return sys.modules[spec.name]

    def exec_module(self, module: types.ModuleType) -> None:
        # Loaded already; the import system gave it this finder's spec: its own goes back.
        spec = module.__spec__
        module.__spec__ = spec.loader_state if spec is not None else None


def _stand_in(name: str) -> Optional[OnFirstUse]:
    """A stand-in for the top-level module ``name``, or None when it is imported
    already or not installed (an ``import`` of it then does what it would anyway)."""
    if name in sys.modules or "." in name:
        return None
    spec = importlib.util.find_spec(name)
    return None if spec is None else OnFirstUse(spec)


@contextlib.contextmanager
def deferring(names: Iterable[str]) -> Iterator[None]:
    """While the block runs, each top-level module of ``names`` that is installed and
    not imported yet is an :class:`OnFirstUse` in ``sys.modules``."""
    stand_ins = {name: stand_in for name in names
                 if (stand_in := _stand_in(name)) is not None}
    if not stand_ins:
        yield
        return
    finder = _Submodules(stand_ins)
    sys.modules.update(stand_ins)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name, stand_in in stand_ins.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
