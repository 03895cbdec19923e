"""``Value``, ``Array``, ``RawValue`` and ``RawArray`` shared by any processes of a run.

``multiprocessing`` puts these ctypes objects in shared memory, which a
container or a pod on another machine cannot map. fibrl *hosts* the ctypes
object in the hub of the process that created it, and every access
(``v.value``, ``a[i]``, ``a[2:5] = ...``) is one atomic operation on it::

    any process                                owner process (hub)
    v.value += 1   -> call get(tid) ---------> _CTypesService: ctypes object
                   -> call set(tid, x) ------>   when the value's lock is held by
                                                 another thread, the access waits
    with v.get_lock(): ...  (a fibrl.RLock hosted next to it: same owner)

Semantics kept: ``Value``/``Array`` with ``lock=True`` (an ``RLock``, the
default), a given ``Lock``/``RLock`` or ``lock=False``; ``get_lock()``,
``get_obj()``, ``acquire``/``release``, ``with``; ``.value``/``.raw`` of
char arrays; fields of ``ctypes.Structure`` values; elements and fields that are
Structures or arrays (``A[0].x = 1``, ``for a in A: a.x **= 2``), which ctypes
gives as views into the shared memory: here they are :class:`HostedPart` objects
that read and write the hosted object (setting a name that is not a field raises).
An access from a thread that does not hold the lock waits while another thread
holds it, as with ``multiprocessing`` (so a multi-step update under the lock is
seen whole).

Not kept, because no memory is shared across machines: ``RawValue`` and
``RawArray`` (and ``get_obj()``) are hosted objects too, not ctypes
instances, so ``memoryview()``, ``numpy.frombuffer()``, ``ctypes.addressof()``
and ``ctypes.byref()`` raise ``TypeError`` (use a ``Queue`` or
``fibrl.rl`` stores for bulk arrays); every access is a round trip to the
owner. Everything else reads and writes as ``multiprocessing`` does, and the
objects pickle to any process (not only at process start).
"""
from __future__ import annotations

import ctypes
import threading
# (the stdlib's table of array typecodes: typeshed does not declare it)
from multiprocessing.sharedctypes import typecode_to_type  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any, Callable, Optional

from .hosting.hosted import HostedHandle, HostedService
from .hosting.hub import ReplySink, get_hub
from .synchronize import LockHandle, RLock
from .synchronize.services import LockService, owner_of

__all__ = ["RawValue", "RawArray", "Value", "Array", "synchronized", "copy",
           "HostedValue", "HostedArray", "HostedPart", "Synchronized", "SynchronizedArray",
           "SynchronizedString"]


_CTYPES = (ctypes._SimpleCData, ctypes.Structure, ctypes.Union, ctypes.Array)

if TYPE_CHECKING:
    from typing import TypeAlias

    # A ctypes type that can be made and multiplied (``c_int * 3``): one of _CTYPES.
    _CType: TypeAlias = ("type[ctypes._SimpleCData[Any]] | type[ctypes.Structure]"
                         " | type[ctypes.Union] | type[ctypes.Array[Any]]")


def _ctype(typecode_or_type: Any) -> _CType:
    ctype = typecode_to_type.get(typecode_or_type, typecode_or_type)
    if not (isinstance(ctype, type) and issubclass(ctype, _CTYPES)):
        raise TypeError(
            f"{typecode_or_type!r} is neither an array typecode ({''.join(typecode_to_type)}) "
            f"nor a ctypes type; pass for example 'i', 'd' or ctypes.c_double.")
    return ctype


def _fields(ctype: type) -> tuple:
    return tuple(name for name, *_ in getattr(ctype, "_fields_", ()))


def _plain(value: Any) -> Any:
    """A picklable copy of what ctypes returned: lists for arrays, Structure copies."""
    if isinstance(value, ctypes.Array):
        value = value[:]  # bytes/str for char arrays, a list of elements otherwise
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, (ctypes.Structure, ctypes.Union)):
        return type(value).from_buffer_copy(value)
    return value


_NAMES = ("value", "raw")  # the attributes a hosted object has besides its fields


def _step(obj: Any, key: Any) -> Any:
    """One step down a path: a field of a Structure or an element of an array."""
    if isinstance(key, str):
        if key not in _fields(type(obj)):
            raise AttributeError(f"{type(obj).__name__} object has no field {key!r}")
        return getattr(obj, key)
    if isinstance(key, int) and isinstance(obj, ctypes.Array):
        return obj[key]
    raise TypeError(f"cannot index {type(obj).__name__} with {key!r}")


_children: dict = {}


