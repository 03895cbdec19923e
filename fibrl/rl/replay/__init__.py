"""A replay buffer served by fibrl processes and shared by every writer and learner.

:class:`ReplayStore` starts one store server per shard (a fibrl manager
server on the configured backend) and is itself a small picklable client:
hand it to any number of Process or Pool workers and they all write into and
sample from the same items. A process that fibrl did not start (a ``torchrun``
rank) joins with ``ReplayStore.connect(store.address, authkey)``. See
``docs/replay.md``.

Layout::

    selectors.py  sampler/remover specs and their server-side indexes (sum tree, order, heap)
    limiters.py   rate limiter specs, admission rule, deadlock refusal
    table.py      ReplayTable: the hosted object of one shard (storage, locking, n-step,
                  snapshots, write-ahead log)
    persist.py    snapshot and write-ahead log file formats
    batch.py      SampleBatch, PendingSample, importance weights, merging shards' parts
    client.py     ReplayStore (and joining by address), ReplayTableProxy, ReplayManager
    errors.py     RateLimiterTimeout, ReplayStorageError, ReplayStoreLost

Example:
    >>> from fibrl.rl import ReplayStore
    >>> from fibrl.rl.replay import Prioritized
    >>> with ReplayStore(100_000, sampler=Prioritized(alpha=0.6, beta=0.4)) as store:
    ...     ids = store.insert({"obs": np.zeros((64, 4), np.float32)})
    ...     batch = store.sample(32)
"""
from __future__ import annotations

from .client import (PendingSample, ReplayManager, ReplayStore, ReplayTableProxy, SampleBatch,
                     register_replay_store)
from .errors import RateLimiterTimeout, ReplayStorageError, ReplayStoreLost
from .limiters import MinSize, Queue, SampleToInsertRatio, Stack
from .selectors import Fifo, Lifo, MaxHeap, MinHeap, Prioritized, Uniform
from .table import NStep

__all__ = [
    "Fifo", "Lifo", "MaxHeap", "MinHeap", "MinSize", "NStep", "PendingSample", "Prioritized",
    "Queue",
    "RateLimiterTimeout", "ReplayManager", "ReplayStorageError", "ReplayStore",
    "ReplayStoreLost",
    "ReplayTableProxy", "SampleBatch", "SampleToInsertRatio", "Stack", "Uniform",
    "register_replay_store",
]
