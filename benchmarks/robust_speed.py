"""Speed and memory of one robust aggregation at ResNet-18 size, pflower vs Flower's strategies.

N client replies of a ResNet-18 (CIFAR-10 head, d = 11.2 M float32 parameters, 62 tensors) are
aggregated by Flower's own ``MultiKrum``, ``FedMedian`` and ``FedTrimmedAvg`` and by pflower's
``RobustFedAvg`` with the corresponding rules (and the rules Flower lacks), each through the
strategy's ``aggregate_train`` on the same replies; calls interleaved, median of ``--repeats``,
so the ratios come from one run. Each call is timed in CPU seconds of the process (all threads:
``time.process_time``; the ratios use these, since this machine is shared and wall time varies
with the other jobs on it) and in wall seconds. Flower's FedMedian / FedTrimmedAvg consume the
replies' arrays, so the replies are rebuilt (untimed) before every call.

    python benchmarks/robust_speed.py --repeats 3 --out benchmarks/results/robust-speed.md

Memory: ``benchmarks/aggregation_memory.py`` (peak memory / reply size, every rule and Flower's).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torchvision
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg, MultiKrum
from flwr.supercore.task_identity import TaskIdentity

from pflower.strategies.aggregators import make_aggregator
from pflower.strategies.robust_fedavg import RobustFedAvg

F = 5  # assumed Byzantine replies for Krum


def layout() -> dict[str, tuple]:
    model = torchvision.models.resnet18(num_classes=10)
    return {k: tuple(p.shape) for k, p in model.named_parameters()}


def client_arrays(n: int, shapes: dict, seed: int = 0) -> list[dict[str, Array]]:
    rng = np.random.default_rng(seed)
    return [
        {k: Array(rng.standard_normal(s, dtype=np.float32)) for k, s in shapes.items()}
        for _ in range(n)
    ]


def replies(arrays: list[dict[str, Array]]) -> list[Message]:
    """Fresh reply messages around the (immutable) Arrays: Flower's FedMedian and
    FedTrimmedAvg pop the arrays out of the replies they aggregate."""
    if TaskIdentity._run_id is None:  # messages need a task identity (the SuperLink's)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    out = []
    for i, record in enumerate(arrays):
        content = RecordDict(
            {"arrays": ArrayRecord(dict(record)), "metrics": MetricRecord({"num-examples": 10})}
        )
        msg = Message(content=content, dst_node_id=i + 1, message_type="train")
        out.append(Message(content=content, reply_to=msg))
    return out


def current(shapes: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in shapes.items()})


def ours(name: str, n: int, **options) -> RobustFedAvg:
    return RobustFedAvg(aggregator=make_aggregator(name, **options), byzantine=F)


def contenders(n: int) -> dict:
    return {
        "Flower MultiKrum (m=1)": lambda: MultiKrum(num_malicious_nodes=F, num_nodes_to_select=1),
        "pflower krum": lambda: ours("krum", n),
        "Flower MultiKrum (m=10)": lambda: MultiKrum(num_malicious_nodes=F, num_nodes_to_select=10),
        "pflower multi-krum (m=10)": lambda: ours("multi-krum", n, m=10),
        "Flower FedMedian": lambda: FedMedian(),
        "pflower median": lambda: ours("median", n),
        "Flower FedTrimmedAvg (beta=0.1)": lambda: FedTrimmedAvg(beta=0.1),
        "pflower trimmed-mean (beta=0.1)": lambda: ours("trimmed-mean", n, beta=0.1),
        "pflower geometric-median": lambda: ours("geometric-median", n),
        "pflower centered-clipping": lambda: ours("centered-clipping", n),
        "pflower bucketing(2) + median": lambda: ours("median", n, bucket_size=2),
        "pflower mean": lambda: ours("mean", n),
    }


def aggregate_once(strategy, msgs: list[Message], shapes: dict) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one ``aggregate_train``."""
    if isinstance(strategy, RobustFedAvg):
        strategy._current = current(shapes)  # what configure_train would have kept
    cpu, wall = time.process_time(), time.perf_counter()
    arrays, _ = strategy.aggregate_train(1, msgs)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert arrays is not None
    return cpu, wall


def speed(args) -> str:
    shapes = layout()
    d = sum(int(np.prod(s)) for s in shapes.values())
    table = contenders(args.clients)
    cpu: dict[str, list[float]] = {k: [] for k in table}
    wall: dict[str, list[float]] = {k: [] for k in table}
    for rep in range(args.repeats):
        arrays = client_arrays(args.clients, shapes, seed=rep)
        for name, make in table.items():
            msgs = replies(arrays)
            c, w = aggregate_once(make(), msgs, shapes)
            cpu[name].append(c)
            wall[name].append(w)
            print(f"{name}: {c:.2f} CPU-s, {w:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    med_wall = {k: statistics.median(v) for k, v in wall.items()}
    lines = [
        f"One aggregation, N = {args.clients} replies of ResNet-18 (d = {d:,} float32), through "
        f"each strategy's aggregate_train; median of {args.repeats} interleaved calls. "
        "Flower / pflower is the ratio of CPU seconds (> 1: pflower is faster).",
        "",
        "| strategy | CPU seconds | wall seconds | Flower / pflower (CPU) |",
        "|---|---:|---:|---:|",
    ]
    pairs = {
        "pflower krum": "Flower MultiKrum (m=1)",
        "pflower multi-krum (m=10)": "Flower MultiKrum (m=10)",
        "pflower median": "Flower FedMedian",
        "pflower trimmed-mean (beta=0.1)": "Flower FedTrimmedAvg (beta=0.1)",
    }
    for name, t in med.items():
        ratio = f"{med[pairs[name]] / t:.1f}x" if name in pairs else ""
        lines.append(f"| {name} | {t:.2f} | {med_wall[name]:.2f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    text = speed(args)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
