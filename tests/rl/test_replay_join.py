"""Processes that fibrl did not start join a ReplayStore by address and authkey.

The joiners here are plain ``subprocess.run([sys.executable, ...])`` children
(replay_joiner.py): they hold no run secret unless given one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import require_module

import fibrl
from fibrl.hosting.hub import get_hub
from fibrl.rl import ReplayStore
from fibrl.rl.replay import Prioritized, ReplayStoreLost

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHI2_999_DF9 = 27.88          # chi-square, 9 degrees of freedom, p = 0.001


def run_joiner(address: str, key: bytes, *args: str, timeout: float = 240) -> tuple:
    """Run replay_joiner.py as a plain child process; (exit code, its JSON output)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run([sys.executable, str(HERE / "replay_joiner.py"), address, *args],
                         input=bytes(key).hex() + "\n", capture_output=True, text=True,
                         timeout=timeout, env=env)
    lines = run.stdout.strip().splitlines()
    assert lines, f"the joiner printed nothing (exit {run.returncode}): {run.stderr[-3000:]}"
    return run.returncode, json.loads(lines[-1])


def owner_key() -> bytes:
    return bytes(fibrl.current_process().authkey)


def test_a_plain_subprocess_joins_with_the_authkey_and_is_refused_without():
    with ReplayStore(1000, sampler=Prioritized(alpha=1.0, beta=0.5, eps=0.0),
                     num_shards=2) as store:
        code, out = run_joiner(store.address, owner_key(), "write")
        assert code == 0, out
        assert out["address"] == store.address
        assert out["size"] == len(store) == 100
        assert set(out["sampled"]) <= set(out["ids"])
        assert len(set(i % 2 for i in out["ids"])) == 1     # one insert: one shard
        # what the joiner inserted, the owner samples, with its priorities
        batch = store.sample(1000)
        assert set(batch.ids.tolist()) <= set(out["ids"])
        np.testing.assert_array_equal(batch.priorities, batch["x"] + 1.0)

        code, out = run_joiner(store.address, os.urandom(32), "write")
        assert code == 3 and out["error"] == "AuthenticationError", out
        assert "authkey" in out["message"]
        assert len(store) == 100


def sample_in_fibrl_process(store, rounds, results):
    batches = [store.sample(250, timeout=30) for _ in range(rounds)]
    results.put(dict(ids=np.concatenate([b.ids for b in batches]).tolist(),
                     probabilities=batches[0].probabilities.tolist(),
                     first=batches[0].ids.tolist(), stats=store.stats(),
                     weights=None if batches[0].weights is None
                     else batches[0].weights.tolist()))


@pytest.mark.timeout(180)   # 15-60 s measured on a loaded two-core machine
def test_a_joined_client_samples_as_a_fibrl_process_client_does():
    spec = Prioritized(alpha=1.0, beta=0.6, eps=0.0)
    with ReplayStore(40, sampler=spec, num_shards=2, seed=7) as store:
        prios = np.arange(1.0, 11.0)
        ids = np.concatenate([store.insert({"x": np.arange(5)}, prios[:5]),
                              store.insert({"x": np.arange(5)}, prios[5:])])
        exact = prios / prios.sum()
        order = np.argsort(ids)

        def check(out):
            rows = order[np.searchsorted(ids[order], out["ids"])]
            counts = np.bincount(rows, minlength=10)
            expected = exact * counts.sum()
            assert ((counts - expected) ** 2 / expected).sum() < CHI2_999_DF9
            first = order[np.searchsorted(ids[order], out["first"])]
            np.testing.assert_allclose(out["probabilities"], exact[first], rtol=1e-9)
            np.testing.assert_allclose(out["weights"], (exact.min() / exact[first]) ** 0.6,
                                       rtol=1e-5)

        code, joined = run_joiner(store.address, owner_key(), "sample", "40")
        assert code == 0, joined
        check(joined)
        assert joined["stats"] == store.stats()   # nothing happened since it read them

        results = fibrl.Queue()
        proc = fibrl.Process(target=sample_in_fibrl_process, args=(store, 40, results))
        proc.start()
        forked = results.get(timeout=240)
        proc.join(60)
        assert proc.exitcode == 0
        check(forked)
        assert forked["stats"] == store.stats()
        assert forked["stats"]["samples"] - joined["stats"]["samples"] == 40 * 250


