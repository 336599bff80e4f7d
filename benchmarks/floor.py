"""pflower against the floor: the same clients' SGD as a bare loop (plain torch, no federated
framework), per training round, in CPU seconds of one process with one torch thread.

For each algorithm the bare loop does the arithmetic pflower's client halves and server do in
a training round, and nothing else: the sampled clients' minibatch steps on tensors already in
memory (one permutation per epoch, ``x[idx]``), their personal state kept in a dict, the
server's mean (or PFLEGO's Adam step). No messages, records, configs, checks, metrics or
state stores: what is left is the physical cost of the work. pflower runs the same
configuration on ``LocalGrid`` (the ServerApp's strategy and the production ClientApp, every
message in this process) and, with ``--engine simulation``, through Flower's
``run_simulation`` (the process tree's CPU: Ray's workers and daemons included).

    python benchmarks/floor.py                      # mnist-5c, every algorithm, LocalGrid
    python benchmarks/floor.py --preset default     # the app's default run (2 classes)
    python benchmarks/floor.py --engine simulation --algorithms fedavg
    python benchmarks/floor.py --breakdown          # + pflower's cost centres per message

Per algorithm: ``bare_s`` and ``pflower_s``, the median CPU seconds of a training round
(rounds 2.. : round 1 loads the data), their ratio (target <= 1.15 on LocalGrid); on
LocalGrid also ``bare_functional_step_s``, the bare loop stepping with torch's functional
SGD as pflower does (``Bare``), and pflower's ratio to that; and
pflower's per-message split (``client_cost``-style: the ClientApp outside ``ClientHalf.train``,
the server outside the clients). The two sides run alternately, ``--repeats`` times each.
Results: one JSON line per algorithm and engine on stdout (``--out`` appends them to a file).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.optim.sgd import sgd as functional_sgd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))  # client_cost, scale (--engine simulation)

#: the budget-equal comparison's setting (benchmarks/experiments/mnist-5c.toml)
MNIST_5C = {
    "dataset": "mnist-5k",
    "partitioner": "pathological",
    "classes-per-client": 5,
    "model": "mlp",
    "fraction-train": 0.2,
    "lr": 0.05,
    "batch-size": 32,
    "local-epochs": 2,
    "pretrain-rounds": 0,
}
PRESETS = {"mnist-5c": (MNIST_5C, 50), "default": ({}, 10)}
#: per algorithm: run-config keys over the preset, as mnist-5c.toml sets them
ALGORITHMS = {
    "fedavg": {"split": "none"},
    "local": {"split": "full"},
    "fedalt": {"split": "head", "local-epochs": 1, "personal-epochs": 1},
    "fedsim": {"split": "head"},
    "apfl": {"local-epochs": 1},
    "pflego": {"split": "head", "personal-lr": 0.5},
    "ffgg": {
        "split": "head",
        "local-epochs": 1,
        "personal-epochs": 1,
        "server-lr": 0.5,
        "ffgg-init": "received",
    },
}


def settings(preset: str, algorithm: str, rounds: int) -> tuple[dict, int]:
    base, nodes = PRESETS[preset]
    run = {
        **base,
        "algorithm": algorithm,
        **ALGORITHMS[algorithm],
        "num-server-rounds": rounds,
        "evaluate-every": 10_000,  # the final round only: training rounds are measured
        "finetune-epochs": 0,
        "console": "compact",
    }
    if preset == "default" and algorithm in ("fedalt", "fedsim"):
        run["local-epochs"] = 1
    return run, nodes


# --- the bare loop ----------------------------------------------------------------------------
@torch.no_grad()
def plain_sgd_step(params: list, lr: float) -> None:
    """Plain SGD on ``params`` by torch's functional ``torch.optim.sgd.sgd``: what a
    ``torch.optim.SGD(params, lr)`` step computes, without the optimizer object."""
    functional_sgd(
        params,
        [p.grad for p in params],
        [None] * len(params),
        weight_decay=0.0,
        momentum=0.0,
        lr=lr,
        dampening=0.0,
        nesterov=False,
        maximize=False,
    )


class Bare:
    """The algorithm's training round on plain tensors and modules.

    ``functional_step``: each SGD step calls torch's functional ``torch.optim.sgd.sgd``
    instead of a ``torch.optim.SGD`` object's ``step`` (the same update, bit for bit, without
    the optimizer's per-step machinery: what ``pflower.task.train.SGDSteps`` does). The
    default is the loop as it is usually written, and as the peer library writes it."""

    def __init__(self, run: dict, nodes: int, functional_step: bool = False) -> None:
        self.functional_step = functional_step
        from pflower.config import Config
        from pflower.strategies import build_run_model, wire_split
        from pflower.task.data.loaders import client_arrays

        cfg = Config.from_run_config(run)
        self.cfg, self.nodes = cfg, nodes
        model = build_run_model(cfg)  # the architecture only: a plain nn.Sequential
        split = wire_split(model, cfg)
        self.model = copy.deepcopy(model)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.personal = set(split.personal) & set(self.names)
        self.params = dict(self.model.named_parameters())
        self.data = []
        for i in range(nodes):
            a = client_arrays(cfg, i, nodes)
            self.data.append((torch.from_numpy(a.x_train).float(), torch.from_numpy(a.y_train)))
        self.glob = {n: p.detach().clone() for n, p in self.params.items()}
        self.state: dict[int, dict] = {}
        self.rng = np.random.default_rng(cfg.seed)
        self.r = max(1, round(cfg.fraction_train * nodes))
        self.adam = None

    def round(self) -> None:
        clients = self.rng.choice(self.nodes, self.r, replace=False)
        getattr(self, self.cfg.algorithm)(clients)

    # helpers
    def load(self, values: dict) -> None:
        with torch.no_grad():
            for n, v in values.items():
                self.params[n].copy_(v)

    def sgd(self, x, y, epochs: int, names: list[str], lr: float) -> None:
        for p in self.params.values():
            p.requires_grad_(False)
        chosen = [self.params[n] for n in names]
        for p in chosen:
            p.requires_grad_(True)
        bs = self.cfg.batch_size
        if self.functional_step:  # torch's functional SGD, without the optimizer object
            for _ in range(epochs):
                for idx in torch.randperm(len(y)).split(bs):
                    for p in chosen:
                        p.grad = None
                    nn.functional.cross_entropy(self.model(x[idx]), y[idx]).backward()
                    plain_sgd_step(chosen, lr)
            return
        opt = torch.optim.SGD(chosen, lr=lr)
        for _ in range(epochs):
            for idx in torch.randperm(len(y)).split(bs):
                opt.zero_grad()
                nn.functional.cross_entropy(self.model(x[idx]), y[idx]).backward()
                opt.step()

    def mean_into_global(self, sums: dict, total: float, names) -> None:
        for n in names:
            self.glob[n] = sums[n] / total

    # algorithms
    def fedavg(self, clients) -> None:
        sums, total = {n: torch.zeros_like(v) for n, v in self.glob.items()}, 0.0
        for c in clients:
            x, y = self.data[c]
            self.load(self.glob)
            self.sgd(x, y, self.cfg.local_epochs, self.names, self.cfg.lr)
            for n in self.names:
                sums[n] += len(y) * self.params[n].detach()
            total += len(y)
        self.mean_into_global(sums, total, self.names)

    def local(self, clients) -> None:
        for c in clients:
            x, y = self.data[c]
            self.load(self.state.get(c, self.glob))
            self.sgd(x, y, self.cfg.local_epochs, self.names, self.cfg.lr)
            self.state[c] = {n: p.detach().clone() for n, p in self.params.items()}

    def _partial(self, clients, joint: bool) -> None:
        shared = [n for n in self.names if n not in self.personal]
        personal = [n for n in self.names if n in self.personal]
        sums, total = {n: torch.zeros_like(self.glob[n]) for n in shared}, 0.0
        for c in clients:
            x, y = self.data[c]
            self.load(self.glob)
            self.load(self.state.get(c, {}))
            if joint:  # FedSim: u and v together
                self.sgd(x, y, self.cfg.local_epochs, self.names, self.cfg.lr)
            else:  # FedAlt: v, then u
                self.sgd(x, y, self.cfg.personal_epochs, personal, self.cfg.lr)
                self.sgd(x, y, self.cfg.local_epochs, shared, self.cfg.lr)
            self.state[c] = {n: self.params[n].detach().clone() for n in personal}
            for n in shared:
                sums[n] += len(y) * self.params[n].detach()
            total += len(y)
        self.mean_into_global(sums, total, shared)

    def fedalt(self, clients) -> None:
        self._partial(clients, joint=False)

    def fedsim(self, clients) -> None:
        self._partial(clients, joint=True)

    def apfl(self, clients) -> None:
        """w: a FedAvg step; v: a step on v_bar = alpha v + (1 - alpha) w (w detached);
        alpha: -lr <v - w, grad f(v_bar)>, projected on [0, 1]; every step the same batch."""
        sums, total = {n: torch.zeros_like(v) for n, v in self.glob.items()}, 0.0
        lr, bs = self.cfg.lr, self.cfg.batch_size
        for c in clients:
            x, y = self.data[c]
            w = {n: v.clone().requires_grad_(True) for n, v in self.glob.items()}
            v, alpha = self.state.get(c, ({n: t.clone() for n, t in self.glob.items()}, 0.5))
            v = {n: t.clone().requires_grad_(True) for n, t in v.items()}
            for _ in range(self.cfg.local_epochs):
                for idx in torch.randperm(len(y)).split(bs):
                    xb, yb = x[idx], y[idx]
                    gw = torch.autograd.grad(
                        nn.functional.cross_entropy(functional_call(self.model, w, (xb,)), yb),
                        list(w.values()),
                    )
                    mixed = {n: alpha * v[n] + (1 - alpha) * w[n].detach() for n in v}
                    gv = torch.autograd.grad(
                        nn.functional.cross_entropy(functional_call(self.model, mixed, (xb,)), yb),
                        list(v.values()),
                    )
                    with torch.no_grad():
                        # d f / d v = alpha * grad f(v_bar): gv already carries alpha
                        step = sum(
                            float(((v[n] - w[n]) * g).sum()) / max(alpha, 1e-12)
                            for n, g in zip(v, gv)
                        )
                        for p, g in zip(w.values(), gw):
                            p -= lr * g
                        for p, g in zip(v.values(), gv):
                            p -= lr * g
                        alpha = min(1.0, max(0.0, alpha - lr * step))
            self.state[c] = ({n: t.detach() for n, t in v.items()}, alpha)
            for n in w:
                sums[n] += len(y) * w[n].detach()
            total += len(y)
        self.mean_into_global(sums, total, self.names)

    def ffgg(self, clients) -> None:
        """Alg. 1 with the SGD fine-tuner: w from the received init, ``personal-epochs`` of
        SGD on w (theta frozen), then the exact gradient in theta over the local data; the
        server steps with the unweighted mean of the gradients."""
        shared = [n for n in self.names if n not in self.personal]
        personal = [n for n in self.names if n in self.personal]
        sums = {n: torch.zeros_like(self.glob[n]) for n in shared}
        for c in clients:
            x, y = self.data[c]
            self.load(self.glob)  # ffgg-init = "received": w starts from the server's init
            self.sgd(x, y, self.cfg.personal_epochs, personal, self.cfg.personal_lr or self.cfg.lr)
            for p in self.params.values():
                p.requires_grad_(False)
            chosen = [self.params[n] for n in shared]
            for p in chosen:
                p.requires_grad_(True)
            # the mean loss's gradient batch by batch, as pflower's full_gradient goes over
            # the client's loader: each batch's summed loss, divided by the count at the end
            for idx in torch.arange(len(y)).split(self.cfg.batch_size):
                loss = nn.functional.cross_entropy(self.model(x[idx]), y[idx], reduction="sum")
                for n, g in zip(shared, torch.autograd.grad(loss, chosen)):
                    sums[n] += g / len(y)
        lr = self.cfg.server_lr or 1.0
        for n in shared:
            self.glob[n] = self.glob[n] - lr * sums[n] / len(clients)

    def pflego(self, clients) -> None:
        """Features once; tau - 1 closed-form head steps; one exact gradient; Adam on theta."""
        body = self.model[:-1]
        head_w, head_b = self.model[-1].weight, self.model[-1].bias
        shared = [n for n in self.names if n not in self.personal]
        tau, beta = self.cfg.local_steps or 50, self.cfg.personal_lr or self.cfg.lr
        rho = self.cfg.server_lr or 0.003
        sums, total_n = {n: torch.zeros_like(self.glob[n]) for n in shared}, 0.0
        everyone = sum(len(d[1]) for d in self.data)
        for c in clients:
            x, y = self.data[c]
            self.load({n: self.glob[n] for n in shared})
            if c not in self.state:
                k, m = head_w.shape
                self.state[c] = torch.rand(k, m + 1)
            big_w = self.state[c]
            with torch.no_grad():
                phi = torch.cat([body(x), torch.ones(len(y), 1)], 1)
                onehot = nn.functional.one_hot(y, big_w.shape[0]).float()
                for _ in range(tau - 1):
                    p = torch.softmax(phi @ big_w.T, 1)
                    big_w -= beta * (p - onehot).T @ phi / len(y)
                head_w.copy_(big_w[:, :-1])
                head_b.copy_(big_w[:, -1])
            for p in self.params.values():
                p.requires_grad_(True)
                p.grad = None
            nn.functional.cross_entropy(self.model(x), y).backward()
            with torch.no_grad():
                g_w = torch.cat([head_w.grad, head_b.grad[:, None]], 1)
                big_w -= rho * self.nodes / len(clients) * g_w
            for n in shared:
                sums[n] += len(y) / everyone * self.params[n].grad
            total_n += len(y)
        scale = self.nodes / len(clients)
        grads = [scale * sums[n] for n in shared]
        if self.adam is None:
            self.adam_params = [self.glob[n].clone().requires_grad_(True) for n in shared]
            self.adam = torch.optim.Adam(self.adam_params, lr=rho)
        for p, g in zip(self.adam_params, grads):
            p.grad = g
        self.adam.step()
        for n, p in zip(shared, self.adam_params):
            self.glob[n] = p.detach().clone()


def bare_round_cpu(run: dict, nodes: int, rounds: int, functional_step=False) -> list[float]:
    torch.manual_seed(0)
    bare = Bare(run, nodes, functional_step)
    spent = []
    for _ in range(rounds):
        start = time.process_time()
        bare.round()
        spent.append(time.process_time() - start)
    return spent


# --- pflower ----------------------------------------------------------------------------------
#: what pflower spends per message beyond the SGD, by cost centre (``--breakdown``): each a
#: set of functions timed inclusively (none nested in another of the table)
COST_CENTRES = {
    "set-up": [("pflower.client_app", "make_job"), ("pflower.client_app", "scope_job")],
    "receive": [("pflower.strategies.client", "ClientJob.receive")],
    "reply record": [("pflower.strategies.client", "ClientJob.shared_record")],
    "state": [
        ("pflower.strategies.client", "ClientJob.load"),
        ("pflower.context_store", "ScopedStore.save"),
    ],
    "metrics": [
        ("pflower.client_app", "measured"),
        *[(f"pflower.strategies.{m}", "train_metrics") for m in ("fedavg", "fedalt", "apfl")],
    ],
    "reply checks": [  # the reply pipeline's admit and bound stages
        ("pflower.strategies.admit", "Admit.train"),
        ("pflower.strategies.bound", "Bound.__call__"),
    ],
    "aggregation": [
        ("pflower.strategies.server", "PersonalizedStrategy.combine"),
        ("pflower.strategies.server_opt", "ServerOptimizer.step"),
    ],
}


@contextlib.contextmanager
def timed_centres(spent: dict[str, float]):
    """Add each cost centre's CPU seconds to ``spent`` while inside (functions patched)."""
    restore = []
    for centre, places in COST_CENTRES.items():
        spent[centre] = 0.0
        for module, qualname in places:
            owner = importlib.import_module(module)
            *path, name = qualname.split(".")
            for part in path:
                owner = getattr(owner, part)
            fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

            def timed(*args, _fn=fn, _centre=centre, **kwargs):
                start = time.process_time()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    spent[_centre] += time.process_time() - start

            setattr(owner, name, timed)
            restore.append((owner, name, fn))
    try:
        yield
    finally:
        for owner, name, fn in reversed(restore):
            setattr(owner, name, fn)


