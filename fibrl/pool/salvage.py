"""Decoding, item by item, a block of results the parent cannot unpickle as a whole.

A worker sends the outcomes of several items in one pickled list (``Report``).
When the parent cannot rebuild one of them (a class it cannot import, a
``__reduce__`` callable or ``__setstate__`` that raises here), plain
``pickle.loads`` fails for the whole list. :func:`salvage` loads it again with
a forgiving unpickler that puts a stand-in where an object cannot be rebuilt,
then fails only the items holding a stand-in. This runs only after a failure,
so it may be slow (the pure-Python unpickler).

Owns nothing else: deciding what a failed item means is the service's, and
fibrl frames (``serialization``; used when plain pickle cannot send a value)
are not split here: their block fails as a whole.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

from ..wire import serialization
from ..errors import SerializationError
from .results import Failure

__all__ = ["salvage"]


class _StandIn:
    """Takes the place of an object that could not be rebuilt; remembers why."""

    error: BaseException = SerializationError("unknown")

    def __new__(cls, *args: Any, **kwargs: Any) -> "_StandIn":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    # What unpickling may do to the object next (state, list/dict/set items): ignored.
    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def add(self, item: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def _stand_in(error: BaseException) -> _StandIn:
    obj = _StandIn()
    obj.error = error
    return obj


def _stand_in_class(error: BaseException) -> type:
    return type("StandIn", (_StandIn,), {"error": error})


def _on_error(load: Any, recover: Any) -> Any:
    """Wrap an opcode handler: if rebuilding an object raises, ``recover`` puts a stand-in."""

    def guarded(self: "_Forgiving") -> None:
        try:
            load(self)
        except Exception as exc:
            recover(self.stack, exc)

    return guarded


def _replace_top(stack: list, exc: Exception) -> None:
    stack[-1] = _stand_in(exc)   # REDUCE and BUILD had popped their argument


def _push(stack: list, exc: Exception) -> None:
    stack.append(_stand_in(exc))  # NEWOBJ(_EX) had popped the class and its arguments


class _Forgiving(pickle._Unpickler):  # the pure-Python one: its opcodes can be wrapped
    stack: list  # (set by load(); typeshed does not declare it)
    dispatch = dict(pickle._Unpickler.dispatch)
    for _op, _recover in ((pickle.REDUCE, _replace_top), (pickle.BUILD, _replace_top),
                          (pickle.NEWOBJ, _push), (pickle.NEWOBJ_EX, _push)):
        dispatch[_op[0]] = _on_error(dispatch[_op[0]], _recover)
    del _op, _recover

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except Exception as exc:  # a module or class the parent does not have
            return _stand_in_class(exc)


class _Found(Exception):
    def __init__(self, stand_in: Any) -> None:
        super().__init__()
        self.error = stand_in.error


class _Finder(pickle.Pickler):
    """Pickles to nowhere, raising :class:`_Found` at the first stand-in it meets."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _StandIn) or (isinstance(obj, type) and issubclass(obj, _StandIn)):
            raise _Found(obj)
        return NotImplemented


class _Nowhere:
    def write(self, data: Any) -> int:
        return len(data)


def salvage(payload: bytes, count: int, error: SerializationError) -> list:
    """The ``count`` outcomes pickled in ``payload``, which ``unpack`` refused with ``error``.

    Items that cannot be rebuilt here become a :class:`Failure` saying why;
    the others keep their value. If the block cannot be split, every item
    fails with ``error``.
    """
    whole = [Failure(error)] * count
    if payload[:3] == serialization.MAGIC:
        return whole
    try:
        values = _Forgiving(io.BytesIO(payload)).load()
    except Exception:  # not a list of outcomes we can walk: fail the block
        return whole
    if type(values) is not list or len(values) != count:
        return whole
    return [_checked(value) for value in values]


def _checked(value: Any) -> Any:
    try:
        _Finder(_Nowhere(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except _Found as found:
        return Failure(_cannot_unpickle(found.error))
    except Exception:  # it rebuilt fine; that it cannot be pickled again is not our concern
        pass
    return value


def _cannot_unpickle(exc: BaseException) -> SerializationError:
    error = SerializationError(
        f"cannot unpickle this item's result in the parent ({type(exc).__name__}: {exc}). "
        f"The parent must be able to import every module and class the result uses, and "
        f"rebuild it; check that both run the same code and that it is on sys.path.")
    error.__cause__ = exc
    return error
