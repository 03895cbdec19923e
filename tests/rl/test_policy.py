"""PolicyStore: versions published by a learner, read by fibrl processes and by scripts."""
from __future__ import annotations

import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
from conftest import checkout_env, wait_until

import fibrl
from fibrl.rl import PolicyFollower, PolicyStore
from fibrl.rl.policy import PolicyStoreLost, VersionNotKept
from fibrl.rl.policy.protocol import Op, Request

MB = 1 << 20


# -- a version that says whether it is whole ----------------------------------------------
def params_of(version: int, arrays: dict) -> dict:
    """``arrays`` filled in place with ``version``, and their checksum."""
    for array in arrays.values():
        array.fill(version)
    return {"layers": arrays, "version": version, "checksum": checksum(arrays)}


def checksum(arrays: dict) -> int:
    return zlib.crc32(b"".join(np.ascontiguousarray(arrays[k]).tobytes()
                               for k in sorted(arrays)))


def whole(params: dict, version: int) -> bool:
    arrays = params["layers"]
    return (params["version"] == version and checksum(arrays) == params["checksum"]
            and all((a == version).all() for a in arrays.values()))


def ten_mb() -> dict:
    return {"w1": np.zeros((1024, 1024), np.float32), "w2": np.zeros(1024 * 1024, np.float64),
            "b": np.zeros(1024 * 1024, np.int16)}


def record_waits(store) -> list:
    """From now on, each request for a newer version that reaches the store (in its own
    thread, before it waits) appends its ``wait`` (seconds) to the list returned: the
    state to wait for before acting on a reader that must be waiting."""
    versions = store._versions
    newer, waits = versions.newer, []

    def recorded(than, wait):
        waits.append(wait)
        return newer(than, wait)

    versions.newer = recorded
    return waits


def poll_versions(store, last: int, results) -> None:
    """Read every version that comes, up to ``last``; report those torn or out of order."""
    seen, bad, version = [], [], 0
    deadline = time.monotonic() + 240
    while version < last and time.monotonic() < deadline:
        found = store.latest(newer_than=version, timeout=10)
        if found is None:
            continue
        if found[0] <= version or not whole(found[1], found[0]):
            bad.append(found[0])
        version = found[0]
        seen.append(version)
    results.put((seen, bad))


@pytest.mark.timeout(300)   # 1000 versions of 10 MB: two minutes on a loaded machine
def test_a_reader_never_sees_a_torn_version():
    versions = 1000
    arrays = ten_mb()
    with PolicyStore() as store:
        store.publish(params_of(1, arrays))
        results = fibrl.Queue()
        reader = fibrl.Process(target=poll_versions, args=(store, versions, results))
        reader.start()
        for version in range(2, versions + 1):   # the same arrays, changed in place
            assert store.publish(params_of(version, arrays)) == version
        seen, bad = results.get(timeout=240)
        reader.join(60)
    assert reader.exitcode == 0
    assert not bad, f"torn or out-of-order versions: {bad}"
    assert seen[-1] == versions and seen == sorted(set(seen))
    assert len(seen) >= 2   # it read while the learner published


# -- versions, waiting, keep ----------------------------------------------------------------
def test_with_keep_1_publish_reuses_the_buffer_nobody_reads():
    """The publisher holds one copy of the params: the next version is written into the
    current one's buffer, unless a reader is receiving it (then that buffer stays as it
    is until the reader is done, and a new one is made)."""
    params = {"w": np.zeros(1 << 18, np.float32)}
    with PolicyStore() as store:
        versions = store._versions
        store.publish(params)
        first = versions.get(1)
        buffer = first.blob.obj
        versions.release(first)
        params["w"][:] = 2
        store.publish(params)
        second = versions.get(2)
        assert second.blob.obj is buffer           # reused: nobody held version 2's
        params["w"][:] = 3
        before = bytes(second.blob)                # version 2 is lent (being "sent")
        store.publish(params)
        assert bytes(second.blob) == before        # left alone while lent
        third = versions.get(3)
        assert third.blob.obj is not buffer
        versions.release(third)
        versions.release(second)
        assert store.latest()[1]["w"][0] == 3
        assert store.get(3)["w"][0] == 3


