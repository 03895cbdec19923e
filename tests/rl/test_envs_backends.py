"""The seed snippet (RemoteEnvManager) and RemoteVectorEnv on every backend."""
from __future__ import annotations


from conftest import require_module

gymnasium = require_module("gymnasium", "CI_REQUIRE_DOCKER")
np = require_module("numpy", "CI_REQUIRE_DOCKER")

import fibrl.rl  # noqa: E402


class RemoteEnvManager(fibrl.rl.RemoteEnvManager):
    pass


RemoteEnvManager.register("Env", lambda: gymnasium.make("CartPole-v1"))


def policy(obs):
    return [int(o[0][2] > 0) for o in obs]


def test_seed_snippet(ctx):
    manager = RemoteEnvManager()
    manager.start()
    try:
        envs = [manager.Env() for _ in range(10)]
        obs = [h.get(timeout=60) for h in [e.reset() for e in envs]]
        for _ in range(300):
            handles = [e.step(a) for e, a in zip(envs, policy(obs))]
            results = [h.get(timeout=60) for h in handles]
            obs = [(o, i) if not (term or trunc) else e.reset().get(timeout=60)
                   for e, (o, _r, term, trunc, i) in zip(envs, results)]
        assert len(results) == 10 and all(len(r) == 5 for r in results)
        gym_env = manager.GymEnv("CartPole-v1")
        first, _ = gym_env.reset(seed=3).get(timeout=60)
        expected, _ = gymnasium.make("CartPole-v1").reset(seed=3)
        np.testing.assert_array_equal(first, expected)
    finally:
        manager.shutdown()


def test_remote_vector_env(ctx):
    envs = fibrl.rl.RemoteVectorEnv("CartPole-v1", 4, envs_per_worker=2)
    try:
        sync = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * 4)
        np.testing.assert_array_equal(envs.reset(seed=5)[0], sync.reset(seed=5)[0])
        for _ in range(30):
            got, want = envs.step(np.ones(4, np.int64)), sync.step(np.ones(4, np.int64))
            for a, b in zip(got[:4], want[:4]):
                np.testing.assert_array_equal(a, b)
    finally:
        envs.close()


def test_killed_worker_is_replaced(ctx):
    """SIGKILL on local, docker kill of the container, deletion of the pod."""
    envs = fibrl.rl.RemoteVectorEnv("CartPole-v1", 4, envs_per_worker=2)
    try:
        envs.reset(seed=0)
        victim = envs.processes[1]
        victim.kill()
        victim.join(60)
        obs, rewards, terms, truncs, infos = envs.step(np.zeros(4, np.int64))
        assert truncs[2:].tolist() == [True, True]
        assert infos["_fibrl_restarted"].tolist() == [False, False, True, True]
        assert envs.processes[1] is not victim
        for _ in range(5):
            *_, infos = envs.step(np.zeros(4, np.int64))
            assert "fibrl_restarted" not in infos
    finally:
        envs.close()
