"""Ape-X style DQN on CartPole-v1 with a shared prioritized fibrl ReplayStore.

N actor processes, each with its own exploration epsilon, step their own
environment, assemble n-step transitions, compute initial priorities with
their copy of the Q-network, and insert batches into one prioritized
``ReplayStore``. The learner samples prioritized batches, trains a double DQN
with importance weights, writes new priorities back, and publishes its weights
to a ``PolicyStore``; actors check for a newer version every few hundred steps
(one small round trip when there is none).

    python examples/apex_dqn.py                      # learns to a greedy mean return >= 475
    python examples/apex_dqn.py --num-actors 1 --max-updates 50 --min-replay 200   # smoke size

Needs ``pip install 'fibrl[rl]' torch``.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import queue
import time
from typing import Optional

import numpy as np

import fibrl
from fibrl.rl import PolicyStore, ReplayStore
from fibrl.rl.replay import Prioritized, RateLimiterTimeout, SampleToInsertRatio


@dataclasses.dataclass
class Args:
    num_actors: int = 2
    capacity: int = 100_000
    batch_size: int = 128
    insert_batch: int = 32
    n_step: int = 3
    gamma: float = 0.99
    lr: float = 5e-4
    target_every: int = 250         # learner updates between target-network copies
    publish_every: int = 50         # learner updates between weight publications
    sync_every: int = 200           # actor steps between checks for newer weights
    min_replay: int = 2_000
    samples_per_insert: float = 8.0  # rate limiter: actors wait when they run this far ahead
    eval_every: int = 500           # learner updates between greedy evaluations
    eval_episodes: int = 10
    target_return: float = 475.0
    max_updates: int = 60_000
    max_seconds: float = 3_000.0
    hidden: int = 128
    seed: int = 0
    curve: Optional[str] = None     # CSV of the learning curve


def parse_args(argv=None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        flag = "--" + field.name.replace("_", "-")
        kind = str if field.name == "curve" else type(field.default)
        parser.add_argument(flag, type=kind, default=field.default)
    return Args(**vars(parser.parse_args(argv)))


def q_network(hidden: int):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 2))


def actor(index: int, args: Args, store: ReplayStore, policy: PolicyStore, stop,
          returns) -> None:
    """Step one CartPole with epsilon-greedy on the latest weights; insert n-step items."""
    import gymnasium as gym
    import torch
    torch.set_num_threads(1)
    epsilon = 0.4 ** (1 + 7 * index / max(1, args.num_actors - 1))  # Ape-X's schedule
    rng = np.random.default_rng(args.seed + 1000 + index)
    env = gym.make("CartPole-v1")
    net, weights = q_network(args.hidden), policy.follow(as_torch=True)
    if not weights.refresh(timeout=120):
        raise TimeoutError("the learner published no weights within 120 s")
    net.load_state_dict(weights.params)
    obs, _ = env.reset(seed=args.seed + index)
    window: list = []
    out: list = []
    episode_return, steps = 0.0, 0
    while True:
        if steps % args.sync_every == 0:  # one small round trip per check, not per step
            if stop.is_set():
                return
            if weights.refresh():
                net.load_state_dict(weights.params)
        with torch.no_grad():
            q = net(torch.from_numpy(obs).float().unsqueeze(0))[0].numpy()
        action = int(rng.integers(2)) if rng.random() < epsilon else int(q.argmax())
        next_obs, reward, terminated, truncated, _ = env.step(action)
        steps += 1
        episode_return += reward
        window.append((obs, action, reward, next_obs, terminated))
        if terminated or truncated:
            out.extend(_nstep(window[j:], args.gamma) for j in range(len(window)))
            window.clear()
            returns.put((index, episode_return))
            episode_return = 0.0
            next_obs, _ = env.reset()
        elif len(window) == args.n_step:
            out.append(_nstep(window, args.gamma))
            window.pop(0)
        obs = next_obs
        if len(out) >= args.insert_batch:
            batch = {k: np.stack([item[k] for item in out]) for k in out[0]}
            priorities = _td_error(net, batch, args.gamma)
            out.clear()
            while True:  # the rate limiter holds us while the learner catches up
                try:
                    store.insert(batch, priorities=priorities, timeout=2)
                    break
                except RateLimiterTimeout:
                    if stop.is_set():
                        return


def _nstep(window: list, gamma: float) -> dict:
    ret = sum(gamma ** i * step[2] for i, step in enumerate(window))
    done = window[-1][4]
    return dict(obs=window[0][0].astype(np.float32), action=np.int64(window[0][1]),
                reward=np.float32(ret), next_obs=window[-1][3].astype(np.float32),
                discount=np.float32(0.0 if done else gamma ** len(window)))


def _td_error(net, batch: dict, gamma: float, target=None):
    """|n-step target - Q(s, a)|, double-DQN style when a target net is given."""
    import torch
    with torch.no_grad():
        obs = torch.as_tensor(batch["obs"])
        nxt = torch.as_tensor(batch["next_obs"])
        act = torch.as_tensor(batch["action"]).long()
        q = net(obs).gather(1, act[:, None])[:, 0]
        best = net(nxt).argmax(1, keepdim=True)
        bootstrap = (target or net)(nxt).gather(1, best)[:, 0]
        y = torch.as_tensor(batch["reward"]) + torch.as_tensor(batch["discount"]) * bootstrap
        return (y - q).abs().numpy()


def evaluate(net, episodes: int, seed: int) -> float:
    import gymnasium as gym
    import torch
    env = gym.make("CartPole-v1")
    total = 0.0
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done = False
        while not done:
            with torch.no_grad():
                action = int(net(torch.from_numpy(obs).float().unsqueeze(0)).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total += reward
            done = terminated or truncated
    return total / episodes


def learn(args: Args, store: ReplayStore, policy: PolicyStore, returns) -> list:
    import torch
    import torch.nn.functional as F
    torch.manual_seed(args.seed)
    net, target = q_network(args.hidden), q_network(args.hidden)
    target.load_state_dict(net.state_dict())
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    policy.publish(net.state_dict())
    curve, actor_returns = [], []
    start = time.monotonic()
    new_priorities = None  # sent with the next sample: one round trip per step
    for update in range(1, args.max_updates + 1):
        batch = store.sample(args.batch_size, timeout=120, as_torch=True,
                             update=new_priorities)
        obs, act = batch["obs"], batch["action"].long()
        q = net(obs).gather(1, act[:, None])[:, 0]
        with torch.no_grad():
            best = net(batch["next_obs"]).argmax(1, keepdim=True)
            bootstrap = target(batch["next_obs"]).gather(1, best)[:, 0]
            y = batch["reward"] + batch["discount"] * bootstrap
        loss = (batch.weights * F.smooth_l1_loss(q, y, reduction="none")).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        new_priorities = (batch.ids, (y - q).detach().abs().numpy())
        if update % args.target_every == 0:
            target.load_state_dict(net.state_dict())
        if update % args.publish_every == 0:
            policy.publish(net.state_dict())
        while True:
            try:
                actor_returns.append(returns.get_nowait()[1])
            except queue.Empty:
                break
        if update % args.eval_every == 0 or update == args.max_updates:
            score = evaluate(net, args.eval_episodes, args.seed + 10_000)
            row = dict(update=update, seconds=round(time.monotonic() - start, 1),
                       inserts=store.stats()["inserts"], policy_version=policy.version,
                       eval_return=score,
                       actor_return=float(np.mean(actor_returns[-20:])) if actor_returns else 0.0)
            curve.append(row)
            print(row, flush=True)
            if score >= args.target_return or row["seconds"] > args.max_seconds:
                break
    return curve


def limiter(args: Args) -> SampleToInsertRatio:
    """Keep about ``samples_per_insert`` sampled items per inserted one, so that on a
    small machine the actors leave the learner its share of the CPU."""
    burst = args.num_actors * args.insert_batch * args.samples_per_insert + args.batch_size
    return SampleToInsertRatio(args.samples_per_insert, args.min_replay, error_buffer=4 * burst)


def main(argv=None) -> list:
    args = parse_args(argv)
    store = ReplayStore(args.capacity, sampler=Prioritized(alpha=0.6, beta=0.4),
                        rate_limiter=limiter(args), seed=args.seed)
    with store, PolicyStore() as policy:
        stop, returns = fibrl.Event(), fibrl.Queue()
        actors = [fibrl.Process(target=actor, args=(i, args, store, policy, stop, returns))
                  for i in range(args.num_actors)]
        for proc in actors:
            proc.start()
        try:
            curve = learn(args, store, policy, returns)
        finally:
            stop.set()
            for proc in actors:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
            while True:  # leave no item behind in the queue's buffers
                try:
                    returns.get_nowait()
                except queue.Empty:
                    break
    if args.curve:
        with open(args.curve, "w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=list(curve[0]))
            writer.writeheader()
            writer.writerows(curve)
    return curve


if __name__ == "__main__":
    main()
