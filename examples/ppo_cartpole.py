"""PPO (torch, CPU) on CartPole-v1, with the envs stepped by a RemoteVectorEnv.

The policy trains in this process; the envs live in fibrl workers (local
processes by default, containers or pods with ``--backend``), ``envs_per_worker``
to a worker. Training stops when the mean return of the last 20 episodes
reaches ``target`` (475 by default: CartPole-v1's "solved") or after
``total_steps`` env steps. Each finished episode is logged to ``--log`` (CSV:
env steps, return, seconds), which ``benchmarks/plot_ppo.py`` plots.

    python examples/ppo_cartpole.py [--backend docker] [--log ppo.csv]
"""
from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import time

import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers.vector import RecordEpisodeStatistics
from torch import nn

import fibrl
from fibrl.rl import RemoteVectorEnv


@dataclasses.dataclass
class Args:
    backend: str = "local"
    num_envs: int = 8
    envs_per_worker: int = 4
    num_steps: int = 128          # steps per env per rollout
    total_steps: int = 500_000
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
    log: str = ""


def layer(n_in: int, n_out: int, std: float = 2 ** 0.5) -> nn.Linear:
    lin = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(lin.weight, std)
    nn.init.zeros_(lin.bias)
    return lin


class Agent(nn.Module):
    def __init__(self, n_obs: int, n_act: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(layer(n_obs, 64), nn.Tanh(), layer(64, 64), nn.Tanh(),
                                    layer(64, 1, 1.0))
        self.actor = nn.Sequential(layer(n_obs, 64), nn.Tanh(), layer(64, 64), nn.Tanh(),
                                   layer(64, n_act, 0.01))

    def act(self, obs: torch.Tensor, action: torch.Tensor = None):
        dist = torch.distributions.Categorical(logits=self.actor(obs))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(obs).squeeze(-1)


def advantages(rewards, values, dones, next_value, next_done, gamma, lam):
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(len(rewards))):
        not_done = 1.0 - (next_done if t == len(rewards) - 1 else dones[t + 1])
        nxt = next_value if t == len(rewards) - 1 else values[t + 1]
        delta = rewards[t] + gamma * nxt * not_done - values[t]
        last = delta + gamma * lam * not_done * last
        adv[t] = last
    return adv


def update(agent, optimizer, batch, args: Args) -> None:
    obs, actions, logprobs, adv, returns = batch
    n = len(obs)
    size = n // args.minibatches
    for _ in range(args.epochs):
        for idx in torch.randperm(n).split(size):
            _, newlog, entropy, value = agent.act(obs[idx], actions[idx])
            ratio = (newlog - logprobs[idx]).exp()
            a = adv[idx]
            a = (a - a.mean()) / (a.std() + 1e-8)
            pg = torch.max(-a * ratio, -a * ratio.clamp(1 - args.clip, 1 + args.clip)).mean()
            loss = pg - args.ent_coef * entropy.mean() + args.vf_coef * (
                (value - returns[idx]) ** 2).mean() * 0.5
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
            optimizer.step()


def train(args: Args) -> dict:
    """Train; returns the env steps, seconds and last mean return reached."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    fibrl.init(backend=args.backend)
    envs = RecordEpisodeStatistics(RemoteVectorEnv(
        "CartPole-v1", args.num_envs, envs_per_worker=args.envs_per_worker,
        autoreset_mode=AutoresetMode.SAME_STEP, seed=args.seed))
    log = open(args.log, "w", newline="") if args.log else None
    writer = csv.writer(log) if log else None
    if writer:
        writer.writerow(["env_steps", "return", "seconds"])
    try:
        return _loop(args, envs, writer)
    finally:
        envs.close()
        if log:
            log.close()


class Rollout:
    """One rollout's tensors (``num_steps`` x ``num_envs``): what :meth:`collect` fills
    from the envs and :meth:`learn` trains on."""

    def __init__(self, args: Args, n_obs: int) -> None:
        shape = (args.num_steps, args.num_envs)
        self.args, self.n_obs = args, n_obs
        self.obs = torch.zeros(shape + (n_obs,))
        self.act, self.logp, self.rew, self.done, self.val = (torch.zeros(shape)
                                                              for _ in range(5))

    def collect(self, envs, agent: Agent, next_obs, next_done) -> tuple:
        """Step ``envs`` ``num_steps`` times; returns the next observation and done flags,
        and ``(step, return)`` of each episode that ended (``step``: 1 for the first)."""
        ended = []
        for t in range(self.args.num_steps):
            self.obs[t], self.done[t] = next_obs, next_done
            with torch.no_grad():
                action, logp, _, value = agent.act(next_obs)
            self.act[t], self.logp[t], self.val[t] = action, logp, value
            obs, reward, term, trunc, infos = envs.step(action.numpy())
            self.rew[t] = torch.as_tensor(reward, dtype=torch.float32)
            next_obs = torch.tensor(obs, dtype=torch.float32)
            next_done = torch.as_tensor(term | trunc, dtype=torch.float32)
            if "episode" in infos:
                ended += [(t + 1, float(r)) for r in infos["episode"]["r"][infos["_episode"]]]
        return next_obs, next_done, ended

    def learn(self, agent: Agent, optimizer, next_obs, next_done) -> None:
        """One PPO update on this rollout (GAE advantages, then :func:`update`)."""
        args = self.args
        with torch.no_grad():
            next_value = agent.act(next_obs)[3]
        adv = advantages(self.rew, self.val, self.done, next_value, next_done, args.gamma,
                         args.gae_lambda)
        batch = (self.obs.reshape(-1, self.n_obs), self.act.reshape(-1),
                 self.logp.reshape(-1), adv.reshape(-1), (adv + self.val).reshape(-1))
        update(agent, optimizer, batch, args)


def _loop(args: Args, envs, writer) -> dict:
    n_obs = envs.single_observation_space.shape[0]
    agent = Agent(n_obs, int(envs.single_action_space.n))
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    rollout = Rollout(args, n_obs)
    recent: collections.deque = collections.deque(maxlen=20)
    next_obs = torch.tensor(envs.reset(seed=args.seed)[0], dtype=torch.float32)
    next_done = torch.zeros(args.num_envs)
    steps, start, mean = 0, time.monotonic(), 0.0
    while steps < args.total_steps:
        next_obs, next_done, ended = rollout.collect(envs, agent, next_obs, next_done)
        for t, r in ended:
            recent.append(r)
            if writer:
                writer.writerow([steps + t * args.num_envs, r,
                                 round(time.monotonic() - start, 2)])
        steps += args.num_steps * args.num_envs
        mean = float(np.mean(recent)) if recent else 0.0
        print(f"steps {steps:7d}  mean return (last {len(recent)}) {mean:6.1f}  "
              f"{time.monotonic() - start:6.1f} s", flush=True)
        if len(recent) == recent.maxlen and mean >= args.target:
            break
        rollout.learn(agent, optimizer, next_obs, next_done)
    return {"env_steps": steps, "seconds": time.monotonic() - start, "mean_return": mean}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                            type=type(field.default), default=field.default)
    result = train(Args(**vars(parser.parse_args())))
    print(f"done: {result['env_steps']} env steps, {result['seconds']:.0f} s, "
          f"mean return {result['mean_return']:.1f}")


if __name__ == "__main__":
    main()
