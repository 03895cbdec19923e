"""Smoke tests of examples/: each example's ``main`` at a tiny size.

The examples are imported from their files (examples/ is not a package) and run
in this process, as a user's ``python examples/<name>.py`` would run them; each
test checks the example's answer, not only that it returned. All run on the
local backend; ``pi_estimation`` also on docker; the five
core examples also on kubernetes (the fake API server
of tests/kube unless ``KUBE_TEST_KUBECONFIG`` names a cluster). On kubernetes the
cluster's settings reach the unchanged example as a user's would: ``FIBRL_*``
environment variables, which its ``fibrl.init(backend=...)`` reads. The ``ctx``
fixture (conftest) restores the config in force afterwards, since ``main``
calls ``fibrl.init``. The quickstart also runs as the README's set-up command
runs it, in a fresh interpreter. The RL examples that need torch
(``remote_envs``, ``ppo_cartpole``, ``apex_dqn``) have their smoke tests in
tests/rl.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str):
    """Import ``examples/<name>.py`` as a module named ``name``.

    Registered in ``sys.modules`` so that workers, which import a function's
    module by name, can import it as well (examples/ goes on their path below).
    """
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


LOCAL = pytest.mark.parametrize("ctx", ["local"], indirect=True)
KUBERNETES = pytest.param("kubernetes", marks=pytest.mark.kubernetes)
LOCAL_AND_KUBERNETES = pytest.mark.parametrize("ctx", ["local", KUBERNETES], indirect=True)


@pytest.fixture(autouse=True)
def cluster_in_environment(request, monkeypatch):
    """On kubernetes: the test cluster's settings as FIBRL_* variables, where the
    example's own ``fibrl.init(backend="kubernetes")`` finds them."""
    if ("ctx" not in request.fixturenames
            or request.getfixturevalue("ctx").get_start_method() != "kubernetes"):
        return
    for key, value in request.getfixturevalue("kube_settings").items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        monkeypatch.setenv(f"FIBRL_{key.upper()}", text)


@pytest.mark.parametrize("ctx", ["local", pytest.param("docker", marks=pytest.mark.docker),
                                 KUBERNETES], indirect=True)
def test_pi_estimation(ctx):
    example = load("pi_estimation")
    pi = example.main(example.parse(["--backend", ctx.get_start_method(), "--workers", "2",
                                     "--tasks", "4", "--samples", "20000"]))
    assert math.isclose(pi, math.pi, abs_tol=0.05)


@LOCAL_AND_KUBERNETES
def test_queue_pipeline(ctx):
    example = load("queue_pipeline")
    args = example.parse(["--backend", ctx.get_start_method(), "--producers", "2",
                          "--consumers", "2", "--items", "25", "--timeout", "60"])
    results = example.main(args)
    assert sorted(results) == [(p, i) for p in range(2) for i in range(25)]
    assert results[1, 7] == example.digest("item 1-7")


@LOCAL_AND_KUBERNETES
def test_shared_state(ctx):
    example = load("shared_state")
    result = example.main(example.parse(["--backend", ctx.get_start_method(), "--workers", "3",
                                         "--increments", "10", "--timeout", "60"]))
    assert result["counters"]["total"] == 30
    assert result["log"] == [f"worker {w} done" for w in range(3)]


@LOCAL_AND_KUBERNETES
def test_evolution_strategies(ctx, tmp_path):
    pytest.importorskip("gymnasium", reason="the rl extra (gymnasium) is not installed")
    pytest.importorskip("matplotlib", reason="the docs extra (matplotlib) is not installed")
    example = load("evolution_strategies")
    png = tmp_path / "es.png"
    history = example.main(example.parse([
        "--backend", ctx.get_start_method(), "--workers", "2", "--generations", "2",
        "--population", "4", "--episodes", "1", "--plot", str(png)]))
    assert [h["generation"] for h in history] == [0, 1]
    assert all(h["max"] >= h["mean"] > 0 for h in history)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


QUICKSTART_LINES = ["hello world from pid ", "pipe answered PING", "sum of squares below 5: 30"]


@LOCAL_AND_KUBERNETES
def test_quickstart(ctx, monkeypatch, capsys):
    example = load("quickstart")
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--backend", ctx.get_start_method(),
                                      "--tasks", "5"])
    example.main(example.parse())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert [line[:len(want)] for line, want in zip(lines, QUICKSTART_LINES)] == QUICKSTART_LINES


def test_quickstart_as_the_readme_runs_it(tmp_path):
    """``python examples/quickstart.py``, the README's first command, in a fresh
    interpreter (its main guard, its own ``__main__``), from another directory."""
    root = EXAMPLES.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("FIBRL_BACKEND", None)
    run = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True,
                         text=True, timeout=240, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("hello world from pid "), run.stdout
    assert lines[1:] == ["pipe answered PING", "sum of squares below 20: 2470"], run.stdout
