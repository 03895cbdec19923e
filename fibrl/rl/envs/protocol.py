"""Messages between a :class:`RemoteVectorEnv` and its workers, and batch helpers.

One request per worker per step carries the actions of all the envs it steps;
one reply per half carries their results as numpy arrays. Infos travel as one
list of per-env dicts, ``None`` for an empty one.

:func:`encode` and :func:`decode` turn messages into frames (a worker builds
its step replies with :func:`encode_result`, from its arrays). The per-step
messages (a ``Step`` whose actions are one numpy array, a ``Result`` of a step
whose observations are one numpy array) use a compact binary layout: a fixed
header, the slots, then the arrays' raw bytes (a large observation batch is
sent as its own part, not copied into a joined frame); only non-empty infos
and restarts are pickled. Everything else is a fibrl frame
(``fibrl.channel.dumps``: pickle protocol 5, large buffers out of band)::

    Step:   b"FS" | seq:u64 | nslots:u32 | slots:u32[nslots] | actions (array)
    Result: b"FR" | worker:u32 | gen:u32 | seq:u64 | nslots:u32 | slots:u32[nslots]
            | obs (array) | rewards:f64[n] | terminated:b1[n] | truncated:b1[n]
            | len(tail):u32 | tail (a fibrl frame of (infos, restarts), when not empty)
    array:  len(dtype):u8 | dtype.str | ndim:u8 | shape:u32[ndim] | raw bytes (C order)

The row helpers work on batches of any gymnasium space whose batch is a
numpy array or a dict/tuple of them (Box, Discrete, MultiDiscrete,
MultiBinary, Dict, Tuple), and on the 1-D object arrays that carry the
elements of every other space (see :mod:`.spaces`).
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Any, Optional

import numpy as np

from ...channel import dumps, loads

__all__ = ["Hello", "Step", "Reset", "Call", "Close", "Result", "Called", "Broken", "Died",
           "Failure", "rows", "row", "write_rows", "stack", "encode", "encode_result",
           "decode"]


@dataclasses.dataclass(frozen=True, slots=True)
class Hello:
    """A worker's first frame: which worker (and incarnation) this connection is, and the
    address of its own listener when it offers a direct connection (else ``""``)."""

    worker: int
    gen: int
    address: str = ""


@dataclasses.dataclass(slots=True)   # (not frozen: made per worker and step, on both
class Step:                            # sides; a frozen dataclass's init costs 2.5x)
    """Step the envs at ``slots`` (indices into the worker's envs) with batched ``actions``."""

    seq: int
    slots: tuple
    actions: Any

    def __reduce__(self):  # the hot path: plain positional rebuild, no per-field setstate
        return (Step, (self.seq, self.slots, self.actions))


@dataclasses.dataclass(frozen=True, slots=True)
class Reset:
    """Reset the envs at ``slots`` with one seed each and the shared ``options``."""

    seq: int
    slots: tuple
    seeds: tuple
    options: Optional[dict]


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """Call ``name(*args, **kwargs)`` on every env of the worker (or get the attribute);
    ``values`` set it instead, one value per env."""

    seq: int
    name: str
    args: tuple = ()
    kwargs: Optional[dict] = None
    values: Optional[tuple] = None


@dataclasses.dataclass(frozen=True, slots=True)
class Close:
    """Close every env and exit."""


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """What a Step or Reset produced for ``slots`` of worker ``worker`` (incarnation ``gen``).

    ``restarts`` lists a :class:`Failure` for each env that raised during this
    request: recreated (``restarted``; those envs report ``truncated=True``), or
    left for the caller to see (``on_error="raise"``, or a reset that failed again
    on a fresh env with the same seed).
    """

    worker: int
    gen: int
    seq: int
    slots: tuple
    obs: Any
    rewards: Any
    terminated: Any
    truncated: Any
    infos: list
    restarts: tuple = ()

    def __reduce__(self):  # the hot path: plain positional rebuild, no per-field setstate
        return (Result, (self.worker, self.gen, self.seq, self.slots, self.obs, self.rewards,
                         self.terminated, self.truncated, self.infos, self.restarts))


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """An exception an env's own code raised in slot ``slot`` (``step``, ``reset`` or a
    call): its type and message, its formatted traceback, and the exception itself when
    it pickles (``None`` otherwise). ``restarted``: the worker recreated the env."""

    slot: int
    traceback: str
    error_type: str
    message: str
    error: Optional[BaseException] = dataclasses.field(default=None, compare=False)
    restarted: bool = True

    @classmethod
    def capture(cls, slot: int, exc: BaseException, restarted: bool = True) -> "Failure":
        """The failure of ``exc``, being handled now (its traceback is formatted here)."""
        import traceback

        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        error: Optional[BaseException] = exc
        try:
            loads(dumps(exc))
        except Exception:
            error = None   # rebuilt from its type and message by the vector env
        if error is not None:
            error.__traceback__ = None
            error.__context__ = error.__cause__ = None
        return cls(slot, text, type(exc).__name__, str(exc), error, restarted)

    @property
    def summary(self) -> str:
        """``"Type: message"``, as the traceback's last line says it."""
        return f"{self.error_type}: {self.message}" if self.message else self.error_type


@dataclasses.dataclass(frozen=True, slots=True)
class Called:
    """The per-env results of a Call, in slot order (a :class:`Failure` instead, when one
    raised)."""

    worker: int
    gen: int
    seq: int
    values: list
    error: Optional[Failure] = None


@dataclasses.dataclass(frozen=True, slots=True)
class Broken:
    """A worker cannot go on: an env could not even be recreated (``traceback`` says why)."""

    worker: int
    gen: int
    slot: int
    traceback: str


# -- posted to the vector env by its supervisor (never sent on the wire) ------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Died:
    """A worker's process ended; ``detail``: the backend's reason or its load error."""

    worker: int
    gen: int
    exitcode: Optional[int]
    detail: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Started:
    """A worker's process started (its Hello may come before or after this)."""

    worker: int
    gen: int


@dataclasses.dataclass(frozen=True, slots=True)
class StartFailed:
    """The backend refused to start a worker's process."""

    worker: int
    gen: int
    error: BaseException


# -- batches ------------------------------------------------------------------------------
def row(batch: Any, i: int) -> Any:
    """Element ``i`` of a batch (a numpy array, a list, or a dict/tuple of batches)."""
    if isinstance(batch, dict):
        return {k: row(v, i) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(row(v, i) for v in batch)
    return batch[i]


def rows(batch: Any, idx: Any) -> Any:
    """The sub-batch at indices ``idx`` (a copy, so it pickles as its own buffer)."""
    if isinstance(batch, dict):
        return {k: rows(v, idx) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(rows(v, idx) for v in batch)
    if isinstance(batch, list):
        return [batch[i] for i in np.arange(len(batch))[idx]]
    part = np.asarray(batch)[idx]
    return part.copy() if isinstance(idx, slice) else part   # a slice is a view


def write_rows(dst: Any, idx: Any, src: Any) -> None:
    """``dst[idx] = src`` through dicts and tuples."""
    if isinstance(dst, dict):
        for k in dst:
            write_rows(dst[k], idx, src[k])
    elif isinstance(dst, tuple):
        for d, s in zip(dst, src):
            write_rows(d, idx, s)
    else:
        dst[idx] = src


def stack(items: list) -> Any:
    """A batch from single elements (``np.stack`` through dicts and tuples)."""
    first = items[0]
    if isinstance(first, dict):
        return {k: stack([it[k] for it in items]) for k in first}
    if isinstance(first, tuple):
        return tuple(stack([it[j] for it in items]) for j in range(len(first)))
    return np.stack([np.asarray(it) for it in items])


# -- frames -------------------------------------------------------------------------------
_STEP = struct.Struct("<2sQI")
_RESULT = struct.Struct("<2sIIQI")
_U32 = struct.Struct("<I")
_STEP_TAG, _RESULT_TAG = b"FS", b"FR"
_JOIN_MAX = 64 * 1024   # larger observation batches travel as their own part


def _plain(a: Any) -> bool:
    """An array the compact layout can carry: numeric numpy, not object or structured."""
    return type(a) is np.ndarray and a.dtype.kind in "biufc" and a.ndim < 256


_heads: dict = {}    # (dtype, shape) -> array header; a few entries per vector env
_layouts: dict = {}  # array header -> (dtype, shape, count, nbytes): the reverse
_slot_structs: dict = {}  # n -> Struct of n slots
_CACHE_MAX = 1024


def _array_head(a: np.ndarray) -> bytes:
    key = (a.dtype, a.shape)
    head = _heads.get(key)
    if head is None:
        code = a.dtype.str.encode()
        head = (bytes((len(code),)) + code + bytes((a.ndim,))
                + struct.pack(f"<{a.ndim}I", *a.shape))
        if len(_heads) < _CACHE_MAX:
            _heads[key] = head
    return head


def _slots(n: int) -> struct.Struct:
    """The Struct of ``n`` u32 slots (cached: a vector env uses a few sizes)."""
    packer = _slot_structs.get(n)
    if packer is None:
        packer = struct.Struct(f"<{n}I")
        if len(_slot_structs) < _CACHE_MAX:
            _slot_structs[n] = packer
    return packer


def _layout(head: bytes) -> tuple:
    """(dtype, shape, count, nbytes) of an array header."""
    layout = _layouts.get(head)
    if layout is None:
        n = head[0]
        dtype = np.dtype(head[1:1 + n].decode())
        ndim = head[1 + n]
        shape = struct.unpack_from(f"<{ndim}I", head, 2 + n)
        count = 1
        for d in shape:
            count *= d
        layout = (dtype, shape, count, count * dtype.itemsize)
        if len(_layouts) < _CACHE_MAX:
            _layouts[head] = layout
    return layout


def _head_at(buf: Any, offset: int) -> tuple:
    """``(layout, end)`` of the array header that starts at ``offset`` of ``buf``: its
    ``_layout``, and where the array's bytes begin."""
    end = offset + 2 + buf[offset] + 4 * buf[offset + 1 + buf[offset]]
    return _layout(bytes(buf[offset:end])), end


def _read_array(buf: Any, offset: int) -> tuple:
    """The array whose header starts at ``offset`` (a view of ``buf``) and where it ends."""
    (dtype, shape, count, nbytes), end = _head_at(buf, offset)
    a = np.frombuffer(buf, dtype, count, end)
    if len(shape) != 1:
        a = a.reshape(shape)
    return a, end + nbytes


def encode(msg: Any) -> Any:
    """The frame of ``msg``: ``bytes``, or a list of parts (see the module docstring)."""
    if type(msg) is Step and _plain(msg.actions):
        acts = np.ascontiguousarray(msg.actions)
        n = len(msg.slots)
        return b"".join((_STEP.pack(_STEP_TAG, msg.seq, n), _slots(n).pack(*msg.slots),
                         _array_head(acts), acts.tobytes()))
    if type(msg) is Result and msg.rewards is not None:
        return encode_result(msg.worker, msg.gen, msg.seq, msg.slots, msg.obs, msg.rewards,
                             msg.terminated, msg.truncated, msg.infos, msg.restarts)
    return dumps(msg)


def encode_result(worker: int, gen: int, seq: int, slots: tuple, obs: Any, rewards: Any,
                  terminated: Any, truncated: Any, infos: list, restarts: tuple = ()) -> Any:
    """The frame of the step ``Result`` with these fields, built without the message (the
    worker's hot path). The frame holds copies: ``obs`` may be reused once it is sent."""
    if not _plain(obs):
        return dumps(Result(worker, gen, seq, slots, obs, rewards, terminated,
                                          truncated, infos, restarts))
    n = len(slots)
    if not obs.flags.c_contiguous:
        obs = np.ascontiguousarray(obs)
    tail = dumps((infos, restarts)) if restarts or any(infos) else b""
    head = (_RESULT.pack(_RESULT_TAG, worker, gen, seq, n) + _slots(n).pack(*slots)
            + _array_head(obs))
    stats = (np.asarray(rewards, np.float64).tobytes(),
             np.asarray(terminated, np.bool_).tobytes(),
             np.asarray(truncated, np.bool_).tobytes(), _U32.pack(len(tail)), tail)
    if obs.nbytes <= _JOIN_MAX:
        return b"".join((head, obs.tobytes(), *stats))
    return [head, memoryview(obs).cast("B"), b"".join(stats)]


def decode(frame: Any) -> Any:
    """The message of a frame made by :func:`encode` (arrays are read-only views of the
    frame, except a Step's actions: a writable copy, as a pickled array would be)."""
    tag = bytes(frame[:2])
    if tag == _RESULT_TAG:
        _, worker, gen, seq, n = _RESULT.unpack_from(frame)
        slots = _slots(n).unpack_from(frame, _RESULT.size)
        obs, at = _read_array(frame, _RESULT.size + 4 * n)
        rewards = np.frombuffer(frame, np.float64, n, at)
        flags = np.frombuffer(frame, np.bool_, 2 * n, at + 8 * n)
        at += 10 * n
        size = _U32.unpack_from(frame, at)[0]
        infos, restarts = [None] * n, ()
        if size:
            infos, restarts = loads(memoryview(frame)[at + 4:at + 4 + size])
        return Result(worker, gen, seq, slots, obs, rewards, flags[:n], flags[n:], infos,
                      restarts)
    if tag == _STEP_TAG:
        _, seq, n = _STEP.unpack_from(frame)
        slots = _slots(n).unpack_from(frame, _STEP.size)
        actions, _ = _read_array(frame, _STEP.size + 4 * n)
        return Step(seq, slots, actions.copy())
    return loads(frame)
