"""Compare personalization methods through Flower's simulation engine; mean ± std over seeds.

Each (method, seed) is one ``flwr.simulation.run_simulation`` of the pflower app, in
process. Writes every run's final metrics to JSON and prints a Markdown table.

    python benchmarks/compare.py --setting mnist-2c --seeds 0 1 2
    python benchmarks/compare.py --setting mnist-5c-small --seeds 0 1 2
    python benchmarks/compare.py --setting synthetic --seeds 0 1 2

Methods (``--methods``, default all): FedAvg (global model), FedAvg-FT (FedAvg, then every
parameter fine-tuned locally), Local (each client alone), and per split (``--splits``):
FT(part.) (FedAvg, then the split's personal part fine-tuned), FedAlt and FedSim (FedAvg
pre-training for half the rounds, then the algorithm, then v-only fine-tuning); with
``--ffgg`` also Local FFGG and FFGG through the same pipeline. Every
method gets the same total number of rounds and the same local epochs per round; 20% of the
clients are sampled per round, except Local, where every client trains every round.
Only the final round is evaluated (every client). ``hurt vs FedAvg``: clients whose
personalized accuracy is below the FedAvg global model's on the same client and seed (the
paper's count). ``own global acc.``: the method's shared part with a new client's personal
init. ``s/round`` is the median wall time of a training round of the algorithm phase (all
sampled clients, in Ray on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

from flwr.simulation import run_simulation  # noqa: E402

from pflower.client_app import build_client_app  # noqa: E402
from pflower.server_app import build_server_app  # noqa: E402

SETTINGS = {
    # the setting: pathological 2 classes per client, 25 clients (~160 train samples)
    "mnist-2c": dict(
        nodes=25,
        dataset="mnist-5k",
        partitioner="pathological",
        **{"classes-per-client": 2, "model": "mlp"},
    ),
    # collaboration matters: 5 classes per client, 50 clients, ~80 train samples each
    "mnist-5c-small": dict(
        nodes=50,
        dataset="mnist-5k",
        partitioner="pathological",
        **{"classes-per-client": 5, "model": "mlp"},
    ),
    # LEAF Synthetic(0.5, 0.5), natural clients, capped at 100 train samples each
    "synthetic": dict(
        nodes=20,
        dataset="synthetic-leaf",
        partitioner="natural",
        **{"model": "mlp", "max-train-samples": 100},
    ),
}
SPLITS = ("head", "input", "adapter")


def methods(splits, rounds: int, with_ffgg: bool = False, ffgg_lr: float = 0.5):
    half = rounds // 2
    rows = [
        ("FedAvg (global)", "none", {"algorithm": "fedavg", "split": "none"}),
        ("FedAvg-FT", "full", {"algorithm": "fedavg-ft", "split": "full"}),
        # each client alone, training every round: the strongest no-collaboration baseline
        ("Local", "full", {"algorithm": "local", "split": "full", "fraction-train": 1.0}),
    ]
    for split in splits:
        pipeline = {"pretrain-rounds": half, "num-server-rounds": rounds - half, "split": split}
        rows += [
            ("FT (part.)", split, {"algorithm": "fedavg-ft", "split": split}),
            ("FedAlt", split, {"algorithm": "fedalt", **pipeline}),
            ("FedSim", split, {"algorithm": "fedsim", **pipeline}),
        ]
        if with_ffgg:
            rows += [
                ("Local FFGG", split, {"algorithm": "local-ffgg", **pipeline}),
                ("FFGG", split, {"algorithm": "ffgg", "server-lr": ffgg_lr, **pipeline}),
            ]
    return rows


def run_one(overrides: dict, nodes: int) -> dict:
    reports = []
    run_simulation(
        server_app=build_server_app(overrides, on_report=reports.append),
        client_app=build_client_app(overrides),
        num_supernodes=nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    (report,) = reports
    cfg = report.cfg
    algo_rounds = [r for r in report.rounds if r.round > cfg.pretrain_rounds and r.train]
    return {
        "final": report.final,
        # median: the first rounds also pay for loading and partitioning data in each worker
        "seconds-per-round": statistics.median(r.seconds for r in algo_rounds),
        "data-passes": statistics.mean(
            r.train.get("data-passes", float("nan")) for r in algo_rounds
        ),
        "seconds": report.seconds,
        "dropped": report.dropped,
        "clients": {int(c["partition-id"]): c["personal-accuracy"] for c in report.clients},
    }


def fmt(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    values = [v * scale for v in values]
    mean = statistics.mean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def hurt_vs_fedavg(results: list[dict]) -> None:
    """Per seed: clients whose personalized accuracy is below FedAvg's global model's on
    the same client (the paper's "personalization hurts" count)."""
    fedavg = next((r for r in results if r["method"] == "FedAvg (global)"), None)
    if fedavg is None:
        return
    for row in results:
        for run, base in zip(row["runs"], fedavg["runs"]):
            run["hurt-vs-fedavg"] = sum(
                acc < base["clients"][pid] for pid, acc in run["clients"].items()
            )


def table(results: list[dict]) -> str:
    hurt_vs_fedavg(results)
    lines = [
        "| method | split | personalized acc. | p10 | p50 | p90 | hurt vs FedAvg "
        "| own global acc. | passes/round | s/round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results:
        finals = [r["final"] for r in row["runs"]]

        def col(key, finals=finals):
            vals = [f[key] for f in finals if key in f]
            return fmt(vals) if len(vals) == len(finals) else "–"

        hurt = [r.get("hurt-vs-fedavg") for r in row["runs"]]
        hurt_s = fmt(hurt, 1.0, 1) if None not in hurt else "–"
        passes = fmt([r["data-passes"] for r in row["runs"]], 1.0, 1)
        secs = fmt([r["seconds-per-round"] for r in row["runs"]], 1.0, 2)
        lines.append(
            f"| {row['method']} | {row['split']} | {col('personal-accuracy')} "
            f"| {col('personal-accuracy-p10')} | {col('personal-accuracy-p50')} "
            f"| {col('personal-accuracy-p90')} | {hurt_s} | {col('global-accuracy')} "
            f"| {passes} | {secs} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="mnist-2c")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=30, help="total rounds of every method")
    parser.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="labels to run, e.g. FedAvg FedAlt (default: all)",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra run-config overrides for every run",
    )
    parser.add_argument(
        "--ffgg", action="store_true", help="also run Local FFGG and FFGG (FedAlt's pipeline)"
    )
    parser.add_argument(
        "--ffgg-server-lr", type=float, default=0.5, help="FFGG's gamma_theta in the FFGG rows"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    setting = dict(SETTINGS[args.setting])
    nodes = setting.pop("nodes")
    extra = {}
    for item in args.set:
        key, value = item.split("=", 1)
        extra[key] = json.loads(value) if value[:1] in "0123456789-[{tf" else value
    common = {
        "num-server-rounds": args.rounds,
        "fraction-train": 0.2,
        "evaluate-every": 1000,
        "lr": 0.05,
        "batch-size": 32,
        "finetune-epochs": 5,
        **setting,
        **extra,
        "outputs-dir": "/tmp/pflower-benchmark-outputs",
    }
    results = []
    started = time.time()
    for label, split, overrides in methods(
        args.splits, args.rounds, args.ffgg, args.ffgg_server_lr
    ):
        if args.methods and label not in args.methods:
            continue
        runs = []
        for seed in args.seeds:
            runs.append(run_one({**common, **overrides, "seed": seed}, nodes))
            acc = runs[-1]["final"].get("personal-accuracy", float("nan"))
            print(
                f"# {label} / {split} / seed {seed}: {100 * acc:.2f}% "
                f"({time.time() - started:.0f} s elapsed)",
                file=sys.stderr,
                flush=True,
            )
        results.append({"method": label, "split": split, "runs": runs})
    out = args.out or Path(__file__).parent / "results" / f"compare-{args.setting}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "setting": args.setting,
                "nodes": nodes,
                "common": common,
                "seeds": args.seeds,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"\n{args.setting}: {nodes} clients, {args.rounds} rounds, seeds {args.seeds}\n")
    print(table(results))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
