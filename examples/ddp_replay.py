"""torch.distributed ranks that fibrl did not start share one prioritized ReplayStore.

The launcher makes the store (its servers are fibrl processes) and starts the
ranks with ``torch.multiprocessing.spawn``, as ``torchrun`` would start them:
plain processes that hold no fibrl run secret. Each rank joins with
``ReplayStore.connect(address, authkey)``, inserts its items, then samples with
a beta annealed toward 1 and checks, with ``torch.distributed`` collectives,
that what it draws follows the priorities of every rank's items:

    ranks (gloo) --connect--> ReplayStore (prioritized, sharded)
      1. insert items_per_rank items each; all_reduce the per-class counts
      2. barrier; every rank sees ranks * items_per_rank items
      3. sample with beta annealed; each item's weight must be
         (P_min / P(i)) ** beta with P_min over the whole store: that of a few
         rare items of rank 0 that almost no batch holds; all_reduce the sampled
         counts: chi-square against the priority mass of each class over all items
      4. a few DistributedDataParallel steps on importance-weighted batches,
         priorities updated; all ranks end with the same parameters

    python examples/ddp_replay.py                       # 4 ranks x 10,000 items
    python examples/ddp_replay.py --items-per-rank 500 --sample-steps 10
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

import fibrl
from fibrl.rl import ReplayStore
from fibrl.rl.replay import Prioritized

CLASSES = 4                       # item classes; class c has priority 2 ** c
RARE, RARE_PRIORITY = CLASSES, 1e-3   # rank 0's few rare items: the smallest priority
ALPHA, BETA0, EPS = 0.6, 0.4, 1e-6
FEATURES = 8
CHI2_CRITICAL = 21.11             # chi-square, 3 degrees of freedom, p = 1e-4


@dataclasses.dataclass
class Args:
    backend: str = "local"        # where the store's servers run (the ranks run here)
    ranks: int = 4
    items_per_rank: int = 10_000
    rare_items: int = 8           # of rank 0's items
    insert_batch: int = 500
    shards: int = 2
    batch: int = 256
    sample_steps: int = 40
    train_steps: int = 40
    seed: int = 0
    timeout: float = 300.0        # seconds any collective or store call may wait


def class_priorities() -> np.ndarray:
    """The priority of each class: ``2 ** c`` for the main ones, then the rare one."""
    return np.append(2.0 ** np.arange(CLASSES), RARE_PRIORITY)


def class_mix(rank: int) -> np.ndarray:
    """How rank ``rank`` draws its items' main classes: mostly its own."""
    mix = np.full(CLASSES, 0.15)
    mix[rank % CLASSES] = 0.55
    return mix / mix.sum()


def insert_items(store: ReplayStore, rank: int, args: Args) -> np.ndarray:
    """Insert this rank's items in batches; returns how many of each class."""
    rng = np.random.default_rng(args.seed * 1000 + rank)
    true_w = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)
    counts = np.zeros(CLASSES + 1, np.int64)
    for start in range(0, args.items_per_rank, args.insert_batch):
        n = min(args.insert_batch, args.items_per_rank - start)
        cls = rng.choice(CLASSES, size=n, p=class_mix(rank))
        if rank == 0 and start == 0:
            cls[:args.rare_items] = RARE
        obs = rng.standard_normal((n, FEATURES), dtype=np.float32)
        store.insert({"obs": obs, "target": obs @ true_w, "cls": cls,
                      "rank": np.full(n, rank)},
                     priorities=class_priorities()[cls], timeout=args.timeout)
        counts += np.bincount(cls, minlength=CLASSES + 1)
    return counts


def anneal(step: int, steps: int) -> float:
    """beta from BETA0 at the first step to 1 at the last (PER's schedule)."""
    return BETA0 + (1.0 - BETA0) * min(1.0, step / max(1, steps - 1))


