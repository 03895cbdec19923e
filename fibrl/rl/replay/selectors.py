"""Which items a replay table samples or removes: the selector specs and their indexes.

Owns the six selection strategies (Reverb's set) twice over: as small picklable
specs that users pass (:class:`Uniform`, :class:`Prioritized`, :class:`Fifo`,
:class:`Lifo`, :class:`MinHeap`, :class:`MaxHeap`) and as the index each one
builds inside the store server (a sum tree, an insertion-order deque, a lazy
heap). It does not own storage, locking or rate limiting (``table``).

Every index is keyed by *slot* (the row of the table's arrays) and checks an
entry against the table's ``slot_ids`` array, so removed items are dropped
lazily and a stale entry can never select a reused slot.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Any, Optional, Union

import numpy as np

__all__ = ["Uniform", "Prioritized", "Fifo", "Lifo", "MinHeap", "MaxHeap", "SelectorSpec",
           "as_selector", "SumTree", "MinTree", "WEIGHT_NORMALIZATIONS"]


@dataclasses.dataclass(frozen=True)
class Uniform:
    """Every live item equally likely (with replacement within a batch)."""


#: how importance weights are normalised (see :class:`Prioritized`)
WEIGHT_NORMALIZATIONS = ("buffer", "batch")


@dataclasses.dataclass(frozen=True)
class Prioritized:
    """Item ``i`` drawn with probability ``P(i) = (p_i + eps)**alpha / sum_j (p_j + eps)**alpha``.

    Importance weights are ``w_i = (N * P(i)) ** -beta`` (``N`` items held), divided by
    the largest weight any held item could get, ``(N * P_min) ** -beta`` with ``P_min``
    the smallest nonzero probability in the whole store (over every shard), as in
    Schaul et al. (2016), cpprb and torchrl: ``weights="buffer"``, the default. With
    ``weights="batch"`` they are divided by the batch's largest weight instead (every
    batch then has a weight of exactly 1). ``beta`` is the default of
    ``sample(..., beta=...)``, which anneals it per call.

    Example:
        >>> Prioritized(alpha=0.6, beta=0.4)                  # PER's normalisation
        Prioritized(alpha=0.6, beta=0.4, eps=1e-06, weights='buffer')
        >>> Prioritized(weights="batch").weights               # the batch's largest
        'batch'
    """

    alpha: float = 0.6
    beta: float = 0.4
    eps: float = 1e-6
    weights: str = "buffer"

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta >= 0 and self.eps >= 0):
            raise ValueError(f"Prioritized needs alpha, beta, eps >= 0, got {self!r}")
        if self.weights not in WEIGHT_NORMALIZATIONS:
            raise ValueError(f"Prioritized(weights={self.weights!r}): choose \"buffer\" "
                             f"(divide by the largest weight over the store, as PER does) "
                             f"or \"batch\" (divide by the batch's largest)")


@dataclasses.dataclass(frozen=True)
class Fifo:
    """The oldest items first: a batch of k is the k oldest (repeated if fewer exist)."""


@dataclasses.dataclass(frozen=True)
class Lifo:
    """The newest items first: a batch of k is the k newest (repeated if fewer exist)."""


@dataclasses.dataclass(frozen=True)
class MinHeap:
    """The lowest priorities first: a batch of k is the k lowest."""


@dataclasses.dataclass(frozen=True)
class MaxHeap:
    """The highest priorities first: a batch of k is the k highest."""


SelectorSpec = Union[Uniform, Prioritized, Fifo, Lifo, MinHeap, MaxHeap]
_NAMES = {"uniform": Uniform, "prioritized": Prioritized, "fifo": Fifo, "lifo": Lifo,
          "min_heap": MinHeap, "max_heap": MaxHeap, "lowest_priority": MinHeap}


def as_selector(spec: Any, what: str) -> SelectorSpec:
    """A selector spec from a spec or its name (``"fifo"``, ``"prioritized"``, ...)."""
    if isinstance(spec, str):
        cls = _NAMES.get(spec.lower())
        if cls is None:
            raise ValueError(f"unknown {what} {spec!r}; choose one of {sorted(_NAMES)} or pass "
                             f"an instance such as fibrl.rl.replay.Prioritized(alpha=0.6)")
        return cls()
    if isinstance(spec, (Uniform, Prioritized, Fifo, Lifo, MinHeap, MaxHeap)):
        return spec
    raise TypeError(f"{what} must be a selector name or spec, got {type(spec).__name__}")


class SumTree:
    """Per-slot weights, drawn from in proportion to weight, a batch at a time.

    A binary sum tree (heap layout: node ``i`` has children ``2i`` and ``2i + 1``,
    the leaves are ``size .. 2 * size - 1``) that keeps only its lower levels: the
    widest level of at most :attr:`ROOTS` nodes is the top, and a draw finds its
    top node with one ``cumsum`` + ``searchsorted`` over that level, then walks
    the few levels below (8 for a million slots, none up to ``ROOTS`` slots).

    Every step is one numpy call over the whole batch, so a batch of 256 costs
    about as many calls as a batch of one; the walk reads one node per item and
    level, which on a large table means a cache miss each, hence few levels.
    """

    #: the most nodes of the top level (its cumulative sum is recomputed per draw)
    ROOTS = 4096

    def __init__(self, capacity: int) -> None:
        self.depth = max(1, int(capacity - 1).bit_length())
        self.size = 1 << self.depth
        self.walk = max(0, self.depth - (self.ROOTS.bit_length() - 1))
        self.width = self.size >> self.walk  # nodes in the top level
        self.tree = np.zeros(2 * self.size, dtype=np.float64)
        self.top = self.tree[self.width:2 * self.width]  # a view: sums kept by set()
        self._total: Optional[float] = 0.0   # the top level's sum; None: not known

    def set(self, leaves: np.ndarray, values: np.ndarray) -> None:
        _set_leaves(leaves, values, self, None)

    def total(self) -> float:
        if self._total is None:
            self._total = float(self.top.sum())
        return self._total

    def leaf(self, leaves: np.ndarray) -> np.ndarray:
        return self.tree.take(np.asarray(leaves, dtype=np.int64) + self.size)

    def find(self, fractions: np.ndarray, rng: np.random.Generator) -> tuple:
        """``(leaves, total)``: for each of ``fractions`` (in ``[0, 1)``) the leaf where
        the prefix sums cross ``fraction * total``, so leaf ``i`` is drawn with
        probability ``weight_i / total``.

        Raises:
            ValueError: every weight is zero (nothing can be drawn).
        """
        sums = np.cumsum(self.top)
        total = self._total = float(sums[-1])
        if not total > 0:
            raise ValueError("cannot sample: every held item has weight 0 (priorities 0 "
                             "with eps=0); give Prioritized an eps > 0 or nonzero priorities")
        u = fractions * total
        node = np.searchsorted(sums, u, side="right")
        np.minimum(node, self.width - 1, out=node)  # u rounded up to the total
        u -= np.concatenate(([0.0], sums)).take(node)  # the mass left of the top node
        node += self.width
        tree = self.tree
        for _level in range(self.walk):
            node <<= 1
            left = tree.take(node)
            right = u >= left
            left *= right   # (faster than subtract(..., where=right): no masked loop)
            u -= left
            node += right
        leaves = node - self.size
        empty = tree.take(node) <= 0
        if empty.any():  # rounding walked onto an empty leaf: draw those again
            leaves[empty] = self.find(rng.random(int(empty.sum())), rng)[0]
        return leaves, total


class MinTree:
    """The smallest positive per-slot weight, kept as slots change.

    Laid out like :class:`SumTree` (heap layout, only the levels below a top level of
    at most :attr:`SumTree.ROOTS` nodes kept): a change walks those few levels, and
    :meth:`min` reads the top level. An empty slot, or one of weight 0 (never drawn),
    holds ``inf``.
    """

    def __init__(self, capacity: int) -> None:
        self.depth = max(1, int(capacity - 1).bit_length())
        self.size = 1 << self.depth
        self.walk = max(0, self.depth - (SumTree.ROOTS.bit_length() - 1))
        self.width = self.size >> self.walk
        self.tree = np.full(2 * self.size, np.inf, dtype=np.float64)
        self.top = self.tree[self.width:2 * self.width]

    def set(self, leaves: np.ndarray, values: np.ndarray) -> None:
        _set_leaves(leaves, values, None, self)

    def min(self) -> float:
        """The smallest positive weight held (``inf`` when none is)."""
        return float(self.top.min())


def _set_leaves(leaves: np.ndarray, values: np.ndarray, sums: Optional[SumTree],
                mins: Optional[MinTree]) -> None:
    """Set ``leaves`` of a sum tree, a min tree or both (of one capacity, so laid out
    alike) to ``values``, and their ancestors up to the top level: one walk for both
    trees, as a priority update changes both."""
    tree = sums if sums is not None else mins
    assert tree is not None and (sums is None or mins is None or sums.size == mins.size)
    idx = np.asarray(leaves, dtype=np.int64) + tree.size
    if sums is not None:
        sums._total = None
        added = sums.tree
        added[idx] = values
        add_pairs = added.reshape(-1, 2)   # row i: the two children of node i
    if mins is not None:
        values = np.asarray(values, dtype=np.float64)
        least = mins.tree
        least[idx] = values if values.min(initial=np.inf) > 0 else np.where(values > 0, values,
                                                                             np.inf)
        min_pairs = least.reshape(-1, 2)
    for _level in range(tree.walk):
        # duplicates just recompute the same parent: cheaper than np.unique per level
        idx >>= 1
        if sums is not None:
            both = add_pairs.take(idx, axis=0)
            added[idx] = both[:, 0] + both[:, 1]
        if mins is not None:
            both = min_pairs.take(idx, axis=0)
            least[idx] = np.minimum(both[:, 0], both[:, 1])


class TreeIndex:
    """Uniform and prioritized selection: a sum tree of each slot's weight (and, for
    PER's weight normalisation, a :class:`MinTree` of them)."""

    def __init__(self, spec: SelectorSpec, capacity: int, slot_ids: np.ndarray) -> None:
        self.spec = spec
        self.tree = SumTree(capacity)
        self.slot_ids = slot_ids
        buffer_wide = isinstance(spec, Prioritized) and spec.weights == "buffer"
        self.low: Optional[MinTree] = MinTree(capacity) if buffer_wide else None

    def _weights(self, priorities: np.ndarray) -> np.ndarray:
        if isinstance(self.spec, Prioritized):
            return (np.abs(priorities) + self.spec.eps) ** self.spec.alpha
        return np.ones(len(priorities))

    def _set(self, slots: np.ndarray, weights: np.ndarray) -> None:
        _set_leaves(slots, weights, self.tree, self.low)

    def add(self, slots: np.ndarray, ids: np.ndarray, priorities: np.ndarray) -> None:
        self._set(slots, self._weights(priorities))

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self._set(slots, self._weights(priorities))

    def remove(self, slots: np.ndarray) -> None:
        self._set(slots, np.zeros(len(slots)))

    def mass(self) -> float:
        return self.tree.total()

    def min_weight(self) -> Optional[float]:
        """The smallest positive weight held, for PER's weight normalisation (None when
        this index does not keep it: uniform, or ``weights="batch"``)."""
        return None if self.low is None else self.low.min()

    def select(self, k: int, rng: np.random.Generator, distinct: bool = False):
        """``k`` slots and their probabilities (distinct ones without replacement)."""
        if not distinct:
            slots, total = self.tree.find(rng.random(k), rng)
            return slots, self.tree.leaf(slots) / total
        chosen: list = []
        saved = []
        while len(chosen) < k and self.tree.total() > 0:
            slots = np.unique(self.tree.find(rng.random(k - len(chosen)), rng)[0])
            saved.append((slots, self.tree.leaf(slots)))
            self.tree.set(slots, np.zeros(len(slots)))
            chosen.extend(slots.tolist())
        for slots, weights in saved:  # the caller removes them; keep the tree unchanged here
            self.tree.set(slots, weights)
        return np.asarray(chosen, dtype=np.int64), None