def test_versions_increase_and_latest_waits_for_a_newer_one():
    with PolicyStore() as store:
        reader = pickle.loads(pickle.dumps(store))   # a reader, as a worker gets it
        assert store.version == 0 and reader.version == 0
        assert reader.latest() is None and reader.latest(timeout=0) is None
        assert store.publish({"w": np.ones(3)}) == 1
        assert store.publish({"w": np.full(3, 2.0)}) == 2
        version, params = reader.latest()
        assert version == 2 and params["w"].tolist() == [2.0] * 3
        start = time.monotonic()
        assert reader.latest(newer_than=2, timeout=0.3) is None
        assert time.monotonic() - start >= 0.29   # (a timeout is never cut short)
        waits = record_waits(store)
        publisher = threading.Thread(target=lambda: (
            wait_until(lambda: 60 in waits, "the reader to wait for a newer version"),
            store.publish({"w": np.full(3, 3.0)})))
        publisher.start()
        # published while the reader waits: answered by the publish, not at its timeout
        # (60 s; the publish comes as soon as the reader waits, so a wide bound tells
        # the two apart)
        start = time.monotonic()
        version, params = reader.latest(newer_than=2, timeout=60)
        assert version == 3 and params["w"][0] == 3.0
        assert time.monotonic() - start < 30, "answered at the timeout, not by the publish"
        publisher.join(60)
        assert store.latest(newer_than=3) is None and store.latest(newer_than=2)[0] == 3
        reader.close()


def test_keep_holds_the_last_k_versions():
    with PolicyStore(keep=3) as store:
        reader = pickle.loads(pickle.dumps(store))
        for v in range(1, 6):
            store.publish({"v": np.full(10_000, v)})   # out of band: larger than 4 KiB
        assert store.versions() == reader.versions() == [3, 4, 5]
        for source in (store, reader):
            for v in (3, 4, 5):
                assert (source.get(v)["v"] == v).all()
            with pytest.raises(VersionNotKept, match=r"no longer kept.*\[3, 4, 5\]") as old:
                source.get(2)
            assert isinstance(old.value, KeyError) and old.value.kept == (3, 4, 5)
            with pytest.raises(VersionNotKept, match="not been published yet"):
                source.get(6)
        reader.close()


def test_published_versions_do_not_change_with_the_learners_arrays():
    weights = np.zeros(100_000, np.float32)
    with PolicyStore(keep=2) as store:
        store.publish({"w": weights})
        weights += 1
        got = store.get(1)
        got["w"][:] = 5          # the caller's own copy: the kept version stays as it was
        assert (store.get(1)["w"] == 0).all() and store.latest()[1]["w"].sum() == 0


# -- readers that stall, die, or outlive the learner -------------------------------------------
def stall_mid_transfer(address, asked) -> None:
    """Ask for the latest (large) version, then never read the answer."""
    import fibrl.channel as channel
    conn = channel.connect(address)
    conn.send(Request(Op.LATEST, 1, 0, 0.0).pack())
    asked.put(os.getpid())
    time.sleep(600)


def read_versions(store, count, results) -> None:
    follower = store.follow()
    for _ in range(count):
        assert follower.refresh(timeout=120)
        results.put((follower.version, float(follower.params["w"][0])))


