"""The privacy-accuracy figure of ``experiments/dp-tradeoff.toml``: personalized test accuracy
(pooled over every client's test examples, mean ± std over seeds) against epsilon, one line
per method; epsilon = inf (no DP) at the right, Local (nothing shared) as a flat line. Reads
the experiment's ``summary.csv`` and each run's ``config.json`` / ``results.json`` (the epsilon
spent, the calibrated noise multiplier, each accountant's epsilon, the canary estimate);
writes ``tradeoff.png`` and ``tradeoff.md``.

    python benchmarks/dp_tradeoff.py benchmarks/results/dp-tradeoff

``--accounting`` needs no run: epsilon under each accountant and neighbour relation for the
experiment's settings (or ``--nodes/--fraction/--rounds/--delta/--epsilon`` given), seconds:

    python benchmarks/dp_tradeoff.py --accounting benchmarks/experiments/dp-tradeoff.toml
    python benchmarks/dp_tradeoff.py --accounting --nodes 10 --fraction 0.5 --rounds 20 \
        --delta 1e-5 --epsilon 8          # the README's main job with dp-epsilon = 8
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
from pathlib import Path


def load(out: Path) -> dict[str, dict[float, list[dict]]]:
    """method -> epsilon (inf: no DP) -> the seeds' rows. Epsilon from the run's label
    (``dp=central dp-epsilon=4.0``); the spent epsilon and the calibrated noise multiplier
    from the run's ``results.json`` where the run directories are there."""
    methods: dict[str, dict[float, list[dict]]] = {}
    with open(out / "summary.csv") as f:
        for row in csv.DictReader(f):
            found = re.search(r"dp-epsilon=([0-9.]+)", row["label"])
            eps = float(found.group(1)) if found else math.inf
            results = Path(row["path"]) / "results.json"
            privacy = {}
            if results.exists():
                privacy = json.loads(results.read_text()).get("privacy") or {}
            methods.setdefault(row["name"], {}).setdefault(eps, []).append(
                {
                    "accuracy": 100 * float(row["personal-accuracy"]),
                    "spent": privacy.get("epsilon"),
                    "noise": privacy.get("noise-multiplier"),
                    "canary": privacy.get("canary-epsilon"),
                }
            )
    return methods


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(methods: dict[str, dict[float, list[dict]]]) -> str:
    epsilons = sorted({e for by_eps in methods.values() for e in by_eps}, reverse=True)
    head = ["method"] + [("ε = ∞ (no DP)" if math.isinf(e) else f"ε = {e:g}") for e in epsilons]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_eps in methods.items():
        cells = []
        for e in epsilons:
            rows = by_eps.get(e) or by_eps.get(math.inf) if name == "Local" else by_eps.get(e)
            if not rows:
                cells.append("–")
                continue
            m, s = mean_std([r["accuracy"] for r in rows])
            cells.append(f"{m:.2f} ± {s:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    noise = {}
    for e in epsilons:
        zs = [r["noise"] for by in methods.values() for r in by.get(e, []) if r["noise"]]
        if zs and not math.isinf(e):
            noise[e] = statistics.mean(zs)
    if noise:
        lines += [
            "",
            "Noise multiplier z calibrated per ε (the same for every method: same m, N, "
            "rounds): " + ", ".join(f"ε {e:g}: z = {z:.3g}" for e, z in noise.items()),
        ]
    canaries = {}
    for e in epsilons:
        found = [r["canary"] for by in methods.values() for r in by.get(e, []) if r["canary"]]
        if found and not math.isinf(e):
            canaries[e] = (statistics.mean(found), max(found))
    if canaries:  # dp-canaries set: the one-shot estimate of the final models
        lines += [
            "",
            "Canary estimate of the final models' ε (mean, max over runs): "
            + ", ".join(f"ε {e:g}: {m:.3g}, {x:.3g}" for e, (m, x) in canaries.items()),
        ]
    return "\n".join(lines)


def accounting(nodes: int, fraction: float, rounds: int, delta: float, epsilons) -> str:
    """Epsilon under each accountant and neighbour relation, no training: for each target
    epsilon, the noise multiplier the run calibrates (fixed-size sample, replace-one, RDP) and
    what that noise spends as the run accounts it, as a Poisson sample would (add/remove, RDP
    and PLD: ``dp-sampling = "poisson"``), and with a sample anyone can reproduce (no
    amplification: the most sampled client of the seed-0 schedule, ``random.Random(0)`` as the
    server draws it); then the noise ``dp-sampling = "poisson"`` calibrates."""
    import random

    from pflower.strategies import privacy

    m = max(1, round(fraction * nodes))
    schedule, counts = random.Random(0), [0] * nodes
    for _ in range(rounds):
        for node in schedule.sample(range(nodes), m):
            counts[node] += 1
    most = max(counts)
    head = (
        f"{m} of {nodes} clients per round, {rounds} training rounds, δ = {delta:g}; a seeded "
        f"sample's most sampled client: {most} rounds\n\n"
        "| target ε | z (fixed) | fixed, replace-one: RDP | Poisson, add/remove: RDP | PLD "
        "| seeded, no amplification: RDP | PLD | z (Poisson, calibrated) |\n|" + "---|" * 8
    )
    lines = [head]
    for target in epsilons:
        z = privacy.noise_for_epsilon(target, rounds, m, nodes, delta)
        ledger = privacy.plan(rounds, m, nodes)
        fixed = privacy.epsilons(z, ledger, delta)
        poisson = privacy.poisson_comparison(z, ledger, delta)
        open_ = privacy.epsilons(z, privacy.plan(most, 1, 1), delta, amplified=False)
        z_poisson = privacy.noise_for_epsilon(
            target, rounds, m, nodes, delta, sampling=privacy.POISSON
        )
        cells = [
            f"{target:g}",
            f"{z:.4g}",
            f"{fixed['rdp']:.4g}",
            f"{poisson['rdp']:.4g}",
            f"{poisson['pld']:.4g}",
            f"{open_['rdp']:.4g}",
            f"{open_['pld']:.4g}",
            f"{z_poisson:.4g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def experiment_settings(path: Path) -> tuple[int, float, int, float, list[float]]:
    """(nodes, fraction-train, training rounds, delta, target epsilons) of an experiment file."""
    import tomllib

    spec = tomllib.loads(path.read_text())
    base = spec["base"]
    targets = sorted(
        {
            float(p["dp-epsilon"])
            for run in spec["run"]
            for p in run.get("grid", {}).get("privacy", [])
            if "dp-epsilon" in p
        },
        reverse=True,
    )
    rounds = int(base["num-server-rounds"]) + int(base.get("pretrain-rounds", 0))
    nodes = int(spec["experiment"]["nodes"])
    return nodes, float(base["fraction-train"]), rounds, float(base["dp-delta"]), targets


def figure(methods: dict[str, dict[float, list[dict]]], path: Path) -> None:
    import matplotlib.pyplot as plt

    finite = sorted({e for by in methods.values() for e in by if not math.isinf(e)})
    inf_x = max(finite) * 4  # where "no DP" sits on the log axis
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (name, by_eps) in enumerate(methods.items()):
        color = plt.get_cmap("tab10")(i % 10)
        if name == "Local":
            m, s = mean_std([r["accuracy"] for rows in by_eps.values() for r in rows])
            ax.axhline(m, color=color, ls="--", label=f"{name} (nothing shared)")
            ax.axhspan(m - s, m + s, color=color, alpha=0.1, lw=0)
            continue
        xs = sorted(by_eps, key=lambda e: inf_x if math.isinf(e) else e)
        stats = [mean_std([r["accuracy"] for r in by_eps[e]]) for e in xs]
        x = [inf_x if math.isinf(e) else e for e in xs]
        ax.errorbar(
            x,
            [m for m, _ in stats],
            yerr=[s for _, s in stats],
            marker="o",
            ms=4,
            capsize=3,
            color=color,
            label=name,
        )
    ax.set_xscale("log")
    ax.set_xticks(finite + [inf_x])
    ax.set_xticklabels([f"{e:g}" for e in finite] + ["∞\n(no DP)"])
    ax.set_xlabel("ε (user-level, δ = 1e-4, central DP on the shared updates)")
    ax.set_ylabel("personalized test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "out",
        type=Path,
        nargs="?",
        help="the experiment's output directory (--accounting: its experiment file, optional)",
    )
    parser.add_argument("--accounting", action="store_true", help="epsilon by accountant, no run")
    parser.add_argument("--nodes", type=int, default=0)
    parser.add_argument("--fraction", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--delta", type=float, default=0.0)
    parser.add_argument("--epsilon", type=float, action="append", default=[])
    args = parser.parse_args(argv)
    if args.accounting:
        if args.out is not None:
            print(accounting(*experiment_settings(args.out)))
        else:
            print(accounting(args.nodes, args.fraction, args.rounds, args.delta, args.epsilon))
        return
    methods = load(args.out)
    text = table(methods)
    (args.out / "tradeoff.md").write_text(text + "\n")
    figure(methods, args.out / "tradeoff.png")
    print(text)


if __name__ == "__main__":
    main()
