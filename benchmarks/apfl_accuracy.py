"""APFL's Table 2 and Fig. 4 analogues: APFL with fixed / adaptive alpha vs FedAvg (global
and localized) vs Local, mean ± std over seeds.

Table 2 (``--table mnist``): mnist-5k, pathological 2 classes per client, 50 clients (~80
training examples each), MLP 2x200, tau = 20 steps of batch 20, 100 rounds, 20% of the
clients per round. Fig. 4 (``--table synthetic``): synthetic-leaf (gamma, beta) in
{(0, 0), (0.5, 0.5), (1, 1)}, natural clients capped at 100 training examples, logistic
regression, adaptive alpha_0 = 0.01 vs FedAvg. FedAvg is APFL with alpha = 0 fixed: its w
trajectory is FedAvg's bit for bit (tests/test_apfl.py), its ``global`` column is the
FedAvg global model and its ``localized`` column the paper's "FedAvg localized" (the
global model after the client's tau local steps). Step size eta_t = 0.1 * 0.999^t over the
global step t (the paper decays 1% per step; at tau = 20 over 100 rounds that leaves
eta ~ 1e-10 after round 50, so a tenth of it). Every run goes through pflower's strategy and
ClientApp on a ``LocalGrid``; the final round evaluates every client on its test split.

    python benchmarks/apfl_accuracy.py --table mnist --out benchmarks/results/apfl-mnist
    python benchmarks/apfl_accuracy.py --table synthetic --out benchmarks/results/apfl-synthetic
    python benchmarks/apfl_accuracy.py --table newclients --out benchmarks/results/apfl-newclients

Fig. 6 analogue (``--table newclients``): the Table 2 setting with 10 of the 50 clients
(``holdout-fraction`` 0.2) never trained; at the end they start v from the global w and
fine-tune it one epoch with w fixed (eq. 17), then are evaluated.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _pool import percent_cell, pooled_accuracy, quiet_worker, run_pool

APFL = {"algorithm": "apfl", "local-steps": 20, "lr": 0.1, "apfl-lr-decay": 0.999}
FEDAVG = {**APFL, "apfl-alpha": 0.0, "apfl-adaptive": False}
LOCAL = {"algorithm": "local", "local-steps": 20, "lr": 0.1}

MNIST_2C = {
    "dataset": "mnist-5k",
    "partitioner": "pathological",
    "classes-per-client": 2,
    "model": "mlp",
    "batch-size": 20,
    "fraction-train": 0.2,
    "finetune-epochs": 1,
}

TABLES = {
    "mnist": {
        "common": MNIST_2C,
        "clients": 50,
        "settings": {"MNIST 2 classes": {}},
        "methods": {
            "APFL alpha=0.25": {**APFL, "apfl-alpha": 0.25, "apfl-adaptive": False},
            "APFL alpha=0.5": {**APFL, "apfl-alpha": 0.5, "apfl-adaptive": False},
            "APFL alpha=0.75": {**APFL, "apfl-alpha": 0.75, "apfl-adaptive": False},
            "APFL adaptive (alpha_0=0.01)": {**APFL, "apfl-alpha": 0.01},
            "APFL adaptive (alpha_0=0.5)": {**APFL, "apfl-alpha": 0.5},
            "FedAvg": FEDAVG,
            "Local": LOCAL,
        },
    },
    # Fig. 6 analogue: 20% of the clients never train and are evaluated as new clients
    "newclients": {
        "common": {**MNIST_2C, "holdout-fraction": 0.2},
        "clients": 50,
        "settings": {"MNIST 2 classes, 10 of 50 clients held out": {}},
        "methods": {
            "APFL alpha=0.25": {**APFL, "apfl-alpha": 0.25, "apfl-adaptive": False},
            "APFL adaptive (alpha_0=0.01)": {**APFL, "apfl-alpha": 0.01},
            "FedAvg": FEDAVG,
        },
    },
    "synthetic": {
        "common": {
            "dataset": "synthetic-leaf",
            "partitioner": "natural",
            "max-train-samples": 100,
            "model": "logreg",
            "batch-size": 20,
            "fraction-train": 0.2,
            "finetune-epochs": 1,
        },
        "clients": 30,
        "settings": {
            f"Synthetic({g},{b})": {"synthetic-gamma": g, "synthetic-beta": b}
            for g, b in ((0.0, 0.0), (0.5, 0.5), (1.0, 1.0))
        },
        "methods": {
            "APFL adaptive (alpha_0=0.01)": {**APFL, "apfl-alpha": 0.01},
            "FedAvg": FEDAVG,
            "Local": LOCAL,
        },
    },
}


def one(job) -> dict:
    table, setting, method, seed, rounds = job
    quiet_worker()
    from pflower.experiments.local_grid import run_local

    spec = TABLES[table]
    cfg = {
        **spec["common"],
        **spec["settings"][setting],
        **spec["methods"][method],
        "num-server-rounds": rounds,
        "evaluate-every": rounds,
        "seed": seed,
        "outputs-dir": str(Path(tempfile.gettempdir()) / "pflower-apfl-runs"),
    }
    start = time.perf_counter()
    report = run_local(cfg, spec["clients"])
    final = report.final
    held = _held_out_accuracy(report.clients, spec["clients"], cfg.get("holdout-fraction", 0))
    return {
        "setting": setting,
        "method": method,
        "seed": seed,
        **{k: final.get(f"{k}-accuracy") for k in ("personal", "global", "localized")},
        **held,
        "seconds": time.perf_counter() - start,
        "config": cfg,
    }


def _held_out_accuracy(rows: list[dict], clients: int, fraction: float) -> dict:
    """Pooled personalized accuracy of the held-out (new) clients and of the trained ones."""
    if not fraction:
        return {}
    cutoff = clients - round(fraction * clients)
    out = {}
    for name, keep in (("new", lambda p: p >= cutoff), ("trained", lambda p: p < cutoff)):
        out[name] = pooled_accuracy([r for r in rows if keep(int(r["partition-id"]))])
    return out


def table(results: list[dict], name: str, args) -> str:
    spec = TABLES[name]
    lines = [
        f"{name}: {spec['clients']} clients, {args.rounds} rounds, seeds {args.seeds}; "
        "pooled test accuracy (%), mean ± std",
        "",
        "| setting | method | personalized | global | localized |",
        "|---|---|---|---|---|",
    ]
    columns = ("personal", "global", "localized")
    if "holdout-fraction" in spec["common"]:
        columns = ("trained", "new", "global")
        lines[2:4] = [
            "| setting | method | trained clients (personalized) | new clients (eq. 17) | global |",
            "|---|---|---|---|---|",
        ]
    for setting in spec["settings"]:
        for method in spec["methods"]:
            rows = [r for r in results if (r["setting"], r["method"]) == (setting, method)]
            if rows:
                cells = [percent_cell([r.get(k) for r in rows]) for k in columns]
                lines.append(f"| {setting} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _label(r: dict) -> str:
    return f"{r['setting']} | {r['method']} | seed {r['seed']}: {r['personal']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=list(TABLES), default="mnist")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--methods", nargs="*", default=None, help="default: all of the table")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    spec = TABLES[args.table]
    out = Path(args.out or f"benchmarks/results/apfl-{args.table}")
    out.mkdir(parents=True, exist_ok=True)
    jobs = [
        (args.table, setting, method, seed, args.rounds)
        for setting in spec["settings"]
        for method in args.methods or spec["methods"]
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
    text = table(results, args.table, args)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
