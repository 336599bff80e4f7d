"""What the claim bound and the loss clip cost an honest federation (issue 45).

**Weights.** Every reply weighs ``min(claim, first claim, kappa x m)``, ``m`` the lower
median of the nodes' first claims (``checks.ClaimBound``). With honest claims (the
partitions' true sizes) this replays the sampling of a run — ``fraction-train`` of the
nodes per round, uniformly without replacement, ``--seeds`` generators — through
``ClaimBound.weigh`` and prints, per kappa, how often an honest weight was capped and how far
the round's weight shares moved from the claims' (total variation, ½ Σ |p_i − q_i|, and the
largest relative change of one node's share). The same for the evaluation claims (test
sets, ``fraction-evaluate``) and for PFLEGO's start-up claims (every node known at once).

**Losses** (``--losses``): a pooled loss clips each client's loss at ``LOSS_CLIP`` x the
lower median of the round's (``history.clip_losses``). A few honest LocalGrid runs
(evaluation every round) report the largest per-client loss as a multiple of that lower
median, per metric (the clip leaves honest figures alone while that stays below it), and
how much a clip at each of ``--clips`` would lower the honest pooled loss (its worst round).

    python benchmarks/claim_weights.py                       # mnist-5k, Dirichlet 0.3, 50
    python benchmarks/claim_weights.py --partitioner pathological --nodes 20
    python benchmarks/claim_weights.py --losses              # + the honest loss spread
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import random
import tempfile
import warnings

import numpy as np

from pflower.config import Config
from pflower.strategies.bound import ClaimBound, lower_median
from pflower.strategies.history import LOSS_CLIP
from pflower.task.data.loaders import client_arrays
from pflower.wire import is_loss


def sizes(cfg: Config, nodes: int) -> tuple[list[int], list[int]]:
    """Each partition's (train, test) size, as its client reports them."""
    train, test = [], []
    for pid in range(nodes):
        a = client_arrays(cfg, pid, nodes)
        train.append(len(a.y_train))
        test.append(len(a.y_test))
    return train, test


def replay(claims: list[int], fraction: float, rounds: int, kappa: float, seed: int, known: bool):
    """One run's rounds through ``ClaimBound.weigh``: per round (capped replies, total
    variation, largest relative change of a share)."""
    bound = ClaimBound(factor=kappa)
    rng = random.Random(seed)
    nodes = list(range(len(claims)))
    start_up = {n: float(claims[n]) for n in nodes} if known else {}
    out = []
    for _ in range(rounds):
        sample = sorted(rng.sample(nodes, max(1, round(fraction * len(nodes)))))
        weighed = bound.weigh({n: float(claims[n]) for n in sample}, start_up)
        w = np.array([weighed[n][0] for n in sample])
        c = np.array([claims[n] for n in sample], dtype=float)
        p, q = c / c.sum(), w / w.sum()
        capped = sum(1 for n in sample if weighed[n][1])
        out.append((capped, 0.5 * float(np.abs(p - q).sum()), float(np.max(np.abs(q / p - 1)))))
    return out


def weights_table(args) -> None:
    cfg = Config.from_run_config(
        {
            "dataset": args.dataset,
            "partitioner": args.partitioner,
            "dirichlet-alpha": args.alpha,
            "seed": args.data_seed,
        }
    )
    train, test = sizes(cfg, args.nodes)
    for name, v in (("train", train), ("test", test)):
        m = lower_median(v)
        print(
            f"{name} sizes: min {min(v)}, lower median {m:g}, max {max(v)} "
            f"(max / lower median {max(v) / m:.2f})"
        )
    print(
        f"\n{args.dataset}, partitioner {args.partitioner}"
        + (f" (alpha {args.alpha})" if args.partitioner == "dirichlet" else "")
        + f", {args.nodes} nodes, {args.rounds} rounds, {args.seeds} sampling seeds\n"
    )
    print(
        "| claims | fraction | kappa | replies capped | rounds with a cap "
        "| TV distance: mean / max | largest share change |"
    )
    print("|---|---|---|---|---|---|---|")
    cases = (
        ("training", train, args.fraction_train, False),
        ("evaluation", test, args.fraction_evaluate, False),
        ("PFLEGO start-up", train, args.fraction_train, True),
    )
    for name, claims, fraction, known in cases:
        for kappa in args.kappa:
            rows = [
                r
                for seed in range(args.seeds)
                for r in replay(claims, fraction, args.rounds, kappa, seed, known)
            ]
            replies = len(rows) * max(1, round(fraction * len(claims)))
            capped = sum(r[0] for r in rows)
            tv = [r[1] for r in rows]
            print(
                f"| {name} | {fraction:g} | {kappa:g} | {capped} of {replies} "
                f"| {sum(r[0] > 0 for r in rows)} of {len(rows)} "
                f"| {np.mean(tv):.4f} / {max(tv):.4f} | {max(r[2] for r in rows):.3f} |"
            )


