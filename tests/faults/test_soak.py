"""A short soak run (benchmarks/soak.py): kills and freezes of pool workers and queue
consumers under Pool + Queue + Manager + replay load, on the local backend.

The seed is fixed and chosen so that every kind of fault lands within the first 20 s
(the faults' kinds, moments and durations come from it alone). The run must exit 0
with a summary that shows each kind injected, nothing lost and nothing duplicated.
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 1366        # its first five faults are one of each kind, all within 15 s
SECONDS = 20
KINDS = ("kill_pool_worker", "freeze_pool_worker_short", "freeze_pool_worker_long",
         "kill_consumer", "freeze_consumer")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_short_soak_loses_and_duplicates_nothing():
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"),
         "--seconds", str(SECONDS), "--seed", str(SEED)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert out.startswith(f"seed {SEED}\n"), out
    faults = re.search(r"^faults injected: (\{.*?\})", out, re.M)
    assert faults, out
    injected = eval(faults.group(1), {})   # the summary prints a dict of str -> int
    assert all(injected.get(kind, 0) >= 1 for kind in KINDS), injected
    assert re.search(r"^items lost: 0$", out, re.M), out
    assert re.search(r"^results duplicated: 0$", out, re.M), out