def chi_square(counts: np.ndarray, shares: np.ndarray) -> float:
    expected = shares * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def check_sampling(store: ReplayStore, global_counts: np.ndarray, args: Args) -> dict:
    """Sample with beta annealed; compare classes and weights with the global priorities."""
    mass = (class_priorities() + EPS) ** ALPHA
    lowest = mass[global_counts > 0].min()           # P_min's class, over every rank's items
    # the main classes' shares among the main classes' draws (the rare items, about one
    # draw in a million, are left out of the test)
    main = global_counts[:CLASSES] * mass[:CLASSES]
    shares = main / main.sum()
    sampled = np.zeros(CLASSES, np.int64)
    weight_error = 0.0
    for step in range(args.sample_steps):
        beta = anneal(step, args.sample_steps)
        batch = store.sample(args.batch, beta=beta, timeout=args.timeout)
        cls = batch["cls"]
        sampled += np.bincount(cls[cls < CLASSES], minlength=CLASSES)
        expected = (lowest / mass[cls]) ** beta
        weight_error = max(weight_error, float(np.abs(batch.weights - expected).max()))
    return dict(sampled=sampled, shares=shares, weight_error=weight_error,
                chi2=chi_square(sampled, shares))


def train(store: ReplayStore, args: Args) -> dict:
    """A few DistributedDataParallel steps on importance-weighted batches."""
    torch.manual_seed(args.seed)                     # DDP also broadcasts rank 0's start
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(FEATURES, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    update, losses = None, []
    for step in range(args.train_steps):
        batch = store.sample(args.batch, beta=anneal(step, args.train_steps), as_torch=True,
                             update=update, timeout=args.timeout)
        error = model(batch["obs"]).squeeze(1) - batch["target"]
        loss = (batch.weights * error ** 2).mean()
        optim.zero_grad()
        loss.backward()                               # gradients averaged over the ranks
        optim.step()
        losses.append(loss.item())
        update = (batch.ids, error.detach().abs().numpy() + 1e-3)
    if update is not None:
        store.update_priorities(*update)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(replicas, flat)
    return dict(first_loss=losses[0] if losses else None,
                last_loss=losses[-1] if losses else None,
                replicas_agree=all(torch.equal(r, replicas[0]) for r in replicas))


def rank_main(rank: int, world: int, port: int, address: str, authkey: bytes,
              args: Args) -> None:
    """One rank: a process that fibrl did not start."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        store = ReplayStore.connect(address, authkey=authkey)
        counts = torch.from_numpy(insert_items(store, rank, args))
        dist.all_reduce(counts)                       # every rank's class counts
        dist.barrier()                                # every insert is in
        size = len(store)
        if size != world * args.items_per_rank:
            raise AssertionError(f"rank {rank} sees {size} items, expected "
                                 f"{world * args.items_per_rank}")
        seen = check_sampling(store, counts.numpy(), args)
        if seen["chi2"] > CHI2_CRITICAL:
            raise AssertionError(f"rank {rank}'s samples do not follow the global "
                                 f"priorities: {seen}")
        everyone = torch.from_numpy(seen["sampled"])
        dist.all_reduce(everyone)
        worst = torch.tensor([seen["weight_error"]])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        trained = train(store, args)
        if rank == 0:
            report = dict(items=size, class_counts=counts.tolist(),
                          sampled=everyone.tolist(), shares=seen["shares"].round(4).tolist(),
                          chi2=round(chi_square(everyone.numpy(), seen["shares"]), 3),
                          max_weight_error=float(worst), **trained)
            print("RESULT " + json.dumps(report), flush=True)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args: Args) -> dict:
    fibrl.init(backend=args.backend)
    total = args.ranks * args.items_per_rank
    # each shard can hold every item: inserts rotate over shards per rank, so one
    # shard may get more than its share, and nothing should be evicted here
    with ReplayStore(args.shards * total, num_shards=args.shards, seed=args.seed,
                     sampler=Prioritized(alpha=ALPHA, beta=BETA0, eps=EPS)) as store:
        # the ranks get the address and the key as torchrun ranks would from a launcher
        # (never on a command line: a process listing shows it)
        authkey = bytes(fibrl.current_process().authkey)
        torch_mp.spawn(rank_main, nprocs=args.ranks, join=True,
                       args=(args.ranks, free_port(), store.address, authkey, args))
        stats = store.stats()
        if len(store) != total or stats["inserts"] != total:
            raise AssertionError(f"the store holds {len(store)} items ({stats['inserts']} "
                                 f"inserted), expected {total}")
        return dict(items=len(store), samples=stats["samples"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                            default=field.default)
    args = Args(**vars(parser.parse_args()))
    result = run(args)
    print(f"the store holds {result['items']} items; {result['samples']} sampled by "
          f"{args.ranks} ranks")


if __name__ == "__main__":
    main()