def losses_table(args) -> None:
    """Honest runs, evaluation every round: the largest per-client loss over the lower
    median of the round's, per metric, its worst round."""
    import pflower.strategies.server as server
    from pflower.testbed.local_grid import run_local

    seen: list[list[dict]] = []
    real = server.summarize_clients

    def spy(rows):
        seen.append([dict(r) for r in rows])
        return real(rows)

    server.summarize_clients = spy
    base = {
        "model": "mlp",
        "batch-size": 32,
        "finetune-epochs": 1,
        "evaluate-every": 1,
        "fraction-train": args.loss_fraction,
        "num-server-rounds": args.loss_rounds,
        "outputs-dir": tempfile.mkdtemp(prefix="pflower-claim-weights-"),
        "seed": 0,
    }
    runs = (
        ("fedalt, mnist-5k, pathological", {"algorithm": "fedalt", "dataset": "mnist-5k"}),
        (
            "fedavg, mnist-5k, dirichlet 0.3",
            {"algorithm": "fedavg", "dataset": "mnist-5k", "partitioner": "dirichlet"},
        ),
        ("pflego, mnist-5k, pathological", {"algorithm": "pflego", "dataset": "mnist-5k"}),
        (
            "ffgg, synthetic-linear",
            {"algorithm": "ffgg", "dataset": "synthetic-linear", "partitioner": "iid"},
        ),
    )
    print(
        f"\nLOSS_CLIP = {LOSS_CLIP:g}; {args.loss_nodes} nodes, {args.loss_rounds} rounds, "
        f"fraction-train {args.loss_fraction:g}\n"
    )
    print(
        "| run | metric | largest loss / lower median (its round) "
        "| pooled loss lowered by the clip, worst round |"
    )
    print("|---|---|---|---|")
    for name, overrides in runs:
        if args.loss_runs and overrides["algorithm"] not in args.loss_runs:
            continue
        seen.clear()
        with contextlib.redirect_stdout(io.StringIO()):
            run_local({**base, **overrides}, args.loss_nodes)
        worst: dict[str, tuple[float, int]] = {}
        moved: dict[tuple[str, float], float] = {}
        for rnd, rows in enumerate(seen, 1):
            for key in sorted({k for r in rows for k in r if is_loss(k)}):
                values = np.array([r[key] for r in rows if key in r])
                n = np.array([r["num-examples"] for r in rows if key in r], dtype=float)
                m = lower_median(list(values))
                ratio = values.max() / m if m > 0 else math.inf
                if ratio > worst.get(key, (-1.0, 0))[0]:
                    worst[key] = (ratio, rnd)
                raw = float((n * values).sum() / n.sum())
                for c in args.clips:  # the pooled loss with the clip at c, against without
                    clipped = float((n * np.minimum(values, c * m)).sum() / n.sum())
                    change = (raw - clipped) / raw if raw > 0 else 0.0
                    moved[key, c] = max(moved.get((key, c), 0.0), change)
        for key, (ratio, rnd) in sorted(worst.items()):
            changes = ", ".join(f"c = {c:g}: {moved[key, c]:.2%}" for c in args.clips)
            print(f"| {name} | {key} | {ratio:.2f} ({rnd}) | {changes} |", flush=True)
    server.summarize_clients = real


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="mnist-5k")
    parser.add_argument("--partitioner", default="dirichlet")
    parser.add_argument("--alpha", type=float, default=0.3, help="dirichlet-alpha")
    parser.add_argument("--data-seed", type=int, default=0, help="the run's seed (partitions)")
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=20, help="sampling seeds replayed")
    parser.add_argument("--fraction-train", type=float, default=0.5)
    parser.add_argument("--fraction-evaluate", type=float, default=1.0)
    parser.add_argument("--kappa", type=float, nargs="+", default=[4.0, 5.0, 10.0])
    parser.add_argument("--losses", action="store_true", help="also the honest loss spread")
    parser.add_argument("--loss-nodes", type=int, default=10)
    parser.add_argument("--loss-rounds", type=int, default=10)
    parser.add_argument("--loss-runs", nargs="*", default=[], help="algorithms (default: all)")
    parser.add_argument("--loss-fraction", type=float, default=1.0, help="fraction-train")
    parser.add_argument("--clips", type=float, nargs="+", default=[10.0, 100.0, 1000.0])
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    weights_table(args)
    if args.losses:
        losses_table(args)


if __name__ == "__main__":
    main()
