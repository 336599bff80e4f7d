"""PFLEGO's Table 1 analogue on mnist-5k: High / Medium / No personalisation.

mnist-5k, round-robin partition (the paper's dealing) with 2 / 5 / 10 classes per client,
I = 50 clients (~80 training examples each), tau = 50 full-batch steps per round, 20% of
the clients per round, the paper's MLP (784 -> 200 ReLU -> head). Methods: Local (each
client alone, same sampling), FedAvg (``local-gd``: tau GD steps on the whole model,
evaluated as the global model), FedPer (FedSim, head split), FedRep (FedAlt, head split:
40 head steps then 10 body steps), PFLEGO (Adam server). Every run goes through pflower's
strategies and ClientApp on a ``LocalGrid`` (the same code path as the simulation engine,
in process). Final round: every client evaluated on its own test split; the table gives
the accuracy pooled over test examples, mean ± std over seeds.

    python benchmarks/pflego_accuracy.py --seeds 0 1 2 --out benchmarks/results/pflego-accuracy
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from _pool import percent_cell, run_pool

SETTINGS = {"High (2 classes)": 2, "Medium (5 classes)": 5, "No (10 classes)": 10}

COMMON = {
    "dataset": "mnist-5k",
    "partitioner": "round-robin",
    "model": "pflego-mlp",
    "split": "head",
    "batch-size": 100_000,  # full batch
    "fraction-train": 0.2,
    "finetune-epochs": 5,
}

METHODS = {
    "Local": {"algorithm": "local", "local-steps": 50, "lr": 0.1},
    "FedAvg": {"algorithm": "local-gd", "local-steps": 50, "lr": 0.1},
    "FedPer": {"algorithm": "fedper", "local-steps": 50, "lr": 0.1},
    "FedRep": {"algorithm": "fedrep", "personal-steps": 40, "local-steps": 10, "lr": 0.1},
    "PFLEGO": {
        "algorithm": "pflego",
        "local-steps": 50,
        "personal-lr": 0.5,
        "server-optimizer": "adam",
        "server-lr": 0.003,
    },
}


def one(job) -> dict:
    setting, classes, method, seed, rounds, clients = job
    import torch

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from pflower.experiments.local_grid import run_local

    cfg = {
        **COMMON,
        **METHODS[method],
        "classes-per-client": classes,
        "num-server-rounds": rounds,
        "evaluate-every": rounds,
        "seed": seed,
        "outputs-dir": str(Path(tempfile.gettempdir()) / "pflower-pflego-runs"),
    }
    start = time.perf_counter()
    report = run_local(cfg, clients)
    return {
        "setting": setting,
        "method": method,
        "seed": seed,
        "accuracy": report.final["personal-accuracy"],
        "seconds": time.perf_counter() - start,
        "config": cfg,
    }


def table(results: list[dict], args) -> str:
    lines = [
        f"mnist-5k, round-robin, I = {args.clients}, tau = 50, 20% participation, "
        f"{args.rounds} rounds, seeds {args.seeds}; pooled test accuracy (%), mean ± std",
        "",
        "| method | " + " | ".join(SETTINGS) + " |",
        "|---|" + "---|" * len(SETTINGS),
    ]
    for method in METHODS:
        cells = []
        for setting in SETTINGS:
            accs = [
                r["accuracy"] for r in results if (r["method"], r["setting"]) == (method, setting)
            ]
            cells.append(percent_cell(accs))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _label(r: dict) -> str:
    return f"{r['setting']} | {r['method']} | seed {r['seed']}: {100 * r['accuracy']:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/pflego-accuracy")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [
        (setting, classes, method, seed, args.rounds, args.clients)
        for setting, classes in SETTINGS.items()
        for method in args.methods
        for seed in args.seeds
    ]
    results = run_pool(
        one,
        jobs,
        args.workers,
        out,
        {"args": vars(args)},
        _label,
    )
    text = table(results, args)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
