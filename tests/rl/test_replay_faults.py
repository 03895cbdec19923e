"""ReplayStore under faults: a full disk, a store killed mid-snapshot, sharded recovery,
n-step items across a truncation.

Each test's docstring states the property it checks. The full-disk tests run on a
2 MB tmpfs that the ``small_disk`` fixture mounts (the store servers are local
processes, so they see the mount) and unmounts afterwards.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import threading

import numpy as np
import psutil
import pytest
from conftest import wait_until

from fibrl.rl import ReplayStore
from fibrl.rl.replay import Fifo, NStep, ReplayStorageError, ReplayStoreLost
from fibrl.rl.replay.persist import read_log
from fibrl.rl.replay.table import ReplayTable, TableConfig

OBS = 32   # float32 values per item: 128 bytes


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs at ``tmp_path / "disk"``, unmounted after the test."""
    where = tmp_path / "disk"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the full-disk tests need a 2 MB tmpfs to fill")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"mounting a 2 MB tmpfs was refused (the full-disk tests need root or "
                    f"CAP_SYS_ADMIN): {done.stderr.strip() or done.returncode}")
    try:
        yield where
    finally:
        # lazily: a store server killed by a failed test may still hold a file open
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=60)


def fill(disk, leave: int, name: str = "filler") -> None:
    """Take all of ``disk``'s free space but about ``leave`` bytes."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    with open(disk / name, "wb") as out:
        out.write(b"\0" * max(0, free - leave))


def batch_of(tag: int, n: int = 100) -> dict:
    """``n`` items of writer batch ``tag``: each item's content follows from (tag, seq)."""
    seq = np.arange(n, dtype=np.int64)
    return {"tag": np.full(n, tag, np.int64), "seq": seq, "obs": expected_obs(tag, seq)}


def expected_obs(tag, seq) -> np.ndarray:
    base = np.asarray(tag, np.float32) * 1000 + np.asarray(seq, np.float32)
    return base.reshape(-1, 1) + np.arange(OBS, dtype=np.float32) / OBS


def everything(store):
    """Every item (the stores here sample FIFO, so a batch of the size is all of them)."""
    return store.sample(len(store), timeout=60)


def check_contents(batch) -> None:
    """Each item holds what its writer inserted."""
    np.testing.assert_array_equal(batch["obs"], expected_obs(batch["tag"], batch["seq"]))


def tags_of(batch) -> dict:
    """tag -> the sorted seqs held of it."""
    out: dict = {}
    for tag, seq in zip(batch["tag"].tolist(), batch["seq"].tolist()):
        out.setdefault(tag, []).append(seq)
    return {tag: sorted(seqs) for tag, seqs in out.items()}


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_servers(store) -> None:
    pids = store.server_pids()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        wait_until(lambda pid=pid: gone(pid), f"store server {pid} to die")


