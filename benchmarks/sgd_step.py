"""pflower's training primitive against the bare torch loop, side by side in one process.

One client message of ``floor.py``'s ``mnist-5c`` work (the MLP 784-200-200-10, ~80
examples, batches of 32, 2 epochs), on one torch thread, in four variants that alternate
``--repeats`` times, ``--messages`` messages each:

- ``bare``: the loop as it is usually written (a ``torch.optim.SGD`` per message, ``x[idx]``);
- ``bare-functional``: the same loop stepping with torch's functional ``torch.optim.sgd.sgd``;
- ``pflower``: ``pflower.task.train.sgd`` (its ``SGDSteps``, the loader's ``one_pass``, the
  frozen-parameter guard, the loss read back per step);
- ``pflower-optim``: the same with a ``torch.optim.SGD`` object doing the steps (pflower
  before ``SGDSteps``).

Prints one JSON line: the median CPU milliseconds per message of each variant and their
ratios to ``bare``.

    python benchmarks/sgd_step.py
    python benchmarks/sgd_step.py --repeats 30 --messages 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from floor import plain_sgd_step  # noqa: E402

from pflower.task import train  # noqa: E402
from pflower.task.data.loaders import batched  # noqa: E402


class OptimizerSteps:
    """``SGDSteps``'s interface over a ``torch.optim.SGD`` object (pflower before it)."""

    def __init__(self, groups, *, lr, momentum, weight_decay) -> None:
        self.optimizer = torch.optim.SGD(
            groups, lr=lr, momentum=momentum, weight_decay=weight_decay
        )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--messages", type=int, default=100)
    p.add_argument("--examples", type=int, default=80)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 200),
        nn.ReLU(),
        nn.Linear(200, 200),
        nn.ReLU(),
        nn.Linear(200, 10),
    )
    n, bs, lr = args.examples, 32, 0.05
    x, y = torch.rand(n, 1, 28, 28), torch.randint(0, 10, (n,))
    loader = batched(TensorDataset(x, y), bs, shuffle=True)
    params = list(model.parameters())

    def bare() -> None:
        opt = torch.optim.SGD(params, lr=lr)
        for _ in range(args.epochs):
            for idx in torch.randperm(n).split(bs):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()

    def bare_functional() -> None:
        for _ in range(args.epochs):
            for idx in torch.randperm(n).split(bs):
                for q in params:
                    q.grad = None
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                plain_sgd_step(params, lr)

    def pflower() -> None:
        train.sgd(model, params, loader, lr=lr, epochs=args.epochs)

    def pflower_optim() -> None:
        lean, train.SGDSteps = train.SGDSteps, OptimizerSteps
        try:
            train.sgd(model, params, loader, lr=lr, epochs=args.epochs)
        finally:
            train.SGDSteps = lean

    variants = {
        "bare": bare,
        "bare-functional": bare_functional,
        "pflower": pflower,
        "pflower-optim": pflower_optim,
    }
    for fn in variants.values():  # the first optimizer step imports torch._dynamo (~3 s)
        fn()
    spent: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):  # alternately: the box's load hits every variant alike
        for name, fn in variants.items():
            start = time.process_time()
            for _ in range(args.messages):
                fn()
            spent[name].append(1e3 * (time.process_time() - start) / args.messages)
    ms = {k: round(statistics.median(v), 3) for k, v in spent.items()}
    row = {
        "ms_per_message": ms,
        "ratio_to_bare": {k: round(v / ms["bare"], 3) for k, v in ms.items()},
        "examples": n,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "messages": args.messages,
        "torch": torch.__version__,
    }
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
