"""Plot episode return against env steps from the CSV of examples/ppo_cartpole.py --log.

    python benchmarks/plot_ppo.py ppo.csv docs/ppo_cartpole.png
"""
from __future__ import annotations

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def main(src: str, dst: str) -> None:
    with open(src, newline="") as f:
        rows = [(int(r["env_steps"]), float(r["return"]), float(r["seconds"]))
                for r in csv.DictReader(f)]
    steps = np.array([r[0] for r in rows])
    returns = np.array([r[1] for r in rows])
    window = 20
    mean = np.array([returns[max(0, i - window + 1):i + 1].mean() for i in range(len(returns))])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, returns, ".", ms=2, alpha=0.3, label="episode return")
    ax.plot(steps, mean, lw=2, label=f"mean of last {window}")
    ax.axhline(475, color="gray", ls="--", lw=1, label="475 (solved)")
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    ax.set_title(f"PPO on CartPole-v1, RemoteVectorEnv (8 envs, 2 workers): "
                 f"{rows[-1][2]:.0f} s wall clock")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
