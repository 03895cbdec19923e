"""The RL examples run, at tiny sizes (cleanrl-style smoke tests)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_module

require_module("gymnasium", "CI_REQUIRE_DOCKER")
require_module("torch", "CI_REQUIRE_DOCKER")

ROOT = Path(__file__).resolve().parents[2]


# torch's import alone takes 17-40 s on a 2-core machine, several times that beside the
# rest of the suite
pytestmark = pytest.mark.timeout(600)


def run_example(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args],
                         capture_output=True, text=True, timeout=540, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_remote_envs_example():
    assert "10 envs x 50 steps on local" in run_example("remote_envs.py", "--steps", "50")


def test_ppo_cartpole_example(tmp_path):
    log = tmp_path / "ppo.csv"
    out = run_example("ppo_cartpole.py", "--num-envs", "2", "--envs-per-worker", "1",
                      "--num-steps", "32", "--total-steps", "256", "--log", str(log))
    assert "done: 256 env steps" in out
    assert log.read_text().startswith("env_steps,return,seconds")