def test_a_reader_killed_mid_transfer_disturbs_neither_publish_nor_other_readers():
    big = {"w": np.full(64 * MB // 4, 1.0, np.float32)}   # far beyond the socket buffers
    with PolicyStore() as store:
        store.publish(big)
        asked, results = fibrl.Queue(), fibrl.Queue()
        staller = fibrl.Process(target=stall_mid_transfer, args=(store.address, asked))
        staller.start()
        asked.get(timeout=120)
        # its transfer starts, then stops at full socket buffers: version 1 stays lent
        # to the send of its answer
        wait_until(lambda: store._versions._lent[1] >= 1, "the staller's answer to be sent")
        other = fibrl.Process(target=read_versions, args=(store, 3, results))
        other.start()
        assert results.get(timeout=120) == (1, 1.0)
        assert store._versions._lent[1] >= 1, "the staller's answer is no longer stuck"
        start = time.monotonic()
        store.publish({"w": np.full(1000, 2.0, np.float32)})
        # (the staller never reads on until it is killed below: a publish that waited
        # for it would never return, so a wide bound tells the two apart)
        assert time.monotonic() - start < 60, "publish waited for the stalled reader"
        assert results.get(timeout=120) == (2, 2.0)
        os.kill(staller.pid, signal.SIGKILL)   # mid-transfer: its answer is still going
        staller.join(60)
        store.publish({"w": np.full(1000, 3.0, np.float32)})
        assert results.get(timeout=120) == (3, 3.0)
        other.join(60)
        assert other.exitcode == 0 and staller.exitcode == -signal.SIGKILL
        assert store.latest()[0] == 3


def wait_for_news(store, results) -> None:
    try:
        store.latest(newer_than=store.version, timeout=300)
        results.put("answered")
    except PolicyStoreLost as exc:
        results.put(f"lost: {exc}")


def test_readers_are_told_when_the_store_closes_even_while_waiting():
    store = PolicyStore()
    store.publish({"w": np.zeros(3)})
    waits = record_waits(store)
    results = fibrl.Queue()
    waiter = fibrl.Process(target=wait_for_news, args=(store, results))
    waiter.start()
    reader = PolicyStore.connect(store.address)
    assert reader.version == 1
    wait_until(lambda: 300 in waits, "the waiter to wait on the store")
    start = time.monotonic()
    store.close()
    said = results.get(timeout=60)
    assert said.startswith("lost: the policy store at") and "closed it, exited" in said
    assert time.monotonic() - start < 30
    with pytest.raises(PolicyStoreLost):
        reader.latest()
    with pytest.raises(PolicyStoreLost):          # and stays lost: nothing listens now
        reader.latest()
    waiter.join(60)
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        store.publish({"w": np.zeros(3)})


def publish_then_exit(queue, read) -> None:
    store = PolicyStore()
    store.publish({"w": np.arange(5)})
    queue.put(store)
    read.wait(120)               # until the test has read it (or gave up): then exit


def test_readers_are_told_when_the_learner_process_exits():
    queue, read = fibrl.Queue(), fibrl.Event()
    learner = fibrl.Process(target=publish_then_exit, args=(queue, read))
    learner.start()
    store = queue.get(timeout=120)
    try:
        assert store.latest(timeout=30)[1]["w"].tolist() == [0, 1, 2, 3, 4]
    finally:
        read.set()
    learner.join(60)
    assert learner.exitcode == 0
    with pytest.raises(PolicyStoreLost, match="closed it, exited or was killed"):
        store.latest()                      # its connection broke
    fresh = pickle.loads(pickle.dumps(store))
    with pytest.raises(PolicyStoreLost, match="closed it, exited or was killed"):
        fresh.latest()                      # nothing listens at the address
    store.close()
    fresh.close()


# -- snapshot and restore -----------------------------------------------------------------------
def test_snapshot_restore_keeps_the_version_number(tmp_path):
    path = str(tmp_path / "policy.snap")
    with PolicyStore(snapshot_path=path) as store:
        for v in range(1, 4):
            store.publish({"w": np.full(50_000, v, np.float32), "step": v * 10})
        assert store.wait_snapshot(timeout=60)
    assert os.listdir(tmp_path) == ["policy.snap"]   # the temporary file was renamed
    for again in (PolicyStore(snapshot_path=path), PolicyStore.restore(path, keep=2)):
        with again:
            version, params = again.latest()
            assert version == again.version == 3
            assert (params["w"] == 3).all() and params["step"] == 30
            assert again.publish({"w": np.zeros(2)}) == 4
            assert again.wait_snapshot(timeout=60)
    with PolicyStore.restore(path) as latest:
        assert latest.version == 4
    with pytest.raises(FileNotFoundError, match="no policy snapshot"):
        PolicyStore.restore(str(tmp_path / "missing"))
    (tmp_path / "junk").write_bytes(b"not a snapshot at all")
    with pytest.raises(ValueError, match="not a fibrl policy snapshot"):
        PolicyStore.restore(str(tmp_path / "junk"))
    data = open(path, "rb").read()
    (tmp_path / "cut").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="damaged|truncated"):
        PolicyStore.restore(str(tmp_path / "cut"))


# -- torch --------------------------------------------------------------------------------
def test_as_torch_and_a_state_dict_round_trip():
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.BatchNorm1d(200))
    with PolicyStore() as store:
        reader = pickle.loads(pickle.dumps(store))
        assert store.publish(net.state_dict()) == 1
        expected = {k: v.detach().clone() for k, v in net.state_dict().items()}
        with torch.no_grad():
            net[0].weight.add_(1.0)            # after publish: no published version changes
        version, params = reader.latest(as_torch=True)
        assert version == 1 and set(params) == set(expected)
        for key, value in expected.items():
            assert isinstance(params[key], torch.Tensor) and params[key].device.type == "cpu"
            assert torch.equal(params[key], value), key
        numpy_params = reader.get(1)
        assert isinstance(numpy_params["0.weight"], np.ndarray)
        fresh = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.BatchNorm1d(200))
        fresh.load_state_dict(params)
        assert torch.equal(fresh[0].weight, expected["0.weight"])
        store.publish({"half": torch.ones(3, dtype=torch.bfloat16), "x": np.arange(3)})
        odd = reader.latest(newer_than=1)[1]
        assert odd["half"].dtype == torch.bfloat16 and odd["x"].tolist() == [0, 1, 2]
        assert torch.equal(reader.latest(as_torch=True)[1]["x"], torch.arange(3))
        reader.close()