def _child_type(ctype: type, key: Any) -> Optional[type]:
    """The ctypes type of ``ctype``'s field or element ``key`` when ctypes gives a view of it
    (a nested Structure, Union or array), None when it gives a plain value."""
    slot = (ctype, key if isinstance(key, str) else int)
    if slot not in _children:
        probe = _probe(ctype, key)
        _children[slot] = type(probe) if isinstance(probe, _AGGREGATES) else None
    return _children[slot]


_AGGREGATES = (ctypes.Structure, ctypes.Union, ctypes.Array)


def _probe(ctype: type, key: Any) -> Any:
    if isinstance(key, str):
        return getattr(ctype(), key)
    # what indexing gives, on a zeroed one-element array (an array type's ``_type_``:
    # typeshed knows it on instances only)
    return (ctype._type_ * 1)()[0]  # type: ignore[attr-defined]


class _Recipe:
    """Pickles a ctypes type as a recipe when it is an array type (``c_int * 2`` is
    made at run time and cannot be found by name); unpickles to the type itself."""

    def __init__(self, ctype: type) -> None:
        self.ctype = ctype

    def __reduce__(self):
        if issubclass(self.ctype, ctypes.Array):
            return (_array_type, (_Recipe(self.ctype._type_), self.ctype._length_))
        return (_same, (self.ctype,))


def _array_type(item: _CType, length: int) -> type:
    return item * length


def _same(ctype: type) -> type:
    return ctype


class _CTypesService(HostedService):
    """A ctypes object with atomic get/set operations, lock-aware when its lock is local."""

    def __init__(self, obj: Any, lock: Optional[LockService]) -> None:
        super().__init__()
        self.obj = obj
        self.lock = lock

    def _run(self, reply: ReplySink, tid: int, fn: Callable[[], Any]) -> None:
        if self.lock is None:
            reply(fn())
        else:
            self.lock.run_unlocked(owner_of(reply, tid), reply, fn)

    def _at(self, path: tuple) -> Any:
        obj = self.obj
        for key in path:
            obj = _step(obj, key)
        return obj

    def _get(self, path: tuple, key: Any) -> Any:
        obj = self._at(path)
        if isinstance(key, str):
            return _plain(getattr(obj, self._name(obj, key)))
        return _plain(obj[key])

    def _set(self, path: tuple, key: Any, value: Any) -> None:
        obj = self._at(path)
        if isinstance(key, str):
            setattr(obj, self._name(obj, key), value)
        else:
            obj[key] = value

    @staticmethod
    def _name(obj: Any, name: str) -> str:
        if name not in _NAMES + _fields(type(obj)) or not hasattr(obj, name):
            raise AttributeError(f"{type(obj).__name__} object has no attribute {name!r}")
        return name

    def op_get(self, reply: ReplySink, tid: int, path: tuple, key: Any) -> None:
        """Read field or item ``key`` of the part of the object at ``path``."""
        self._run(reply, tid, lambda: self._get(tuple(path), key))

    def op_set(self, reply: ReplySink, tid: int, path: tuple, key: Any, value: Any) -> None:
        """Write field or item ``key`` of the part of the object at ``path``."""
        self._run(reply, tid, lambda: self._set(tuple(path), key, value))

    def op_getattr(self, reply: ReplySink, tid: int, name: str) -> None:
        self.op_get(reply, tid, (), name)

    def op_setattr(self, reply: ReplySink, tid: int, name: str, value: Any) -> None:
        self.op_set(reply, tid, (), name, value)

    def op_getitem(self, reply: ReplySink, tid: int, index: Any) -> None:
        self.op_get(reply, tid, (), index)

    def op_setitem(self, reply: ReplySink, tid: int, index: Any, value: Any) -> None:
        self.op_set(reply, tid, (), index, value)

    def op_repr(self, reply: ReplySink) -> None:
        reply(repr(self.obj))

    def op_snapshot(self, reply: ReplySink, tid: int, path: tuple = ()) -> None:
        self._run(reply, tid, lambda: _plain_copy(self._at(tuple(path))))


def _plain_copy(obj: Any) -> Any:
    return type(obj).from_buffer_copy(obj)


