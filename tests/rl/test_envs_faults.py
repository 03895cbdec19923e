"""RemoteVectorEnv survives crashing envs and killed workers, within a restart budget."""
from __future__ import annotations

import functools
import logging
import os
import signal
import time
import traceback

import pytest

from conftest import require_module, wait_until

gymnasium = require_module("gymnasium", "CI_REQUIRE_DOCKER")
np = require_module("numpy", "CI_REQUIRE_DOCKER")

from fibrl.rl import RemoteVectorEnv  # noqa: E402
from fibrl.rl.envs import EnvCrashError  # noqa: E402
from fibrl.rl.envs.worker import restart_seed  # noqa: E402

import envs_helpers  # noqa: E402


def test_env_that_raises_at_step_50_is_recreated_and_reseeded():
    fns = [envs_helpers.Pid, functools.partial(envs_helpers.CrashAt, 50), envs_helpers.Pid]
    # same-step autoreset: every vector step is one env.step() call
    envs = RemoteVectorEnv(fns, envs_per_worker=3, seed=1234, autoreset_mode="SameStep")
    try:
        envs.reset(seed=0)
        for t in range(1, 50):
            obs, rewards, terms, truncs, infos = envs.step(np.array([0, 1, 0]) if t % 2 else
                                                           np.array([1, 0, 1]))
            assert "fibrl_restarted" not in infos
        obs, rewards, terms, truncs, infos = envs.step(np.zeros(3, dtype=np.int64))
        assert infos["final_info"]["_fibrl_restarted"].tolist() == [False, True, False]
        assert truncs[1] and not terms[1] and rewards[1] == 0.0
        assert infos["_fibrl_restarted"].tolist() == [False, True, False]
        fresh = gymnasium.make("CartPole-v1")
        expected, _ = fresh.reset(seed=restart_seed(1234, 1, 1))
        np.testing.assert_array_equal(obs[1], expected)  # deterministic reseed
        for _ in range(20):  # still usable, env 1 included
            obs, *_ = envs.step(np.zeros(3, dtype=np.int64))
        assert obs.shape == (3, 4)
    finally:
        envs.close()


