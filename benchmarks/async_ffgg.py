"""Synchronous FFGG vs asynchronous FFGG (Alg. 3) on wall clock, with stragglers.

20% of the clients are 10x slower (``straggler-fraction`` 0.2, ``straggler-factor`` 10: each
training reply waits ``straggler-delay-s`` = 0.05 s, or 0.5 s for a straggler, on top of its
compute). Both servers run pflower's strategy and ClientApp on a ``LocalGrid`` whose
``workers`` threads let C = 5 clients compute at once (as a SuperLink would): synchronous FFGG
samples 5 clients per round and waits for the slowest; AsyncFFGG keeps 5 in flight and
applies each gradient on arrival with step gamma / 5 (the per-gradient step of synchronous
FFGG's mean over 5), so the two differ only in waiting. Clock: training wall time
(evaluation pauses excluded), measured in the same process one run after the other.

- ``synthetic-linear`` (Mishchenko et al. §3.1 problem; M = 20, n = 200, d_theta = 20,
  d_w = 10, CG fine-tuner): ||theta - theta*||^2 by the server's closed form; seconds and
  server updates until it first falls below ``--target`` x its initial value; then AsyncFFGG
  with maximum staleness 2, 5, 10 (older updates dropped) and staleness-scaled steps.
- ``mnist-5k`` pathological (5 classes per client, 20 clients, head split, FFGG with the
  received head init): both servers get the same training time budget; the final accuracy of
  every client (personalized, pooled) and the number of gradients applied.

    python benchmarks/async_ffgg.py --out benchmarks/results/async-ffgg
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

STRAGGLERS = {"straggler-delay-s": 0.05, "straggler-fraction": 0.2, "straggler-factor": 10.0}
SLOTS = 5
LINEAR = {
    "dataset": "synthetic-linear",
    "model": "synthetic-linear",
    "linear-n": 200,
    "linear-dtheta": 20,
    "linear-dw": 10,
    "split": "head",
    "ffgg-solver": "cg",
    "personal-steps": 10,
    "fraction-evaluate": 0.1,
    **STRAGGLERS,
}
MNIST = {
    "dataset": "mnist-5k",
    "partitioner": "pathological",
    "classes-per-client": 5,
    "model": "mlp",
    "split": "head",
    "ffgg-init": "received",
    "lr": 0.05,
    "fraction-evaluate": 0.25,
    **STRAGGLERS,
}


def run(overrides: dict, clients: int) -> list:
    from pflower.testbed.local_grid import run_local

    logging.getLogger("flwr").setLevel(logging.ERROR)
    cfg = {**overrides, "outputs-dir": str(Path(tempfile.gettempdir()) / "pflower-async")}
    return run_local(cfg, clients, workers=SLOTS)


def sync_cfg(base: dict, gamma: float, clients: int, rounds: int) -> dict:
    return {
        **base,
        "algorithm": "ffgg",
        "server-lr": gamma,
        "fraction-train": SLOTS / clients,
        "num-server-rounds": rounds,
    }


def async_cfg(base: dict, gamma: float, updates: int, **extra) -> dict:
    return {
        **base,
        "algorithm": "async-ffgg",
        "server-lr": gamma / SLOTS,
        "async-concurrency": SLOTS,
        "async-updates": updates,
        "num-server-rounds": 1,
        **extra,
    }


def curve(report) -> list[tuple[float, int, float]]:
    """(training seconds, server updates, theta error) after every logged update/round."""
    out, clock = [], 0.0
    synchronous = report.cfg.algorithm == "ffgg"
    for r in report.rounds:
        if synchronous and r.seconds:
            clock += r.seconds
        elif r.seconds:
            clock = r.seconds
        if "theta-error" in r.server:
            out.append((clock, r.round, r.server["theta-error"]))
    return out


def first_below(points, level) -> tuple[float, int] | None:
    for seconds, updates, error in points:
        if error <= level:
            return seconds, updates
    return None


def linear_table(args) -> tuple[str, dict]:
    gamma, clients = 75.0, 20  # 1 / (2 L_F): L_F = 0.0067 for this problem (task/linear.py)
    rows, raw = [], {}
    runs = {
        "FFGG (synchronous)": sync_cfg(LINEAR, gamma, clients, args.linear_rounds),
        "AsyncFFGG": async_cfg(LINEAR, gamma, args.linear_rounds * SLOTS),
        "AsyncFFGG, max staleness 10": async_cfg(
            LINEAR, gamma, args.linear_rounds * SLOTS, **{"async-max-staleness": 10}
        ),
        "AsyncFFGG, max staleness 5": async_cfg(
            LINEAR, gamma, args.linear_rounds * SLOTS, **{"async-max-staleness": 5}
        ),
        "AsyncFFGG, max staleness 2": async_cfg(
            LINEAR, gamma, args.linear_rounds * SLOTS, **{"async-max-staleness": 2}
        ),
        "AsyncFFGG, step / (1 + s)^0.5": async_cfg(
            LINEAR, gamma, args.linear_rounds * SLOTS, **{"async-staleness-power": 0.5}
        ),
    }
    results = {}
    for name, cfg in runs.items():
        cfg = {**cfg, "async-evaluate-every": SLOTS, "evaluate-every": 1}
        start = time.perf_counter()
        report = run(cfg, clients)
        points = curve(report)
        results[name] = (report, points)
        raw[name] = {"points": points, "dropped": report.dropped, "config": cfg}
        print(f"{name}: {time.perf_counter() - start:.0f} s, final {points[-1]}", flush=True)
    initial = results["FFGG (synchronous)"][1][0][2]
    level = args.target * initial
    sync_hit = first_below(results["FFGG (synchronous)"][1], level)
    for name, (report, points) in results.items():
        hit = first_below(points, level)
        seconds, updates, final = points[-1]
        gradients = updates * (SLOTS if report.cfg.algorithm == "ffgg" else 1)
        speedup = f"{sync_hit[0] / hit[0]:.2f}x" if hit and sync_hit else "–"
        rows.append(
            f"| {name} | {hit[0]:.1f} | {hit[1]} | {speedup} | {final:.3g} | {gradients} | "
            f"{report.dropped} |"
            if hit
            else f"| {name} | not reached | – | – | {final:.3g} | {gradients} | {report.dropped} |"
        )
    head = [
        f"synthetic-linear, M = {clients}, {SLOTS} clients computing at once, 20% of them 10x "
        f"slower; target ||theta - theta*||^2 <= {args.target} x initial ({level:.3g}); "
        "one run each, this machine",
        "",
        "| server | seconds to target | server updates to target | speed-up vs sync | final "
        "error | client gradients used | dropped |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    return "\n".join(head + rows), raw


def mnist_table(args) -> tuple[str, dict]:
    clients, budget = 20, args.mnist_seconds
    raw, cells = {}, {}
    for seed in args.seeds:
        for name, cfg in {
            "FFGG (synchronous)": sync_cfg(MNIST, 0.5, clients, 10_000),
            "AsyncFFGG": async_cfg(MNIST, 0.5, 10_000 * SLOTS),
        }.items():
            cfg = {**cfg, "seed": seed, "evaluate-every": 10_000}
            if name.startswith("FFGG"):
                cfg["round-timeout"] = 600
            cfg["async-time-budget-s"] = budget
            report = run_budgeted(cfg, clients, budget)
            acc = report.final.get("personal-accuracy")
            steps = [r for r in report.rounds if r.train]
            gradients = sum(r.train.get("applied", 1) for r in steps)
            cells.setdefault(name, []).append((acc, gradients))
            raw[f"{name} seed {seed}"] = {"accuracy": acc, "gradients": gradients}
            print(f"mnist {name} seed {seed}: {acc}, {gradients} gradients", flush=True)
    lines = [
        f"mnist-5k, 5 classes per client, {clients} clients, head split, {budget:.0f} s of "
        f"training each, {SLOTS} clients computing at once, 20% 10x slower; seeds {args.seeds}",
        "",
        "| server | personalized accuracy (%) | client gradients applied |",
        "|---|---|---:|",
    ]
    for name, values in cells.items():
        accs = [100 * a for a, _ in values]
        grads = [g for _, g in values]
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        lines.append(
            f"| {name} | {statistics.mean(accs):.2f} ± {std:.2f} | {statistics.mean(grads):.0f} |"
        )
    return "\n".join(lines), raw


def run_budgeted(cfg: dict, clients: int, budget: float):
    """Synchronous FFGG has no time budget of its own: a probe run measures its seconds per
    round, then it runs the number of rounds that fits ``budget``."""
    if cfg["algorithm"] == "async-ffgg":
        return run(cfg, clients)
    probe_rounds = max(5, int(budget / 2))
    probe = run({**cfg, "num-server-rounds": probe_rounds, "evaluate-every": probe_rounds}, clients)
    per_round = sum(r.seconds for r in probe.rounds if r.seconds) / probe_rounds
    return run({**cfg, "num-server-rounds": max(1, int(budget / per_round))}, clients)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.03)
    parser.add_argument("--linear-rounds", type=int, default=60)
    parser.add_argument("--mnist-seconds", type=float, default=40.0)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--tables", nargs="*", default=["linear", "mnist"])
    parser.add_argument("--out", default="benchmarks/results/async-ffgg")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts, raw = [], {}
    if "linear" in args.tables:
        text, raw["linear"] = linear_table(args)
        texts.append(text)
        plot(raw["linear"], out / "convergence.png")
    if "mnist" in args.tables:
        text, raw["mnist"] = mnist_table(args)
        texts.append(text)
    (out / "results.json").write_text(json.dumps({"args": vars(args), **raw}, default=str))
    (out / "table.md").write_text("\n\n".join(texts) + "\n")
    print("\n\n".join(texts))


def plot(raw: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, entry in raw.items():
        seconds, updates, error = zip(*entry["points"])
        axes[0].semilogy(seconds, error, label=name)
        gradients = [u * (SLOTS if name.startswith("FFGG") else 1) for u in updates]
        axes[1].semilogy(gradients, error, label=name)
    axes[0].set_xlabel("training wall clock (s)")
    axes[1].set_xlabel("client gradients")
    for ax in axes:
        ax.set_ylabel("||theta - theta*||^2")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