# -- raw (lock-free) hosted objects ------------------------------------------------------------
class _CTypesHandle(HostedHandle):
    """Client side of a hosted ctypes object."""

    _ctype: type

    def _state(self) -> dict:
        return {"_ctype": _Recipe(self._ctype)}

    def _get(self, name: str) -> Any:
        return self._read((), name)

    def _set(self, name: str, value: Any) -> None:
        self._write((), name, value)

    def _read(self, path: tuple, key: Any, ctype: Optional[type] = None) -> Any:
        """Field or item ``key`` at ``path``: a value, or a HostedPart where ctypes gives
        a view (so writes through it reach the hosted object, as through shared memory)."""
        ctype = ctype or _type_at(self._ctype, path)
        child = _child_type(ctype, key if isinstance(key, str) else 0)
        if child is None:
            return self._call("get", threading.get_ident(), path, key)
        if isinstance(key, str):
            return HostedPart(self, path + (key,), child)
        length = ctype._length_  # type: ignore[attr-defined]  # (an array type's, as above)
        if isinstance(key, slice):
            return [HostedPart(self, path + (i,), child) for i in range(length)[key]]
        return HostedPart(self, path + (_index(key, length),), child)

    def _write(self, path: tuple, key: Any, value: Any) -> None:
        if isinstance(value, HostedPart):
            value = value._copy()
        elif isinstance(key, slice) and isinstance(value, (list, tuple)):
            value = [v._copy() if isinstance(v, HostedPart) else v for v in value]
        self._call("set", threading.get_ident(), path, key, value)

    def __repr__(self) -> str:
        try:
            text = self._call("repr")
        except Exception:
            text = f"{self._ctype.__name__} at {self._address}"
        return f"<hosted {text}>"


def _tupled(value: Any) -> Any:
    """Lists (what arrays read as) as tuples, which ctypes takes for an array slot."""
    if isinstance(value, list):
        return tuple(_tupled(item) for item in value)
    return value


def _index(index: int, length: int) -> int:
    if not isinstance(index, int):
        raise TypeError(f"indices must be integers or slices, not {type(index).__name__}")
    if not -length <= index < length:
        raise IndexError("invalid index")
    return index % length