def test_as_torch_without_torch_says_so(monkeypatch):
    with PolicyStore() as store:
        store.publish({"w": np.ones(2)})
        monkeypatch.setitem(sys.modules, "torch", None)   # import torch fails
        with pytest.raises(ModuleNotFoundError, match="as_torch=True needs torch"):
            store.latest(as_torch=True)


# -- handing the store over ---------------------------------------------------------------
def follow_through_a_queue(queue, results) -> None:
    store = queue.get(timeout=120)
    follower = store.follow()
    assert isinstance(follower, PolicyFollower) and follower.version == 0
    assert follower.refresh(timeout=60) and not follower.refresh()
    with pytest.raises(RuntimeError, match="only the process that made"):
        store.publish({"w": 1})
    results.put((follower.version, follower.params["w"].sum(), store.is_stale(1, 0)))


def test_a_store_travels_through_a_queue_to_a_process():
    with PolicyStore() as store:
        store.publish({"w": np.ones(10)})
        store.publish({"w": np.ones(20)})
        queue, results = fibrl.Queue(), fibrl.Queue()
        proc = fibrl.Process(target=follow_through_a_queue, args=(queue, results))
        proc.start()
        queue.put(store)
        assert results.get(timeout=120) == (2, 20.0, True)
        proc.join(60)
        assert proc.exitcode == 0
        assert store.is_stale(1, max_lag=0) and not store.is_stale(1, max_lag=1)
        assert not store.is_stale(2)


SCRIPT = """
import sys, zlib
import fibrl
from fibrl.rl import PolicyStore
address, key = sys.stdin.readline().split()
store = PolicyStore.connect(address, authkey=bytes.fromhex(key))
try:
    version, params = store.latest(timeout=60)
except fibrl.AuthenticationError as exc:
    print("AuthenticationError", exc)
    sys.exit(0)
print(version, zlib.crc32(params["w"].tobytes()))
"""


