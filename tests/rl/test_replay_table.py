"""ReplayTable in-process: samplers, removers, rate limiters, priorities, n-step, snapshots.

The table is the object a store server hosts; testing it directly keeps these
cases fast and exact. What needs a real server (sharing, kills, backends) is
in test_replay_store.py.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import wait_until

from fibrl.rl.replay import (Fifo, Lifo, MaxHeap, MinHeap, MinSize, NStep, Prioritized, Queue,
                             RateLimiterTimeout, SampleToInsertRatio, Stack, Uniform)
from fibrl.rl.replay.packed import RawSample
from fibrl.rl.replay.selectors import SumTree
from fibrl.rl.replay.table import ReplayTable, TableConfig

# chi-square critical values at p = 0.001 (df -> value), so a correct sampler fails
# once in a thousand seeds; the seeds below are fixed.
CHI2_999 = {1: 10.83, 7: 24.32, 9: 27.88}


def table(capacity=100, **kw) -> ReplayTable:
    return ReplayTable(TableConfig(capacity, **kw))


def items(n, start=0):
    return {"x": np.arange(start, start + n, dtype=np.int64),
            "obs": np.ones((n, 4), np.float32) * np.arange(start, start + n)[:, None]}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# -- sampling ----------------------------------------------------------------------------------
def test_prioritized_sampling_matches_exact_probabilities():
    spec = Prioritized(alpha=0.7, beta=0.5, eps=0.01)
    t = table(16, sampler=spec, seed=1234)
    prios = np.array([0.1, 0.5, 1.0, 2.0, 3.0, 0.0, 5.0, 8.0, 1.5, 0.3])
    ids = t.insert(items(10), prios)
    weights = (prios + spec.eps) ** spec.alpha
    exact = weights / weights.sum()
    counts = np.zeros(10)
    for _ in range(50):
        out = t.sample(400)
        np.add.at(counts, np.searchsorted(ids, out["ids"]), 1)
        np.testing.assert_allclose(out["probabilities"],
                                   exact[np.searchsorted(ids, out["ids"])], rtol=1e-12)
    assert chi_square(counts, exact) < CHI2_999[9]


@pytest.mark.parametrize("capacity", [16, SumTree.ROOTS, 20 * SumTree.ROOTS + 3])
def test_sum_tree_draws_in_proportion_to_weight_at_every_size(capacity):
    # from no walked level (all leaves in the top level) to several below it
    rng = np.random.default_rng(capacity)
    tree = SumTree(capacity)
    weights = rng.random(capacity) ** 3
    weights[rng.random(capacity) < 0.3] = 0.0
    tree.set(np.arange(capacity), weights)
    tree.set(np.array([capacity - 1, 0, 0]), np.array([0.0, 0.7, 0.7]))  # duplicates set once
    weights[[capacity - 1, 0]] = [0.0, 0.7]
    np.testing.assert_allclose(tree.total(), weights.sum(), rtol=1e-12)
    leaves, total = tree.find(rng.random(200_000), rng)
    np.testing.assert_allclose(total, weights.sum(), rtol=1e-12)
    assert weights[leaves].min() > 0                      # an empty slot is never drawn
    # 10 bins of consecutive slots, then for each bit of the slot number (each tree
    # level) the slots with it clear against those with it set
    groupings = [(np.arange(capacity) * 10 // capacity, 9)]
    groupings += [((np.arange(capacity) >> bit) & 1, 1) for bit in range(tree.depth)]
    for bins, df in groupings:
        mass = np.bincount(bins, weights) / weights.sum()
        counts = np.bincount(bins[leaves], minlength=len(mass))
        live = mass > 0
        assert counts[~live].sum() == 0
        assert chi_square(counts[live], mass[live]) < CHI2_999[df]


def test_sum_tree_with_every_weight_zero_says_why_it_cannot_draw():
    t = table(16, sampler=Prioritized(alpha=1.0, eps=0.0))
    t.insert(items(4), np.zeros(4))
    with pytest.raises(ValueError, match="weight 0"):
        t.sample(2)


def test_importance_weights_follow_the_formula_on_one_shard():
    from fibrl.rl.replay.client import _finish
    spec = Prioritized(alpha=0.6, beta=0.4, eps=0.0)
    t = table(16, sampler=spec, seed=3)
    prios = np.arange(1.0, 11.0)
    ids = t.insert(items(10), prios)
    batch = _finish(t.sample(64), as_torch=False)
    exact = prios ** spec.alpha / (prios ** spec.alpha).sum()
    p = exact[np.searchsorted(ids, batch.ids)]
    w = (10 * p) ** -spec.beta
    np.testing.assert_allclose(batch.weights, w / w.max(), rtol=1e-5)
    assert batch.weights.dtype == np.float32 and batch.weights.max() == 1.0


def test_priority_update_changes_the_distribution_and_stale_ids_are_ignored():
    t = table(8, sampler=Prioritized(alpha=1.0, eps=0.0), seed=7)
    ids = t.insert(items(8), np.ones(8))
    assert t.update_priorities(ids[:4], np.zeros(4)) == 4
    out = t.sample(2000)
    assert set(out["ids"].tolist()) <= set(ids[4:].tolist())
    t.insert(items(8, 8), np.ones(8))           # evicts all 8 first ids (FIFO)
    assert t.update_priorities(ids, np.full(8, 100.0)) == 0
    assert t.stats()["stale_updates"] == 8
    assert t.sample(500)["priorities"].max() == 1.0  # the new items kept their priority


def test_a_priority_update_carried_by_sample_applies_first():
    t = table(8, sampler=MaxHeap())
    ids = t.insert(items(4), np.ones(4))
    out = t.sample(1, update=(ids[2:3], np.array([7.0])))
    assert out["ids"].tolist() == [ids[2]] and t.stats()["stale_updates"] == 0


def _pickled_and_back(out):
    from fibrl.wire import serialization
    return serialization.loads(serialization.dumps(out))


@pytest.mark.parametrize("sampler", [Prioritized(alpha=0.6, beta=0.4), Uniform()])
def test_a_sample_sent_as_one_buffer_arrives_as_the_same_writable_arrays(sampler):
    t = table(64, sampler=sampler, seed=3)
    batch = {"obs": np.arange(40 * 6, dtype=np.float32).reshape(40, 2, 3),
             "action": np.arange(40, dtype=np.int64), "done": np.arange(40) % 3 == 0,
             "reward": np.arange(40, dtype=np.float16), "tag": np.array(["a", "bc"] * 20)}
    t.insert(batch, np.arange(40) + 1.0)
    for k in (1, 3, 37, 3000):   # odd sizes: arrays start after padding; the last is
        out = t.sample(k)         # too large to be joined (its arrays go as they are)
        assert isinstance(out, RawSample) == (k < 3000)
        back = _pickled_and_back(out)
        assert type(back) is dict and list(back) == list(out)
        assert back["data"].keys() == out["data"].keys()
        arrays = [(back["data"][n], out["data"][n]) for n in out["data"]]
        arrays += [(back[n], out[n]) for n in ("ids", "priorities", "probabilities")
                   if out[n] is not None]
        for got, sent in arrays:
            assert got.dtype == sent.dtype and got.shape == sent.shape
            np.testing.assert_array_equal(got, sent)
            assert got.flags.writeable and (got.flags.aligned or k == 3000)
        assert (back["probabilities"] is None) == (out["probabilities"] is None)
        for n in ("size", "mass", "beta", "min_probability", "weights"):
            assert back[n] == out[n]


def test_a_sample_holds_the_drawn_rows_after_the_columns_change():
    """Where each array lies in a sample's buffer is worked out once per batch size:
    a clear() followed by columns of other names, dtypes and shapes must not be read
    through the old layout."""
    t = table(64, sampler=Prioritized(), seed=5)

    def check(batch: dict, ids: np.ndarray) -> None:
        row = {int(i): r for r, i in enumerate(ids)}
        for k in (7, 7, 20):   # the second draw of 7 reuses the layout
            out = t.sample(k)
            assert isinstance(out, RawSample)
            rows = [row[int(i)] for i in out["ids"]]
            assert list(out["data"]) == list(batch)
            for name, column in batch.items():
                np.testing.assert_array_equal(out["data"][name], column[rows])
                assert out["data"][name].dtype == column.dtype
            np.testing.assert_array_equal(out["priorities"], np.asarray(rows) + 1.0)

    first = {"obs": np.arange(40 * 4, dtype=np.float32).reshape(40, 4),
             "action": np.arange(40, dtype=np.int64)}
    check(first, t.insert(first, np.arange(40) + 1.0))
    t.clear()
    second = {"frame": np.arange(30 * 6, dtype=np.uint8).reshape(30, 2, 3),
              "value": np.linspace(0, 1, 30), "done": np.arange(30) % 2 == 0}
    check(second, t.insert(second, np.arange(30) + 1.0))


def test_a_slot_out_of_range_raises_instead_of_reading_another_row():
    from fibrl.rl.replay.packed import gather
    columns = {"x": np.arange(10.0), "y": np.arange(20).reshape(10, 2)}
    with pytest.raises(IndexError):
        gather(columns, np.array([3, 10]), np.arange(10), np.ones(10), None, {}, size=10)
    out = gather(columns, np.array([3, 9]), np.arange(10), np.ones(10), None, {}, size=10)
    assert out["data"]["x"].tolist() == [3.0, 9.0] and out["ids"].tolist() == [3, 9]


def test_a_sample_whose_arrays_have_no_plain_bytes_is_pickled_array_by_array():
    t = table(16, seed=0)
    t.insert({"obj": np.array([{"a": 1}, None, "x", 2.5], dtype=object),
              "pair": np.zeros(4, dtype=[("a", "i4"), ("b", "f8")])})
    out = t.sample(6)
    assert type(out) is dict   # not the one-buffer form
    back = _pickled_and_back(out)
    assert list(back["data"]["obj"]) == list(out["data"]["obj"])
    assert back["data"]["pair"].dtype == out["data"]["pair"].dtype
    empty = table(16, seed=0)
    empty.insert({"nothing": np.zeros((4, 0), np.float32), "x": np.arange(4)})
    out = empty.sample(5)
    assert _pickled_and_back(out)["data"]["nothing"].shape == (5, 0)


def test_uniform_sampling_is_uniform():
    t = table(16, sampler=Uniform(), seed=99)
    ids = t.insert(items(8))
    counts = np.zeros(8)
    out = t.sample(8000)
    np.add.at(counts, np.searchsorted(ids, out["ids"]), 1)
    np.testing.assert_allclose(out["probabilities"], 1 / 8)
    assert chi_square(counts, np.full(8, 1 / 8)) < CHI2_999[7]


@pytest.mark.parametrize("sampler, expected", [
    (Fifo(), [0, 1, 2]), (Lifo(), [5, 4, 3]), (MinHeap(), [2, 4, 0]), (MaxHeap(), [5, 1, 3])])
def test_ordered_samplers(sampler, expected):
    t = table(10, sampler=sampler)
    t.insert(items(6), np.array([3.0, 8.0, 1.0, 7.0, 2.0, 9.0]))
    assert t.sample(3)["data"]["x"].tolist() == expected


def test_ordered_sampler_repeats_when_the_batch_exceeds_the_size():
    t = table(10, sampler=Fifo())
    t.insert(items(2))
    assert t.sample(5)["data"]["x"].tolist() == [0, 1, 0, 1, 0]


# -- removal -----------------------------------------------------------------------------------
@pytest.mark.parametrize("remover, evicted", [
    (Fifo(), [0, 1]), (Lifo(), [4, 3]), (MinHeap(), [2, 4]), (MaxHeap(), [1, 3])])
def test_eviction_order(remover, evicted):
    t = table(5, remover=remover)
    t.insert(items(5), np.array([3.0, 8.0, 1.0, 7.0, 2.0]))
    t.insert(items(2, 100), np.array([5.0, 5.0]))
    held = set(t.columns["x"][t.slot_ids >= 0].tolist())
    assert held == ({0, 1, 2, 3, 4} - set(evicted)) | {100, 101}
    assert t.stats()["evictions"] == 2


def test_prioritized_remover_removes_high_priority_items():
    t = table(5, remover=Prioritized(alpha=1.0, eps=0.0), seed=3)
    t.insert(items(5), np.array([0.0, 0.0, 1000.0, 0.0, 0.0]))
    t.insert(items(1, 100), np.array([0.0]))
    assert 2 not in t.columns["x"][t.slot_ids >= 0].tolist()


def test_uniform_remover_evicts_distinct_old_items():
    t = table(5, remover=Uniform(), seed=11)
    t.insert(items(5))
    t.insert(items(3, 100))
    held = set(t.columns["x"][t.slot_ids >= 0].tolist())
    assert len(held) == 5 and {100, 101, 102} <= held and t.stats()["evictions"] == 3


def test_max_times_sampled_removes_items():
    t = table(10, sampler=Fifo(), max_times_sampled=2)
    t.insert(items(3))
    assert t.sample(2)["data"]["x"].tolist() == [0, 1]
    assert t.sample(2)["data"]["x"].tolist() == [0, 1]
    assert t.size() == 1 and t.sample(1)["data"]["x"].tolist() == [2]


def test_ids_are_never_reused():
    t = table(4)
    first = t.insert(items(4))
    t.clear()
    second = t.insert(items(4))
    assert not set(first.tolist()) & set(second.tolist())
    assert t.update_priorities(first, np.ones(4)) == 0


# -- rate limiters -----------------------------------------------------------------------------
def test_min_size_blocks_sampling_then_times_out_with_the_state():
    t = table(10, rate_limiter=MinSize(3))
    t.insert(items(2))
    with pytest.raises(RateLimiterTimeout, match=r"sample of 1 items waited 0.2 s.*size=2.*"
                                                 r"min_size=3"):
        t.sample(1, timeout=0.2)
    assert t.stats()["sample_blocked_s"] >= 0.2


def test_min_size_sampler_wakes_on_insert():
    t = table(10, rate_limiter=MinSize(3))
    t.insert(items(2))
    got = []
    sampler = threading.Thread(target=lambda: got.append(t.sample(2, timeout=30)))
    sampler.start()
    t.insert(items(1, 2))
    sampler.join(30)
    assert len(got) == 1 and len(got[0]["ids"]) == 2


def test_sample_to_insert_ratio_holds_writers_until_samples_catch_up():
    t = table(1000, rate_limiter=SampleToInsertRatio(2.0, 10, error_buffer=20))
    t.insert(items(10))                    # reaching min size never blocks
    t.insert(items(10, 10))                # diff = 40 - 0 <= 20 + 20
    with pytest.raises(RateLimiterTimeout, match="insert of 10 items.*learners to sample"):
        t.insert(items(10, 20), timeout=0.1)
    done = threading.Event()
    writer = threading.Thread(target=lambda: (t.insert(items(10, 20), timeout=30), done.set()))
    writer.start()
    assert not done.wait(0.1)
    t.sample(20)                           # diff 40 - 20 = 20 -> 40 after the insert
    assert done.wait(30)
    writer.join(30)
    t.sample(20)
    t.sample(20)                           # diff 60 - 60 = 0, the band's floor
    with pytest.raises(RateLimiterTimeout, match="writers to insert"):
        t.sample(1, timeout=0.1)


@pytest.mark.parametrize("kw, message", [
    (dict(capacity=10, rate_limiter=MinSize(11)), "exceeds capacity"),
    (dict(capacity=10, rate_limiter=SampleToInsertRatio(4.0, 1, error_buffer=2)),
     "narrower than max"),
    (dict(capacity=10, rate_limiter=SampleToInsertRatio(4.0, 1, error_buffer=8),
          max_times_sampled=2), "exceeds max_times_sampled"),
    (dict(capacity=10, rate_limiter=Queue(11)), "exceeds capacity"),
])
def test_deadlocking_configurations_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        ReplayTable(TableConfig(**kw))


def test_a_batch_too_large_for_the_band_is_refused():
    t = table(1000, rate_limiter=SampleToInsertRatio(1.0, 1, error_buffer=10))
    t.insert(items(5))
    with pytest.raises(ValueError, match="can deadlock"):
        t.sample(16)


def test_queue_and_stack_modes():
    q = table(4, sampler=Fifo(), remover=Fifo(), max_times_sampled=1, rate_limiter=Queue(4))
    q.insert(items(3))
    q.insert(items(1, 3))
    with pytest.raises(RateLimiterTimeout):
        q.insert(items(1, 4), timeout=0.1)           # full
    assert [q.sample(1)["data"]["x"][0] for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(RateLimiterTimeout):
        q.sample(1, timeout=0.1)                     # empty
    s = table(4, sampler=Lifo(), remover=Lifo(), max_times_sampled=1, rate_limiter=Stack(4))
    s.insert(items(3))
    assert [s.sample(1)["data"]["x"][0] for _ in range(3)] == [2, 1, 0]


# -- n-step ------------------------------------------------------------------------------------
def test_n_step_items_assembled_per_environment():
    t = table(100, sampler=Fifo(), n_step=NStep(n=3, gamma=0.5))

    def steps(env_rewards, done):
        n = len(env_rewards)
        return {"obs": np.array([[r] for _e, r in env_rewards], np.float32),
                "action": np.zeros(n, np.int64),
                "reward": np.array([r for _e, r in env_rewards], np.float32),
                "next_obs": np.array([[r + 0.5] for _e, r in env_rewards], np.float32),
                "done": np.array(done)}

    # two environments interleaved: env 0 rewards 1, 2, 3, 4 ; env 1 rewards 10, 20 (ends)
    assert len(t.append(steps([(0, 1), (1, 10)], [False, False]), [0, 1])) == 0
    assert len(t.append(steps([(0, 2), (1, 20)], [False, True]), [0, 1])) == 2
    assert len(t.append(steps([(0, 3), (0, 4)], [False, False]), [0, 0])) == 2
    out = t.sample(4)["data"]
    assert out["reward"].tolist() == [10 + 0.5 * 20, 20, 1 + 0.5 * 2 + 0.25 * 3,
                                      2 + 0.5 * 3 + 0.25 * 4]
    assert out["discount"].tolist() == [0.0, 0.0, 0.125, 0.125]
    assert out["next_obs"][:, 0].tolist() == [20.5, 20.5, 3.5, 4.5]
    assert out["obs"][:, 0].tolist() == [10, 20, 1, 2]


# -- persistence -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fork", "chunked"])
def test_snapshot_during_concurrent_inserts_restores_equal_contents(tmp_path, method):
    path = str(tmp_path / "snap.bin")
    t = table(50_000, sampler=Prioritized(), remover=Fifo())
    t.snapshot_method = method
    t.insert(items(1000), np.random.default_rng(0).random(1000))
    stop = threading.Event()

    def write():
        start = 1000
        while not stop.is_set() and start < 40_000:  # never evicts: capacity 50,000
            t.insert(items(50, start))
            start += 50

    writer = threading.Thread(target=write)
    writer.start()
    # the snapshot starts while the writer is inserting
    wait_until(lambda: t.size() >= 2000, "the writer to insert", interval=0.001)
    try:
        info = t.snapshot(path)
    finally:
        stop.set()
        writer.join(30)
    assert info["method"] == method
    restored = ReplayTable(TableConfig(50_000, sampler=Prioritized()), restore_path=path)
    assert restored.size() == info["items"] >= 1000
    live = restored.slot_ids >= 0
    xs = restored.columns["x"][live]
    assert sorted(xs.tolist()) == list(range(info["items"]))  # a prefix of the inserts
    held = {int(i): int(x) for i, x in zip(t.slot_ids, t.columns["x"]) if i >= 0}
    assert all(held[int(i)] == x for i, x in zip(restored.slot_ids[live], xs))  # same ids
    original = {int(i): float(p) for i, p in zip(t.slot_ids, t.priorities) if i >= 0}
    assert all(original.get(int(i), p) == p
               for i, p in zip(restored.slot_ids[live], restored.priorities[live]))
    assert restored.sample(10)["data"]["obs"].shape == (10, 4)
    more = restored.insert(items(1, 10**6))
    assert more[0] > restored.slot_ids[live].max()   # ids keep counting after a restore


def test_a_failed_forked_snapshot_raises_the_reason(tmp_path):
    t = table(10)
    t.insert(items(5))
    with pytest.raises(OSError, match="No such file or directory.*directory exists"):
        t.snapshot(str(tmp_path / "missing" / "snap.bin"))
    assert t.stats()["snapshots"] == 0
    info = t.snapshot(str(tmp_path / "snap.bin"))   # the table still serves and snapshots
    assert info["items"] == 5 and t.stats()["snapshots"] == 1


def test_write_ahead_log_replays_and_drops_a_torn_tail(tmp_path):
    wal = str(tmp_path / "wal")
    t = table(10, wal_path=wal)
    ids = t.insert(items(8))
    t.update_priorities(ids[:2], [5.0, 6.0])
    t.insert(items(4, 8))                           # evicts 0 and 1
    t.wal.close()
    with open(wal, "ab") as out:
        out.write(b"\x10\x00\x00")                   # a record cut short by a kill
    again = table(10, wal_path=wal)
    assert sorted(again.columns["x"][again.slot_ids >= 0].tolist()) == list(range(2, 12))
    again.insert(items(1, 12))
    again.wal.close()
    third = table(10, wal_path=wal)
    assert sorted(third.columns["x"][third.slot_ids >= 0].tolist()) == list(range(3, 13))


def test_point_in_time_copy_ignores_writes_made_while_it_runs():
    from fibrl.rl.replay.table import PointInTimeCopy
    t = table(50, sampler=Prioritized(), max_times_sampled=3, seed=5)
    t.insert(items(40), np.arange(40, dtype=float))
    expected = {"data.x": t.columns["x"].copy(), "data.obs": t.columns["obs"].copy(),
                "slot_ids": t.slot_ids.copy(), "priorities": t.priorities.copy(),
                "times_sampled": t.times_sampled.copy()}
    with t.cond:
        copy = t.copy = PointInTimeCopy(t)
    copy.rows = 7
    step = 0
    while not copy.done():
        with t.cond:
            copy.copy_chunk()
        step += 1
        t.insert(items(5, 100 + 5 * step), np.full(5, 9.0))      # evicts once full
        t.update_priorities(t.slot_ids[t.slot_ids >= 0][:10], np.ones(10))
        t.sample(8)
    t.copy = None
    for name, want in expected.items():
        np.testing.assert_array_equal(copy.out[name], want, err_msg=name)
    assert not np.array_equal(t.slot_ids, expected["slot_ids"])


def test_public_names():
    import fibrl.rl
    import fibrl.rl.replay as replay
    assert all(hasattr(replay, name) for name in replay.__all__)
    assert fibrl.rl.ReplayStore is replay.ReplayStore


def test_restore_replays_only_the_log_written_after_the_snapshot(tmp_path):
    wal, snap = str(tmp_path / "wal"), str(tmp_path / "snap.bin")
    t = table(100, sampler=Fifo(), wal_path=wal, seed=1)
    t.insert(items(10))
    t.snapshot(snap)
    ids = t.insert(items(5, 10))
    t.update_priorities(ids[:1], [9.0])
    t.wal.close()                                   # the store is gone; its files remain
    again = ReplayTable(TableConfig(100, sampler=Fifo(), wal_path=wal), restore_path=snap)
    assert again.sample(15)["data"]["x"].tolist() == list(range(15))   # each item once
    assert again.priorities[again.slot_ids == ids[0]].tolist() == [9.0]


def test_periodic_snapshots(tmp_path):
    from conftest import wait_until
    path = str(tmp_path / "periodic.bin")
    t = table(10, snapshot_path=path, snapshot_every=0.05)
    t.insert(items(3))
    wait_until(lambda: t.stats()["snapshots"] >= 2, "two periodic snapshots")
    t.stop.set()
    assert ReplayTable(TableConfig(10), restore_path=path).size() == 3


def test_a_log_dropped_without_close_releases_its_descriptor(tmp_path):
    import gc
    import os

    from fibrl.rl.replay.persist import WriteAheadLog

    path = str(tmp_path / "wal")
    log = WriteAheadLog(path)
    fd = log.fd
    del log
    gc.collect()
    try:
        still = os.readlink(f"/proc/self/fd/{fd}") == path
    except OSError:   # closed
        still = False
    assert not still, "a write-ahead log nobody holds keeps its file open"