def test_connect_in_process_gives_the_same_client():
    with ReplayStore(100, sampler="fifo", num_shards=3) as store:
        store.insert({"x": np.arange(6)})
        joined = ReplayStore.connect(store.address, owner_key())
        assert joined.num_shards == 3 and joined.address == store.address
        joined.insert({"x": np.arange(6, 12)})
        assert len(joined) == len(store) == 12
        assert joined.stats()["shards"] == store.stats()["shards"]
        assert ReplayStore.connect(store.address.split(","), owner_key()).num_shards == 3
        joined.close()                                   # a joiner's close stops nothing
        assert len(store) == 12


# the hub fibrl keeps for the store's authkey (one per key, for the process's life) keeps
# its connection to this process's own hub, which outlives the test: its client thread and
# the listener's thread serving it, the connection's two ends and their two wake pipes
@pytest.mark.leaves(threads=2, fds=6, reason="a connection between two hubs of this process")
def test_addresses_that_are_not_a_store_fail_clearly():
    key = owner_key()
    with ReplayStore(10, num_shards=2) as store:
        first, second = store.address.split(",")
        with pytest.raises(fibrl.AuthenticationError, match="authkey"):
            ReplayStore.connect(store.address, os.urandom(32))
        for bad in ("", "garbage", "tcp://127.0.0.1:5/", "http://127.0.0.1:5/x.1"):
            with pytest.raises(ValueError, match="not a replay store address|empty"):
                ReplayStore.connect(bad, key)
        with pytest.raises(TypeError, match="string"):
            ReplayStore.connect(42, key)
        with pytest.raises(ValueError, match="holds no replay store"):
            ReplayStore.connect(get_hub().address + "/x.1", key)   # a fibrl process's hub
        with pytest.raises(ValueError, match="holds no replay store"):
            ReplayStore.connect(first.rpartition("/")[0] + "/0.1", key)
        with pytest.raises(ValueError, match="not every shard of one store in order"):
            ReplayStore.connect(f"{second},{first}", key)
        with pytest.raises(ValueError, match="not every shard of one store in order"):
            ReplayStore.connect(first, key)
        address = store.address
    with pytest.raises(ReplayStoreLost, match="no replay store answers"):
        ReplayStore.connect(address, key)                   # closed


def test_a_store_with_its_own_authkey_admits_that_key_only():
    key = os.urandom(32)
    with ReplayStore(1000, authkey=key) as store:
        store.insert({"x": np.arange(3)})
        code, out = run_joiner(store.address, key, "write")
        assert code == 0 and out["size"] == 103, out
        # the run's secret is not the store's key: a holder of it alone cannot join
        code, out = run_joiner(store.address, owner_key(), "write")
        assert code == 3 and out["error"] == "AuthenticationError", out
        results = fibrl.Queue()   # a fibrl process given the store at start gets the key
        proc = fibrl.Process(target=sample_in_fibrl_process, args=(store, 1, results))
        proc.start()
        assert len(results.get(timeout=240)["ids"]) == 250
        proc.join(60)
        assert proc.exitcode == 0


TLS_OWNER = """
import subprocess, sys, json
import numpy as np
import fibrl
from fibrl.rl import ReplayStore

if __name__ == "__main__":
    fibrl.init(tls=True)
    with ReplayStore(100, sampler="prioritized") as store:
        run = subprocess.run([sys.executable, sys.argv[1], store.address, "write"],
                             input=bytes(fibrl.current_process().authkey).hex() + "\\n",
                             capture_output=True, text=True, timeout=200)
        print(json.dumps(dict(address=store.address, code=run.returncode,
                              out=run.stdout[-2000:], err=run.stderr[-2000:],
                              size=len(store))))
"""


def test_a_joiner_speaks_tls_to_a_store_of_a_tls_run(tmp_path):
    require_module("cryptography")
    script = tmp_path / "owner.py"
    script.write_text(TLS_OWNER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run([sys.executable, str(script), str(HERE / "replay_joiner.py")],
                         capture_output=True, text=True, timeout=400, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["address"].startswith("tls+tcp://")
    assert result["code"] == 0, result["err"]
    assert result["size"] == 100
