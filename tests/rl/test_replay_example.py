"""The Ape-X DQN example runs end to end at a tiny size (actors, store, learner, weights)."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import checkout_env

ROOT = Path(__file__).resolve().parents[2]


# Each of its four processes imports torch: 17-40 s apiece on a 2-core machine, several
# times that while the rest of the suite runs beside it (the training itself takes 2 s).
@pytest.mark.timeout(600)
def test_apex_dqn_example_smoke(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    curve = tmp_path / "curve.csv"
    env = checkout_env()
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "apex_dqn.py"), "--num-actors", "2",
         "--max-updates", "40", "--min-replay", "200", "--eval-every", "20",
         "--eval-episodes", "1", "--capacity", "2000", "--hidden", "16",
         "--curve", str(curve)],
        capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    with open(curve) as src:
        rows = list(csv.DictReader(src))
    assert [int(r["update"]) for r in rows] == [20, 40]
    assert int(rows[-1]["inserts"]) >= 200 and float(rows[-1]["eval_return"]) > 0
