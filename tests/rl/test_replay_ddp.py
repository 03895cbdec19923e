"""examples/ddp_replay.py at a small size: four gloo ranks, started by
torch.multiprocessing (not by fibrl), join one prioritized store and sample it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# Each rank imports torch: several seconds apiece on a 2-core machine, more while the rest
# of the suite runs beside it (the work itself takes about a second).
@pytest.mark.timeout(600)
def test_ddp_ranks_share_one_prioritized_store():
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ddp_replay.py"), "--ranks", "4",
         "--items-per-rank", "400", "--insert-batch", "100", "--batch", "128",
         "--sample-steps", "10", "--train-steps", "10", "--timeout", "240"],
        capture_output=True, text=True, timeout=540, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, run.stdout[-2000:]
    report = json.loads(lines[0][len("RESULT "):])
    assert report["items"] == 1600 and sum(report["class_counts"]) == 1600
    assert 4 * 10 * 128 - 5 <= sum(report["sampled"]) <= 4 * 10 * 128   # (less rare items)
    assert report["class_counts"][-1] == 8                 # rank 0's rare ones
    assert report["chi2"] < 21.11                       # chi2(3), p = 1e-4
    assert report["max_weight_error"] < 1e-5           # (P_min / P(i)) ** beta, global P_min
    assert report["replicas_agree"] and report["last_loss"] < report["first_loss"]
    assert "the store holds 1600 items" in run.stdout
