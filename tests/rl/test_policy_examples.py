"""The PolicyStore example runs end to end at a tiny size (workers, store, learner)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import checkout_env

ROOT = Path(__file__).resolve().parents[2]


# Each of its processes imports torch: 17-40 s apiece on a 2-core machine, several
# times that beside the rest of the suite (the training itself takes a few seconds).
@pytest.mark.timeout(600)
def test_ppo_remote_rollouts_example_smoke(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    env = checkout_env()
    # three workers for two rollouts per update: the learner trains once all three hold
    # the first policy, so each makes a rollout of it and the third of them is stale
    # after the first update, however late it comes (dropped when read, or when the
    # queue is emptied at the end)
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ppo_remote_rollouts.py"),
         "--num-workers", "3", "--envs-per-worker", "2", "--num-steps", "16",
         "--rollouts-per-update", "2", "--total-steps", "320"],
        capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    done = re.search(r"done: (\d+) env steps, (\d+) updates, policy v(\d+), (\d+) stale "
                     r"rollouts dropped", run.stdout)
    assert done, run.stdout[-2000:]
    steps, updates, version, dropped = map(int, done.groups())
    assert steps == 320 and updates == 5 and version == updates + 1
    assert dropped >= 1, "no stale rollout was dropped"
