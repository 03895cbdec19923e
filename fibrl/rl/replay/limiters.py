"""When a replay table lets an insert or a sample through: the rate limiters.

Owns the limiter specs users pass (Reverb's set: :class:`MinSize`,
:class:`SampleToInsertRatio`, :class:`Queue`, :class:`Stack`), the admission
rule each one applies to a batch, and the refusal of configurations that can
deadlock. It does not own waiting (the table waits on its condition variable
and asks :meth:`Limiter.can_insert` / :meth:`Limiter.can_sample` again after
every change).

All limiters are one rule over three numbers: ``size`` (items held),
``inserts`` and ``samples`` (items ever inserted and sampled). With
``diff = inserts * samples_per_insert - samples``:

- a sample of ``k`` items passes when ``size >= min_size`` and
  ``diff - k >= min_diff``;
- an insert of ``n`` items passes when ``size + n <= min_size`` or
  ``diff + n * samples_per_insert <= max_diff``.

``min_diff``/``max_diff`` are ``samples_per_insert * min_size -/+ error_buffer``
for :class:`SampleToInsertRatio`, and unbounded for :class:`MinSize`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

__all__ = ["MinSize", "SampleToInsertRatio", "Queue", "Stack", "LimiterSpec", "Limiter"]


@dataclasses.dataclass(frozen=True)
class MinSize:
    """Sampling waits until the store holds ``min_size`` items; inserts never wait."""

    min_size: int = 1


@dataclasses.dataclass(frozen=True)
class SampleToInsertRatio:
    """Keep ``samples / inserts`` near ``samples_per_insert``, within ``error_buffer`` samples.

    Writers that run ahead wait for the learner and the learner that runs ahead waits
    for the writers, once ``min_size_to_sample`` items are in.
    """

    samples_per_insert: float
    min_size_to_sample: int
    error_buffer: float


@dataclasses.dataclass(frozen=True)
class Queue:
    """A bounded queue of ``size`` items: each item sampled once, oldest first.

    Use with :meth:`fibrl.rl.ReplayStore.queue` (which sets the FIFO sampler and
    remover and ``max_times_sampled=1``).
    """

    size: int


@dataclasses.dataclass(frozen=True)
class Stack:
    """Like :class:`Queue`, newest first (:meth:`fibrl.rl.ReplayStore.stack`)."""

    size: int


LimiterSpec = Union[MinSize, SampleToInsertRatio, Queue, Stack]


class Limiter:
    """The admission rule of one spec, over the table's counters."""

    def __init__(self, spec: Optional[LimiterSpec], capacity: int,
                 max_times_sampled: Optional[int]) -> None:
        spec = MinSize(1) if spec is None else spec
        self.spec = spec
        if isinstance(spec, MinSize):
            self.spi, self.min_size = 1.0, spec.min_size
            self.min_diff, self.max_diff = -math.inf, math.inf
        elif isinstance(spec, SampleToInsertRatio):
            self.spi, self.min_size = float(spec.samples_per_insert), spec.min_size_to_sample
            centre = self.spi * self.min_size
            self.min_diff = centre - spec.error_buffer
            self.max_diff = centre + spec.error_buffer
        elif isinstance(spec, (Queue, Stack)):
            self.spi, self.min_size = 1.0, 1
            self.min_diff, self.max_diff = 0.0, float(spec.size)
        else:
            raise TypeError(f"rate_limiter must be MinSize, SampleToInsertRatio, Queue or "
                            f"Stack, got {type(spec).__name__}")
        self.largest_insert = 1
        self.largest_sample = 1
        refuse_deadlocks(self, spec, capacity, max_times_sampled)

    def can_sample(self, k: int, size: int, inserts: int, samples: int) -> bool:
        return size >= max(1, self.min_size) and inserts * self.spi - samples - k >= self.min_diff

    def can_insert(self, n: int, size: int, inserts: int, samples: int) -> bool:
        return (size + n <= self.min_size
                or (inserts + n) * self.spi - samples <= self.max_diff)

    def check_batch(self, side: str, n: int) -> None:
        """Refuse a batch that, with the largest batch seen on the other side, cannot
        ever pass (both sides would wait for each other)."""
        if self.max_diff == math.inf:
            return
        inserts = n if side == "insert" else self.largest_insert
        samples = n if side == "sample" else self.largest_sample
        band = self.max_diff - self.min_diff
        if inserts * self.spi + samples > band:
            raise ValueError(
                f"a {side} of {n} items can deadlock this rate limiter: an insert of "
                f"{inserts} items ({inserts * self.spi:g} samples' worth) plus a sample of "
                f"{samples} items need a tolerance band of at least "
                f"{inserts * self.spi + samples:g}, but the band "
                f"(max_diff - min_diff) is {band:g}. Use smaller batches or a larger "
                f"error_buffer ({self.spec!r}).")
        if side == "insert":
            self.largest_insert = max(self.largest_insert, n)
        else:
            self.largest_sample = max(self.largest_sample, n)

    def describe(self, size: int, inserts: int, samples: int) -> str:
        diff = inserts * self.spi - samples
        return (f"size={size}, inserts={inserts}, samples={samples}, samples_per_insert="
                f"{self.spi:g}, min_size={self.min_size}, diff={diff:g}, allowed band "
                f"[{self.min_diff:g}, {self.max_diff:g}] ({self.spec!r})")


def refuse_deadlocks(limiter: Limiter, spec: Any, capacity: int,
                     max_times_sampled: Optional[int]) -> None:
    """Raise ``ValueError`` for a configuration where writers and learners can both wait
    forever, naming the reason."""
    if limiter.min_size > capacity:
        raise ValueError(f"min size to sample {limiter.min_size} exceeds capacity {capacity}: "
                         f"the store can never hold enough items to sample. Lower the "
                         f"minimum size or raise the capacity.")
    if isinstance(spec, SampleToInsertRatio):
        if spec.samples_per_insert <= 0:
            raise ValueError(f"samples_per_insert must be > 0, got {spec.samples_per_insert}")
        if spec.error_buffer < max(1.0, spec.samples_per_insert):
            raise ValueError(
                f"error_buffer={spec.error_buffer} is narrower than max(1, samples_per_insert)"
                f"={max(1.0, spec.samples_per_insert):g}: one insert would move the ratio out "
                f"of the band on one side and one sample out of it on the other, so writers and "
                f"learner can both block. Use error_buffer >= {max(1.0, spec.samples_per_insert):g}"
                f" (larger than your batch sizes for batched calls).")
        if max_times_sampled is not None and spec.samples_per_insert > max_times_sampled:
            raise ValueError(
                f"samples_per_insert={spec.samples_per_insert} exceeds max_times_sampled="
                f"{max_times_sampled}: items are removed before the learner may take its "
                f"share of samples, the store drains below the minimum size while writers "
                f"wait for samples, and both block. Raise max_times_sampled or lower the ratio.")
    if isinstance(spec, (Queue, Stack)) and spec.size > capacity:
        raise ValueError(f"{type(spec).__name__}(size={spec.size}) exceeds capacity {capacity}: "
                         f"inserts would evict unread items. Use capacity >= size.")