class OrderIndex:
    """FIFO and LIFO: slots in insertion order, dead entries skipped (and dropped at the ends)."""

    def __init__(self, spec: SelectorSpec, capacity: int, slot_ids: np.ndarray) -> None:
        self.newest_first = isinstance(spec, Lifo)
        self.order: collections.deque = collections.deque()
        self.slot_ids = slot_ids

    def add(self, slots: np.ndarray, ids: np.ndarray, priorities: np.ndarray) -> None:
        self.order.extend(zip(ids.tolist(), slots.tolist()))

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        pass

    def remove(self, slots: np.ndarray) -> None:
        pass  # lazily: an entry whose slot holds another id is dead

    def mass(self) -> float:
        return float(np.count_nonzero(self.slot_ids >= 0))

    def min_weight(self) -> None:
        return None

    def _live(self, newest_first: bool):
        order, ids = self.order, self.slot_ids
        pop = order.pop if newest_first else order.popleft
        end = -1 if newest_first else 0
        while order and ids[order[end][1]] != order[end][0]:
            pop()  # dead entries at the end we read from
        for item_id, slot in (reversed(order) if newest_first else order):
            if ids[slot] == item_id:
                yield slot

    def select(self, k: int, rng: np.random.Generator, distinct: bool = False):
        import itertools
        slots = list(itertools.islice(self._live(self.newest_first), k))
        if slots and not distinct and len(slots) < k:
            slots = (slots * (k // len(slots) + 1))[:k]
        return np.asarray(slots, dtype=np.int64), None


class HeapIndex:
    """Lowest or highest priority first: a heap with lazy deletion of stale entries."""

    def __init__(self, spec: SelectorSpec, capacity: int, slot_ids: np.ndarray) -> None:
        self.sign = -1.0 if isinstance(spec, MaxHeap) else 1.0
        self.heap: list = []
        self.slot_ids = slot_ids
        self.priorities = np.zeros(capacity, dtype=np.float64)

    def add(self, slots: np.ndarray, ids: np.ndarray, priorities: np.ndarray) -> None:
        self.priorities[slots] = priorities
        for key, item_id, slot in zip((self.sign * priorities).tolist(), ids.tolist(),
                                      slots.tolist()):
            heapq.heappush(self.heap, (key, item_id, slot))
        self._compact()

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self.add(slots, self.slot_ids[slots], priorities)

    def remove(self, slots: np.ndarray) -> None:
        pass  # lazily

    def mass(self) -> float:
        return float(np.count_nonzero(self.slot_ids >= 0))

    def min_weight(self) -> None:
        return None

    def _valid(self, entry: tuple) -> bool:
        key, item_id, slot = entry
        return self.slot_ids[slot] == item_id and self.sign * self.priorities[slot] == key

    def _compact(self) -> None:
        live = int(np.count_nonzero(self.slot_ids >= 0))
        if len(self.heap) > 2 * live + 1024:
            self.heap = [entry for entry in self.heap if self._valid(entry)]
            heapq.heapify(self.heap)

    def select(self, k: int, rng: np.random.Generator, distinct: bool = False):
        taken: list = []
        while self.heap and len(taken) < k:
            entry = heapq.heappop(self.heap)
            if self._valid(entry):
                taken.append(entry)
        for entry in taken:
            heapq.heappush(self.heap, entry)
        slots = [slot for _key, _id, slot in taken]
        if slots and not distinct and len(slots) < k:
            slots = (slots * (k // len(slots) + 1))[:k]
        return np.asarray(slots, dtype=np.int64), None


def make_index(spec: SelectorSpec, capacity: int, slot_ids: np.ndarray) -> Any:
    """The server-side index for ``spec``."""
    if isinstance(spec, (Uniform, Prioritized)):
        return TreeIndex(spec, capacity, slot_ids)
    if isinstance(spec, (Fifo, Lifo)):
        return OrderIndex(spec, capacity, slot_ids)
    return HeapIndex(spec, capacity, slot_ids)


def index_key(spec: SelectorSpec) -> Optional[tuple]:
    """Specs with equal keys can share one index (a FIFO sampler and FIFO remover)."""
    return (type(spec).__name__, dataclasses.astuple(spec))