def pflower_round_cpu(run: dict, nodes: int, out: str, breakdown: bool = False) -> dict:
    """CPU seconds per training round on LocalGrid (``configure_train`` to the next phase),
    and the share of them spent in the ClientApp outside ``ClientHalf.train``; with
    ``breakdown``, each of ``COST_CENTRES`` per round too."""
    from pflower.client_app import build_client_app
    from pflower.config import Config
    from pflower.strategies import get_algorithm
    from pflower.strategies.server import PersonalizedStrategy
    from pflower.task.data.loaders import client_arrays
    from pflower.testbed.local_grid import run_local

    run = {**run, "outputs-dir": out}
    cfg = Config.from_run_config(run)
    # every client's data loaded before timing, as the bare loop's is: a round measures the
    # steady state, not the first visits (the ClientApp's cache key is this same Config)
    for i in range(nodes):
        client_arrays(cfg, i, nodes, None)
    half = type(get_algorithm(cfg.algorithm).client)
    train_fn = half.train
    in_train, in_app = [0.0], [0.0]

    def timed_train(self, job, config):
        start = time.process_time()
        try:
            return train_fn(self, job, config)
        finally:
            in_train[0] += time.process_time() - start

    app = build_client_app(run)

    def client(msg, context):
        start = time.process_time()
        try:
            return app(msg, context)
        finally:
            in_app[0] += time.process_time() - start

    marks: list[tuple[str, float, float, float, dict]] = []
    spent: dict[str, float] = {}
    originals = {
        n: getattr(PersonalizedStrategy, n) for n in ("configure_train", "configure_evaluate")
    }

    def marking(name):
        def wrapped(self, *args, **kwargs):
            marks.append((name, time.process_time(), in_train[0], in_app[0], dict(spent)))
            return originals[name](self, *args, **kwargs)

        return wrapped

    half.train = timed_train
    for name in originals:
        setattr(PersonalizedStrategy, name, marking(name))
    try:
        with timed_centres(spent) if breakdown else contextlib.nullcontext():
            run_local(run, nodes, client_app=client)
    finally:
        half.train = train_fn
        for name, fn in originals.items():
            setattr(PersonalizedStrategy, name, fn)
    rows, centres = [], []
    for (phase, cpu, tr, ap, c), (_, cpu2, tr2, ap2, c2) in zip(marks, marks[1:]):
        if phase == "configure_train":
            rows.append((cpu2 - cpu, tr2 - tr, (ap2 - ap) - (tr2 - tr)))
            centres.append({k: c2[k] - c[k] for k in c})
    return {
        "round": [r[0] for r in rows],
        "train": [r[1] for r in rows],
        "client_outside_train": [r[2] for r in rows],
        "centres": centres,
    }


