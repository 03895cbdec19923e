"""A policy's parameters frozen into one immutable buffer (its *blob*), and back.

Owns what ``publish`` accepts (a dict of numpy arrays, nested dicts and scalars, or a
torch ``state_dict`` whose tensors may live on a GPU), the blob's layout, and the
conversion to torch tensors for ``as_torch=True``. It knows nothing of versions or
connections.

Blob layout (little endian; offsets are from the blob's start)::

    b"FBPOLv1\\0" | nbuf:u32 | 0:u32 | len(pickle):u64 | (offset:u64, size:u64) * nbuf
    | pickle stream (protocol 5) | pad | buf_0 | pad | buf_1 ...

Each array larger than :data:`OUT_OF_BAND` bytes is one out-of-band buffer, copied
once into the blob (that copy is the freeze: changing the learner's arrays later
changes no published version). Buffers start where ``BIAS + offset`` is a multiple of
:data:`ALIGN`: the blob travels behind a ``BIAS``-byte header (an answer's, a
snapshot file's), so the arrays a reader rebuilds on the received frame are aligned
for every dtype, and torch tensors made from them need no copy.
"""
from __future__ import annotations

import pickle
import struct
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from .protocol import HEADER

__all__ = ["prepare", "lay_out", "Prepared", "thaw", "to_torch", "ALIGN", "BIAS",
           "OUT_OF_BAND"]

_MAGIC = b"FBPOLv1\0"
_HEAD = struct.Struct("<8sIIQ")
_SPAN = struct.Struct("<QQ")
ALIGN = 64
BIAS = HEADER
OUT_OF_BAND = 4096


class Prepared:
    """Params pickled, their large arrays not copied yet: ``size`` is the blob's."""

    def __init__(self, stream: bytes, raws: list) -> None:
        self.stream, self.raws = stream, raws
        position = _HEAD.size + _SPAN.size * len(raws) + len(stream)
        self.spans = []
        for raw in raws:
            position += -(BIAS + position) % ALIGN
            self.spans.append((position, raw.nbytes))
            position += raw.nbytes
        self.size = position


def prepare(params: Any) -> Prepared:
    """Check and pickle ``params`` (all that can fail), before anything changes; then
    :func:`lay_out` makes the blob.

    Raises:
        TypeError: ``params`` is not a dict, or a value in it cannot be pickled (the
            message names its key).
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"a policy's params are a dict (of arrays, tensors, numbers or "
                        f"nested dicts: a torch state_dict will do), got "
                        f"{type(params).__name__}")
    plain = _plain(params, "params")
    buffers: list = []
    try:
        stream = pickle.dumps(plain, protocol=5, buffer_callback=_out_of_band(buffers))
    except Exception as exc:
        raise _unpicklable(plain, exc) from exc
    return Prepared(stream, [b.raw() for b in buffers])


def lay_out(prepared: Prepared, into: Any = None) -> memoryview:
    """The read-only blob of ``prepared``, written into ``into`` (a bytearray
    of ``prepared.size`` bytes that nobody reads now) or a new buffer."""
    stream, raws, spans = prepared.stream, prepared.raws, prepared.spans
    blob = into if into is not None and len(into) == prepared.size else bytearray(prepared.size)
    _HEAD.pack_into(blob, 0, _MAGIC, len(raws), 0, len(stream))
    for i, span in enumerate(spans):
        _SPAN.pack_into(blob, _HEAD.size + i * _SPAN.size, *span)
    start = _HEAD.size + _SPAN.size * len(raws)
    blob[start:start + len(stream)] = stream
    for raw, (offset, size) in zip(raws, spans):
        blob[offset:offset + size] = raw
    return memoryview(blob).toreadonly()


def _out_of_band(buffers: list):
    def keep(buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < OUT_OF_BAND:
            return True   # small: cheaper in the stream
        buffers.append(buffer)
        return False
    return keep


def thaw(blob: Any) -> dict:
    """The params of a blob, rebuilt on its memory (arrays are views of ``blob``:
    writable if it is).

    Raises:
        ValueError: ``blob`` is not a blob of this version, or is truncated.
    """
    view = memoryview(blob).cast("B")
    if view.nbytes < _HEAD.size or bytes(view[:8]) != _MAGIC:
        raise ValueError(f"{view.nbytes} bytes that are not a fibrl policy blob (wrong "
                         f"magic): a file or answer from another program or version")
    _magic, count, _zero, length = _HEAD.unpack_from(view)
    start = _HEAD.size + _SPAN.size * count
    spans = [_SPAN.unpack_from(view, _HEAD.size + i * _SPAN.size) for i in range(count)]
    end = max([start + length] + [offset + size for offset, size in spans])
    if end > view.nbytes:
        raise ValueError(f"a truncated fibrl policy blob: {view.nbytes} bytes of {end}")
    return pickle.loads(view[start:start + length],
                        buffers=[view[offset:offset + size] for offset, size in spans])


def to_torch(params: Any) -> Any:
    """``params`` with each numpy array replaced by a CPU torch tensor on its memory
    (a copy only for an array torch cannot take: misaligned or read-only).

    Raises:
        ModuleNotFoundError: torch is not installed.
    """
    try:
        import torch
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "as_torch=True needs torch, which is not installed in this process "
            "(pip install torch), or leave as_torch out to get numpy arrays") from exc
    return _map_arrays(params, lambda a: torch.from_numpy(
        a if a.flags.aligned and a.flags.writeable else a.copy()))


def _map_arrays(value: Any, convert) -> Any:
    if isinstance(value, dict):
        return {key: _map_arrays(item, convert) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_map_arrays(item, convert) for item in value)
    if isinstance(value, np.ndarray) and value.dtype != object:
        return convert(value)
    return value


def _plain(value: Any, path: str) -> Any:
    """``value`` with mappings made dicts and torch tensors made numpy arrays on CPU."""
    if isinstance(value, Mapping):
        return {key: _plain(item, f"{path}[{key!r}]") for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(item, f"{path}[{i}]") for i, item in enumerate(value))
    torch = sys.modules.get("torch")   # never imported here: only if the program uses it
    if torch is not None and isinstance(value, torch.Tensor):
        return _tensor(value)
    return value


def _tensor(tensor: Any) -> Any:
    """A tensor's values on the CPU: a numpy array (sharing a CPU tensor's memory: the
    blob's copy freezes it), or a CPU tensor for a dtype numpy lacks (bfloat16)."""
    cpu = tensor.detach().cpu().resolve_conj().resolve_neg()
    try:
        return cpu.numpy()
    except TypeError:
        return cpu.contiguous()


def _unpicklable(plain: Any, exc: Exception) -> TypeError:
    path, culprit = _first_unpicklable(plain, "params")
    what = f"{path} (a {type(culprit).__name__})" if path else "the params"
    return TypeError(f"cannot publish {what}: it cannot be pickled ({type(exc).__name__}: "
                     f"{exc}). Publish numpy arrays, tensors, numbers, strings and nested "
                     f"dicts of them; rebuild other objects from those in the reader.")


def _first_unpicklable(value: Any, path: str) -> tuple:
    """The path and value of the first leaf of ``value`` that pickle refuses."""
    if isinstance(value, dict):
        items = [(f"{path}[{key!r}]", item) for key, item in value.items()]
    elif type(value) in (list, tuple):
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    else:
        try:
            pickle.dumps(value, protocol=5, buffer_callback=lambda _buffer: False)
        except Exception:
            return path, value
        return "", None
    for where, item in items:
        found = _first_unpicklable(item, where)
        if found[0]:
            return found
    return "", None
