"""Peak memory of one aggregation, relative to the replies it combines.

N training replies carrying a full ResNet-18 (GroupNorm) in float32 (44.7 MB each) go through
``aggregate_train`` of pflower's FedAvg (the plain mean; the mean-type strategies FedAlt,
FedSim and APFL share it), of pflower's FedAvg with each robust rule (f = 2 Byzantine
assumed), and of Flower's own FedAvg, FedMedian, FedTrimmedAvg and MultiKrum, each in a fresh
process. Peak = the process's peak resident memory during the call (the kernel's high-water
mark, reset just before it through ``/proc/self/clear_refs``) minus its resident memory just
before (after the replies were built and freed memory handed back with ``malloc_trim``), so
NumPy's and PyTorch's allocations both count. CPU = the call's CPU seconds (all threads).

    python benchmarks/aggregation_memory.py [--clients 50] [--rules mean median ...] [--flower]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import get_args

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flwr.app as fa  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from pflower.settings import RobustAggregator  # noqa: E402


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


# the plain mean, every robust rule of the run config, and bucketing (s = 2) + median
RULES = ["mean", *get_args(RobustAggregator)[2:], "median+b2"]
FLOWER = {"mean", "median", "trimmed-mean", "multi-krum"}  # rules Flower has a strategy for


def pflower_strategy(rule: str, current: dict[str, np.ndarray], clients: int):
    from pflower.strategies import FedAvg
    from pflower.strategies.aggregators import make_aggregator

    name, _, bucket = rule.partition("+b")
    options = {"m": 10} if name == "multi-krum" else {}
    robust = (
        None
        if rule == "mean"
        else make_aggregator(name, bucket_size=int(bucket or 1), seed=0, **options)
    )
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
        "multi-krum": lambda: MultiKrum(num_malicious_nodes=2, num_nodes_to_select=10),
    }[rule]()


def _status(key: str) -> int:
    """A /proc/self/status memory line, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(call) -> tuple[float, float, object]:
    """(peak resident bytes above the start, CPU seconds, result) of ``call()``."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS: not reusable unseen
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here
    start = time.process_time()
    result = call()
    cpu = time.process_time() - start
    return _status("VmHWM") - before, cpu, result


def child(who: str, rule: str, clients: int) -> dict:
    current = resnet18_shared()
    replies = replies_of(current, clients)
    size = sum(v.nbytes for v in current.values()) * clients
    if who == "pflower":
        strategy = pflower_strategy(rule, current, clients)
    else:
        strategy = flower_strategy(rule)
    peak, cpu, (arrays, metrics) = measure(lambda: strategy.aggregate_train(1, replies))
    metrics = dict(metrics or {})
    if arrays is None or metrics.get("skipped") or metrics.get("applied", clients) != clients:
        raise RuntimeError(f"{who} {rule}: the round was not aggregated ({metrics})")
    return {
        "who": who,
        "rule": rule,
        "clients": clients,
        "replies_mb": round(size / 2**20),
        "peak_over_replies": round(peak / size, 2),
        "cpu_s": round(cpu, 2),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[50])
    parser.add_argument("--rules", nargs="+", default=RULES, choices=RULES)
    parser.add_argument("--flower", action="store_true", help="Flower's strategies too")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.clients[0])), flush=True)
        return
    for clients in args.clients:
        for rule in args.rules:
            for who in ["pflower", "flower"] if args.flower and rule in FLOWER else ["pflower"]:
                cmd = [sys.executable, __file__, "--child", who, rule, "--clients", str(clients)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    print(out.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"{who} {rule} at {clients} clients failed")
                print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
