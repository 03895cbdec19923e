"""A drawn sample's arrays in one buffer: how a store server hands a batch out.

Pickled as a dict of numpy arrays, a sample costs pickle's reduction of each of its
arrays (the columns, ids, priorities, probabilities): about 25 us for a CartPole
batch of 256, most of a store server's encoding time per sample. :func:`gather`
returns a :class:`RawSample` instead: the same dict, whose arrays it takes straight into
one buffer, and which pickles as that buffer and a small layout tuple (about 5 us).
Unpickled, it is a plain dict again, its arrays writable, aligned views of the received
buffer (about 11 us for that batch, against 17 for the arrays)::

    buffer: [column 0][column 1]...[ids:i8][priorities:f8][probabilities:f8]
            each array at an offset rounded up to 16 bytes, C order
    layout: (k, column names, dtype strings, row shapes, has probabilities)

A sample larger than 64 KiB (its large arrays are sent out of band, uncopied), or with
an array whose dtype has no plain binary form (object, structured), or an empty one,
stays a dict of arrays, pickled array by array.
"""
from __future__ import annotations

import pickle
from typing import Any, Optional

import numpy as np

__all__ = ["RawSample", "gather"]

_ALIGN = 16
# The largest sample joined: a larger one's copy costs more than pickle's per-array work
# saves, and fibrl sends a buffer of 64 KiB or more out of band, without a copy (a
# joined buffer that went so anyway is read back as well: see _rebuilt).
_JOIN_MAX = 64 * 1024 - 1
_CACHE_MAX = 256
_plans: dict = {}   # layout -> ([(dtype, shape, offset, count)], total bytes)
_SCALARS = ("size", "mass", "beta", "min_probability", "weights")


def _plan(layout: tuple) -> Optional[tuple]:
    """Where each array of a sample with this layout lies in its buffer (cached); None
    when an array is empty (numpy reads no empty array at the end of a buffer)."""
    plan = _plans.get(layout)
    if plan is None:
        k, _names, dtypes, rows, _has_probs = layout
        places, at = [], 0
        for code, row in zip(dtypes, rows):
            dtype = np.dtype(code)
            shape = (k,) + tuple(row)
            count = int(np.prod(shape, dtype=np.int64))
            if not count:
                return None
            places.append((dtype, shape, at, count))
            at += -(-count * dtype.itemsize // _ALIGN) * _ALIGN
        plan = (places, at)
        if len(_plans) < _CACHE_MAX:
            _plans[layout] = plan
    return plan


class RawSample(dict):
    """A sample (the dict :meth:`ReplayTable.sample` returns) whose arrays are views of
    one buffer, and which pickles as that buffer. Built by :func:`gather` only: its
    pickle is the buffer's arrays, so the dict is not to be given other arrays before it
    is sent."""

    __slots__ = ("_buffer", "_layout")
    _buffer: bytearray
    _layout: tuple

    def __reduce__(self) -> tuple:
        return (_rebuilt, (self._layout, pickle.PickleBuffer(self._buffer),
                           tuple(self[name] for name in _SCALARS)))


def _rebuilt(layout: tuple, buffer: Any, scalars: tuple) -> dict:
    """The sample dict, its arrays views of ``buffer``: a bytearray (pickled in band:
    allocated aligned), or a memoryview of the received frame (a large sample, sent out
    of band), copied once into an aligned buffer when its place in the frame is not."""
    places, _total = _plan(layout)  # type: ignore[misc]  # (made with one by gather)
    if type(buffer) is not bytearray:
        flat = np.frombuffer(buffer, np.uint8)
        if flat.ctypes.data % _ALIGN:
            buffer = flat.copy()
    arrays = [np.frombuffer(buffer, dtype, count, at).reshape(shape)
              for dtype, shape, at, count in places]
    names, has_probs = layout[1], layout[4]
    n = len(names)
    raw = dict(data=dict(zip(names, arrays[:n])), ids=arrays[n], priorities=arrays[n + 1],
               probabilities=arrays[n + 2] if has_probs else None)
    raw.update(zip(_SCALARS, scalars))
    return raw


def _code(dtype: np.dtype) -> Optional[str]:
    """``dtype.str``, or None for a dtype with no plain binary form."""
    return None if dtype.kind in "OV" else dtype.str


def _joinable(columns: dict, k: int, has_probs: bool) -> Optional[tuple]:
    """``(layout, places, total bytes)`` of a sample of ``k`` rows of ``columns``, or
    None when it is sent as a plain dict (see the module's docstring)."""
    codes = tuple([_code(c.dtype) for c in columns.values()])
    if None in codes:
        return None
    extra = _EXTRA_CODES[has_probs]   # ids, priorities(, probabilities)
    rows = tuple([c.shape[1:] for c in columns.values()]) + ((),) * len(extra)
    layout = (k, tuple(columns), codes + extra, rows, has_probs)
    plan = _plan(layout)
    if plan is None or plan[1] > _JOIN_MAX:
        return None   # (its large arrays travel out of band, uncopied)
    return layout, plan[0], plan[1]


# the dtype strings of the arrays every sample has after its columns, without and with
# probabilities
_EXTRA_CODES = {False: (np.dtype(np.int64).str, np.dtype(np.float64).str),
                True: (np.dtype(np.int64).str,) + (np.dtype(np.float64).str,) * 2}


def gather(columns: dict, slots: np.ndarray, slot_ids: np.ndarray, priorities: np.ndarray,
           probabilities: Optional[np.ndarray], plans: dict, **scalars: Any) -> dict:
    """The sample of rows ``slots``: ``data`` (each column's rows), ``ids``,
    ``priorities``, ``probabilities`` and the ``scalars`` (size, mass, beta,
    min_probability, weights); a :class:`RawSample` when every dtype allows it.

    ``plans`` caches where each array lies per batch size: the caller owns it and
    empties it whenever ``columns`` change (another dict, other dtypes or shapes).
    """
    has_probs = probabilities is not None
    key = (len(slots), has_probs)
    found = plans.get(key, False)
    if found is False:
        found = _joinable(columns, len(slots), has_probs)
        if len(plans) < _CACHE_MAX:
            plans[key] = found
    if found is None:
        # take() gathers rows two to three times faster than fancy indexing
        return dict(data={name: col.take(slots, axis=0) for name, col in columns.items()},
                    ids=slot_ids.take(slots), priorities=priorities.take(slots),
                    probabilities=probabilities, **scalars)
    layout, places, total = found
    buffer = bytearray(total)
    views = [np.ndarray(shape, dtype, buffer, at) for dtype, shape, at, _count in places]
    n = len(columns)
    # rows taken straight into place: the first take checks every slot (a slot out of
    # range raises IndexError), so the others can skip that ("clip": no buffered copy)
    slot_ids.take(slots, out=views[n])
    priorities.take(slots, out=views[n + 1], mode="clip")
    for column, view in zip(columns.values(), views):
        column.take(slots, axis=0, out=view, mode="clip")
    if has_probs:
        views[n + 2][...] = probabilities
    out = RawSample(data=dict(zip(layout[1], views[:n])), ids=views[n],
                    priorities=views[n + 1], probabilities=views[n + 2] if has_probs else None,
                    **scalars)
    out._buffer, out._layout = buffer, layout
    return out

