"""Importance weights as PER defines them, per-call beta, and n-step appends with priorities.

Every expected weight here is written out from the priorities the test inserted:
``P(i) = (p_i + eps)**alpha / sum_j (p_j + eps)**alpha`` over every item held (all
shards), ``w_i = (N * P(i))**-beta / (N * P_min)**-beta`` with ``P_min`` the smallest
nonzero ``P`` held, or ``/ max over the batch`` with ``weights="batch"``.
"""
from __future__ import annotations

import numpy as np
import pytest

from fibrl.rl import ReplayStore
from fibrl.rl.replay import NStep, Prioritized
from fibrl.rl.replay.selectors import MinTree, TreeIndex
from fibrl.rl.replay.table import ReplayTable, TableConfig

ALPHA, BETA, EPS = 0.7, 0.5, 0.01


def by_hand(prios: np.ndarray, alpha: float = ALPHA, eps: float = EPS) -> np.ndarray:
    """P(i) for every inserted item, from its priority alone."""
    mass = (prios + eps) ** alpha
    return mass / mass.sum()


def rows_of(ids: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Positions in ``ids`` (the insert order) of the ``wanted`` ids."""
    order = np.argsort(ids)
    return order[np.searchsorted(ids[order], wanted)]


# -- PER's normalisation: over the whole store ---------------------------------------------------
@pytest.mark.parametrize("num_shards", [1, 2])
def test_weights_are_normalised_by_the_largest_weight_in_the_store(num_shards):
    spec = Prioritized(alpha=ALPHA, beta=BETA, eps=1e-6)
    # one rare item (P ~ 5e-6) that a batch of 16 almost never holds: with the batch's
    # largest weight as the divisor the weights would differ from PER's
    high = np.linspace(1.0, 3.0, 15)
    prios = np.concatenate([[1e-6], high])
    with ReplayStore(64, sampler=spec, num_shards=num_shards, seed=11) as store:
        ids = np.concatenate([store.insert({"x": np.arange(1)}, prios[:1]),
                              store.insert({"x": np.arange(15)}, prios[1:])])
        if num_shards == 2:
            assert ids[0] % 2 != ids[1] % 2      # the rare item is alone on its shard
        exact = by_hand(prios, eps=1e-6)
        n = len(prios)
        largest = (n * exact.min()) ** -BETA      # the rare item's weight
        for _ in range(5):
            batch = store.sample(16)
            assert ids[0] not in batch.ids       # (so the batch's max is not the store's)
            p = exact[rows_of(ids, batch.ids)]
            np.testing.assert_allclose(batch.probabilities, p, rtol=1e-9)
            np.testing.assert_allclose(batch.weights, (n * p) ** -BETA / largest, rtol=1e-5)
            assert batch.weights.dtype == np.float32 and batch.weights.max() < 0.02


@pytest.mark.parametrize("num_shards", [1, 2])
def test_batch_normalisation_stays_available_by_name(num_shards):
    spec = Prioritized(alpha=ALPHA, beta=BETA, eps=EPS, weights="batch")
    prios = np.concatenate([[1e-6], np.linspace(1.0, 3.0, 15)])
    with ReplayStore(64, sampler=spec, num_shards=num_shards, seed=5) as store:
        ids = np.concatenate([store.insert({"x": np.arange(1)}, prios[:1]),
                              store.insert({"x": np.arange(15)}, prios[1:])])
        exact = by_hand(prios)
        batch = store.sample(16)
        w = (len(prios) * exact[rows_of(ids, batch.ids)]) ** -BETA
        np.testing.assert_allclose(batch.weights, w / w.max(), rtol=1e-5)
        assert batch.weights.max() == 1.0


def test_weights_follow_updates_and_evictions_of_the_smallest_priority():
    spec = Prioritized(alpha=1.0, beta=1.0, eps=0.0)
    store = ReplayTable(TableConfig(4, sampler=spec, seed=1))   # FIFO remover
    from fibrl.rl.replay.batch import finish as _finish
    ids = store.insert({"x": np.arange(4)}, np.array([1.0, 2.0, 4.0, 8.0]))

    def weights_of(batch, prios):   # beta 1: w_i = P_min / P(i) = min(p) / p_i
        return prios.min() / prios[rows_of(ids, batch.ids)]

    batch = _finish(store.sample(32), as_torch=False)
    np.testing.assert_allclose(batch.weights, weights_of(batch, np.array([1., 2, 4, 8])),
                               rtol=1e-6)
    store.update_priorities(ids[:1], [0.5])                     # a new smallest
    batch = _finish(store.sample(32), as_torch=False)
    np.testing.assert_allclose(batch.weights, weights_of(batch, np.array([.5, 2, 4, 8])),
                               rtol=1e-6)
    new = store.insert({"x": np.arange(1)}, [16.0])             # evicts the smallest (FIFO)
    ids = np.concatenate([ids[1:], new])
    batch = _finish(store.sample(32), as_torch=False)
    np.testing.assert_allclose(batch.weights, weights_of(batch, np.array([2., 4, 8, 16])),
                               rtol=1e-6)


def test_items_of_probability_zero_do_not_set_the_normalisation():
    from fibrl.rl.replay.batch import finish as _finish
    spec = Prioritized(alpha=1.0, beta=1.0, eps=0.0)
    store = ReplayTable(TableConfig(8, sampler=spec, seed=2))
    ids = store.insert({"x": np.arange(4)}, np.array([0.0, 2.0, 4.0, 8.0]))
    batch = _finish(store.sample(64), as_torch=False)
    assert ids[0] not in batch.ids                          # never drawn
    np.testing.assert_allclose(batch.weights, 2.0 / batch.priorities, rtol=1e-6)


def test_min_tree_matches_a_brute_force_minimum():
    rng = np.random.default_rng(4)
    for capacity in (5, 4096, 20_000):                      # no walk, one level, several
        tree, values = MinTree(capacity), np.zeros(capacity)
        for _ in range(30):
            slots = rng.integers(0, capacity, rng.integers(1, 300))
            new = rng.random(len(slots)) * (rng.random(len(slots)) > 0.2)   # zeros: none
            tree.set(slots, new)
            values[slots] = new       # the last of duplicate slots wins, as in the tree
            positive = values[values > 0]
            assert tree.min() == (positive.min() if len(positive) else np.inf)


def test_a_removed_item_leaves_the_normalisation():
    spec = Prioritized(alpha=1.0, eps=0.0)
    index = TreeIndex(spec, 8, np.full(8, -1, np.int64))
    index.add(np.arange(4), np.arange(4), np.array([1.0, 2.0, 4.0, 8.0]))
    assert index.min_weight() == 1.0
    index.remove(np.array([0]))                       # (max_times_sampled, an eviction)
    assert index.min_weight() == 2.0
    index.remove(np.arange(1, 4))
    assert index.min_weight() == np.inf
    assert TreeIndex(Prioritized(weights="batch"), 8, np.zeros(8, np.int64)).min_weight() \
        is None


# -- beta per call ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_shards", [1, 2])
def test_beta_per_call_overrides_the_samplers(num_shards):
    prios = np.array([0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
    with ReplayStore(32, sampler=Prioritized(alpha=ALPHA, beta=BETA, eps=EPS),
                     num_shards=num_shards, seed=3) as store:
        ids = np.concatenate([store.insert({"x": np.arange(3)}, prios[:3]),
                              store.insert({"x": np.arange(3)}, prios[3:])])
        exact = by_hand(prios)
        for beta in (0.0, 0.4, 0.75, 1.0):                 # an annealing schedule
            batch = store.sample(20, beta=beta)
            p = exact[rows_of(ids, batch.ids)]
            np.testing.assert_allclose(batch.weights, (p / exact.min()) ** -beta, rtol=1e-5)
            pending = store.sample_async(20, beta=beta).get(timeout=30)
            p = exact[rows_of(ids, pending.ids)]
            np.testing.assert_allclose(pending.weights, (p / exact.min()) ** -beta,
                                       rtol=1e-5)
        batch = store.sample(20)                          # the sampler's beta again
        p = exact[rows_of(ids, batch.ids)]
        np.testing.assert_allclose(batch.weights, (p / exact.min()) ** -BETA, rtol=1e-5)


def test_a_bad_beta_is_refused_before_anything_is_drawn():
    with ReplayStore.queue(8) as store:
        store.insert({"x": np.arange(4)})
        with pytest.raises(ValueError, match="prioritized"):
            store.sample(2, beta=0.5)                     # a FIFO queue has no weights
        assert len(store) == 4                            # nothing was taken off the queue
        with pytest.raises(ValueError, match="beta must be"):
            store.sample(2, beta=-0.1)
        with pytest.raises(ValueError, match="beta must be"):
            store.sample_async(2, beta=float("nan"))
        assert store.sample(4, timeout=30)["x"].tolist() == [0, 1, 2, 3]


def test_weights_must_be_buffer_or_batch():
    with pytest.raises(ValueError, match="buffer"):
        Prioritized(weights="max")


# -- n-step append with priorities ---------------------------------------------------------------
def steps(env, start, count, done_last=False):
    """``count`` steps of environment ``env`` from step ``start`` (its ``t`` column)."""
    t = np.arange(start, start + count)
    done = np.zeros(count, bool)
    done[-1] = done_last
    return {"env": np.full(count, env), "t": t, "obs": t[:, None].astype(np.float32),
            "action": np.zeros(count, np.int64), "reward": np.ones(count, np.float32),
            "next_obs": t[:, None].astype(np.float32) + 1, "done": done}


def joined(*parts):
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


@pytest.mark.parametrize("num_shards", [1, 2])
def test_n_step_items_take_the_priority_of_their_first_step(num_shards):
    with ReplayStore(64, sampler="fifo", n_step=NStep(n=2, gamma=0.5),
                     num_shards=num_shards) as store:
        # environments 7 and 8 (one shard each when sharded), three steps each, the
        # last ending the episode; rows interleaved, each environment's in time order
        rows = [steps(7, 0, 1), steps(8, 0, 1), steps(7, 1, 1), steps(8, 1, 1),
                steps(7, 2, 1, True), steps(8, 2, 1, True)]
        prios = np.array([0.1, 1.1, 0.2, 1.2, 0.3, 1.3])
        batch_in = joined(*rows)
        ids = store.append(batch_in, batch_in["env"], prios)
        assert len(ids) == 6 and len(store) == 6
        out = store.sample(6)
        got = {(int(e), int(t)): float(p)
               for e, t, p in zip(out["env"], out["t"], out.priorities)}
        assert got == pytest.approx({(7, 0): 0.1, (7, 1): 0.2, (7, 2): 0.3,
                                     (8, 0): 1.1, (8, 1): 1.2, (8, 2): 1.3})


def test_n_step_items_without_priorities_get_the_largest_seen():
    with ReplayStore(64, sampler="fifo", n_step=NStep(n=2, gamma=0.5)) as store:
        store.append(steps(1, 0, 2), [1, 1], [5.0, 6.0])     # stores (1, 0) at 5.0
        store.append(steps(0, 0, 2), [0, 0])                  # (0, 0): none given
        store.append(steps(0, 2, 1, True), [0], [0.3])        # (0, 1) had none; (0, 2)
        store.append(steps(1, 2, 1, True), [1])               # (1, 1) at 6.0; (1, 2) none
        out = store.sample(6)
        got = {(int(e), int(t)): float(p)
               for e, t, p in zip(out["env"], out["t"], out.priorities)}
        assert got == {(1, 0): 5.0, (0, 0): 5.0, (0, 1): 5.0, (0, 2): 0.3, (1, 1): 6.0,
                       (1, 2): 5.0}


def test_n_step_priorities_must_match_the_steps():
    with ReplayStore(16, n_step=NStep(n=2), num_shards=2) as store:
        two = joined(steps(0, 0, 1), steps(1, 0, 1))
        with pytest.raises(ValueError, match="priorities"):
            store.append(two, [0, 1], [1.0])
        with pytest.raises(ValueError, match="priorities"):
            store.append(two, [0, 1], [1.0, float("nan")])
        assert len(store) == 0
