"""PPO on CartPole-v1 with remote rollout workers that follow a PolicyStore.

``num_workers`` rollout workers (fibrl processes: local processes by default,
containers or pods with ``--backend``) each step ``envs_per_worker`` CartPoles with
the newest policy they took from the learner's ``PolicyStore``, and send each
rollout, tagged with that policy's version, through a fibrl Queue. The learner
trains on ``rollouts_per_update`` rollouts per update and keeps them on-policy:
a rollout more than ``max_lag`` versions behind its policy is dropped and counted.
The learner trains once every worker holds the first policy (a worker that
starts late, a pod waiting for a node, would otherwise miss the first versions).
After each update it publishes the new policy; a worker whose last rollout used
the latest policy waits for the next one (the store answers as soon as it is
published) instead of making a rollout that would be dropped.

    python examples/ppo_remote_rollouts.py [--backend docker] [--num-workers 4]
    python examples/ppo_remote_rollouts.py --num-workers 3 --total-steps 512  # smoke size

With more workers than ``rollouts_per_update``, the extra rollouts of each version
arrive after the update and are dropped (so are stale ones still queued when
training ends): the count shows what strict on-policy training costs;
``--max-lag 1`` trains on them instead (slightly off-policy, which PPO's clipped
ratio tolerates). Needs ``pip install 'fibrl[rl]' torch``.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import queue
import time

import numpy as np
import torch
from ppo_cartpole import Agent, advantages, update

import fibrl
from fibrl.rl import PolicyStore


@dataclasses.dataclass
class Args:
    backend: str = "local"
    num_workers: int = 2
    envs_per_worker: int = 4
    num_steps: int = 128          # steps per env per rollout
    rollouts_per_update: int = 2
    max_lag: int = 0              # policy versions a rollout may be behind (0: on-policy)
    total_steps: int = 500_000    # env steps trained on
    target: float = 475.0
    lr: float = 2.5e-4
    epochs: int = 4
    minibatches: int = 4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    seed: int = 1


# -- a rollout worker -------------------------------------------------------------------
def rollout_worker(index: int, args: Args, policy: PolicyStore, rollouts, stop,
                   started) -> None:
    """Make rollouts with the newest policy of ``policy`` until ``stop`` is set;
    release ``started`` once it holds its first policy."""
    import gymnasium as gym
    from gymnasium.vector import AutoresetMode
    torch.set_num_threads(1)
    torch.manual_seed(args.seed + 1000 + index)
    envs = gym.wrappers.vector.RecordEpisodeStatistics(gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")] * args.envs_per_worker,
        autoreset_mode=AutoresetMode.SAME_STEP))
    agent = Agent(4, 2)
    follower = policy.follow(as_torch=True)
    obs, _ = envs.reset(seed=args.seed + 1000 * index)
    state = (torch.tensor(obs, dtype=torch.float32), torch.zeros(args.envs_per_worker))
    while not stop.is_set():
        # On-policy, wait (1 s at a time, to see stop) for a policy newer than the last
        # rollout's; with lag allowed, take whatever is newest and go on.
        wait = 1.0 if args.max_lag == 0 or follower.version == 0 else None
        if follower.refresh(timeout=wait):
            agent.load_state_dict(follower.params)
            if follower.version == 1:
                started.release()   # the learner trains once every worker holds it
        elif wait is not None:
            continue
        rollout, state = collect(agent, envs, state, args)
        rollout.update(version=follower.version, worker=index)
        rollouts.put(rollout)
    envs.close()


def collect(agent: Agent, envs, state: tuple, args: Args) -> tuple:
    """``num_steps`` steps of every env: a rollout (numpy arrays, advantages included)
    and the state to go on from."""
    next_obs, next_done = state
    shape = (args.num_steps, args.envs_per_worker)
    obs_buf = torch.zeros(shape + (4,))
    act, logp, rew, done, val = (torch.zeros(shape) for _ in range(5))
    returns = []
    for t in range(args.num_steps):
        obs_buf[t], done[t] = next_obs, next_done
        with torch.no_grad():
            action, logp[t], _, val[t] = agent.act(next_obs)
        act[t] = action
        obs, reward, term, trunc, infos = envs.step(action.numpy())
        rew[t] = torch.as_tensor(reward, dtype=torch.float32)
        next_obs = torch.tensor(obs, dtype=torch.float32)
        next_done = torch.as_tensor(term | trunc, dtype=torch.float32)
        if "episode" in infos:
            returns += infos["episode"]["r"][infos["_episode"]].tolist()
    with torch.no_grad():
        next_value = agent.act(next_obs)[3]
    adv = advantages(rew, val, done, next_value, next_done, args.gamma, args.gae_lambda)
    rollout = dict(obs=obs_buf.reshape(-1, 4).numpy(), actions=act.reshape(-1).numpy(),
                   logprobs=logp.reshape(-1).numpy(), advantages=adv.reshape(-1).numpy(),
                   returns=(adv + val).reshape(-1).numpy(), episode_returns=returns)
    return rollout, (next_obs, next_done)


# -- the learner ------------------------------------------------------------------------
def learn(args: Args, policy: PolicyStore, rollouts, workers: list, started) -> dict:
    """Train on the rollouts of the current policy; returns what it reached."""
    agent = Agent(4, 2)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    policy.publish(agent.state_dict())
    for _ in workers:   # each makes a rollout of this first policy
        wait_for_worker(started, workers)
    recent: collections.deque = collections.deque(maxlen=20)
    steps, updates, dropped, mean, start = 0, 0, 0, 0.0, time.monotonic()
    while steps < args.total_steps:
        batch = []
        while len(batch) < args.rollouts_per_update:
            rollout = next_rollout(rollouts, workers)
            recent.extend(rollout["episode_returns"])
            if policy.is_stale(rollout["version"], args.max_lag):
                dropped += 1          # made by a policy more than max_lag versions old
                continue
            batch.append(rollout)
        keys = ("obs", "actions", "logprobs", "advantages", "returns")
        update(agent, optimizer, tuple(torch.from_numpy(np.concatenate([r[k] for r in batch]))
                                       for k in keys), args)
        steps += sum(len(r["actions"]) for r in batch)
        updates += 1
        version = policy.publish(agent.state_dict())
        mean = float(np.mean(recent)) if recent else 0.0
        print(f"steps {steps:7d}  policy v{version:<4d} stale rollouts dropped {dropped:4d}  "
              f"mean return (last {len(recent)}) {mean:6.1f}  "
              f"{time.monotonic() - start:6.1f} s", flush=True)
        if len(recent) == recent.maxlen and mean >= args.target:
            break
    return dict(env_steps=steps, updates=updates, version=policy.version, dropped=dropped,
                mean_return=mean, seconds=time.monotonic() - start)


def next_rollout(rollouts, workers: list) -> dict:
    """The next rollout; a clear error if the workers died instead."""
    while True:
        try:
            return rollouts.get(timeout=10)
        except queue.Empty:
            check_alive(workers)


def wait_for_worker(started, workers: list) -> None:
    """Wait for one more worker to hold the first policy (importing torch takes a
    while); a clear error if the workers died instead."""
    while not started.acquire(timeout=10):
        check_alive(workers)


def check_alive(workers: list) -> None:
    dead = [w.exitcode for w in workers if not w.is_alive()]
    if dead:
        raise RuntimeError(f"rollout workers exited (exit codes {dead}); see "
                           f"their output above")


def train(args: Args) -> dict:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    fibrl.init(backend=args.backend)
    with PolicyStore() as policy:
        rollouts, stop, started = fibrl.Queue(), fibrl.Event(), fibrl.Semaphore(0)
        workers = [fibrl.Process(target=rollout_worker,
                                 args=(i, args, policy, rollouts, stop, started))
                   for i in range(args.num_workers)]
        for worker in workers:
            worker.start()
        result = None
        try:
            result = learn(args, policy, rollouts, workers, started)
        finally:
            stop.set()
            for worker in workers:
                worker.join(60)
                if worker.is_alive():
                    worker.kill()
                    worker.join(10)
            while True:   # leave nothing behind in the queue's buffers
                try:
                    left = rollouts.get_nowait()
                except queue.Empty:
                    break
                if result is not None and policy.is_stale(left["version"], args.max_lag):
                    result["dropped"] += 1   # stale too: made before the last updates
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                            type=type(field.default), default=field.default)
    result = train(Args(**vars(parser.parse_args())))
    print(f"done: {result['env_steps']} env steps, {result['updates']} updates, policy "
          f"v{result['version']}, {result['dropped']} stale rollouts dropped, "
          f"{result['seconds']:.0f} s, mean return {result['mean_return']:.1f}")


if __name__ == "__main__":
    main()
