"""A process that fibrl did not start, joining a ReplayStore by address.

test_replay_join.py runs it with ``subprocess.run([sys.executable, ...])``: the store's
address is its first argument, the authkey comes as hex on stdin (never on the command
line), and what it saw goes to stdout as one JSON object.

    python replay_joiner.py ADDRESS write          insert 100 items, sample 64
    python replay_joiner.py ADDRESS sample ROUNDS  sample ROUNDS batches of 250
"""
from __future__ import annotations

import json
import sys

import numpy as np

import fibrl
from fibrl.rl import ReplayStore


def write(store: ReplayStore) -> dict:
    ids = store.insert({"x": np.arange(100)}, priorities=np.arange(1.0, 101.0))
    batch = store.sample(64, timeout=30)
    return dict(ids=ids.tolist(), sampled=batch.ids.tolist(), x=batch["x"].tolist(),
                weights=None if batch.weights is None else batch.weights.tolist(),
                size=len(store))


def sample(store: ReplayStore, rounds: int) -> dict:
    batches = [store.sample(250, timeout=30) for _ in range(rounds)]
    return dict(ids=np.concatenate([b.ids for b in batches]).tolist(),
                probabilities=batches[0].probabilities.tolist(),
                first=batches[0].ids.tolist(), weights=batches[0].weights.tolist(),
                stats=store.stats())


def main() -> int:
    address, task = sys.argv[1], sys.argv[2]
    key = bytes.fromhex(sys.stdin.readline().strip())
    try:
        store = ReplayStore.connect(address, authkey=key)
    except fibrl.AuthenticationError as exc:
        print(json.dumps(dict(error=type(exc).__name__, message=str(exc))))
        return 3
    out = write(store) if task == "write" else sample(store, int(sys.argv[3]))
    out["address"] = store.address
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
