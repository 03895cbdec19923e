"""ReplayStore served by fibrl processes: sharing across writers, kills, shards, backends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import wait_until

import fibrl
from fibrl.managers import SyncManager
from fibrl.rl import ReplayStore
from fibrl.rl.replay import (Fifo, MinSize, Prioritized, RateLimiterTimeout, ReplayManager,
                             ReplayStoreLost, register_replay_store)

WRITERS, PER_WRITER, BATCH = 4, 10_000, 10


def write_items(store, writer, count, batch):
    """Insert ``count`` items tagged (writer, seq) in batches; return the acknowledged ids."""
    ids = []
    for start in range(0, count, batch):
        seq = np.arange(start, start + batch, dtype=np.int64)
        ids.append(store.insert({"writer": np.full(batch, writer, np.int64), "seq": seq,
                                 "obs": np.zeros((batch, 4), np.float32)}))
    return np.concatenate(ids)


def writer_process(store, writer, count, batch, results):
    results.put((writer, write_items(store, writer, count, batch)))


def everything(store):
    """Every item, oldest first (the store's sampler is FIFO)."""
    return store.sample(len(store), timeout=30)


def test_seed_case_four_writers_share_one_buffer():
    with ReplayStore(WRITERS * PER_WRITER, sampler=Fifo()) as store:
        results = fibrl.Queue()
        procs = [fibrl.Process(target=writer_process,
                               args=(store, w, PER_WRITER, BATCH, results))
                 for w in range(WRITERS)]
        for proc in procs:
            proc.start()
        acked = dict(results.get(timeout=240) for _ in procs)
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0
        assert len(store) == WRITERS * PER_WRITER
        batch = everything(store)
        assert len(np.unique(batch.ids)) == WRITERS * PER_WRITER
        assert set(batch.ids.tolist()) == set(np.concatenate(list(acked.values())).tolist())
        tags = set(zip(batch["writer"].tolist(), batch["seq"].tolist()))
        assert tags == {(w, s) for w in range(WRITERS) for s in range(PER_WRITER)}


def pool_writer(store, task, marker_dir):
    """Insert 1000 items for ``task``; victims SIGKILL their worker halfway, once."""
    marker = os.path.join(marker_dir, f"killed-{task}")
    if task in (3, 17, 29) and not os.path.exists(marker):
        open(marker, "w").close()
        write_items_tagged(store, task, 0, 500)
        os.kill(os.getpid(), signal.SIGKILL)
    return write_items_tagged(store, task, 0, 1000)


def write_items_tagged(store, task, start, stop):
    ids = []
    for lo in range(start, stop, 100):
        seq = np.arange(lo, lo + 100, dtype=np.int64)
        ids.append(store.insert({"writer": np.full(100, task, np.int64), "seq": seq,
                                 "obs": np.zeros((100, 4), np.float32)}))
    return np.concatenate(ids)


def test_seed_case_with_pool_workers_sigkilled(tmp_path):
    with ReplayStore(60_000, sampler=Fifo()) as store, \
            fibrl.Pool(4, max_task_retries=2) as pool:
        results = pool.starmap(pool_writer, [(store, t, str(tmp_path)) for t in range(40)],
                               chunksize=1)
        acked = np.concatenate(results)
        assert len(np.unique(acked)) == 40_000
        assert store.stats()["evictions"] == 0
        batch = everything(store)
        # every id the store acknowledged is there once: ids are unique, none went missing
        assert len(np.unique(batch.ids)) == len(batch.ids) == len(store)
        assert set(acked.tolist()) <= set(batch.ids.tolist())
        counts: dict = {}
        for tag in zip(batch["writer"].tolist(), batch["seq"].tolist()):
            counts[tag] = counts.get(tag, 0) + 1
        assert set(counts) == {(t, s) for t in range(40) for s in range(1000)}
        # a killed attempt's inserts were acknowledged to it before it died: kept too
        again = {tag for tag, n in counts.items() if n > 1}
        assert again >= {(t, s) for t in (3, 17, 29) for s in range(500)}
        assert max(counts.values()) <= 1 + pool_retries_seen(again)


def pool_retries_seen(tags) -> int:
    """Items of one task are stored once per attempt that reached them (at most 3 here)."""
    return 2 if tags else 0


def test_prioritized_sampling_exact_across_shards():
    spec = Prioritized(alpha=1.0, beta=0.6, eps=0.0)
    with ReplayStore(40, sampler=spec, num_shards=2, seed=2024) as store:
        prios = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
        ids = np.concatenate([store.insert({"x": np.arange(i, i + 5)}, prios[i:i + 5])
                              for i in (0, 5)])
        assert {int(i) % 2 for i in ids[:5]} != {int(i) % 2 for i in ids[5:]}  # both shards
        exact = prios / prios.sum()
        counts = np.zeros(10)
        order = np.argsort(ids)
        for _ in range(40):
            batch = store.sample(250)
            rows = order[np.searchsorted(ids[order], batch.ids)]
            np.add.at(counts, rows, 1)
            np.testing.assert_allclose(batch.probabilities, exact[rows], rtol=1e-9)
            w = (10 * exact[rows]) ** -spec.beta   # over the store's largest weight
            np.testing.assert_allclose(batch.weights, w / (10 * exact.min()) ** -spec.beta,
                                       rtol=1e-5)
        expected = exact * counts.sum()
        assert ((counts - expected) ** 2 / expected).sum() < 27.88   # chi2(9), p = 0.001
        assert store.update_priorities(ids, np.ones(10)) == 10
        assert len(store) == 10


# -- sample_async -------------------------------------------------------------------------------
@pytest.mark.parametrize("num_shards", [1, 2])
def test_prefetched_samples_carry_updates_and_follow_the_sampler(num_shards):
    with ReplayStore(40, sampler="max_heap", num_shards=num_shards) as store:
        ids = np.concatenate([store.insert({"x": np.arange(i, i + 4)}, np.arange(i, i + 4.0))
                              for i in (0, 4)])
        first = store.sample_async(2)
        second = store.sample_async(2, update=(ids[:1], [100.0]))  # applied before its draw
        assert sorted(second.get(timeout=30)["x"].tolist()) == [0, 7]
        # two shards split an ordered batch by size and take each one's highest
        assert sorted(first.get(timeout=30)["x"].tolist()) == ([6, 7] if num_shards == 1
                                                                else [3, 7])
        assert first.ready() and first.get() is first.get()       # the same batch again
        assert store.stats()["samples"] == 4


def test_a_priority_update_travels_as_the_same_arrays():
    import pickle

    from fibrl.rl.replay.client import _update_arrays
    for ids, priorities in ((np.arange(10)[::2], [1, 2, 3, 4, 5.5]), ([], []),
                            (np.array([[7, 8]], np.int32), np.float32([0.25, 2]))):
        back = pickle.loads(pickle.dumps(_update_arrays(ids, priorities), protocol=5))
        assert [a.dtype for a in back] == [np.int64, np.float64]
        np.testing.assert_array_equal(back[0], np.ravel(ids))
        np.testing.assert_array_equal(back[1], np.ravel(priorities))


def test_pending_samples_are_drawn_in_request_order():
    with ReplayStore.queue(10) as store:
        store.insert({"x": np.arange(6)})
        pending = [store.sample_async(2) for _ in range(3)]
        got = [p.get(timeout=30)["x"].tolist() for p in reversed(pending)]
        assert got == [[4, 5], [2, 3], [0, 1]]


def test_a_pending_sample_waits_for_the_rate_limiter():
    with ReplayStore(10, rate_limiter=MinSize(2)) as store:
        store.insert({"x": np.arange(1)})
        pending = store.sample_async(3, timeout=60)
        with pytest.raises(TimeoutError):
            pending.get(timeout=0.2)                   # still held back: call get again
        assert not pending.ready() and store.stats()["samples"] == 0
        store.insert({"x": np.arange(1, 2)})
        assert set(pending.get(timeout=30)["x"].tolist()) <= {0, 1}
        late = ReplayStore(10, rate_limiter=MinSize(5))
        with late:
            with pytest.raises(RateLimiterTimeout):
                late.sample_async(1, timeout=0.1).get(timeout=30)


def test_a_pending_sample_dropped_unread_leaves_the_next_ones_theirs():
    with ReplayStore.queue(20) as store:
        store.insert({"x": np.arange(8)})
        dropped = store.sample_async(2)
        kept = store.sample_async(2)
        del dropped                                   # its reply is discarded when it comes
        assert kept.get(timeout=30)["x"].tolist() == [2, 3]
        assert store.sample_async(2).get(timeout=30)["x"].tolist() == [4, 5]
        assert store.sample(2, timeout=30)["x"].tolist() == [6, 7]


def test_pending_samples_from_several_threads_each_get_their_own():
    with ReplayStore.queue(4000) as store:
        store.insert({"x": np.arange(3000)})
        got: list = []

        def learner():
            pending = [store.sample_async(10, timeout=60) for _ in range(2)]
            for _ in range(48):
                pending.append(store.sample_async(10, timeout=60))
                got.extend(pending.pop(0).get(timeout=60)["x"].tolist())
            for left in pending:
                got.extend(left.get(timeout=60)["x"].tolist())

        threads = [threading.Thread(target=learner) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(got) == list(range(3000))       # each item once: no reply went astray


def test_a_pending_sample_of_a_killed_store_fails_clearly():
    store = ReplayStore(100, rate_limiter=MinSize(5))
    try:
        store.insert({"x": np.arange(2)})
        pending = store.sample_async(1, timeout=120)   # held back by the rate limiter
        wait_until(lambda: store.stats()["samples_waiting"] == 1,
                   "the sample to wait in the rate limiter")
        os.kill(store.server_pids()[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ReplayStoreLost, match="replay store server is gone"):
            pending.get(timeout=60)
        with pytest.raises(ReplayStoreLost, match="replay store server is gone"):
            store.sample_async(1).get(timeout=60)
        assert time.monotonic() - start < 30
    finally:
        store.close()


@pytest.mark.parametrize("num_shards", [1, 2])
def test_a_priority_update_with_a_priority_missing_is_refused(num_shards):
    with ReplayStore(40, sampler=Prioritized(), num_shards=num_shards) as store:
        ids = store.insert({"x": np.arange(4)})
        with pytest.raises(ValueError, match="priorit"):
            store.update_priorities(ids, [1.0, 2.0, 3.0])
        with pytest.raises(ValueError, match="priorit"):
            store.sample_async(2, update=(ids, [1.0])).get(timeout=30)
        assert store.update_priorities(ids, np.ones(4)) == 4


def test_sample_async_refuses_a_bad_batch_size_at_once():
    with ReplayStore(10) as store:
        with pytest.raises(ValueError, match="batch_size"):
            store.sample_async(0)


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    with ReplayStore(100, sampler=Prioritized()) as store:
        store.insert({"obs": torch.ones(8, 3), "a": torch.arange(8)}, torch.ones(8))
        batch = store.sample(4, as_torch=True)
        assert isinstance(batch["obs"], torch.Tensor) and batch["obs"].shape == (4, 3)
        assert isinstance(batch.weights, torch.Tensor)
        store.sample(2, update=(batch.ids, torch.full((4,), 3.0)))
        assert store.stats()["samples"] == 6
        later = store.sample(200)
        updated = np.isin(later.ids, batch.ids)
        assert updated.any() and np.all(later.priorities[updated] == 3.0)
        assert np.all(later.priorities[~updated] == 1.0)


def test_manager_replay_store_on_a_custom_manager():
    class Mgr(SyncManager):
        pass

    register_replay_store(Mgr)
    with Mgr() as manager, ReplayManager() as other:
        store = manager.ReplayStore(50, sampler="max_heap")
        store.insert({"x": np.arange(5)}, [1.0, 5.0, 2.0, 4.0, 3.0])
        assert store.sample(2)["x"].tolist() == [1, 3]
        assert len(store) == 5 and manager.dict(a=1)["a"] == 1
        assert len(other.ReplayStore(10)) == 0


def blocked_sample(store, results):
    try:
        store.sample(1, timeout=120)
    except BaseException as exc:  # the test checks the type
        results.put(exc)


def test_killed_store_gives_clients_a_clear_error():
    store = ReplayStore(100, rate_limiter=MinSize(5))
    try:
        store.insert({"x": np.arange(2)})
        results = fibrl.Queue()
        waiter = fibrl.Process(target=blocked_sample, args=(store, results))
        waiter.start()
        wait_until(lambda: store.stats()["samples_waiting"] == 1,
                   "the sampler to wait in the rate limiter")
        os.kill(store.server_pids()[0], signal.SIGKILL)
        error = results.get(timeout=60)
        waiter.join(30)
        assert isinstance(error, ReplayStoreLost), repr(error)
        start = time.monotonic()
        with pytest.raises(ReplayStoreLost, match="replay store server is gone "
                                                  ".*lost the manager server at .*restore"):
            store.insert({"x": np.arange(2)})
        assert time.monotonic() - start < 30
    finally:
        store.close()


def test_wal_keeps_every_acknowledged_insert_after_sigkill(tmp_path):
    wal = str(tmp_path / "store.wal")
    store = ReplayStore(200_000, sampler=Fifo(), wal_path=wal)
    acked = []
    try:
        pid = store.server_pids()[0]
        twenty = threading.Event()

        def write():
            try:
                for start in range(0, 200_000, 50):  # seconds of work: killed midway
                    acked.append(store.insert({"x": np.arange(start, start + 50)}))
                    if len(acked) == 20:
                        twenty.set()
            except ReplayStoreLost:
                return

        writer = threading.Thread(target=write)
        writer.start()
        assert twenty.wait(120)
        os.kill(pid, signal.SIGKILL)
        writer.join(60)
        assert not writer.is_alive()
    finally:
        store.close()
    with ReplayStore(200_000, sampler=Fifo(), wal_path=wal) as again:
        have = set(everything(again).ids.tolist())
        want = set(np.concatenate(acked).tolist())
        assert len(want) < 200_000  # the kill came before the writer was done
        assert want <= have and len(have) - len(want) <= 50  # at most the unacknowledged batch


def _snapshot_while_writing(store, path: str) -> dict:
    """``store.snapshot(path)`` once a second writer is inserting (4,000 items)."""
    writer = threading.Thread(target=write_items, args=(store, 1, 4000, 100))
    before = len(store)
    writer.start()
    try:
        wait_until(lambda: len(store) > before, "the second writer to insert")
        return store.snapshot(path)
    finally:
        writer.join(120)


@pytest.mark.timing
def test_a_snapshot_stalls_writers_well_under_a_second(tmp_path):
    with ReplayStore(20_000, sampler=Fifo(), num_shards=2) as store:
        write_items(store, 0, 2000, 100)
        info = _snapshot_while_writing(store, str(tmp_path / "snap.bin"))
    assert info["stall_s"] < 1.0, info


def test_snapshot_while_writing_then_restore(tmp_path):
    path = str(tmp_path / "snap.bin")
    with ReplayStore(20_000, sampler=Fifo(), num_shards=2) as store:
        write_items(store, 0, 2000, 100)
        info = _snapshot_while_writing(store, path)
        assert 2000 <= info["items"] <= 6000 and info["stall_s"] >= 0.0
        before = everything(store)
        original = dict(zip(before.ids.tolist(), zip(before["writer"].tolist(),
                                                     before["seq"].tolist())))
        with ReplayStore.restore(path, num_shards=2) as again:
            assert len(again) == info["items"]
            after = everything(again)
            assert len(set(after.ids.tolist())) == info["items"]
            for item, writer_id, seq in zip(after.ids.tolist(), after["writer"].tolist(),
                                            after["seq"].tolist()):
                assert original[item] == (writer_id, seq)
            assert again.stats()["inserts"] == info["items"]


def test_import_fibrl_rl_does_not_import_numpy():
    code = ("import sys, fibrl, fibrl.rl; bad = [m for m in ('numpy', 'torch', 'gymnasium') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def remote_writer(store, results):
    results.put(store.insert({"x": np.arange(32), "obs": np.ones((32, 8), np.float32)}))


def test_store_server_and_writer_on_each_backend(ctx):
    with ReplayStore(1000, sampler=Prioritized(), ctx=ctx, start_timeout=120) as store:
        results = ctx.Queue()
        proc = ctx.Process(target=remote_writer, args=(store, results))
        proc.start()
        ids = results.get(timeout=120)
        proc.join(60)
        batch = store.sample(16)
        assert set(batch.ids.tolist()) <= set(ids.tolist())
        assert batch["obs"].shape == (16, 8)
        pending = [store.sample_async(8, update=(batch.ids, np.ones(16))) for _ in range(3)]
        assert all(set(p.get(timeout=60).ids.tolist()) <= set(ids.tolist()) for p in pending)
        # the server forks a snapshot writer wherever it runs (a container too)
        info = store.snapshot("/tmp/fibrl-replay-backend-test.snap")
        assert info["items"] == len(store) and info["stall_s"] < 5
        assert store.stats()["snapshots"] == 1


def test_n_step_items_from_sharded_appends():
    from fibrl.rl.replay import NStep
    with ReplayStore(100, sampler=Fifo(), n_step=NStep(n=2, gamma=1.0), num_shards=2) as store:
        for step in range(3):                       # 3 envs x 3 steps, no episode end
            store.append({"obs": np.full((3, 1), step, np.float32),
                          "action": np.zeros(3, np.int64),
                          "reward": np.ones(3, np.float32),
                          "next_obs": np.full((3, 1), step + 1, np.float32),
                          "done": np.zeros(3, bool)}, env_ids=[0, 1, 2])
        assert len(store) == 6                       # 2 complete 2-step items per env
        batch = store.sample(6)
        assert sorted(batch["reward"].tolist()) == [2.0] * 6
        assert sorted(batch["next_obs"][:, 0].tolist()) == [2.0] * 3 + [3.0] * 3
