"""The adversaries of issues 27 and 45, before and after their fixes: the closing notes' tables.

Each attack the issue lists runs on a ``LocalGrid`` (offline data: digits or mnist-5k, the MLP,
a few nodes and rounds) next to the clean run of the same config. A ClientApp wrapper around
pflower's own replaces a training reply's *update* (``theta - w`` for returned weights, else
the vector), its values or its ``num-examples``, as an adaptive adversary would. For each run
it records the final accuracies (``RunReport.final``), the largest |value| of the final shared
parameters, the drops by reason, the skipped rounds, or the exception that stopped the run;
per training round (a wrapper around ``PersonalizedStrategy.bound_updates``, which only
watches): every reply's update norm by partition id, the replies kept, their claims, the
update-norm reference, and the step the shared parameters took.

It imports only what both sides have (``pflower.testbed.local_grid``, ``server_app.run``,
``client_app.build_client_app``, ``strategies.server.PersonalizedStrategy``), so the same file
measures 94eac80 (before the bounds) from a worktree and HEAD::

    git worktree add /tmp/pf-before 94eac80
    PYTHONPATH=/tmp/pf-before .venv/bin/python benchmarks/adversaries.py --out before.json
    .venv/bin/python benchmarks/adversaries.py --out after.json
    .venv/bin/python benchmarks/adversaries.py --compare before.json after.json

Attacks 8-12 are issue 45's on claims and evaluation metrics (before: 2e5a772;
``--only 8,9,10,11,12``). Attack 2's detail (a 1e6 x claim) shows the liar's weight share.

``--only 1,3`` runs some attacks; ``--max-rounds 2`` caps every run's rounds (a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

import pflower
from pflower.client_app import build_client_app
from pflower.config import Config
from pflower.server_app import run as run_on
from pflower.strategies.server import PersonalizedStrategy
from pflower.testbed.local_grid import LocalGrid

REPLY_KEYS = ("arrays", "delta", "gradient")
#: small, fast runs: digits (scikit-learn 8x8), IID, every node every round
DIGITS = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "batch-size": 64,
    "finetune-epochs": 1,
    "pretrain-rounds": 0,
    "fraction-train": 1.0,
    "seed": 0,
}
#: the default run's shape (pyproject: mnist-5k, 2 classes per client, FedAlt), made small
DEFAULT_LIKE = {
    "algorithm": "fedalt",
    "dataset": "mnist-5k",
    "model": "mlp",
    "split": "head",
    "partitioner": "pathological",
    "classes-per-client": 2,
    "batch-size": 32,
    "finetune-epochs": 1,
    "fraction-train": 1.0,
    "seed": 0,
}
ADAM = {"server-optimizer": "adam", "server-lr": 0.01}
MAX_ROUNDS = 0  # --max-rounds (0: as written)
OUTPUTS = tempfile.mkdtemp(prefix="pflower-adversaries-")


# --- the adversary: a ClientApp around pflower's --------------------------------------------
def attacking_app(
    overrides: dict,
    attack: Callable | None = None,
    fill: Callable | None = None,
    claim: Callable | None = None,
    evaluation: Callable | None = None,
) -> ClientApp:
    """pflower's ClientApp of ``overrides``; a training reply may be changed by
    ``attack(pid, round, update) -> update or None`` (the update: ``theta - w`` for returned
    weights, else the reply's vector), ``fill(pid, round) -> value or None`` (every entry of
    the reply's record set to ``value``) and ``claim(pid, n) -> n'`` (its ``num-examples``);
    an evaluation reply's metrics by ``evaluation(pid, metrics)`` (in place).
    ``tests/test_bounds.py``'s ``attacking_app`` with ``fill``: a copy, since this file may
    import neither ``tests/`` nor anything 94eac80 lacks."""
    honest = build_client_app(overrides)
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        reply = honest(msg, context)
        if reply.has_error():
            return reply
        key = next(k for k in REPLY_KEYS if k in reply.content)
        if claim is not None:
            metrics = reply.content["metrics"]
            metrics["num-examples"] = claim(pid, int(metrics["num-examples"]))
        value = fill(pid, rnd) if fill is not None else None
        if value is not None:
            reply.content[key] = ArrayRecord(
                {k: Array(np.full_like(a.numpy(), value)) for k, a in reply.content[key].items()}
            )
            return reply
        if attack is None:
            return reply
        weights = key == "arrays"
        sent = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        vector = {
            k: (sent[k] - a.numpy()) if weights else a.numpy()
            for k, a in reply.content[key].items()
        }
        new = attack(pid, rnd, vector)
        if new is not None:
            reply.content[key] = ArrayRecord(
                {
                    k: Array(((sent[k] - v) if weights else v).astype(vector[k].dtype))
                    for k, v in new.items()
                }
            )
        return reply

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if evaluation is not None and not reply.has_error():
            evaluation(int(context.node_config["partition-id"]), reply.content["metrics"])
        return reply

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return honest(msg, context)

    return app


def scaled(factor_of_round: Callable[[int], float], who=(0,)) -> Callable:
    """An attack: the nodes ``who`` multiply their honest update by ``factor_of_round(r)``."""

    def attack(pid, rnd, vector):
        if pid in who:
            return {k: factor_of_round(rnd) * v for k, v in vector.items()}
        return None

    return attack


# --- what the server did, round by round (watching only) -------------------------------------
def norm64(tensors) -> float:
    return float(np.sqrt(sum(np.square(np.asarray(v, np.float64)).sum() for v in tensors)))


class Recorder:
    """Wraps ``PersonalizedStrategy.bound_updates`` (both sides call it once per training
    round with the checked replies): the round's starting parameters, each reply's update
    norm, the replies kept and their claims, the reference after the round."""

    def __init__(self) -> None:
        self.rounds: list[dict] = []
        self.strategy = None
        real = PersonalizedStrategy.bound_updates
        recorder = self

        def bound_updates(strategy, server_round, current, updates):
            weights = strategy.pretraining(server_round) or strategy.reply_key == "arrays"
            norms = {
                u.node_id: norm64((current[k] - t) if weights else t for k, t in u.tensors.items())
                for u in updates
            }
            kept = real(strategy, server_round, current, updates)
            recorder.strategy = strategy
            recorder.rounds.append(
                {
                    "round": server_round,
                    "theta": {k: np.array(v, copy=True) for k, v in current.items()},
                    "norms": norms,
                    "kept": [u.node_id for u in kept],
                    "claims": {u.node_id: u.num_examples for u in kept},
                    "reference": dict(getattr(strategy, "update_norm_reference", {})),
                }
            )
            return kept

        PersonalizedStrategy.bound_updates = bound_updates

    def reset(self) -> None:
        self.rounds, self.strategy = [], None


RECORDER = Recorder()


def short_reason(reason: str) -> str:
    """A drop reason without its numbers (they differ per reply)."""
    return re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "#", reason).strip()


def as_numpy(v) -> np.ndarray:
    return v.numpy() if hasattr(v, "numpy") else np.asarray(v)


def execute(overrides: dict, nodes: int, client_overrides: dict | None = None, **adversary) -> dict:
    """One run on a LocalGrid of ``nodes`` nodes (the server on ``overrides``, the clients on
    ``overrides`` + ``client_overrides``), summarised."""
    run = {**overrides, "outputs-dir": OUTPUTS}
    if MAX_ROUNDS:
        run["num-server-rounds"] = min(run.get("num-server-rounds", 20), MAX_ROUNDS)
        run["evaluate-every"] = min(run.get("evaluate-every", 5), run["num-server-rounds"])
        run["pretrain-rounds"] = min(run.get("pretrain-rounds", 0), MAX_ROUNDS)
    cfg = Config.from_run_config(run)
    app = attacking_app({**run, **(client_overrides or {})}, **adversary)
    grid = LocalGrid(app, nodes, seed=cfg.seed)
    pid_of = {node: int(c.node_config["partition-id"]) for node, c in grid.contexts.items()}
    RECORDER.reset()
    wall, cpu = time.perf_counter(), time.process_time()
    report, error = None, None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the run's own summary table
            report = run_on(grid, cfg)
    except Exception as err:  # what the run did: RunFailed, a ValueError at start, ...
        error = f"{type(err).__name__}: {err}"
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    strategy = RECORDER.strategy
    history = report.rounds if report is not None else getattr(strategy, "history", [])
    dropped: dict[str, int] = {}
    for entry in history:
        for reason, n in entry.dropped.items():
            dropped[short_reason(reason)] = dropped.get(short_reason(reason), 0) + n
    if report is not None and report.shared is not None:
        final = {k: as_numpy(v) for k, v in report.shared.items()}
    else:  # stopped: no round after the last recorded one applied anything
        final = RECORDER.rounds[-1]["theta"] if RECORDER.rounds else {}
    rounds = []
    thetas = [r["theta"] for r in RECORDER.rounds] + [final]
    for r, before, after in zip(RECORDER.rounds, thetas, thetas[1:]):
        same = set(before) == set(after) and all(before[k].shape == after[k].shape for k in before)
        step = norm64(after[k] - before[k] for k in before) if same else None
        rounds.append(
            {
                "round": r["round"],
                "norms": {pid_of[n]: v for n, v in r["norms"].items()},
                "kept": sorted(pid_of[n] for n in r["kept"]),
                "claims": {pid_of[n]: c for n, c in r["claims"].items()},
                "reference": {
                    ("weights" if k else "vectors"): v for k, v in r["reference"].items()
                },
                "step": step,
            }
        )
    evaluations = {
        e.round: {k: e.evaluate.get(k) for k in ("personal-accuracy", "global-accuracy")}
        for e in history
        if e.evaluate
    }
    return {
        "config": overrides,
        "client-overrides": client_overrides or {},
        "nodes": nodes,
        "outcome": error or "completed",
        "final": {
            k: (report.final.get(k) if report is not None else None)
            for k in ("personal-accuracy", "global-accuracy", "personal-loss")
        },
        "evaluations": evaluations,
        "max-abs": max((float(np.abs(v).max()) for v in final.values()), default=None),
        "dropped": dropped,
        "skipped": sum(1 for e in history if e.train.get("skipped")),
        "applied": [e.train.get("applied") for e in history if e.train],
        "rounds": rounds,
        "wall-s": round(wall, 2),
        "cpu-s": round(cpu, 2),
    }


_CLEAN: dict[str, dict] = {}


def clean(overrides: dict, nodes: int) -> dict:
    """The run without any adversary (once per config)."""
    key = json.dumps([overrides, nodes], sort_keys=True)
    if key not in _CLEAN:
        _CLEAN[key] = execute(overrides, nodes)
    return _CLEAN[key]


# --- the attacks ----------------------------------------------------------------------------
def attack_1() -> list[dict]:
    """One 1e30 reply in a 2-node federation: node 0 sets every entry of its reply (weights,
    gradient or delta) to 1e30, every round."""
    rows = []
    for name, keys in (
        ("fedavg", {"algorithm": "fedavg"}),
        ("ffgg", {"algorithm": "ffgg"}),
        ("fedalt + adam", {"algorithm": "fedalt", **ADAM}),
    ):
        run = {**DIGITS, **keys, "num-server-rounds": 5, "evaluate-every": 5}
        bad = execute(run, 2, fill=lambda pid, rnd: 1e30 if pid == 0 else None)
        kept = [0 in r["kept"] for r in bad["rounds"]]
        rows.append(
            row(
                name,
                clean(run, 2),
                bad,
                f"node 0's 1e30 reply applied in {sum(kept)} of {len(kept)} rounds",
            )
        )
    return rows


def attack_2() -> list[dict]:
    """A 1e6 x num-examples claim from node 0's first reply, in 2-reply rounds (FedAvg)."""
    run = {**DIGITS, "algorithm": "fedavg", "num-server-rounds": 5, "evaluate-every": 5}
    bad = execute(run, 2, claim=lambda pid, n: n * 10**6 if pid == 0 else n)
    shares = [
        r["claims"][0] / sum(r["claims"].values()) if 0 in r["claims"] else 0.0
        for r in bad["rounds"]
    ]
    detail = "liar's weight in the mean per round: " + ", ".join(f"{s:.6f}" for s in shares)
    return [row("fedavg", clean(run, 2), bad, detail)]


def honest_median(r: dict, attackers=(0,)) -> float:
    return float(np.median([v for pid, v in r["norms"].items() if pid not in attackers]))


def attack_3() -> list[dict]:
    """A growing attacker, no robust rule: node 0 of 10 multiplies its honest update by
    3^(r-1) in round r (FedAvg, 10 rounds, every node every round)."""
    run = {
        **DEFAULT_LIKE,
        "algorithm": "fedavg",
        "num-server-rounds": 10,
        "evaluate-every": 10,
    }
    bad = execute(run, 10, attack=scaled(lambda r: 3.0 ** (r - 1)))
    per_round = []
    accepted = []
    for r in bad["rounds"]:
        if 0 not in r["norms"]:
            continue
        multiple = r["norms"][0] / honest_median(r)
        ok = 0 in r["kept"]
        if ok:
            accepted.append(multiple)
        per_round.append(f"r{r['round']} {multiple:.3g}x {'kept' if ok else 'dropped'}")
    medians = [honest_median(r) for r in bad["rounds"] if r["norms"]]
    detail = (
        f"largest accepted attacker update: {max(accepted, default=0):.4g} x the honest median; "
        f"per round: {'; '.join(per_round)}; honest median "
        f"{medians[0]:.3g} -> {max(medians):.3g} (max) -> {medians[-1]:.3g} (last)"
        if medians
        else "no round recorded"
    )
    return [row("fedavg", clean(run, 10), bad, detail)]


def reference_rise(result: dict) -> list[float]:
    refs = [r["reference"].get("weights") for r in result["rounds"]]
    refs = [x for x in refs if x]
    return [x / refs[0] for x in refs] if refs else []


def attack_4() -> list[dict]:
    """A constant 900 x attacker (node 0 of 10, FedAvg, 5 rounds, no robust rule): how far
    the update-norm reference (returned weights) rises over the run."""
    run = {**DEFAULT_LIKE, "algorithm": "fedavg", "num-server-rounds": 5, "evaluate-every": 5}
    base = clean(run, 10)
    bad = execute(run, 10, attack=scaled(lambda r: 900.0))
    rise, clean_rise = reference_rise(bad), reference_rise(base)
    kept = sum(0 in r["kept"] for r in bad["rounds"])
    detail = (
        "reference / round 1's: "
        + ", ".join(f"{x:.3g}" for x in rise)
        + f" (clean: {', '.join(f'{x:.3g}' for x in clean_rise)}); "
        f"attacker kept in {kept} of {len(bad['rounds'])} rounds"
    )
    return [row("fedavg", base, bad, detail)]


def attack_5() -> list[dict]:
    """Byzantine clients during pre-training: the default run's shape (FedAlt, mnist-5k, 2
    classes per client) with 5 pre-training rounds and 5 FedAlt rounds, 10 nodes; nodes 0 and
    1 send -4 x their honest update in every round; Krum with f = 2, without a rule, and Krum
    without the attackers (what the rule itself costs on these clients)."""
    run = {**DEFAULT_LIKE, "pretrain-rounds": 5, "num-server-rounds": 5, "evaluate-every": 5}
    krum = {**run, "robust-aggregator": "krum", "robust-byzantine": 2}
    flip = scaled(lambda r: -4.0, who=(0, 1))
    base = clean(run, 10)
    rows = []
    for name, cfg in (("fedalt + krum f=2", krum), ("fedalt, no rule", run)):
        bad = execute(cfg, 10, attack=flip)
        rows.append(row(name, base, bad, after_pretraining(bad, base, 5)))
    control = clean(krum, 10)  # Krum's own cost on these non-IID clients, no attacker
    rows.append(
        row("fedalt + krum f=2, no attacker", base, control, after_pretraining(control, base, 5))
    )
    return rows


def after_pretraining(bad: dict, base: dict, rounds: int) -> str:
    def acc(result):
        e = result["evaluations"].get(rounds, {})
        return fmt(e.get("global-accuracy"))

    return f"global accuracy after pre-training (round {rounds}): {acc(bad)} (clean {acc(base)})"


def attack_6() -> list[dict]:
    """Multi-Krum m = 5, f = 1 over 6 nodes (FFGG): node 0 sends NaN (dropped), which leaves
    N = 5 replies; node 1 sends 50 x its honest update."""
    run = {
        **DIGITS,
        "algorithm": "ffgg",
        "robust-aggregator": "multi-krum",
        "robust-krum-m": 5,
        "robust-byzantine": 1,
        "num-server-rounds": 3,
        "evaluate-every": 3,
    }

    def attack(pid, rnd, vector):
        if pid == 0:
            return {k: np.full_like(v, np.nan) for k, v in vector.items()}
        if pid == 1:
            return {k: 50.0 * v for k, v in vector.items()}
        return None

    base = clean(run, 6)
    bad = execute(run, 6, attack=attack)

    def steps(result):
        return ", ".join(fmt(r["step"]) for r in result["rounds"])

    detail = (
        f"step per round: {steps(bad)} (clean, 6 honest replies: {steps(base)}); "
        f"skipped rounds: {bad['skipped']}"
    )
    return [row("ffgg", base, bad, detail)]


def attack_7() -> list[dict]:
    """A mismatched-algorithm federation (server FedAlt, every client FedSim), and a run in
    which every reply is dropped (FedAvg, lr = 1e30)."""
    fedalt = {**DIGITS, "algorithm": "fedalt", "num-server-rounds": 5, "evaluate-every": 5}
    mismatch = execute(fedalt, 3, client_overrides={"algorithm": "fedsim"})
    fedavg = {**DIGITS, "algorithm": "fedavg", "num-server-rounds": 4, "evaluate-every": 4}
    hopeless = execute({**fedavg, "lr": 1e30}, 3)
    return [
        row("fedalt server, fedsim clients", clean(fedalt, 3), mismatch, applied(mismatch)),
        row("fedavg, lr = 1e30", clean(fedavg, 3), hopeless, applied(hopeless)),
    ]


def applied(result: dict) -> str:
    return f"replies applied per round: {result['applied']}"


# --- issue 45: claims and evaluation metrics ------------------------------------------------
def weight_shares(result: dict, pid: int) -> list[float]:
    """Node ``pid``'s share of the round's weights (the kept replies' ``num-examples``: the
    claims before issue 45, the bounded weights after), 0 where it was not kept."""
    return [
        r["claims"].get(pid, 0.0) / sum(r["claims"].values()) if r["claims"] else 0.0
        for r in result["rounds"]
    ]


def attack_8() -> list[dict]:
    """A low claim in a 2-node federation: node 0 claims 1 example from its first reply on
    and sends its honest update sign-flipped (FedAvg, digits, 10 rounds)."""
    run = {**DIGITS, "algorithm": "fedavg", "num-server-rounds": 10, "evaluate-every": 10}
    bad = execute(
        run,
        2,
        attack=scaled(lambda r: -1.0),
        claim=lambda pid, n: 1 if pid == 0 else n,
    )
    kept = sum(1 in r["kept"] for r in bad["rounds"])
    shares = ", ".join(f"{s:.3f}" for s in weight_shares(bad, 1))
    detail = (
        f"honest node kept in {kept} of {len(bad['rounds'])} rounds; its weight share: {shares}"
    )
    return [row("fedavg", clean(run, 2), bad, detail)]


def attack_9() -> list[dict]:
    """Seeding R with low claims: nodes 0 and 1 of 4 claim 1 example and send 10 x their
    honest update (inside the first round's bound S) from round 1 (FedAvg, digits, 5
    rounds): is R seeded by their norms?"""
    run = {**DIGITS, "algorithm": "fedavg", "num-server-rounds": 5, "evaluate-every": 5}
    bad = execute(
        run,
        4,
        attack=scaled(lambda r: 10.0, who=(0, 1)),
        claim=lambda pid, n: 1 if pid < 2 else n,
    )
    first = bad["rounds"][0] if bad["rounds"] else None
    if first is None or not first["reference"].get("weights"):
        return [row("fedavg", clean(run, 4), bad, "no reference seeded in round 1")]
    honest = max(v for pid, v in first["norms"].items() if int(pid) >= 2)
    ratio = first["reference"]["weights"] / honest
    kept = sum(int(pid) >= 2 for pid in first["kept"])
    detail = (
        f"round 1: honest replies kept {kept} of 2; R / the largest honest update norm = "
        f"{ratio:.4g}"
    )
    return [row("fedavg", clean(run, 4), bad, detail)]


def evaluation_liar(**changes) -> Callable:
    """Node 0's evaluation metrics: each key of ``changes`` set (a callable: of the value)."""

    def lie(pid, metrics):
        if pid == 0:
            for k, v in changes.items():
                metrics[k] = v(metrics[k]) if callable(v) else v

    return lie


def pooled_figures(result: dict) -> str:
    f = result["final"]
    return f"pooled accuracy {fmt(f['personal-accuracy'])}, pooled loss {fmt(f['personal-loss'])}"


def attack_10() -> list[dict]:
    """A low evaluation claim in a 2-node federation: node 0 reports 1 test example and
    accuracy 1.0 (FedAvg, digits, 5 rounds)."""
    run = {**DIGITS, "algorithm": "fedavg", "num-server-rounds": 5, "evaluate-every": 5}
    lie = evaluation_liar(**{"num-examples": 1, "personal-accuracy": 1.0})
    bad = execute(run, 2, evaluation=lie)
    base = clean(run, 2)
    return [row("fedavg", base, bad, f"{pooled_figures(bad)} (clean: {pooled_figures(base)})")]


def attack_11() -> list[dict]:
    """Evaluation losses of one node of ten, its test-set size truthful: -60 (below any
    loss) and 1e6 (FedAvg, digits, 3 rounds)."""
    run = {**DIGITS, "algorithm": "fedavg", "num-server-rounds": 3, "evaluate-every": 3}
    base = clean(run, 10)
    rows = []
    for value in (-60.0, 1e6):
        bad = execute(run, 10, evaluation=evaluation_liar(**{"personal-loss": value}))
        detail = f"loss {value:g}: {pooled_figures(bad)} (clean: {pooled_figures(base)})"
        rows.append(row("fedavg", base, bad, detail))
    return rows


def attack_12() -> list[dict]:
    """One node of ten reports accuracy 1.0 and claims 95 x its test set (the default run's
    shape: FedAlt, mnist-5k, 2 classes per client, 3 rounds)."""
    run = {**DEFAULT_LIKE, "num-server-rounds": 3, "evaluate-every": 3}
    lie = evaluation_liar(**{"num-examples": lambda n: 95 * n, "personal-accuracy": 1.0})
    bad = execute(run, 10, evaluation=lie)
    base = clean(run, 10)
    return [row("fedalt", base, bad, f"{pooled_figures(bad)} (clean: {pooled_figures(base)})")]


ATTACKS = {
    1: ("one 1e30 reply, 2 nodes", attack_1),
    2: ("1e6 x num-examples from the first reply, 2 nodes", attack_2),
    3: ("growing attacker x3 per round, no rule, 10 nodes", attack_3),
    4: ("constant 900 x attacker, 10 nodes, 5 rounds", attack_4),
    5: ("2 sign-flip (x4) of 10 during 5 pre-training rounds", attack_5),
    6: ("multi-krum m=5 f=1, a drop leaves N=5, a 50 x outlier", attack_6),
    7: ("mismatched algorithm / every reply dropped", attack_7),
    8: ("claim of 1 and a sign flip, 2 nodes (issue 45)", attack_8),
    9: ("2 of 4 claim 1 and send 10 x: R seeded? (issue 45)", attack_9),
    10: ("evaluation: claim of 1, accuracy 1.0, 2 nodes (issue 45)", attack_10),
    11: ("evaluation: loss -60 / 1e6 of 1 node in 10 (issue 45)", attack_11),
    12: ("evaluation: 95 x claim, accuracy 1.0, 1 in 10 (issue 45)", attack_12),
}


# --- the table ------------------------------------------------------------------------------
def fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and (x == 0 or 1e-3 <= abs(x) < 1e4):
        return f"{x:.3g}" if abs(x) < 1 else f"{x:.4g}"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def row(algorithm: str, base: dict, bad: dict, detail: str) -> dict:
    return {"algorithm": algorithm, "clean": base, "attacked": bad, "detail": detail}


def accuracy(result: dict) -> str:
    f = result["final"]
    return f"{fmt(f['personal-accuracy'])} / {fmt(f['global-accuracy'])}"


def counted(result: dict) -> str:
    parts = [f"{n} x {r}" for r, n in sorted(result["dropped"].items())]
    if result["skipped"]:
        parts.append(f"{result['skipped']} skipped")
    if result["outcome"] != "completed":
        parts.append(f"**{result['outcome']}**")
    return "; ".join(parts) or "nothing"


def table(results: dict) -> str:
    lines = [
        "| # | attack | algorithm | accuracy p / g (clean) | max abs theta (clean) | counted "
        "| detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, attack in results["attacks"].items():
        for r in attack["rows"]:
            c, a = r["clean"], r["attacked"]
            lines.append(
                f"| {number} | {attack['title']} | {r['algorithm']} | {accuracy(a)} "
                f"({accuracy(c)}) | {fmt(a['max-abs'])} ({fmt(c['max-abs'])}) | "
                f"{counted(a)} | {r['detail']} |"
            )
    return "\n".join(lines)


def compare(before: dict, after: dict) -> str:
    """Before -> after, one line per attacked run."""
    lines = [
        "| # | attack | algorithm | clean p / g | accuracy p / g: before → after "
        "| max abs theta: before → after (clean) | counted before | counted after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    details = ["", "| # | algorithm | before | after |", "|---|---|---|---|"]
    for number, attack in after["attacks"].items():
        old_rows = before["attacks"].get(number, {}).get("rows", [])
        for i, r in enumerate(attack["rows"]):
            b = old_rows[i] if i < len(old_rows) else None
            a, c = r["attacked"], r["clean"]
            ba = b["attacked"] if b else None
            if b and (b["clean"]["final"], b["clean"]["max-abs"]) != (c["final"], c["max-abs"]):
                details.append(
                    f"| {number} | {r['algorithm']} | clean run differs: "
                    f"{accuracy(b['clean'])} | {accuracy(c)} |"
                )
            lines.append(
                f"| {number} | {attack['title']} | {r['algorithm']} | {accuracy(c)} | "
                f"{accuracy(ba) if ba else '—'} → {accuracy(a)} | "
                f"{fmt(ba['max-abs']) if ba else '—'} → {fmt(a['max-abs'])} "
                f"({fmt(c['max-abs'])}) | {counted(ba) if ba else '—'} | {counted(a)} |"
            )
            details.append(
                f"| {number} | {r['algorithm']} | {b['detail'] if b else '—'} | {r['detail']} |"
            )
    return "\n".join(lines + details + per_round(before, after))


def per_round(before: dict, after: dict) -> list[str]:
    """Attacks 3 and 4 round by round: node 0's update norm as a multiple of the honest
    median, kept or dropped, the reference (returned weights) and the step of the model."""
    lines = []
    for number in ("3", "4"):
        sides = [d["attacks"].get(number, {}).get("rows", [None])[0] for d in (before, after)]
        if None in sides:
            continue
        lines += [
            "",
            f"Attack {number}, round by round (x: node 0's update / the honest median; "
            "R: the update-norm reference; step: ||theta_r+1 - theta_r||):",
            "",
            "| round | before: x | kept | R | step | after: x | kept | R | step |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        b, a = (side["attacked"]["rounds"] for side in sides)
        for rb, ra in zip(b, a):
            cells = []
            for r in (rb, ra):
                honest = [v for pid, v in r["norms"].items() if str(pid) != "0"]
                x = r["norms"].get("0", r["norms"].get(0, 0.0)) / float(np.median(honest))
                kept = "kept" if 0 in r["kept"] else "dropped"
                cells += [f"{x:.3g}", kept, fmt(r["reference"].get("weights")), fmt(r["step"])]
            lines.append(f"| {rb['round']} | " + " | ".join(cells) + " |")
    return lines


def commit_of_package() -> str:
    """The commit of the checkout ``pflower`` is imported from, and whether its package
    differs from that commit (a working tree with uncommitted changes)."""
    root = Path(pflower.__file__).resolve().parent.parent

    def git(*args: str) -> str:
        cmd = ["git", "-C", str(root), *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    try:
        changed = git("status", "--porcelain", "--", "pflower")
        return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    global MAX_ROUNDS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--only", default="", help="attack numbers, e.g. 1,3 (default: all)")
    parser.add_argument("--max-rounds", type=int, default=0, help="cap every run's rounds")
    parser.add_argument(
        "--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="merge two --out files"
    )
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        print(compare(before, after))
        return
    MAX_ROUNDS = args.max_rounds
    logging.getLogger("flwr").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    print(f"pflower from {pflower.__file__} (commit {commit_of_package()})", flush=True)
    chosen = [int(x) for x in args.only.split(",") if x] or list(ATTACKS)
    wall, cpu = time.perf_counter(), time.process_time()
    results = {
        "pflower": pflower.__file__,
        "commit": commit_of_package(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "max-rounds": MAX_ROUNDS,
        "attacks": {},
    }
    for number in chosen:
        title, fn = ATTACKS[number]
        start = time.perf_counter()
        results["attacks"][str(number)] = {"title": title, "rows": fn()}
        print(f"attack {number} ({title}): {time.perf_counter() - start:.1f} s", flush=True)
    results["wall-s"] = round(time.perf_counter() - wall, 1)
    results["cpu-s"] = round(time.process_time() - cpu, 1)
    print(table(results))
    print(f"\nwall {results['wall-s']} s, CPU {results['cpu-s']} s")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=_jsonable))


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    raise TypeError(f"not JSON: {type(x)}")


if __name__ == "__main__":
    main()