def run_script(address: str, key: bytes) -> str:
    env = checkout_env()
    out = subprocess.run([sys.executable, "-c", SCRIPT], input=f"{address} {key.hex()}\n",
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_script_connects_with_the_authkey():
    weights = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    with PolicyStore() as store:
        store.publish({"w": weights})
        key = bytes(fibrl.current_process().authkey)
        assert run_script(store.address, key) == f"1 {zlib.crc32(weights.tobytes())}"
        said = run_script(store.address, os.urandom(32))
        assert said.startswith("AuthenticationError")


def test_connect_checks_its_authkey():
    with pytest.raises(TypeError, match="authkey must be non-empty bytes"):
        PolicyStore.connect("tcp://127.0.0.1:1", authkey="secret")
    import fibrl.channel as channel
    with pytest.raises(TypeError, match="authkey must be non-empty bytes"):
        channel.connect("tcp://127.0.0.1:1", authkey=b"")


TLS_SCRIPT = """
import numpy as np
import fibrl
from fibrl.rl import PolicyStore

def read(store, q):
    version, params = store.latest(timeout=60)
    q.put((version, float(params["w"].sum())))

if __name__ == "__main__":
    fibrl.init(tls=True, backend="local")
    with PolicyStore() as store:
        store.publish({"w": np.ones(100_000, np.float32)})
        q = fibrl.Queue()
        p = fibrl.Process(target=read, args=(store, q))
        p.start()
        print(store.address.split(":")[0], *q.get(timeout=120))
        p.join(60)
"""


def test_the_store_speaks_tls_when_the_run_does(tmp_path):
    pytest.importorskip("cryptography")
    script = tmp_path / "tls_policy.py"
    script.write_text(TLS_SCRIPT)
    env = checkout_env()
    for name in [n for n in env if n.startswith("FIBRL_")]:
        del env[name]
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["tls+tcp", "1", "100000.0"]


# -- bad input --------------------------------------------------------------------------------
def test_bad_input_gets_clear_errors():
    with pytest.raises(ValueError, match="keep must be a positive int"):
        PolicyStore(keep=0)
    with PolicyStore() as store:
        with pytest.raises(TypeError, match="params are a dict"):
            store.publish([np.ones(3)])
        with pytest.raises(TypeError, match=r"params\['net'\]\['lock'\] \(a lock\)"):
            store.publish({"net": {"w": np.ones(3), "lock": threading.Lock()}})
        with pytest.raises(TypeError, match=r"params\['f'\]"):
            store.publish({"f": lambda: 0})
        assert store.version == 0            # nothing half-published
        store.publish({"w": np.ones(3)})
        with pytest.raises(ValueError, match="timeout must be None or >= 0"):
            store.latest(timeout=-1)
        with pytest.raises(TypeError, match="newer_than must be an int"):
            store.latest(newer_than="1")
        with pytest.raises(TypeError, match="version must be an int"):
            store.get(1.0)
        assert store.latest(newer_than=np.int64(0))[0] == 1
        assert store.latest(newer_than=1, timeout=0) is None
        with pytest.raises(RuntimeError, match="snapshot_path"):
            store.wait_snapshot()
        with pytest.raises(ValueError, match="max_lag"):
            store.is_stale(1, -1)


def test_a_reader_that_waits_without_limit_is_answered_by_a_publish():
    with PolicyStore() as store:
        reader = pickle.loads(pickle.dumps(store))
        got = []
        waits = record_waits(store)
        thread = threading.Thread(target=lambda: got.append(reader.latest(timeout=math.inf)))
        thread.start()
        wait_until(lambda: math.inf in waits, "the reader to wait without limit")
        store.publish({"w": np.ones(2)})
        thread.join(60)
        assert got and got[0][0] == 1
        reader.close()
        wait_until(lambda: not thread.is_alive(), "the waiting thread to end", 10)


def test_a_state_dict_on_the_gpu_is_published_from_the_cpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    net = torch.nn.Linear(64, 32).cuda()
    with PolicyStore() as store:
        store.publish(net.state_dict())
        params = store.latest(as_torch=True)[1]
        assert params["weight"].device.type == "cpu"
        assert torch.equal(params["weight"], net.weight.detach().cpu())