# -- a full disk -------------------------------------------------------------------------
def test_a_full_disk_under_the_log_refuses_the_change_and_keeps_the_log_whole(small_disk):
    """A write-ahead log append that hits ENOSPC: the insert raises ReplayStorageError
    (an OSError with errno ENOSPC) and nothing of it is stored; a priority update whose
    record does not fit changes nothing either. The torn bytes are cut off,
    so the log still ends with a whole record, and the inserts acknowledged once there is
    room again are read back after a kill -9: a recovered store holds exactly the
    acknowledged inserts."""
    wal = small_disk / "store.wal"
    store = ReplayStore(10_000, sampler=Fifo(), wal_path=str(wal))
    acked: dict = {}
    try:
        for tag in range(3):
            acked[tag] = store.insert(batch_of(tag), priorities=np.full(100, 1.0 + tag))
        fill(small_disk, leave=30_000)   # room for about one more 17 KB record
        tag = 3
        with pytest.raises(ReplayStorageError) as info:
            while tag < 20:
                acked[tag] = store.insert(batch_of(tag))
                tag += 1
        failed = tag
        assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
        assert "was not applied" in str(info.value) and str(wal) in str(info.value)
        held = everything(store)
        assert len(store) == 100 * len(acked) and failed not in tags_of(held)
        assert tags_of(held) == {t: list(range(100)) for t in acked}
        records = list(read_log(str(wal)))
        assert len(records) == len(acked) and records[-1][1] == os.path.getsize(wal)

        fill(small_disk, leave=0, name="filler2")   # no page is left
        before = everything(store)
        every = np.concatenate(list(acked.values()))   # a record larger than a page
        with pytest.raises(ReplayStorageError):
            store.update_priorities(every, np.full(len(every), 99.0))
        after = everything(store)
        assert len(store) == 100 * len(acked)
        np.testing.assert_array_equal(after.ids, before.ids)
        np.testing.assert_array_equal(after.priorities, before.priorities)
        assert len(list(read_log(str(wal)))) == len(acked)

        os.unlink(small_disk / "filler")   # room again: the writer's retry succeeds
        os.unlink(small_disk / "filler2")
        acked[failed] = store.insert(batch_of(failed))
        acked[failed + 1] = store.insert(batch_of(failed + 1))
        assert store.update_priorities(acked[0][:10], np.full(10, 7.0)) == 10
        kill_servers(store)
    finally:
        store.close()
    with ReplayStore(10_000, sampler=Fifo(), wal_path=str(wal)) as again:
        held = everything(again)
        assert sorted(held.ids.tolist()) == sorted(np.concatenate(list(acked.values())).tolist())
        assert tags_of(held) == {t: list(range(100)) for t in acked}
        check_contents(held)
        first = np.isin(held.ids, acked[0][:10])
        assert held.priorities[first].tolist() == [7.0] * 10


def test_a_full_disk_during_a_snapshot_keeps_the_previous_snapshot(small_disk):
    """A snapshot that hits ENOSPC raises ReplayStorageError (errno ENOSPC) in the caller,
    leaves the previous snapshot byte for byte as it was (and restorable), removes its
    half-written temporary file (giving the space back), and the store goes on serving;
    once there is room, the next snapshot succeeds."""
    snap = small_disk / "snap.bin"
    with ReplayStore(3000, sampler=Fifo()) as store:
        for tag in range(20):
            store.insert(batch_of(tag))
        first = store.snapshot(str(snap))
        assert first["items"] == 2000
        good = snap.read_bytes()
        for tag in range(20, 25):
            store.insert(batch_of(tag))
        fill(small_disk, leave=100_000)   # the table takes about 500 KB
        with pytest.raises(ReplayStorageError) as info:
            store.snapshot(str(snap))
        assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
        assert "previous snapshot" in str(info.value)
        assert snap.read_bytes() == good
        assert not os.path.exists(f"{snap}.tmp")
        assert store.stats()["snapshots"] == 1
        store.insert(batch_of(25))   # still serving
        assert len(store) == 2600
        with ReplayStore.restore(str(snap)) as earlier:
            held = everything(earlier)
            assert tags_of(held) == {t: list(range(100)) for t in range(20)}
            check_contents(held)
        os.unlink(small_disk / "filler")
        assert store.snapshot(str(snap))["items"] == 2600


class FullDisk:
    """Stands in for the ``os`` module of ``fibrl.rl.replay.persist``: every ``write``
    fails as on a full disk, after writing ``room`` bytes in all."""

    def __init__(self, room: int = 0) -> None:
        self.room = room

    def write(self, fd, data):
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, bytes(data)[:self.room])
        self.room -= n
        return n

    def __getattr__(self, name):
        return getattr(os, name)


