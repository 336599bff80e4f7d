"""Peak memory of one aggregation, relative to the replies it combines.

N training replies carrying a full ResNet-18 (GroupNorm) in float32 (44.7 MB each) go through
``aggregate_train`` of pflower's FedAvg (the plain mean; the mean-type strategies FedAlt,
FedSim and APFL share it), of pflower's FedAvg with the robust rules, and of Flower's own
FedAvg, FedMedian, FedTrimmedAvg and MultiKrum, in this process. Peak = the largest memory
NumPy and PyTorch allocate during the call (``tracemalloc``, which both report to), above
what was allocated before it; the replies themselves were allocated before.

    python benchmarks/aggregation_memory.py [--clients 50] [--rules mean median ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flwr.app as fa  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402


def record(tensors: dict[str, np.ndarray]) -> fa.ArrayRecord:
    return fa.ArrayRecord({k: fa.Array(v) for k, v in tensors.items()})


def replies_of(current: dict[str, np.ndarray], clients: int, seed: int = 0) -> list[fa.Message]:
    rng = np.random.default_rng(seed)
    if TaskIdentity._run_id is None:  # messages need a task identity (the SuperLink's)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    out = []
    for node in range(1, clients + 1):
        asked = fa.Message(
            fa.RecordDict({"config": fa.ConfigRecord({})}), node, fa.MessageType.TRAIN, group_id="1"
        )
        arrays = {
            k: v + rng.standard_normal(v.shape, np.float32) * 0.01 for k, v in current.items()
        }
        content = fa.RecordDict(
            {"arrays": record(arrays), "metrics": fa.MetricRecord({"num-examples": 100})}
        )
        out.append(fa.Message(content, reply_to=asked))
    return out


def resnet18_shared() -> dict[str, np.ndarray]:
    from pflower.task.models import build_model

    model = build_model("resnet18-gn", (3, 32, 32), 10, seed=0)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def pflower_strategy(rule: str, current: dict[str, np.ndarray], clients: int):
    from pflower.strategies import FedAvg
    from pflower.strategies.aggregators import make_aggregator

    robust = None if rule == "mean" else make_aggregator(rule, bucket_size=1, seed=0)
    strategy = FedAvg(robust=robust, byzantine=2 if robust else 0, max_update_norm=0)
    strategy.history, strategy.num_rounds = [], 10
    strategy._current = record(current)
    return strategy


def flower_strategy(rule: str):
    from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, MultiKrum

    return {
        "mean": FedAvg,
        "median": FedMedian,
        "trimmed-mean": FedTrimmedAvg,
        "multi-krum": lambda: MultiKrum(num_malicious_nodes=2, num_nodes_to_select=1),
    }[rule]()


def measure(call) -> tuple[float, float]:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    start = time.process_time()
    call()
    cpu = time.process_time() - start
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak, cpu


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rules", nargs="+", default=["mean", "median"])
    parser.add_argument("--flower", action="store_true", help="Flower's strategies too")
    args = parser.parse_args(argv)
    current = resnet18_shared()
    replies = replies_of(current, args.clients)
    size = sum(v.nbytes for v in current.values()) * args.clients
    for rule in args.rules:
        strategy = pflower_strategy(rule, current, args.clients)
        peak, cpu = measure(lambda s=strategy: s.aggregate_train(1, replies))
        row = {"who": "pflower", "rule": rule, "clients": args.clients}
        row |= {"replies_mb": round(size / 2**20), "peak_over_replies": round(peak / size, 2)}
        print(json.dumps(row | {"cpu_s": round(cpu, 2)}), flush=True)
        if args.flower:
            flower = flower_strategy(rule)
            peak, cpu = measure(lambda f=flower: f.aggregate_train(1, replies))
            row = {"who": "flower", "rule": rule, "clients": args.clients}
            row |= {"replies_mb": round(size / 2**20), "peak_over_replies": round(peak / size, 2)}
            print(json.dumps(row | {"cpu_s": round(cpu, 2)}), flush=True)


if __name__ == "__main__":
    main()
