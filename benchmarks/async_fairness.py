"""A fast client in asynchronous FFGG, honest or Byzantine: issue 45's "Asynchronous FFGG
belongs to the fastest client", before and after the fair share and the clip.

digits, MLP, 10 nodes on a ``LocalGrid`` with a worker thread per node (every client computes
at once, as devices do); every key at its default but ``algorithm = "async-ffgg"`` and
``dataset = "digits"``. Node 0 answers at once; every other node waits ``--delay`` seconds
before it replies (node config ``delay-s``). Per run: node 0's share of the applied updates,
the final personalized accuracy, and what stopped the run. The attacker (node 0) sends, every
time, its honest gradient turned around and scaled to 0.99 x the largest norm the update-norm
bound accepts (``min(S_t, S_1)``, S = max(||theta||, 0.1 sqrt(d)) / the server lr: a client
knows theta and the run config); ``drop`` sends 1e6 x its honest gradient (every reply
dropped). C = 5 is the default (``fraction-train`` 0.5); C = 10 keeps every node busy.

It imports only what both sides have (``LocalGrid``, the experiment ClientApp, ``run``,
``AsyncFFGG._apply``), so the same file measures the commit before the change::

    git archive <before> | tar -x -C /tmp/pf-before
    PYTHONPATH=/tmp/pf-before python benchmarks/async_fairness.py --out before.json
    python benchmarks/async_fairness.py --out after.json
    python benchmarks/async_fairness.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

import pflower
from pflower.client_app import build_client_app
from pflower.config import Config
from pflower.server_app import run as run_on
from pflower.strategies.async_ffgg import AsyncFFGG
from pflower.testbed.client_app import experiment_train
from pflower.testbed.local_grid import LocalGrid

NODES = 10
BASE = {
    "algorithm": "async-ffgg",
    "dataset": "digits",
    "model": "mlp",
    "outputs-dir": tempfile.mkdtemp(prefix="pflower-async-fairness-"),
}
#: node ids of the applied updates, in order (``AsyncFFGG._apply`` wrapped: it only watches)
APPLIED: list[int] = []
_real_apply = AsyncFFGG._apply


def _watching_apply(self, new_version, reply, staleness):
    applied = _real_apply(self, new_version, reply, staleness)
    if applied:
        APPLIED.append(self.sender(reply))
    return applied


AsyncFFGG._apply = _watching_apply


def norm64(tensors) -> float:
    return float(np.sqrt(sum(np.square(v.astype(np.float64)).sum() for v in tensors.values())))


def largest_accepted(sent: dict, gradient: dict, memory: dict, server_lr: float) -> dict:
    """The honest gradient turned around, at 0.99 x min(S_t, S_1)."""
    d = sum(v.size for v in sent.values())
    scale = max(norm64(sent), 0.1 * math.sqrt(d)) / server_lr
    scale = min(scale, memory.setdefault("first", scale))
    factor = -0.99 * scale / max(norm64(gradient), 1e-12)
    return {k: factor * v for k, v in gradient.items()}


def huge(sent: dict, gradient: dict, memory: dict, server_lr: float) -> dict:
    return {k: 1e6 * v for k, v in gradient.items()}


ATTACKS = {"clean": None, "largest-accepted": largest_accepted, "drop": huge}


def attacking_app(overrides: dict, attack, server_lr: float) -> ClientApp:
    """The experiment ClientApp (node configs' ``delay-s``) whose node 0 changes its
    training reply by ``attack``: a wrapper around ``experiment_train``, the step that
    ``build_client_app`` runs every training message through."""
    memory: dict = {}

    def train_step(msg: Message, context: Context, job, config, train) -> tuple:
        records, key, metrics = experiment_train(msg, context, job, config, train)
        if attack is None or int(context.node_config["partition-id"]):
            return records, key, metrics
        sent = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        gradient = {k: a.numpy() for k, a in records[key].items()}
        new = attack(sent, gradient, memory, server_lr)
        array = {k: Array(v.astype(gradient[k].dtype)) for k, v in new.items()}
        return {**records, key: ArrayRecord(array)}, key, metrics

    return build_client_app(overrides, wrap_train=train_step)


def execute(overrides: dict, attack: str, delay: float) -> dict:
    run = {**BASE, **overrides}
    cfg = Config.from_run_config(run)
    server_lr = cfg.server_lr or 0.2  # async-ffgg's ``auto``: 0.2
    nodes = {i: {"delay-s": 0.0 if i == 0 else delay} for i in range(NODES)}
    app = attacking_app(run, ATTACKS[attack], server_lr)
    grid = LocalGrid(app, NODES, seed=cfg.seed, workers=NODES, node_configs=nodes)
    pid = {node: int(c.node_config["partition-id"]) for node, c in grid.contexts.items()}
    APPLIED.clear()
    report, outcome, wall = None, "completed", time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            report = run_on(grid, cfg)
    except Exception as err:  # what stopped the run (RunFailed)
        outcome = f"{type(err).__name__}: {str(err)[:160]}"
    wall = time.perf_counter() - wall
    applied = [pid[n] for n in APPLIED]
    counts = {}
    if report is not None:
        counts = {
            k[len("async-") :]: v
            for e in report.rounds
            for k, v in e.server.items()
            if k.startswith("async-")
        }
    return {
        "config": overrides,
        "attack": attack,
        "outcome": outcome,
        "applied": len(applied),
        "fast-share": applied.count(0) / len(applied) if applied else None,
        "accuracy": report.final.get("personal-accuracy") if report is not None else None,
        "counts": counts,
        "wall-s": round(wall, 1),
    }


def scenarios(args) -> list[tuple[str, dict, str]]:
    out = []
    for c in args.concurrency:
        shape = {"async-concurrency": c}
        out += [
            (f"C = {c}, honest", shape, "clean"),
            (f"C = {c}, attacker", shape, "largest-accepted"),
            (
                f"C = {c}, attacker, max-failed-rounds 0",
                {**shape, "max-failed-rounds": 0},
                "largest-accepted",
            ),
            (f"C = {c}, every reply of node 0 dropped", shape, "drop"),
        ]
    return out


def fmt(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def table(results: dict) -> str:
    lines = [
        "| run | node 0's share of applied updates | applied | personalized accuracy | outcome |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in results["runs"].items():
        lines.append(
            f"| {name} | {fmt(r['fast-share'])} | {r['applied']} | {fmt(r['accuracy'])} | "
            f"{r['outcome'][:80]} |"
        )
    return "\n".join(lines)


def compare(before: dict, after: dict) -> str:
    lines = [
        "| run | share before | share after | accuracy before | accuracy after | outcome "
        "before | outcome after |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, b in before["runs"].items():
        a = after["runs"].get(name)
        if a is None:
            continue
        lines.append(
            f"| {name} | {fmt(b['fast-share'])} | {fmt(a['fast-share'])} | "
            f"{fmt(b['accuracy'])} | {fmt(a['accuracy'])} | {b['outcome'][:40]} | "
            f"{a['outcome'][:40]} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=0.3)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[5, 10])
    parser.add_argument("--only", default="", help="run names containing this text")
    parser.add_argument("--out", default="")
    parser.add_argument("--compare", nargs=2, default=None)
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        print(compare(before, after))
        return
    logging.getLogger("flwr").setLevel(logging.ERROR)
    results = {"pflower": pflower.__file__, "delay": args.delay, "runs": {}}
    for name, overrides, attack in scenarios(args):
        if args.only and args.only not in name:
            continue
        results["runs"][name] = r = execute(overrides, attack, args.delay)
        print(f"{name}: {json.dumps(r)}", flush=True)
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