def test_a_change_whose_log_record_fails_is_not_applied(tmp_path, monkeypatch):
    """Every logged change is written before it is applied: with the disk full, a
    clear removes nothing, a priority update changes nothing, an insert stores nothing
    (its first insert makes no columns either), and an n-step append keeps its steps
    pending as they were, so the same append retried once there is room stores exactly
    the items it would have stored the first time. The log holds whole records only."""
    from fibrl.rl.replay import persist
    wal = str(tmp_path / "wal")
    t = ReplayTable(TableConfig(100, sampler=Fifo(), wal_path=wal))
    full = FullDisk(room=5)   # the first record is torn after 5 bytes
    monkeypatch.setattr(persist, "os", full)
    with pytest.raises(ReplayStorageError, match="was not applied"):
        t.insert(batch_of(0, 10))
    assert t.size() == 0 and t.columns == {} and os.path.getsize(wal) == 0
    monkeypatch.setattr(persist, "os", os)
    ids = t.insert(batch_of(1, 10), np.ones(10))
    monkeypatch.setattr(persist, "os", full)
    with pytest.raises(ReplayStorageError):
        t.clear()
    with pytest.raises(ReplayStorageError):
        t.update_priorities(ids, np.full(10, 5.0))
    assert t.size() == 10 and t.priorities[t.slot_ids >= 0].tolist() == [1.0] * 10
    monkeypatch.setattr(persist, "os", os)
    records = list(read_log(wal))
    assert [r[0][0] for r in records] == ["insert"] and records[-1][1] == os.path.getsize(wal)

    n = ReplayTable(TableConfig(100, sampler=Fifo(), n_step=NStep(n=2, gamma=0.5),
                                wal_path=str(tmp_path / "nstep.wal")))

    def steps(obs, reward):
        return {"obs": np.array([[obs]], np.float32), "action": np.array([0]),
                "reward": np.array([reward], np.float32),
                "next_obs": np.array([[obs + 1]], np.float32), "done": np.array([False])}

    n.append(steps(0, 1.0), [3])
    monkeypatch.setattr(persist, "os", FullDisk())
    with pytest.raises(ReplayStorageError):
        n.append(steps(1, 2.0), [3])   # completes the item of steps 0-1, not logged
    monkeypatch.setattr(persist, "os", os)
    assert n.size() == 0
    assert len(n.append(steps(1, 2.0), [3])) == 1   # retried: the same item, once
    assert len(n.append(steps(2, 4.0), [3])) == 1
    data = n.sample(2)["data"]
    assert sorted(data["reward"].tolist()) == [1 + 0.5 * 2, 2 + 0.5 * 4]


@pytest.mark.parametrize("method", ["fork", "chunked"])
def test_both_snapshot_methods_report_a_full_disk_the_same_way(small_disk, method):
    """In-process, with either way of taking the point-in-time view: ENOSPC is a
    ReplayStorageError with errno ENOSPC, the old snapshot stays, no temporary file is
    left behind."""
    snap = small_disk / "snap.bin"
    t = ReplayTable(TableConfig(3000, sampler=Fifo()))
    t.snapshot_method = method
    t.insert(batch_of(0))
    t.snapshot(str(snap))
    good = snap.read_bytes()
    fill(small_disk, leave=50_000)
    with pytest.raises(ReplayStorageError) as info:
        t.snapshot(str(snap))
    assert info.value.errno == errno.ENOSPC
    assert snap.read_bytes() == good and not os.path.exists(f"{snap}.tmp")
    assert ReplayTable(TableConfig(3000), restore_path=str(snap)).size() == 100


