"""What a sample becomes on the client: a :class:`SampleBatch` with its importance weights.

Owns turning the raw answers of the shard servers into a batch: a pending
sample (:class:`PendingSample`), the split of a batch over shards by their
masses, the merge of the shards' parts with their probabilities rescaled to
the global mass, and the importance weights (normalised by the largest weight
any held item could get, over every shard, or by the batch's largest). It does
not own the calls that fetch the parts (``client``) nor how items are drawn
(``table``, ``selectors``)::

    n shards: masses, sizes, smallest weights ─> split(k) ─> per-shard raws
        ─> merge: probabilities * shard mass / total mass, P_min = min weight / total
        ─> finish: weights (P_min / P(i)) ** beta (or / the batch's largest)
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import numpy as np

__all__ = ["SampleBatch", "PendingSample", "importance_weights", "finish", "merge", "split",
           "only"]


@dataclasses.dataclass
class SampleBatch:
    """One sampled batch: ``data`` (column -> stacked array), item ``ids``, and for
    prioritized sampling the normalized importance ``weights`` and ``probabilities``.

    ``batch["obs"]`` is ``batch.data["obs"]``.
    """

    data: dict
    ids: np.ndarray
    weights: Optional[Any] = None
    probabilities: Optional[np.ndarray] = None
    priorities: Optional[np.ndarray] = None

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __len__(self) -> int:
        return len(self.ids)


class PendingSample:
    """A batch on its way from the store: what ``sample_async`` returns.

    The server draws the batch as soon as the request arrives (its rate limiter
    counts it then); :meth:`get` waits for it, and returns the same batch when
    called again.

    Example:
        >>> pending = store.sample_async(256)
        >>> loss = train(batch)              # the previous batch, meanwhile
        >>> batch = pending.get(timeout=60)  # a SampleBatch
    """

    __slots__ = ("_parts", "_merge", "_as_torch", "_batch")

    def __init__(self, parts: list, merge: Callable[[list], dict], as_torch: bool) -> None:
        self._parts = parts          # (shard proxy, handle of its sample call)
        self._merge = merge
        self._as_torch = as_torch
        self._batch: Optional[SampleBatch] = None

    def ready(self) -> bool:
        """Whether :meth:`get` would return without waiting."""
        return self._batch is not None or all(h.ready() for _shard, h in self._parts)

    def get(self, timeout: Optional[float] = None) -> SampleBatch:
        """The batch; waits up to ``timeout`` seconds (None: no limit).

        Raises:
            HandleTimeout: (a ``TimeoutError``) not in within ``timeout``; call again
                to keep waiting.
            RateLimiterTimeout: the server's rate limiter held the sample back for
                the ``timeout`` given to ``sample_async``.
            ReplayStoreLost: the store server is gone.
        """
        if self._batch is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            raws = [shard._wait(handle, None if deadline is None
                                else max(0.0, deadline - time.monotonic()))
                    for shard, handle in self._parts]
            self._batch = finish(self._merge(raws), self._as_torch)
        return self._batch


def only(raws: list) -> dict:
    """The raw sample of a one-shard store (what :class:`PendingSample` merges)."""
    return raws[0]


def importance_weights(probabilities: np.ndarray, size: int, beta: float,
                       min_probability: Optional[float]) -> np.ndarray:
    """``w_i = (N * P(i)) ** -beta``, divided by ``(N * P_min) ** -beta`` (the largest
    weight any held item could get: PER's normalisation) when ``min_probability`` is
    given, else by the batch's largest; float32."""
    if min_probability is None:
        weights = (size * probabilities) ** (-beta)
        return (weights / weights.max()).astype(np.float32)
    # (N P_min / N P_i) ** beta: N cancels, and the ratio is never above 1
    return ((min_probability / probabilities) ** beta).astype(np.float32)


def finish(raw: dict, as_torch: bool) -> SampleBatch:
    """Importance weights (see :func:`importance_weights`) and the requested array type."""
    probs, beta = raw["probabilities"], raw["beta"]
    weights = None
    if beta is not None and probs is not None and len(probs):
        low = raw["min_probability"] if raw["weights"] == "buffer" else None
        weights = importance_weights(probs, raw["size"], beta, low)
    batch = SampleBatch(raw["data"], raw["ids"], weights, probs, raw["priorities"])
    if as_torch:
        import torch  # requested by the caller, so it is installed
        batch.data = {name: torch.from_numpy(np.ascontiguousarray(value))
                      for name, value in batch.data.items()}
        if weights is not None:
            batch.weights = torch.from_numpy(weights)
    return batch


def split(k: int, shares: np.ndarray, rng: np.random.Generator, random: bool) -> np.ndarray:
    """How many of ``k`` items each shard gives: a multinomial draw for random samplers
    (exact probabilities), the largest-remainder rounding of ``k * shares`` for ordered ones."""
    if random:
        return rng.multinomial(k, shares)
    exact = k * shares
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact)[:k - counts.sum()]] += 1
    return counts


def merge(raws: list, total_mass: float, size: int, low: float) -> dict:
    """One raw sample from several shards' raws, probabilities over the global mass.

    ``low`` is the smallest positive sampler weight the shards reported with their
    masses; the smallest probability is the least of it and of the weights the sampled
    shards held when they drew (an item stored between the two rounds counts too), over
    the global mass."""
    data = {name: np.concatenate([raw["data"][name] for raw in raws]) for name in raws[0]["data"]}
    probs = None
    if all(raw["probabilities"] is not None for raw in raws):
        probs = np.concatenate([raw["probabilities"] * (raw["mass"] / total_mass) for raw in raws])
    min_probability = None
    if raws[0]["weights"] == "buffer":
        lows = [low] + [raw["min_probability"] * raw["mass"] for raw in raws]
        min_probability = min(lows) / total_mass
    return dict(data=data, ids=np.concatenate([raw["ids"] for raw in raws]),
                priorities=np.concatenate([raw["priorities"] for raw in raws]),
                probabilities=probs, size=size, beta=raws[0]["beta"],
                weights=raws[0]["weights"], min_probability=min_probability)