def pflower_round_cpu_simulation(run: dict, nodes: int, out: str) -> dict:
    """CPU seconds per training round through Flower's ``run_simulation`` (``nodes``
    SuperNodes, Ray workers of one CPU and one torch thread): the whole process tree's
    (this process, Ray's daemons and workers; ``client_cost.simulate``), and the part the
    workers spent in ``ClientHalf.train``."""
    from client_cost import simulate

    sim = simulate({**run, "outputs-dir": out}, nodes)
    return {
        "round": sim["round_cpu_s"],
        "train": [sum(t) for t in sim["round_train_cpu_s"]],
        "server": sim["kinds"]["server"],
        "workers_outside_train": sim["kinds"]["workers-outside-training"],
        "ray": sim["kinds"]["ray"],
    }


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] or values)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="mnist-5c")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    p.add_argument("--tmp", default="/tmp/pflower-floor")
    p.add_argument(
        "--engine",
        choices=["local-grid", "simulation"],
        default="local-grid",
        help="pflower on LocalGrid (one process) or through run_simulation (the process tree)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time pflower's cost centres per message (COST_CENTRES; the last repeat)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import logging

    logging.disable(logging.WARNING)
    if args.engine == "simulation":
        return simulation_rows(args)
    for algorithm in args.algorithms:
        run, nodes = settings(args.preset, algorithm, args.rounds)
        bare, lean, ours, train, outside = [], [], [], [], []
        for _ in range(args.repeats):  # alternately: the box's load hits both sides alike
            bare.append(median_after_first(bare_round_cpu(run, nodes, args.rounds)))
            lean.append(median_after_first(bare_round_cpu(run, nodes, args.rounds, True)))
            r = pflower_round_cpu(run, nodes, args.tmp, args.breakdown)
            ours.append(median_after_first(r["round"]))
            train.append(median_after_first(r["train"]))
            outside.append(median_after_first(r["client_outside_train"]))
        o = min(ours)
        row = comparison(args, algorithm, "local-grid", run, nodes, bare, ours)
        row.update(
            bare_functional_step_s=round(min(lean), 4),
            ratio_functional_step=round(o / min(lean), 3),
            runs_functional_step=[round(x, 4) for x in lean],
            pflower_train_s=round(min(train), 4),
            pflower_client_outside_train_s=round(min(outside), 4),
            pflower_server_s=round(o - min(train) - min(outside), 4),
        )
        if args.breakdown:  # microseconds per training message, median over rounds 2..
            per = row["clients-per-round"]
            row["per_message_us"] = {
                k: round(1e6 * median_after_first([c[k] for c in r["centres"]]) / per, 1)
                for k in COST_CENTRES
            }
        emit(row, args.out)
    return 0


def comparison(args, algorithm, engine, run, nodes, bare, ours) -> dict:
    """A result row's common part: the better of the repeats on each side, their ratio."""
    b, o = min(bare), min(ours)
    return {
        "preset": args.preset,
        "algorithm": algorithm,
        "engine": engine,
        "nodes": nodes,
        "clients-per-round": max(1, round(run.get("fraction-train", 0.5) * nodes)),
        "bare_s": round(b, 4),
        "pflower_s": round(o, 4),
        "ratio": round(o / b, 3),
        "runs": {"bare": [round(x, 4) for x in bare], "pflower": [round(x, 4) for x in ours]},
    }


def emit(row: dict, out: str | None) -> None:
    """Print ``row`` as a JSON line (and append it to ``out``)."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def simulation_rows(args) -> int:
    """``--engine simulation``: the bare loop beside pflower under ``run_simulation``."""
    for algorithm in args.algorithms:
        run, nodes = settings(args.preset, algorithm, args.rounds)
        bare, ours, parts = [], [], []
        for _ in range(args.repeats):
            bare.append(median_after_first(bare_round_cpu(run, nodes, args.rounds)))
            r = pflower_round_cpu_simulation(run, nodes, args.tmp)
            ours.append(median_after_first(r["round"]))
            parts.append({k: median_after_first(v) for k, v in r.items() if k != "round"})
        best = parts[ours.index(min(ours))]
        row = comparison(args, algorithm, "simulation", run, nodes, bare, ours)
        row.update({f"pflower_{k}_s": round(v, 4) for k, v in best.items()})
        emit(row, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
