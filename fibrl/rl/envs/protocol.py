"""Messages between a :class:`RemoteVectorEnv` and its workers, and batch helpers.

One request per worker per step carries the actions of all the envs it steps;
one reply per half carries their results as numpy arrays (pickled with
protocol 5, so arrays travel as raw buffers, out of band when large). Infos
travel as one list of per-env dicts, ``None`` for an empty one.

The row helpers work on batches of any gymnasium space whose batch is a
numpy array or a dict/tuple of them (Box, Discrete, MultiDiscrete,
MultiBinary, Dict, Tuple).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

__all__ = ["Hello", "Step", "Reset", "Call", "Close", "Result", "Called", "Broken", "Died",
           "rows", "row", "write_rows", "stack"]


@dataclasses.dataclass(frozen=True, slots=True)
class Hello:
    """A worker's first frame: which worker (and incarnation) this connection is."""

    worker: int
    gen: int


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
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

    ``restarts`` lists ``(slot, traceback)`` for each env that raised and was
    recreated during this request; those envs report ``truncated=True``.
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
class Called:
    """The per-env results of a Call, in slot order (an exception instead, when one raised)."""

    worker: int
    gen: int
    seq: int
    values: list
    error: Optional[BaseException] = None


@dataclasses.dataclass(frozen=True, slots=True)
class Broken:
    """A worker cannot go on: an env could not even be recreated (``traceback`` says why)."""

    worker: int
    gen: int
    slot: int
    traceback: str


@dataclasses.dataclass(frozen=True, slots=True)
class Died:
    """Posted by the vector env's watcher when a worker's process ended."""

    worker: int
    gen: int
    exitcode: Optional[int]


# -- batches ------------------------------------------------------------------------------
def row(batch: Any, i: int) -> Any:
    """Element ``i`` of a batch (a numpy array, or a dict/tuple of batches)."""
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
    return np.asarray(batch)[idx]


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
