"""What the library page's ``RobustFedAvg`` example costs on clean data: Flower's PyTorch
quickstart ClientApp as it is (``examples/quickstart/quickstart_app/flower_client_app.py``:
digits, an MLP, two classes per client, 10 nodes, every node every round, lr 0.1), Flower's
``FedAvg`` against ``RobustFedAvg`` with byzantine = 2 over buckets of 2 (the coordinate-wise
median and the geometric median), the global model's accuracy pooled over the clients' test
sets after the last round.

    python benchmarks/robust_fedavg_clean.py --rounds 40 --seeds 0 1 2 \
        --out benchmarks/results/robust-fedavg-clean.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "quickstart"))
from quickstart_app.flower_client_app import app  # noqa: E402
from quickstart_app.task import Net  # noqa: E402

from pflower.strategies.aggregators import make_aggregator  # noqa: E402
from pflower.strategies.robust_fedavg import RobustFedAvg  # noqa: E402
from pflower.testbed.local_grid import LocalGrid  # noqa: E402

STRATEGIES = {
    "FedAvg": lambda: FedAvg(fraction_train=1.0),
    "RobustFedAvg median, buckets of 2, f = 2": lambda: RobustFedAvg(
        aggregator=make_aggregator("median", bucket_size=2), byzantine=2, fraction_train=1.0
    ),
    "RobustFedAvg geometric median, buckets of 2, f = 2": lambda: RobustFedAvg(
        aggregator=make_aggregator("geometric-median", bucket_size=2),
        byzantine=2,
        fraction_train=1.0,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, make in STRATEGIES.items():
        for seed in args.seeds:
            torch.manual_seed(seed)  # the initial model (Net() draws from torch's generator)
            grid = LocalGrid(app, 10, {"batch-size": 32, "local-epochs": 1})
            cpu = time.process_time()
            result = make().start(
                grid=grid,
                initial_arrays=ArrayRecord(Net().state_dict()),
                num_rounds=args.rounds,
                train_config=ConfigRecord({"lr": 0.1}),
            )
            final = result.evaluate_metrics_clientapp[max(result.evaluate_metrics_clientapp)]
            rows.append(
                {
                    "strategy": name,
                    "seed": seed,
                    "rounds": args.rounds,
                    "accuracy": float(final["eval_acc"]),
                    "cpu-s": round(time.process_time() - cpu, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    for name in STRATEGIES:
        accs = [r["accuracy"] for r in rows if r["strategy"] == name]
        mean = sum(accs) / len(accs)
        std = (sum((a - mean) ** 2 for a in accs) / max(1, len(accs) - 1)) ** 0.5
        print(f"{name}: {100 * mean:.2f} ± {100 * std:.2f} ({len(accs)} seeds)")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
