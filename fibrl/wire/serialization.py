"""Turning objects into frames and back.

Owns the wire format of a *payload*: a pickle (protocol 5) whose large buffers
(bytes, numpy arrays, torch tensors) travel out of band, appended after the
pickle stream instead of being copied into it. It does not own connections or
authentication (``transport``) nor message types (``messages``).

Frame layout (little endian)::

    b"FB\\x01" | nbuf:u32 | len(pickle):u64 | len(buf_i):u64 ... | pickle | buf_0 | buf_1 ...

Plain ``pickle`` is tried first (fast, by-reference, like multiprocessing);
objects it cannot handle (lambdas, closures, interactively defined classes)
fall back to cloudpickle, which pickles them by value.
"""
from __future__ import annotations

import copyreg
import io
import pickle
import re
import struct
import sys
from collections import ChainMap
from collections.abc import Iterable
from multiprocessing import process as mp_process
from typing import Any, Callable, SupportsIndex, Union, final

from ..errors import FrameError, SerializationError

__all__ = ["dumps", "loads", "dumps_parts", "encode", "Encoded", "as_bytes", "MAGIC",
           "OOB_THRESHOLD", "stdlib_advice", "unpickle_error", "guarded_main_name",
           "held_authkey", "FramePart"]

MAGIC = b"FB\x01"
OOB_THRESHOLD = 64 * 1024  # smaller buffers are cheaper inline than out of band
_HEAD = struct.Struct("<3sI")
_LEN = struct.Struct("<Q")
_SMALL_HEAD = _HEAD.pack(MAGIC, 0)

#: One byte-like piece of a frame (see :meth:`Encoded.parts`).
FramePart = Union[bytes, bytearray, memoryview]
# What a reducer returns (as ``__reduce__`` does): a callable, its arguments, and maybe
# state and items; its length and members vary.
_Reduction = tuple[Any, ...]


