"""PFLEGO's per-round client cost vs FedAvg and FedPer, side by side in one run.

Each method's client half does one training round of tau full-batch steps on the same
client data and model (mnist-5k, round-robin partition over 10 clients, ~400 training
examples on the client timed): FedAvg = ``local-gd`` (tau GD steps on the whole model),
FedPer = ``fedper`` (FedSim, head split: tau steps on body and head together), PFLEGO
(tau - 1 closed-form head steps on cached features + one exact gradient). Rounds are
interleaved (A B C A B C ...) so machine noise hits all methods alike; the table reports
the median seconds per round and the ratio to PFLEGO, then where PFLEGO's time goes.

    python benchmarks/pflego_cost.py --out benchmarks/results/pflego-cost.md
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch
from flwr.app import Context, RecordDict

from pflower.client_app import make_job, parse_config
from pflower.strategies import FedSimClient, LocalGDClient, PFLEGOClient

METHODS = {
    "FedAvg (local-gd)": ("local-gd", LocalGDClient(), {"lr": 0.05}),
    "FedPer (fedper)": ("fedper", FedSimClient(), {"lr": 0.05, "lr-scale": 1.0}),
    "PFLEGO": ("pflego", PFLEGOClient(), {"lr": 0.05, "pflego-head-lr": 0.01}),
}


def job(algorithm: str, model: str, tau: int, partition: int = 1, clients: int = 10):
    cfg = parse_config(
        frozenset(
            {
                "algorithm": algorithm,
                "model": model,
                "split": "head",
                "dataset": "mnist-5k",
                "partitioner": "round-robin",
                "classes-per-client": 10,
                "batch-size": 100_000,  # full batch
                "local-steps": tau,
                "device": "cpu",
            }.items()
        )
    )
    context = Context(
        run_id=1,
        node_id=1,
        state=RecordDict(),
        node_config={"partition-id": partition, "num-partitions": clients},
        run_config={},
    )
    return make_job(cfg, context, 1)


def measure(model: str, tau: int, repeats: int) -> tuple[dict[str, float], int]:
    jobs = {name: job(alg, model, tau) for name, (alg, _, _) in METHODS.items()}
    for name, (_, half, config) in METHODS.items():  # warm-up
        half.train(jobs[name], config)
    seconds: dict[str, list[float]] = {name: [] for name in METHODS}
    for _ in range(repeats):
        for name, (_, half, config) in METHODS.items():
            start = time.perf_counter()
            half.train(jobs[name], config)
            seconds[name].append(time.perf_counter() - start)
    n = next(iter(jobs.values())).num_train
    return {name: statistics.median(s) for name, s in seconds.items()}, n


def profile_pflego(model: str, tau: int) -> str:
    j = job("pflego", model, tau)
    half, config = PFLEGOClient(), METHODS["PFLEGO"][2]
    half.train(j, config)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        half.train(j, config)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumtime")
    total = stats.total_tt
    parts = {}
    for (_file, _, func), (_, _, _, cum, _) in stats.stats.items():
        if func in ("features", "head_steps", "loss_and_gradient", "save_personal", "restore_head"):
            parts[func] = parts.get(func, 0.0) + cum
    lines = [
        f"- `{k}`: {100 * v / total:.0f}%" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tau", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", nargs="*", default=["pflego-mlp", "cnn-apfl"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        f"tau = {args.tau} full-batch steps, median of {args.repeats} interleaved rounds, "
        f"{args.threads} CPU thread(s)",
        "",
        "| model | client examples | method | s / round | × PFLEGO's time |",
        "|---|---|---|---|---|",
    ]
    for model in args.models:
        medians, n = measure(model, args.tau, args.repeats)
        for name, s in medians.items():
            lines.append(f"| {model} | {n} | {name} | {s:.4f} | {s / medians['PFLEGO']:.1f} |")
        print("\n".join(lines), flush=True)
    lines += ["", "Where PFLEGO's client time goes (cProfile, cumulative share of train()):", ""]
    for model in args.models:
        lines += [f"{model}:", profile_pflego(model, args.tau), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
