"""RemoteVectorEnv.policy_version: each row of a batch says which policy version chose its
action (what an asynchronous PPO or IMPALA learner needs to drop or correct stale rows)."""
from __future__ import annotations

from conftest import require_module

gymnasium = require_module("gymnasium", "CI_REQUIRE_DOCKER")
np = require_module("numpy", "CI_REQUIRE_DOCKER")

from fibrl.rl import RemoteVectorEnv  # noqa: E402


def test_rows_carry_the_version_in_force_when_their_action_was_sent():
    envs = RemoteVectorEnv("CartPole-v1", 4, envs_per_worker=2)
    try:
        envs.reset(seed=0)
        *_, infos = envs.step(np.zeros(4, dtype=np.int64))
        assert "policy_version" not in infos            # off until set
        envs.policy_version = 7
        *_, infos = envs.step(np.zeros(4, dtype=np.int64))
        np.testing.assert_array_equal(infos["policy_version"], [7, 7, 7, 7])
        envs.send(np.zeros(2, dtype=np.int64), env_ids=[0, 1])
        envs.policy_version = 8
        envs.send(np.zeros(2, dtype=np.int64), env_ids=[2, 3])
        seen = {}
        while len(seen) < 4:
            *_, infos = envs.recv(num=1, timeout=60)
            seen[int(infos["env_id"][0])] = int(infos["policy_version"][0])
        assert seen == {0: 7, 1: 7, 2: 8, 3: 8}
        envs.step_async(np.zeros(4, dtype=np.int64))
        envs.policy_version = 9                          # after the send: not this step's
        *_, infos = envs.step_wait(timeout=60)
        np.testing.assert_array_equal(infos["policy_version"], [8, 8, 8, 8])
    finally:
        envs.close()
