"""How large honest updates are next to ``S``, the update-norm bound before a reference exists
(``pflower/strategies/checks.py``): the largest honest update norm of every round divided by
that round's ``S``, for every aggregating algorithm. ``S`` must sit well above it, or the first
rounds would drop honest replies.

    python benchmarks/honest_update_scale.py                      # digits, 6 clients, 3 rounds
    python benchmarks/honest_update_scale.py --dataset mnist-5k --pretrain-rounds 2

Prints a Markdown table: per algorithm, the largest ratio over the rounds, the median honest
norm of round 1, ``S`` and what divides ``||theta||`` in it (``step_factor``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging

import numpy as np

from pflower.config import ALGORITHMS
from pflower.strategies.bound import provisional_scale, update_norms
from pflower.strategies.server import PersonalizedStrategy
from pflower.testbed.local_grid import run_local

#: no aggregate (local), or a key it needs besides these runs' (refused at start otherwise)
SKIP = {"local", "async-ffgg"}


def measure(algorithm: str, args) -> dict:
    """One run of ``algorithm``; the bound's inputs recorded in every round (nothing changed)."""
    rows = []
    real = PersonalizedStrategy.bound_updates

    def spy(self, server_round, current, updates):
        weights = self.pretraining(server_round) or self.reply_key == "arrays"
        norms = update_norms(current, updates, weights)
        scale = provisional_scale(current, self.step_factor(server_round))
        rows.append((float(norms.max()) / scale, float(np.median(norms)), scale))
        rows[-1] += (self.step_factor(server_round),)
        return real(self, server_round, current, updates)

    PersonalizedStrategy.bound_updates = spy
    try:
        run = {
            "algorithm": algorithm,
            "dataset": args.dataset,
            "model": "mlp",
            "num-server-rounds": args.rounds,
            "pretrain-rounds": args.pretrain_rounds,
            "evaluate-every": args.rounds,
            "fraction-train": 1.0,
            "max-failed-rounds": 0,
            "outputs-dir": "/tmp/pflower-benchmarks",
        }
        with contextlib.redirect_stdout(io.StringIO()):
            run_local(run, args.nodes)
    finally:
        PersonalizedStrategy.bound_updates = real
    return {
        "max ratio": max(r[0] for r in rows),
        "round-1 median": rows[0][1],
        "S": rows[-1][2],
        "divides": rows[-1][3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pretrain-rounds", type=int, default=0)
    parser.add_argument("--algorithms", nargs="*", default=None)
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    names = args.algorithms or [a for a in ALGORITHMS if a not in SKIP]
    print("| algorithm | largest honest norm / S | round-1 median norm | S | ||theta|| over |")
    print("|---|---|---|---|---|")
    for name in names:
        m = measure(name, args)
        print(
            f"| {name} | {m['max ratio']:.3f} | {m['round-1 median']:.3g} | {m['S']:.3g} "
            f"| {m['divides']:g} |"
        )


if __name__ == "__main__":
    main()
