"""Plot the learning curve that ``examples/apex_dqn.py --curve FILE.csv`` wrote.

Run::

    python examples/apex_dqn.py --curve apex.csv
    python benchmarks/plot_apex_curve.py apex.csv docs/apex_dqn_cartpole.png

Needs matplotlib (``pip install matplotlib``).
"""
from __future__ import annotations

import argparse
import csv

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("curve", help="CSV written by apex_dqn.py --curve")
    parser.add_argument("png", help="where to write the plot")
    parser.add_argument("--title", default="Ape-X DQN on CartPole-v1, fibrl ReplayStore")
    args = parser.parse_args()
    with open(args.curve) as src:
        rows = list(csv.DictReader(src))
    seconds = [float(r["seconds"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(seconds, [float(r["eval_return"]) for r in rows], marker="o", ms=3,
            label="greedy evaluation (mean of 10 episodes)")
    ax.plot(seconds, [float(r["actor_return"]) for r in rows], alpha=0.7,
            label="actors, epsilon-greedy (mean of last 20 episodes)")
    ax.axhline(475, color="grey", linestyle="--", linewidth=1, label="475")
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("episode return")
    ax.set_title(args.title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)


if __name__ == "__main__":
    main()