def _pickle(obj: Any, buffers: list[pickle.PickleBuffer], by_value: bool,
            spawning: bool = False) -> bytes:
    def keep(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes < OOB_THRESHOLD:
            return True  # serialize in band
        buffers.append(buf)
        return False

    if not by_value:
        try:
            return _dump(_SpawnPickler if spawning else pickle.Pickler, obj, keep)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            if _is_plain_unpicklable(exc):
                raise _unpicklable(obj, exc) from exc
            buffers.clear()
        except Exception as exc:  # raised by the object's own __reduce__/__getstate__
            raise _unpicklable(obj, exc) from exc
    import cloudpickle  # slower; only for what pickle refuses

    pickler = cloudpickle.CloudPickler
    if spawning:
        pickler = _refusing(pickler)
    try:
        return _dump(pickler, obj, keep)
    except Exception as exc:  # cloudpickle raises many kinds
        raise _unpicklable(obj, exc) from exc


def _dump(pickler_class: type, obj: Any, keep: Callable[[pickle.PickleBuffer], bool]) -> bytes:
    torch = sys.modules.get("torch")  # never imported here: only if the program uses it
    if torch is not None and hasattr(torch, "Tensor"):
        pickler_class = _tensor_pickler(pickler_class, torch.Tensor)
    elif pickler_class is pickle.Pickler:
        return pickle.dumps(obj, protocol=5, buffer_callback=keep)
    out = io.BytesIO()
    pickler_class(out, protocol=5, buffer_callback=keep).dump(obj)
    return out.getvalue()


_tensor_picklers: dict[type, type] = {}   # base pickler -> its tensor pickler


def _tensor_pickler(base: type, tensor_type: type) -> type:
    """``base`` with large tensors reduced by :func:`_reduce_tensor` (a pickler
    reads its ``dispatch_table`` when it is created, hence a subclass)."""
    cls = _tensor_picklers.get(base)
    if cls is None:
        table = ChainMap({tensor_type: _reduce_tensor},
                         getattr(base, "dispatch_table", copyreg.dispatch_table))
        cls = _tensor_picklers[base] = type(f"Tensor{base.__name__}", (base,),
                                            {"dispatch_table": table})
    return cls


def _reduce_tensor(tensor: Any) -> _Reduction:
    """Pickle a large dense CPU tensor as one out-of-band buffer (torch's own
    reduction copies the storage into the pickle stream through torch.save)."""
    import torch

    if (tensor.device.type != "cpu" or tensor.layout is not torch.strided
            or tensor.is_quantized or any(getattr(tensor, "names", ()))
            or (tensor.requires_grad and not tensor.is_leaf)
            or tensor.nbytes < OOB_THRESHOLD):
        own: _Reduction = tensor.__reduce_ex__(5)
        return own
    data = tensor.detach().resolve_conj().resolve_neg().contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy()
    return (_rebuild_tensor, (pickle.PickleBuffer(raw), data.dtype, tuple(data.shape),
                              tensor.requires_grad))


def _rebuild_tensor(buf: Any, dtype: Any, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    flat = torch.frombuffer(buf, dtype=torch.uint8)
    if flat.data_ptr() % dtype.itemsize:
        flat = flat.clone()  # the buffer sits unaligned in its frame: realign, once
    tensor = flat.view(dtype).reshape(shape)
    return tensor.requires_grad_() if requires_grad else tensor


def _is_plain_unpicklable(exc: Exception) -> bool:
    # "cannot pickle '_thread.lock' object": cloudpickle cannot do better.
    return isinstance(exc, TypeError) and "cannot pickle" in str(exc)


# multiprocessing objects that only work between processes of one machine sharing
# its descriptors and semaphores, by (module, class) -> the fibrl object to use instead.
_STDLIB_SHARED = {
    ("multiprocessing.queues", "Queue"): "fibrl.Queue",
    ("multiprocessing.queues", "JoinableQueue"): "fibrl.JoinableQueue",
    ("multiprocessing.queues", "SimpleQueue"): "fibrl.SimpleQueue",
    ("multiprocessing.connection", "Connection"): "fibrl.Pipe",
    ("multiprocessing.synchronize", "Lock"): "fibrl.Lock",
    ("multiprocessing.synchronize", "RLock"): "fibrl.RLock",
    ("multiprocessing.synchronize", "Semaphore"): "fibrl.Semaphore",
    ("multiprocessing.synchronize", "BoundedSemaphore"): "fibrl.BoundedSemaphore",
    ("multiprocessing.synchronize", "Condition"): "fibrl.Condition",
    ("multiprocessing.synchronize", "Event"): "fibrl.Event",
    ("multiprocessing.synchronize", "Barrier"): "fibrl.Barrier",
    ("multiprocessing.sharedctypes", "Synchronized"): "fibrl.Value",
    ("multiprocessing.sharedctypes", "SynchronizedArray"): "fibrl.Array",
    ("multiprocessing.sharedctypes", "SynchronizedString"): "fibrl.Array",
    ("multiprocessing.heap", "BufferWrapper"): "fibrl.RawValue / fibrl.RawArray",
}
# threading objects, named in pickle's "cannot pickle '...' object" -> the fibrl object
_THREADING = {"_thread.lock": "fibrl.Lock", "_thread.RLock": "fibrl.RLock"}


def stdlib_advice(kind: str, replacement: str) -> str:
    """The sentence that tells a user which fibrl object replaces a stdlib one."""
    return (f"a {kind} cannot be shared with a fibrl process (it may run on another "
            f"machine, in a fresh interpreter); create a {replacement} instead, which "
            f"works from any process of the run.")


def _refuse(obj: Any) -> _Reduction:
    cls = type(obj)
    replacement = _STDLIB_SHARED[(cls.__module__, cls.__qualname__)]
    raise SerializationError(stdlib_advice(f"{cls.__module__}.{cls.__qualname__}",
                                           replacement))


# multiprocessing's bytes subclass for authkeys (typeshed does not declare it)
_AuthenticationString: type[bytes] = mp_process.AuthenticationString  # type: ignore[attr-defined]


def held_authkey() -> bytes:
    """The run's secret where a started process is unpickled: the key its worker
    already holds (it proved it to connect), so that no start payload carries it."""
    return _AuthenticationString(mp_process.current_process().authkey)


def _reduce_authkey(key: bytes) -> _Reduction:
    # The process's own key (a Process's authkey, a Manager's default one) is never
    # written: the worker fills it in. A key of the user's choosing (a Manager given
    # its own authkey) travels, as multiprocessing's spawn sends it: the worker has no
    # other way to learn it.
    if bytes(key) == bytes(mp_process.current_process().authkey):
        return (held_authkey, ())
    return (_AuthenticationString, (bytes(key),))


def _stdlib_table() -> dict[type, Callable[[Any], _Reduction]]:
    """``type -> reducer`` for a process start: ``_refuse`` for the stdlib classes
    above whose module is loaded (a program that never imported one cannot hold its
    objects), and authkeys written without the run's secret."""
    table: dict[type, Callable[[Any], _Reduction]] = {_AuthenticationString: _reduce_authkey}
    for (module, name) in _STDLIB_SHARED:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            table[cls] = _refuse
    return table


def _refusing(base: type) -> type:
    """``base`` that refuses the stdlib's machine-bound multiprocessing objects."""
    table = ChainMap(_stdlib_table(),
                     getattr(base, "dispatch_table", copyreg.dispatch_table))
    return type(f"Refusing{base.__name__}", (base,), {"dispatch_table": table})


class _SpawnPickler(pickle.Pickler):
    """Pickles a process object for its start: multiprocessing objects pickle "fine"
    while a start is in progress (they take it for a spawn), then fail in the worker,
    so they are refused here with the fibrl object to use instead."""

    # (a property, not the attribute pickle.Pickler declares: the table is made when a
    # pickler is, from the stdlib modules loaded then)
    @property
    def dispatch_table(self) -> ChainMap[type, Callable[[Any], Any]]:  # type: ignore[override]
        return ChainMap(_stdlib_table(), copyreg.dispatch_table)


def _advice(exc: Exception) -> str:
    text = str(exc)
    for name, replacement in _THREADING.items():
        if f"'{name}'" in text:
            return " " + stdlib_advice(f"threading lock ({name})", replacement)
    # multiprocessing's assert_spawning: "Lock objects should only be shared between
    # processes through inheritance"
    if text.endswith("should only be shared between processes through inheritance"):
        kind = text.split(" ", 1)[0]
        for (_module, name), replacement in _STDLIB_SHARED.items():
            if name == kind:
                return " " + stdlib_advice(f"multiprocessing {kind}", replacement)
    return (" Pass the data needed to rebuild it instead (for example a path rather "
            "than an open file, or create the lock/socket inside the worker).")


def _unpicklable(obj: Any, exc: Exception) -> SerializationError:
    """The error for an object that cannot be pickled, catchable both as
    :class:`SerializationError` and as the type pickle raised (as with the stdlib)."""
    if isinstance(exc, SerializationError):
        return exc
    text = repr(obj)
    if len(text) > 200:
        text = text[:200] + "..."
    message = (f"cannot pickle {text} ({type(exc).__name__}: {exc}). Objects sent to "
               f"another process (targets, arguments, queue items, results) must be "
               f"picklable.{_advice(exc)}")
    error: SerializationError = _error_class(type(exc))(message)
    return error


_error_classes: dict[type, type] = {}   # kind -> its SerializationError


def _error_class(kind: type) -> type:
    """A subclass of SerializationError and ``kind``, so ``except kind`` still works."""
    if issubclass(SerializationError, kind):
        return SerializationError
    cls = _error_classes.get(kind)
    if cls is None:
        try:
            cls = type("SerializationError", (SerializationError, kind),
                       {"__module__": SerializationError.__module__})
            cls("probe")
        except TypeError:  # an incompatible layout or constructor (OSError, say)
            cls = SerializationError
        _error_classes[kind] = cls
    return cls


@final  # the code tests ``type(x) is Encoded``: a subclass would not be recognised
class Encoded:
    """An object serialized for another process: its pickle stream and its large
    buffers, kept apart (never joined into one ``bytes``).

    Pickling an ``Encoded`` (inside a message) sends the stream and each buffer
    out of band, so a 512 MB array is copied once, into the outgoing message; on
    the receiving side it arrives as views of the received message, and
    :meth:`load` rebuilds the object on them without another copy.

    ``borrowed``: the buffers are views of the caller's own objects (an array
    that was just put on a queue). Whoever keeps an ``Encoded`` beyond the call
    that made it (a local queue, a batch sent later) calls :meth:`own` first, so
    that changing the original afterwards does not change what is received.
    """

    __slots__ = ("data", "buffers", "borrowed")

    def __init__(self, data: Any, buffers: Any = (), borrowed: bool = False) -> None:
        self.data = data
        self.buffers = buffers
        self.borrowed = borrowed

    @property
    def nbytes(self) -> int:
        if not self.buffers:
            return len(self.data)
        return len(self.data) + sum(memoryview(b).nbytes for b in self.buffers)

    def own(self) -> "Encoded":
        """Copy borrowed buffers (once), so the original objects may change."""
        if self.borrowed:
            self.buffers = [bytearray(b) for b in self.buffers]
            self.borrowed = False
        return self

    def parts(self) -> list[FramePart]:
        """The frame (see :func:`dumps`) as parts that concatenate to it."""
        head = [_HEAD.pack(MAGIC, len(self.buffers)), _LEN.pack(len(self.data))]
        head += [_LEN.pack(memoryview(b).nbytes) for b in self.buffers]
        return [b"".join(head), self.data, *self.buffers]

    def __bytes__(self) -> bytes:
        return b"".join(memoryview(p).cast("B") if type(p) is not bytes else p
                        for p in self.parts())

    def load(self) -> Any:
        """Rebuild the object (arrays share the buffers' memory when those are writable)."""
        if not self.buffers:   # the common small message: nothing borrowed to own
            return _unpickle(self.data, ())
        self.own()  # never hand out views of the sender's own objects
        # Buffers are views of a writable received frame (or owned copies); pickle marks
        # those whose original was read-only, so arrays come back as writable as they left.
        return _unpickle(self.data, list(self.buffers))

    def __reduce__(self) -> tuple[type[Encoded], tuple[Any, tuple[pickle.PickleBuffer, ...]]]:
        data = self.data
        if len(data) >= OOB_THRESHOLD:
            data = pickle.PickleBuffer(data)
        elif type(data) is not bytes:
            data = bytes(data)  # a small view of a received frame
        return (Encoded, (data, tuple(pickle.PickleBuffer(b) for b in self.buffers)))

    def __repr__(self) -> str:
        return f"<Encoded {self.nbytes} bytes, {len(self.buffers)} buffers>"


def encode(obj: Any, *, by_value: bool = False, spawning: bool = False) -> Encoded:
    """Serialize ``obj`` without joining its parts (see :class:`Encoded`).

    Large contiguous buffers (numpy arrays, tensors, ``bytearray``, a ``bytes``
    of at least ``OOB_THRESHOLD``) are borrowed, not copied.
    """
    kind = type(obj)
    if kind in _PLAIN_SMALL and (kind is not bytes or len(obj) < OOB_THRESHOLD):
        # the commonest queue item: nothing to look up by name, no buffer to borrow
        return Encoded(pickle.dumps(obj, protocol=5))
    buffers: list[pickle.PickleBuffer] = []
    if kind is bytes and len(obj) >= OOB_THRESHOLD:
        obj = _LargeBytes(obj)
    data = _pickle(obj, buffers, by_value or main_is_interactive(), spawning)
    return Encoded(data, [b.raw() for b in buffers], bool(buffers))


# builtin types whose pickle needs no pickler of ours (no torch, no cloudpickle, no
# out-of-band buffer when small): encode() pickles them directly
_PLAIN_SMALL = frozenset((bytes, str, int, float, bool, type(None)))


class _LargeBytes:
    """A large ``bytes`` sent out of band (pickle writes ``bytes`` into its stream, a
    copy; this sends the object's own memory and rebuilds ``bytes`` on arrival)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[type[bytes],
                                                               tuple[pickle.PickleBuffer]]:
        return (bytes, (pickle.PickleBuffer(self.data),))


def as_bytes(payload: Any) -> Any:
    """A received payload as a bytes-like object (an :class:`Encoded` as its frame)."""
    return bytes(payload) if type(payload) is Encoded else payload


def dumps_parts(obj: Any, *, by_value: bool = False,
                spawning: bool = False) -> list[FramePart]:
    """Serialize ``obj`` into a list of byte-like parts that concatenate to one frame.

    ``spawning``: ``obj`` is a process object being started; multiprocessing objects
    bound to this machine (a stdlib Queue, Lock, Pipe end...) are refused with the
    fibrl object to use instead.
    """
    encoded = encode(obj, by_value=by_value, spawning=spawning)
    if not encoded.buffers:  # the common small message: one bytes, joined once
        return [_SMALL_HEAD + _LEN.pack(len(encoded.data)) + encoded.data]
    return encoded.parts()


def dumps(obj: Any, *, by_value: bool = False, spawning: bool = False) -> bytes:
    """Serialize ``obj`` into one frame (``bytes``); ``spawning``: see :func:`dumps_parts`.

    Example:
        >>> loads(dumps({"a": 1}))
        {'a': 1}
    """
    return bytes(encode(obj, by_value=by_value, spawning=spawning))


def loads(frame: "bytes | bytearray | memoryview | Encoded") -> Any:
    """Rebuild the object of a frame made by :func:`dumps` (or an :class:`Encoded`).

    Raises:
        FrameError: ``frame`` is not a fibrl frame (wrong magic, truncated).
    """
    if type(frame) is Encoded:
        return frame.load()
    view = memoryview(frame)
    if view.nbytes < _HEAD.size or bytes(view[:3]) != MAGIC:
        raise FrameError(
            f"received {view.nbytes} bytes that do not start with a fibrl frame header; "
            f"the peer is not a fibrl process of a compatible version.")
    _, nbuf = _HEAD.unpack_from(view)
    if nbuf == 0:  # the common small message: one pickle stream, no buffers
        size = _LEN.unpack_from(view, _HEAD.size)[0]
        if view.nbytes == _HEAD.size + _LEN.size + size:
            return _unpickle(view[_HEAD.size + _LEN.size:], [])
    offset = _HEAD.size
    need = offset + _LEN.size * (nbuf + 1)
    if view.nbytes < need:
        raise FrameError(f"truncated fibrl frame: {view.nbytes} bytes, header needs {need}.")
    sizes = [_LEN.unpack_from(view, offset + i * _LEN.size)[0] for i in range(nbuf + 1)]
    offset = need
    if view.nbytes != offset + sum(sizes):
        raise FrameError(
            f"fibrl frame length mismatch: header announces {offset + sum(sizes)} bytes, "
            f"got {view.nbytes}; the message was truncated or corrupted in transit.")
    if nbuf and view.readonly:
        view = memoryview(bytearray(view))  # receivers expect writable arrays, as in mp
    data = view[offset:offset + sizes[0]]
    offset += sizes[0]
    bufs = []
    for size in sizes[1:]:
        bufs.append(view[offset:offset + size])
        offset += size
    return _unpickle(data, bufs)


def _unpickle(data: Any, buffers: Iterable[Any]) -> Any:
    try:
        return pickle.loads(data, buffers=buffers)
    except Exception as exc:
        raise unpickle_error(exc) from exc


def unpickle_error(exc: Exception) -> SerializationError:
    """Why a received object could not be rebuilt, and what to do about it."""
    name = guarded_main_name(exc)
    if name is not None:
        return SerializationError(
            f"define {name} at module top level (functions defined under `if __name__ == "
            f"'__main__':` cannot be found by name in a worker, "
            f"which imports the main script without running that block); cannot unpickle a "
            f"received object ({type(exc).__name__}: {exc}).")
    return SerializationError(
        f"cannot unpickle a received object ({type(exc).__name__}: {exc}). The "
        f"receiving process must be able to import every module and class the sender "
        f"used; check that both run the same code and that it is on sys.path.")


_MISSING_MAIN = re.compile(r"Can't get attribute '([^']+)' on <module '__mp_main__'")


def guarded_main_name(exc: BaseException) -> "str | None":
    """The name a worker's ``__mp_main__`` lacks (a function or class the main script
    defines only when run as ``__main__``), if that is why ``exc`` was raised."""
    cause: "BaseException | None" = exc
    while cause is not None:
        match = _MISSING_MAIN.search(str(cause)) if isinstance(cause, AttributeError) else None
        if match:
            return match.group(1)
        cause = cause.__cause__
    return None


def main_is_interactive() -> bool:
    # Objects defined in an interactive __main__ cannot be found by name in a
    # worker, so they must travel by value.
    main = sys.modules.get("__main__")
    return main is not None and getattr(main, "__file__", None) is None \
        and getattr(main, "__spec__", None) is None