# -- a store killed while it writes a snapshot -------------------------------------------
# up to 20 snapshots to catch the writer mid-file, then a restore: 2 s on a quiet
# machine, over a minute under `stress --cpu 4` beside three other test processes
@pytest.mark.timeout(240)
def test_a_store_killed_mid_snapshot_restores_every_acknowledged_insert(tmp_path):
    """kill -9 of the store server while its snapshot writer is half-way: the writer
    dies with it (it does not finish the file later), the last good snapshot is left
    byte for byte, and ``ReplayStore.restore(snapshot, wal_path=...)`` holds every
    acknowledged insert once, with its content (at most the one batch in flight when
    the server died comes back too, whole)."""
    snap, wal = tmp_path / "snap.bin", tmp_path / "store.wal"
    # room for every insert: an eviction would hide items replayed twice
    store = ReplayStore(250_000, sampler=Fifo(), wal_path=str(wal))
    acked: dict = {}
    stop = threading.Event()
    writer_pid = None
    try:
        for tag in range(100):
            acked[tag] = store.insert(batch_of(tag, 1000))
        store.snapshot(str(snap))   # the last good one
        good = snap.read_bytes()
        server = store.server_pids()[0]

        def write() -> None:   # goes on inserting while the next snapshot is written
            tag = 100
            try:
                while not stop.is_set() and tag < 150:
                    acked[tag] = store.insert(batch_of(tag, 1000))
                    tag += 1
            except ReplayStoreLost:
                return

        outcome: list = []

        def take_snapshot() -> None:
            try:
                outcome.append(store.snapshot(str(snap)))
            except ReplayStoreLost as exc:
                outcome.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        wait_until(lambda: len(acked) > 105, "the writer to insert during the test")
        # catch the forked writer with its file half-written: stop it there, then kill
        # the server under it
        for _attempt in range(20):
            outcome.clear()
            snapshotter = threading.Thread(target=take_snapshot)
            snapshotter.start()
            while snapshotter.is_alive() and writer_pid is None:
                for child in psutil.Process(server).children():
                    try:
                        os.kill(child.pid, signal.SIGSTOP)
                    except ProcessLookupError:
                        continue
                    if os.path.exists(f"{snap}.tmp"):   # open, and not renamed yet
                        writer_pid = child.pid
                        break
                    os.kill(child.pid, signal.SIGCONT)   # not writing yet: let it go on
            if writer_pid is not None:
                break
            snapshotter.join(60)
            good = snap.read_bytes()   # this one completed: it is the last good one now
        assert writer_pid is not None, "never caught the snapshot writer mid-write"
        os.kill(server, signal.SIGKILL)
        snapshotter.join(60)
        writer.join(60)
        assert not snapshotter.is_alive() and not writer.is_alive()
        assert isinstance(outcome[0], ReplayStoreLost)
        # the stopped writer was killed with its server, without finishing its file
        wait_until(lambda: gone(writer_pid), "the snapshot writer to die with its server",
                   timeout=30)
    finally:
        stop.set()
        if writer_pid is not None and not gone(writer_pid):
            os.kill(writer_pid, signal.SIGKILL)   # (broken code: it would stay stopped)
        store.close()
    assert snap.read_bytes() == good
    want = set(np.concatenate(list(acked.values())).tolist())
    with ReplayStore.restore(str(snap), wal_path=str(wal)) as again:
        held = everything(again)
        have = held.ids.tolist()
        assert len(have) == len(set(have))        # each item once
        assert want <= set(have)                  # every acknowledged insert
        assert len(have) - len(want) in (0, 1000)   # plus, at most, the batch in flight
        tags = tags_of(held)
        assert all(tags[t] == list(range(1000)) for t in acked)
        check_contents(held)
        # the half-written file does not hinder the restored store's own snapshots
        assert again.snapshot(str(snap))["items"] == len(have)


# -- sharded recovery --------------------------------------------------------------------
def test_two_shards_recover_from_their_logs_alone_and_from_a_snapshot_plus_logs(tmp_path):
    """With num_shards=2 and a wal_path, each shard logs to ``wal_path.shard<i>``. After
    kill -9 of both servers, ``ReplayStore.restore(snapshot, num_shards=2,
    wal_path=...)`` holds every acknowledged insert and priority update (those after the
    snapshot from the logs), each item in the shard its id names; the restored store
    goes on logging to the same files, so a store made from the logs alone afterwards
    holds all of that again."""
    snap, wal = tmp_path / "snap.bin", tmp_path / "store.wal"
    store = ReplayStore(4000, sampler=Fifo(), num_shards=2, wal_path=str(wal))
    acked: dict = {}
    prios: dict = {}

    def put(target, tag) -> None:
        acked[tag] = target.insert(batch_of(tag), priorities=np.full(100, float(tag)))
        prios.update(dict.fromkeys(acked[tag].tolist(), float(tag)))

    def update(target, ids, value) -> None:
        assert target.update_priorities(ids, np.full(len(ids), value)) == len(ids)
        prios.update(dict.fromkeys(ids.tolist(), value))

    try:
        for tag in range(6):
            put(store, tag)
        update(store, np.concatenate([acked[0][:5], acked[1][:5]]), 50.0)
        store.snapshot(str(snap))
        assert os.path.exists(f"{snap}.shard0") and os.path.exists(f"{snap}.shard1")
        for tag in range(6, 10):
            put(store, tag)
        update(store, np.concatenate([acked[2][:5], acked[7][:5], acked[8][:5]]), 60.0)
        assert os.path.exists(f"{wal}.shard0") and os.path.exists(f"{wal}.shard1")
        kill_servers(store)
    finally:
        store.close()
    assert {int(i) % 2 for t in range(10) for i in acked[t]} == {0, 1}   # both shards used

    def check(target) -> None:
        held = everything(target)
        assert sorted(held.ids.tolist()) == sorted(prios)
        check_contents(held)
        assert dict(zip(held.ids.tolist(), held.priorities.tolist())) == prios
        sizes = [shard["size"] for shard in target.stats()["shards"]]
        assert sizes == [sum(1 for i in prios if i % 2 == s) for s in range(2)]

    with ReplayStore.restore(str(snap), num_shards=2, wal_path=str(wal)) as again:
        check(again)
        put(again, 10)   # the restored store logs on, to the same files
        update(again, acked[3][:5], 70.0)
        assert set(acked[10].tolist()).isdisjoint(set().union(*(acked[t].tolist()
                                                                  for t in range(10))))
        check(again)
        kill_servers(again)
    with ReplayStore(4000, sampler=Fifo(), num_shards=2, wal_path=str(wal)) as from_logs:
        check(from_logs)