class HostedPart:
    """A nested Structure, Union or array inside a hosted object (an element of an
    ``Array`` of Structures, a Structure field of a ``Value``): reads and writes
    go to the hosted object, as a ctypes view writes into shared memory.

    Example: with ``a = Array(Point, [(1, 2)])``, ``a[0].x = 5`` writes into ``a``.
    """

    __slots__ = ("_handle", "_path", "_ctype")

    def __init__(self, handle: "_CTypesHandle", path: tuple, ctype: type) -> None:
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_ctype", ctype)

    def __reduce__(self):
        return (_rebuild_part, (self._handle, self._path))

    def _names(self) -> tuple:
        names = _fields(self._ctype)
        if issubclass(self._ctype, ctypes.Array) and self._ctype._type_ in (ctypes.c_char,
                                                                             ctypes.c_wchar):
            names += _NAMES
        return names

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._names():
            raise AttributeError(f"{self._ctype.__name__} object has no attribute {name!r}")
        return self._handle._read(self._path, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._names():
            raise AttributeError(
                f"{self._ctype.__name__} has no field {name!r}: an element of a shared "
                f"object stores only its fields ({', '.join(self._names()) or 'none'})")
        self._handle._write(self._path, name, value)

    def __len__(self) -> int:
        return len(self._ctype())

    def _is_array(self) -> bool:
        return issubclass(self._ctype, ctypes.Array)

    def __getitem__(self, index: Any) -> Any:
        if not self._is_array():
            raise TypeError(f"{self._ctype.__name__} object is not subscriptable")
        return self._handle._read(self._path, index, self._ctype)

    def __setitem__(self, index: Any, value: Any) -> None:
        if not self._is_array():
            raise TypeError(f"{self._ctype.__name__} object does not support item assignment")
        self._handle._write(self._path, index, value)

    def __iter__(self):
        return iter(self[:])

    def _copy(self) -> Any:
        """A plain copy: a ctypes Structure, or a tuple for an array."""
        return _tupled(self._handle._call("get", threading.get_ident(), self._path[:-1],
                                          self._path[-1]))

    def __repr__(self) -> str:
        return f"<hosted {self._ctype.__name__} part {list(self._path)}>"


def _rebuild_part(handle: "_CTypesHandle", path: tuple) -> HostedPart:
    return HostedPart(handle, path, _type_at(handle._ctype, path))


def _type_at(ctype: type, path: tuple) -> type:
    part: Any = ctype  # (never None: each step of a part's path is a view, see _read)
    for key in path:
        part = _child_type(part, key)
    return part


class HostedValue(_CTypesHandle):
    """What ``RawValue`` returns: a hosted ctypes scalar (or Structure) with ``.value``."""

    @property
    def value(self) -> Any:
        return self._get("value")

    @value.setter
    def value(self, value: Any) -> None:
        self._set("value", value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in _fields(self.__dict__.get("_ctype", object)):
            raise AttributeError(name)
        return self._get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _fields(self.__dict__.get("_ctype", object)):
            self._set(name, value)
        else:
            object.__setattr__(self, name, value)


class HostedArray(_CTypesHandle):
    """What ``RawArray`` returns: a hosted ctypes array with ``len``, indexing and slicing."""

    _length: int
    _elem: _CType

    def _state(self) -> dict:
        return {"_elem": _Recipe(self._elem), "_length": self._length}


    @property
    def _ctype(self) -> type:  # type: ignore[override]
        return self._elem * self._length

    @property
    def _type_(self) -> type:
        return self._elem

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        return self._read((), index)

    def __setitem__(self, index: Any, value: Any) -> None:
        self._write((), index, value)

    def __iter__(self):
        return iter(self[:])

    @property
    def value(self) -> Any:
        """For char arrays: the bytes up to the first NUL."""
        return self._get("value")

    @value.setter
    def value(self, value: Any) -> None:
        self._set("value", value)

    @property
    def raw(self) -> bytes:
        """For char arrays: all the bytes."""
        return self._get("raw")

    @raw.setter
    def raw(self, value: bytes) -> None:
        self._set("raw", value)


def _host_raw(obj: Any, lock: Optional[LockService], cls: type[_CTypesHandle]) -> Any:
    handle = cls.__new__(cls)
    if isinstance(handle, HostedArray):
        handle._elem, handle._length = obj._type_, len(obj)
    else:
        object.__setattr__(handle, "_ctype", type(obj))
    handle._host(_CTypesService(obj, lock))
    return handle


def _new_array(typecode_or_type: Any, size_or_initializer: Any) -> Any:
    ctype = _ctype(typecode_or_type)
    if isinstance(size_or_initializer, int):
        return (ctype * size_or_initializer)()
    items = list(size_or_initializer)
    return (ctype * len(items))(*items)


def RawValue(typecode_or_type: Any, *args: Any) -> HostedValue:
    """A hosted ctypes value without a lock (each access is atomic by itself).

    Example:
        >>> v = RawValue("i", 7); v.value += 1; v.value
        8
    """
    return _host_raw(_ctype(typecode_or_type)(*args), None, HostedValue)


def RawArray(typecode_or_type: Any, size_or_initializer: Any) -> HostedArray:
    """A hosted ctypes array without a lock: zeros of a size, or a copy of a sequence.

    Example:
        >>> a = RawArray("d", [1.0, 2.0]); a[1] = 5; a[:]
        [1.0, 5.0]
    """
    return _host_raw(_new_array(typecode_or_type, size_or_initializer), None, HostedArray)


# -- synchronized wrappers ----------------------------------------------------------------------
class _SynchronizedBase:
    """``multiprocessing.sharedctypes`` wrapper surface over a hosted object and its lock."""

    def __init__(self, obj: _CTypesHandle, lock: LockHandle) -> None:
        self._obj = obj
        self._lock = lock
        self.acquire = lock.acquire
        self.release = lock.release

    def __reduce__(self):
        return (_rebuild_synchronized, (type(self), self._obj, self._lock))

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *args: Any) -> None:
        self._lock.__exit__(*args)

    def get_obj(self) -> _CTypesHandle:
        """The hosted object itself (not a ctypes instance: see the module docstring)."""
        return self._obj

    def get_lock(self) -> LockHandle:
        return self._lock

    def __repr__(self) -> str:
        try:
            text = self._obj._call("repr")
        except Exception:
            text = "unknown"
        return f"<{type(self).__name__} wrapper for {text}>"


def _rebuild_synchronized(cls: type, obj: _CTypesHandle, lock: LockHandle) -> Any:
    return cls(obj, lock)


class Synchronized(_SynchronizedBase):
    """A ``Value`` with a lock: ``.value``, ``get_lock()``, ``with v: ...``."""

    @property
    def value(self) -> Any:
        return self._obj._get("value")

    @value.setter
    def value(self, value: Any) -> None:
        self._obj._set("value", value)


class SynchronizedArray(_SynchronizedBase):
    """An ``Array`` with a lock: ``len``, indexing, slicing, iteration."""

    _obj: HostedArray

    def __len__(self) -> int:
        return len(self._obj)

    def __getitem__(self, index: Any) -> Any:
        return self._obj[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        self._obj[index] = value

    def __iter__(self):
        return iter(self._obj[:])


class SynchronizedString(SynchronizedArray):
    """A char ``Array`` with a lock, adding ``.value`` and ``.raw``."""

    value = property(lambda self: self._obj.value, lambda self, v: setattr(self._obj, "value", v))
    raw = property(lambda self: self._obj.raw, lambda self, v: setattr(self._obj, "raw", v))


_struct_classes: dict = {}


def _struct_class(ctype: type) -> type:
    """A Synchronized subclass with one property per field of a ``ctypes.Structure``."""
    cls = _struct_classes.get(ctype)
    if cls is None:
        namespace: dict[str, Any] = {name: _field_property(name) for name in _fields(ctype)}

        def reduce(self: Synchronized) -> tuple:
            return (_rebuild_struct, (ctype, self._obj, self._lock))

        namespace["__reduce__"] = reduce
        cls = type(f"Synchronized{ctype.__name__}", (Synchronized,), namespace)
        _struct_classes[ctype] = cls
    return cls


def _field_property(name: str) -> property:
    def fget(self: Synchronized) -> Any:
        return self._obj._get(name)

    def fset(self: Synchronized, value: Any) -> None:
        self._obj._set(name, value)

    return property(fget, fset)


def _rebuild_struct(ctype: type, obj: _CTypesHandle, lock: LockHandle) -> Any:
    return _struct_class(ctype)(obj, lock)


def _resolve_lock(lock: Any, ctx: Any) -> Optional[LockHandle]:
    if lock is True or lock is None:
        return RLock(ctx=ctx)
    if lock is False:
        return None
    if not hasattr(lock, "acquire"):
        raise AttributeError(f"{lock!r} has no method 'acquire'")
    if not isinstance(lock, LockHandle):
        raise TypeError(
            f"lock must be a fibrl Lock or RLock (or True/False), got {type(lock).__name__}: "
            f"a threading or multiprocessing lock cannot guard a value shared across machines.")
    return lock


def _local_lock_service(lock: Optional[LockHandle]) -> Optional[LockService]:
    if lock is None:
        return None
    hub = get_hub()
    service = hub.service(lock._oid) if hub.is_local(lock._address) else None
    return service if isinstance(service, LockService) else None


def _synchronized_class(obj: Any) -> type:
    if isinstance(obj, ctypes.Array):
        return SynchronizedString if obj._type_ is ctypes.c_char else SynchronizedArray
    if _fields(type(obj)):
        return _struct_class(type(obj))
    return Synchronized


def _wrap(obj: Any, lock: Any, ctx: Any) -> Any:
    raw_cls = HostedArray if isinstance(obj, ctypes.Array) else HostedValue
    guard = _resolve_lock(lock, ctx)
    handle = _host_raw(obj, _local_lock_service(guard), raw_cls)
    if guard is None:
        return handle
    return _synchronized_class(obj)(handle, guard)


def Value(typecode_or_type: Any, *args: Any, lock: Any = True, ctx: Any = None) -> Any:
    """A hosted ctypes value guarded by a lock (a new ``RLock`` unless given).

    Example:
        >>> v = Value("i", 0)
        >>> with v.get_lock():
        ...     v.value += 1
        >>> v.value
        1
    """
    return _wrap(_ctype(typecode_or_type)(*args), lock, ctx)


def Array(typecode_or_type: Any, size_or_initializer: Any, *, lock: Any = True,
          ctx: Any = None) -> Any:
    """A hosted ctypes array guarded by a lock (a new ``RLock`` unless given).

    Example:
        >>> a = Array("i", range(3)); a[0] = 9; a[:]
        [9, 1, 2]
    """
    return _wrap(_new_array(typecode_or_type, size_or_initializer), lock, ctx)


def synchronized(obj: Any, lock: Any = None, ctx: Any = None) -> Any:
    """Wrap a hosted object from ``RawValue``/``RawArray`` with a lock."""
    if not isinstance(obj, _CTypesHandle):
        raise TypeError(f"synchronized() takes a fibrl RawValue/RawArray, got {type(obj)!r}")
    guard = _resolve_lock(lock, ctx) or RLock(ctx=ctx)
    cls = SynchronizedString if isinstance(obj, HostedArray) and obj._type_ is ctypes.c_char \
        else SynchronizedArray if isinstance(obj, HostedArray) \
        else _struct_class(obj._ctype) if _fields(obj._ctype) else Synchronized
    return cls(obj, guard)


def copy(obj: Any) -> Any:
    """A new hosted object (in this process) with the same contents as ``obj``."""
    if not isinstance(obj, _CTypesHandle):
        raise TypeError(f"copy() takes a fibrl RawValue/RawArray, got {type(obj)!r}")
    return _host_raw(obj._call("snapshot", threading.get_ident()), None, type(obj))