def test_restarts_are_counted_per_env_and_a_failure_is_logged_whole_once(caplog):
    fns = [envs_helpers.Pid, functools.partial(envs_helpers.CrashAt, 3)]
    envs = RemoteVectorEnv(fns, envs_per_worker=1, seed=1, autoreset_mode="SameStep")
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="fibrl.rl.envs.vector"):
            envs.reset(seed=0)
            assert envs.restart_counts == (0, 0)
            for _ in range(12):   # each new instance of env 1 raises on its third step
                envs.step(np.zeros(2, dtype=np.int64))
        took = time.monotonic() - start
        assert envs.restart_counts == (0, 4)
        told = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
        # the first time: the whole traceback, its last line intact; the repeats: one
        # line at most every 10 s (so at most one more per 10 s this took), not one each
        assert "Traceback" in told[0], told[0]
        assert told[0].rstrip().endswith("RuntimeError: boom at step 3"), told[0][-200:]
        assert len(told) <= 2 + int(took // 10), (round(took, 1), told)
    finally:
        envs.close()


def test_a_restarted_env_keeps_what_set_attr_set():
    fns = [envs_helpers.Pid, functools.partial(envs_helpers.CrashAt, 3)]
    envs = RemoteVectorEnv(fns, envs_per_worker=1, seed=1, autoreset_mode="SameStep")
    try:
        envs.reset(seed=0)
        envs.set_attr("tag", ["zero", "one"])
        for _ in range(3):   # env 1 raises on its third step: its worker makes it anew
            *_, infos = envs.step(np.zeros(2, dtype=np.int64))
        assert infos["_fibrl_restarted"].tolist() == [False, True]
        assert envs.get_attr("tag") == ("zero", "one")
        envs.processes[0].kill()   # worker 0 dies: a new worker makes env 0 anew
        restarted, deadline = False, time.monotonic() + 120
        while not restarted and time.monotonic() < deadline:
            *_, infos = envs.step(np.zeros(2, dtype=np.int64))
            restarted = bool(infos.get("_fibrl_restarted", [False])[0])
        assert restarted
        assert envs.restart_counts[0] == 1
        assert envs.get_attr("tag") == ("zero", "one")
    finally:
        envs.close()


def test_sigkilled_worker_mid_step_is_replaced(tmp_path):
    inside = str(tmp_path / "inside")
    fns = [functools.partial(envs_helpers.HangsInFirstStep, inside)] + [envs_helpers.Pid] * 3
    envs = RemoteVectorEnv(fns, envs_per_worker=2)
    try:
        envs.reset(seed=0)
        pids = envs.get_attr("pid")
        assert pids[0] != pids[2]
        envs.step_async(np.zeros(4, dtype=np.int64))
        # worker 0 is inside env 0's step (which never ends by itself) when it is killed
        wait_until(lambda: os.path.exists(inside), "worker 0 to be inside its step")
        os.kill(pids[0], signal.SIGKILL)
        obs, rewards, terms, truncs, infos = envs.step_wait(timeout=120)
        assert truncs[:2].tolist() == [True, True]
        assert infos["_fibrl_restarted"].tolist() == [True, True, False, False]
        new_pids = envs.get_attr("pid")
        assert new_pids[0] != pids[0] and new_pids[2] == pids[2]
        for _ in range(5):
            obs, rewards, terms, truncs, infos = envs.step(np.zeros(4, dtype=np.int64))
            assert "fibrl_restarted" not in infos
    finally:
        envs.close()


def test_always_crashing_env_spends_the_budget_with_a_clear_error():
    fns = [envs_helpers.Pid, envs_helpers.AlwaysCrash]
    envs = RemoteVectorEnv(fns, envs_per_worker=1, max_restarts=3, restart_window=60)
    try:
        envs.reset(seed=0)
        with pytest.raises(EnvCrashError) as info:
            for _ in range(10):
                envs.step(np.zeros(2, dtype=np.int64))
        message = str(info.value)
        assert "env 1 crashed" in message and "max_restarts=3" in message
        assert "RuntimeError: this env always crashes" in message  # its last traceback
        with pytest.raises(EnvCrashError):  # broken for good, and says so
            envs.step(np.zeros(2, dtype=np.int64))
    finally:
        envs.close()


def test_hung_step_hits_the_step_deadline():
    fns = [functools.partial(envs_helpers.HangAt, 3), envs_helpers.Pid]
    envs = RemoteVectorEnv(fns, envs_per_worker=1, step_timeout=1.0)
    try:
        envs.reset(seed=0)
        envs.step(np.ones(2, dtype=np.int64))
        envs.step(np.ones(2, dtype=np.int64))
        start = time.monotonic()
        obs, rewards, terms, truncs, infos = envs.step(np.ones(2, dtype=np.int64))
        took = time.monotonic() - start
        # not before step_timeout (counted from when the step was sent, after `start`),
        # and long before the hung step's hour or any of this test's own limits
        assert 1.0 <= took < 60, f"the hung step ended after {took:.1f} s"
        assert truncs[0] and infos["_fibrl_restarted"].tolist() == [True, False]
    finally:
        envs.close()


def broken_factory():
    raise ImportError("no module named 'simulator' (the env cannot even be made)")


def test_env_that_cannot_be_made_fails_the_constructor_with_a_clear_error():
    with pytest.raises(EnvCrashError, match="no module named 'simulator'"):
        RemoteVectorEnv([envs_helpers.Pid, broken_factory], envs_per_worker=1, max_restarts=1)


def exits_while_made():
    os._exit(3)   # a hard crash while the worker makes its envs: no Broken message


def test_workers_lost_while_starting_are_started_again_in_a_loop_not_deeper_calls():
    # each incarnation dies before it is up; the restarts must not nest (a budget of
    # thousands would overflow the stack): the error's traceback holds one _replace
    with pytest.raises(EnvCrashError, match="max_restarts=4") as failed:
        RemoteVectorEnv([envs_helpers.Pid, exits_while_made], envs_per_worker=1,
                        max_restarts=4)
    replaces = [frame for frame, _ in traceback.walk_tb(failed.value.__traceback__)
                if frame.f_code.co_name == "_replace"]
    assert len(replaces) == 1


def test_requests_kept_for_resending_hold_their_own_actions():
    """A step is kept until answered, to be sent again to a replacement worker: it
    must not view the caller's actions array, which the caller may reuse meanwhile."""
    envs = RemoteVectorEnv([envs_helpers.Pid] * 4, envs_per_worker=2)
    try:
        envs.reset(seed=0)
        actions = np.zeros(4, dtype=np.int64)
        envs.step_async(actions)
        kept = [msg for worker in envs._workers for msg, _ in worker.open]
        assert len(kept) == 2
        actions[:] = 1   # the caller fills its array for the next step
        assert all((msg.actions == 0).all() for msg in kept)
        envs.step_wait(timeout=60)
        mixed = {"a": np.zeros(4, dtype=np.int64)}   # the rows() path: a dict of arrays
        from fibrl.rl.envs.protocol import rows
        part = rows(mixed, slice(0, 2))
        mixed["a"][:] = 1
        assert (part["a"] == 0).all()
    finally:
        envs.close()


def test_on_error_raise_raises_the_envs_exception_and_goes_on_after_reset():
    from gymnasium.error import ResetNeeded

    envs = RemoteVectorEnv([envs_helpers.SeedFails] * 3, envs_per_worker=2, on_error="raise")
    try:
        envs.reset(seed=10)
        with pytest.raises(ValueError, match="Error in step with 1") as info:
            envs.step(np.array([0, 1, 1]))
        cause = info.value.__cause__
        assert type(cause).__name__ == "RemoteTraceback" and "in step" in str(cause)
        assert "env 1" in "".join(getattr(info.value, "__notes__", []))   # the first of 1, 2
        with pytest.raises(ResetNeeded, match=r"envs \[1, 2\]"):
            envs.step(np.zeros(3, np.int64))
        envs.send(np.zeros(1, np.int64), env_ids=[0])   # env 0 did not raise
        envs.recv(timeout=60)
        obs, _ = envs.reset(seed=5)
        obs, rewards, *_ = envs.step(np.zeros(3, np.int64))
        assert rewards.tolist() == [1.0, 1.0, 1.0] and envs.restart_counts == (0, 0, 0)
    finally:
        envs.close()


def test_an_exception_that_does_not_pickle_still_reaches_the_caller():
    envs = RemoteVectorEnv([envs_helpers.RaisesUnpicklable], on_error="raise")
    try:
        envs.reset(seed=0)
        with pytest.raises(RuntimeError, match="Unpicklable: unpicklable failure") as info:
            envs.step(np.zeros(1, np.int64))
        assert "threading" in str(info.value.__cause__) or "raise Unpicklable" in str(
            info.value.__cause__)
    finally:
        envs.close()


def test_a_restart_resets_with_the_episodes_options_and_infos_say_why():
    envs = RemoteVectorEnv([functools.partial(envs_helpers.Flaky, 3)] * 2, envs_per_worker=2,
                           autoreset_mode="SameStep")
    try:
        obs, _ = envs.reset(seed=0, options={"level": 7})
        assert obs[:, 1].tolist() == [7.0, 7.0]
        envs.step(np.zeros(2, np.int64))
        envs.step(np.zeros(2, np.int64))
        obs, _, _, truncs, infos = envs.step(np.zeros(2, np.int64))   # both raise at step 3
        assert truncs.tolist() == [True, True]
        assert obs[:, 1].tolist() == [7.0, 7.0]   # reset again with {"level": 7}
        assert infos["fibrl_error_type"].tolist() == ["ConnectionResetError"] * 2
        assert "dropped the connection at step 3" in infos["fibrl_error"][0]
        assert infos["final_info"]["fibrl_error_type"][1] == "ConnectionResetError"
    finally:
        envs.close()


def test_the_restart_budget_is_per_env_and_counted_in_its_steps():
    fns = [functools.partial(envs_helpers.Flaky, 2), functools.partial(envs_helpers.Flaky, 1)]
    envs = RemoteVectorEnv(fns, envs_per_worker=2, max_restarts=4, restart_window=10,
                           autoreset_mode="SameStep")
    try:
        envs.reset(seed=0)
        with pytest.raises(EnvCrashError) as info:
            for _ in range(30):
                envs.step(np.zeros(2, np.int64))
        # env 0 restarts every 2nd step (5 within 10 steps would spend it) but env 1, every
        # step, spends its own first
        assert "env 1 crashed and its restart budget is spent: 5 restarts within its last " \
               "10 steps" in str(info.value)
        assert envs.restart_counts[1] == 5 and envs.restart_counts[0] == 2
    finally:
        envs.close()


def test_an_env_that_crashes_once_per_500_steps_survives_50000_steps_by_default():
    """An env that crashes now and then is not stopped by the default budget (the old one,
    10 restarts of all envs within 60 s, ended this run after about 6 s)."""
    envs = RemoteVectorEnv([functools.partial(envs_helpers.Flaky, 500)] * 10,
                           envs_per_worker=10, autoreset_mode="SameStep")
    try:
        envs.reset(seed=0)
        actions = np.zeros(10, np.int64)
        for _ in range(5000):   # 50,000 env steps, each env restarting every 500
            envs.step(actions)
        assert envs.restart_counts == (10,) * 10
    finally:
        envs.close()


def test_a_hard_crash_in_a_worker_of_several_envs_names_the_suspects(caplog):
    fns = [envs_helpers.Tiny, functools.partial(envs_helpers.ExitAt, 2), envs_helpers.Tiny]
    envs = RemoteVectorEnv(fns, envs_per_worker=3, seed=0, autoreset_mode="SameStep")
    try:
        envs.reset(seed=0)
        with caplog.at_level(logging.WARNING, logger="fibrl.rl.envs.vector"):
            envs.step(np.zeros(3, np.int64))
            envs.send(np.zeros(1, np.int64), env_ids=[0])   # only env 0 and 1 step now:
            envs.recv(timeout=60)
            envs.send(np.zeros(1, np.int64), env_ids=[1])   # env 1's second step exits
            _, _, _, truncs, infos = envs.recv(timeout=120)
        assert truncs.tolist() == [True] and infos["fibrl_error_type"].tolist() == [
            "WorkerDied"]
        told = " ".join(r.getMessage() for r in caplog.records)
        assert "exit code 3" in told and "while stepping env 1: that env caused it" in told
        assert envs.restart_counts == (1, 1, 1)   # its neighbours started over with it
        *_, infos = envs.step(np.zeros(3, np.int64))   # the others report their restart
        assert infos["_fibrl_restarted"].tolist() == [True, False, True]
        assert "while stepping env 1" in infos["fibrl_error"][0]
    finally:
        envs.close()


def test_isolate_envs_runs_one_process_per_env_and_a_crash_takes_only_its_env():
    fns = [envs_helpers.Tiny, functools.partial(envs_helpers.ExitAt, 2), envs_helpers.Tiny]
    with pytest.raises(ValueError, match="isolate_envs"):
        RemoteVectorEnv(fns, envs_per_worker=3, isolate_envs=True)
    envs = RemoteVectorEnv(fns, isolate_envs=True)
    try:
        assert len({p.pid for p in envs.processes}) == 3
        envs.reset(seed=0)
        envs.step(np.zeros(3, np.int64))
        *_, truncs, infos = envs.step(np.zeros(3, np.int64))   # env 1 exits its process
        assert truncs.tolist() == [False, True, False]
        assert "while stepping env 1: that env caused it" in infos["fibrl_error"][1]
        assert envs.restart_counts == (0, 1, 0)
    finally:
        envs.close()