# -- n-step items across a truncation ------------------------------------------------------
def test_n_step_items_across_a_truncated_step_are_bootstrapped_not_terminal():
    """An episode that ends by truncation stores its tail items with ``discount =
    gamma ** m`` (bootstrapped from the last step's next_obs, done False); one that
    ends by termination stores them with discount 0; no item spans two episodes. The
    expected values are worked out by hand below (n=3, gamma=0.9)."""
    gamma = 0.9
    with ReplayStore(100, sampler=Fifo(), n_step=NStep(n=3, gamma=gamma)) as store:
        def step(obs, reward, done=False, truncated=False):
            return store.append({"obs": np.array([[obs]], np.float32),
                                 "action": np.array([0]), "reward": np.array([reward],
                                                                             np.float32),
                                 "next_obs": np.array([[obs + 1]], np.float32),
                                 "done": np.array([done]),
                                 "truncated": np.array([truncated])}, env_ids=[7])

        assert len(step(0, 1.0)) == 0
        assert len(step(1, 2.0)) == 0
        assert len(step(2, 4.0)) == 1                   # item of steps 0, 1, 2
        assert len(step(3, 8.0, truncated=True)) == 3   # the episode's tail: 1-3, 2-3, 3
        assert len(step(10, 16.0)) == 0                 # a new episode starts afresh
        assert len(step(11, 32.0)) == 0
        assert len(step(12, 64.0, done=True)) == 3      # terminated: 10-12, 11-12, 12
        items = everything(store)
    # by hand: reward = sum of gamma**i * r_i over the window, discount = gamma**len
    # (0 after a termination), next_obs = the window's last next_obs
    expected = [  # (first obs, reward, discount, next_obs, done)
        (0, 1 + 0.9 * 2 + 0.81 * 4, 0.729, 3, False),
        (1, 2 + 0.9 * 4 + 0.81 * 8, 0.729, 4, False),     # = 12.08, bootstrapped
        (2, 4 + 0.9 * 8, 0.81, 4, False),                # = 11.2
        (3, 8, 0.9, 4, False),
        (10, 16 + 0.9 * 32 + 0.81 * 64, 0.0, 13, True),   # = 96.64, terminal
        (11, 32 + 0.9 * 64, 0.0, 13, True),
        (12, 64, 0.0, 13, True),
    ]
    assert items["obs"][:, 0].tolist() == [e[0] for e in expected]
    np.testing.assert_allclose(items["reward"], [e[1] for e in expected], rtol=1e-6)
    np.testing.assert_allclose(items["discount"], [e[2] for e in expected], rtol=1e-6)
    assert items["next_obs"][:, 0].tolist() == [e[3] for e in expected]
    assert items["done"].tolist() == [e[4] for e in expected]
    assert "truncated" not in items.data   # what matters of it is in the discount
