"""One Byzantine client in ten against every aggregating algorithm at its defaults (issue 45).

Each algorithm runs twice on a ``LocalGrid`` (10 nodes, the default run's settings on a small
offline data set: every key at its default unless ``--set`` names it): clean, and with one
adaptive Byzantine node (partition 0 unless ``--byzantine`` says otherwise). The Byzantine
node trains honestly, then replaces its update (``theta - w`` for returned weights, else the
vector it sends) by ``-B u / ||u||``: against its own honest direction, at ``B`` = 0.99 x the
largest update norm the server is known to accept this round (the update-norm bound's state,
read from the strategy: the adversary knows the defaults and the reference, which it can
track from the models it is sent), or 1e6 x its honest norm where nothing drops. With
``--claim K`` it also claims K x its number of examples from its first reply on. It attacks in
every phase (pre-training too) and every round it is sampled in.

``--attack alie`` replaces that adversary by "A little is enough" (Baruch et al. 2019; the
suite's ``pflower.testbed.attacks``): the Byzantine node trains honestly and tags its
reply, and the server, told to simulate the omniscient adversary (``attack-simulation``),
replaces it by mu - z sigma of the round's honest updates, a vector inside the honest spread
that median- and distance-based rules pick. It needs no bound to aim at: it is the attack
against median-based rules (BR-FFGG's bucketed median, FFGG's geometric median) rather
than against clipping.

``--attack ipm`` (``--epsilon``), ``min-max`` and ``min-sum`` (``--direction``: Shejwalkar &
Houmansadr's aggregation-agnostic attacks, gamma by their search) are the other omniscient
attacks the testbed simulates on the server (``pflower.testbed.attacks``). ``--attack
label-flip`` trains on the labels C - 1 - y; ``--attack backdoor`` trains with a 4 x 4 trigger
relabelled 0 on half of its examples and boosts that update along itself to the adaptive
attacker's size (``pflower.testbed.backdoor``); every node then probes the backdoor, in the
clean run too, and the table reports its success on the honest clients' personalized models
(all of them, and those whose data hold class 0), clean -> attacked. Every run also counts the
*hostile-only rounds*: training rounds that applied replies, all of them from attackers,
while honest nodes had been asked (their replies dropped, failed or late): the lockout that
``settle.Rollback`` is there to stop. ``--byzantine 0 1 2`` makes three of the ten attack.

Two controls tell the attack from the metric's own resolution on one seed. ``--attack null``
is no attack: the node sends its honest update scaled by 1 + 1e-3 (does a tiny perturbation
make the two runs' trajectories part?). ``--attack random`` sends a random direction (drawn
per round) at the adaptive attacker's size: what any perturbation that large does to one
seed's figure, whose mean over seeds is the price of the size alone, without the worst
direction. ``--attack absent`` sends NaN, which the server drops and counts: the node's honest
data is missing from the federation, which is the most any defence can achieve against it
(it cannot tell what the node would have sent honestly), so the figure every defence's
loss is to be read against.

The table: personalized (pooled) accuracy clean and attacked, the difference, the replies the
server dropped (by reason) and the replies it clipped, and whether the run ended in an error.

    python benchmarks/default_defence.py --out benchmarks/results/default-defence.json
    python benchmarks/default_defence.py --algorithms fedavg ffgg --set robust-aggregator=none

``--seeds 0 1 2`` repeats every run per seed (mean of the differences reported); each seed is
also the run's ``sample-seed``, so that the clean and the attacked run sample alike.

Every round is evaluated (``evaluate-every = 1``: evaluation trains nothing) and the table's
accuracies are the mean of the last ``--last`` (5) rounds' evaluations: a global model on
2-class clients swings by 5-15 points from one round to the next (the last sampled clients'
classes dominate it), so one final round measures that swing more than the attack. The last
round's figures are kept beside it (``final``), and the honest clients' (only known per
client at the final evaluation) are the last round's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from pflower.client_app import build_client_app
from pflower.config import Config
from pflower.server_app import run as run_on
from pflower.strategies.bound import provisional_scale
from pflower.strategies.pipeline import ReplyPipeline
from pflower.strategies.server import PersonalizedStrategy
from pflower.testbed.attacks import OMNISCIENT, omniscient_tag
from pflower.testbed.client_app import experiment_client_app
from pflower.testbed.local_grid import LocalGrid
from pflower.testbed.server_app import attach
from pflower.wire import ARRAYS, array_view

#: every aggregating algorithm the issue names (async-ffgg and local have no mean to attack)
ALGORITHMS = (
    "fedavg",
    "fedavg-ft",
    "fedalt",
    "fedsim",
    "ffgg",
    "local-ffgg",
    "pflego",
    "apfl",
    "scaffold",
    "l2gd",
)
#: what an algorithm needs besides the defaults (L2GD: every client takes every step)
NEEDS = {"l2gd": {"fraction-train": 1.0}}
REPLY_KEYS = ("arrays", "delta", "gradient")


def app_config() -> dict:
    """The app's default run config (pyproject.toml's ``[tool.flwr.app.config]``: what
    ``flwr run .`` runs, pre-training included)."""
    import tomllib

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    return dict(tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"])


#: every key at the app's default (the main job's pipeline: 10 FedAvg pre-training rounds
#: + 10 rounds of the algorithm on mnist-5k, 10 nodes, 2 classes each, 5 per round)
BASE: dict = app_config()
NUM_NODES = 10

#: the strategy of the run in progress (the adversary reads the bound's state from it)
_RUN: dict = {}


def _watch() -> None:
    """Keep the running strategy where the adversary can read it (configure_train runs before
    the round's messages are answered)."""
    original = PersonalizedStrategy.configure_train
    if getattr(original, "_watched", False):
        return

    def configure_train(self, server_round, arrays, config, grid):
        _RUN["strategy"] = self
        _RUN["round"] = server_round
        return original(self, server_round, arrays, config, grid)

    configure_train._watched = True
    PersonalizedStrategy.configure_train = configure_train
    updates = ReplyPipeline.updates

    def kept(self, rnd, replies):
        out = updates(self, rnd, replies)
        strategy = _RUN.get("strategy")
        if strategy is not None:  # a training round's replies (evaluation has its own way)
            partition = strategy.nodes.partition_of.get
            _RUN.setdefault("kept", {})[rnd.number] = (
                {partition(n) for n in rnd.asked},
                {partition(u.node_id) for u in out},
            )
        return out

    ReplyPipeline.updates = kept


def accepted_norm(strategy: PersonalizedStrategy, weights: bool) -> float:
    """The largest update norm this round's bound can accept, as far as it is known before
    the round's replies (the reference only grows): ``K x R``, or before seeding
    ``min(S_t, S_1)``; inf without a bound."""
    bound = strategy.pipeline.bound.norm
    if not bound.factor:
        return math.inf
    rnd = _RUN["round"]
    current = {k: array_view(a) for k, a in strategy._current.items()}
    scale = provisional_scale(current, strategy.step_factor(rnd))
    scale = min(scale, bound.first_scale.get(weights, scale))
    reference = bound.reference.get(weights)
    return scale if reference is None else bound.factor * reference


#: attacks that train on the node's own corrupted data (the testbed's experiment ClientApp)
DATA_ATTACKS = ("label-flip", "backdoor")
#: the backdoor: a 4 x 4 trigger relabelled 0 on half the attacker's examples; every node
#: probes it (clean runs too), so that attack success is measured clean and attacked
BACKDOOR = {"backdoor-target": 0, "backdoor-trigger": 4}


def byzantine_app(
    overrides: dict, who: set[int], claim: float, attack: str, omniscient: dict | None = None
) -> ClientApp:
    """The federation's ClientApp: honest nodes run pflower's; the nodes ``who`` attack. The
    data attacks train through the experiment ClientApp (node configs ``node_configs``); the
    backdoor's update is then boosted to the adaptive attacker's size, along itself."""
    honest = (
        experiment_client_app(overrides) if attack in DATA_ATTACKS else build_client_app(overrides)
    )
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if int(context.node_config["partition-id"]) not in who or reply.has_error():
            return reply
        if attack in OMNISCIENT:  # the server replaces the tagged reply (the module docstring)
            tag = omniscient_tag(attack, omniscient or {}, attack_simulation=True)
            reply.content["metrics"].update(tag)
            return _claimed(reply, claim)
        if attack == "label-flip":  # its update as trained on the flipped labels
            return _claimed(reply, claim)
        key = next(k for k in REPLY_KEYS if k in reply.content)
        weights = key == ARRAYS
        sent = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        own = {
            k: (sent[k] - a.numpy()) if weights else a.numpy()
            for k, a in reply.content[key].items()
        }
        size = math.sqrt(sum(float(np.square(v.astype(np.float64)).sum()) for v in own.values()))
        strategy = _RUN.get("strategy")
        target = accepted_norm(strategy, weights) if strategy is not None else math.inf
        target = 0.99 * target if math.isfinite(target) else 1e6 * size
        if attack == "absent":  # non-finite: dropped for cause, as a recognised attacker
            own = {k: np.full_like(v, np.nan) for k, v in own.items()}
        if attack == "random":  # the attack's size, a direction drawn per round
            rng = np.random.default_rng(
                [_RUN.get("round", 0), int(context.node_config["partition-id"])]
            )
            own = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in own.items()}
            size = math.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in own.values()))
        if attack in ("null", "absent"):
            factor = 1.0 + 1e-3
        elif attack == "backdoor":  # boosted along itself, just inside the bound
            factor = max(1.0, target / max(size, 1e-12))
        else:
            factor = -target / max(size, 1e-12)
        bad = {k: factor * v.astype(np.float64) for k, v in own.items()}
        reply.content[key] = ArrayRecord(
            {
                k: Array(np.asarray((sent[k] - v) if weights else v, dtype=own[k].dtype))
                for k, v in bad.items()
            }
        )
        return _claimed(reply, claim)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return honest(msg, context)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return honest(msg, context)

    return app


def _claimed(reply: Message, claim: float) -> Message:
    """The reply claiming ``claim`` x its number of examples."""
    if claim != 1.0:
        metrics = reply.content["metrics"]
        metrics["num-examples"] = float(round(claim * float(metrics["num-examples"])))
    return reply


def one_run(
    overrides: dict,
    who: set[int],
    claim: float,
    last: int = 5,
    attack: str = "adaptive",
    byzantine: set[int] | None = None,
    omniscient: dict | None = None,
) -> dict:
    """One run with the nodes ``who`` attacking (none: the clean run); "honest" figures leave
    out the test sets of ``byzantine`` (default ``who``): the clean run's must leave out the
    same clients as the attacked run's, or the two compare different sets of clients. With
    ``attack`` = backdoor every node probes the backdoor, in the clean run too."""
    cfg = Config.from_run_config(overrides)
    node_configs = {i: dict(BACKDOOR) for i in range(NUM_NODES)} if attack == "backdoor" else {}
    for i in who if attack in DATA_ATTACKS else ():
        node_configs.setdefault(i, {})["byzantine"] = attack
    if who:
        app = byzantine_app(overrides, who, claim, attack, omniscient)
    elif node_configs:  # the clean run's probe
        app = experiment_client_app(overrides)
    else:
        app = build_client_app(overrides)
    byzantine = who if byzantine is None else byzantine
    _RUN.clear()
    started = time.process_time()
    try:
        # the run's outputs are not read (the report is): removed with the directory (a
        # 10-seed table left 1 GB of them in /tmp)
        with (
            contextlib.redirect_stdout(io.StringIO()),
            tempfile.TemporaryDirectory(prefix="pflower-defence-") as scratch,
        ):
            grid = LocalGrid(app, NUM_NODES, seed=cfg.seed, node_configs=node_configs)
            rep = run_on(grid, cfg, out=Path(scratch), prepare=attach)
    except Exception as err:  # the run stopped: that is the result
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    dropped: dict[str, int] = {}
    clipped = shared = distrusted = far = 0
    for entry in rep.rounds:
        for reason, n in entry.dropped.items():
            key = reason.split(" ")[0] + " " + reason.split(" ")[1] if " " in reason else reason
            dropped[key] = dropped.get(key, 0) + n
        clipped += int(entry.train.get("clipped", 0))
        shared += int(entry.train.get("shared-votes", 0))
        distrusted += int(entry.train.get("distrusted", 0))
        far += int(entry.train.get("far-off", 0))
    final = rep.final
    # training rounds in which replies were applied, every one of them hostile, while honest
    # nodes had been asked (a taken round applies nothing)
    taken = {e.round for e in rep.rounds if e.train.get("model-taken")}
    hostile_only = [
        r
        for r, (asked, kept) in sorted(_RUN.get("kept", {}).items())
        if kept and kept <= who and asked - who and r not in taken
    ]
    tail = [r.evaluate["personal-accuracy"] for r in rep.rounds if r.evaluate][-last:]
    keys = ("partition-id", "num-examples", "personal-accuracy", *PROBE_METRICS)
    out = {
        # the mean over the last `last` evaluated rounds (the module's docstring says why)
        "personal-accuracy": float(np.mean(tail)) if tail else None,
        "final-personal-accuracy": final.get("personal-accuracy"),
        "global-accuracy": final.get("global-accuracy"),
        "dropped": dropped,
        "clipped": clipped,
        # replies counted under a shared vote (copies of one vector), all rounds
        "shared-votes": shared,
        # replies whose node the defence distrusted (its standing), and replies weighed 0
        # for their reach (far off the centre), all rounds
        "distrusted": distrusted,
        "far-off": far,
        "hostile-only-rounds": hostile_only,
        "taken-rounds": sorted(taken),
        "cpu-s": round(time.process_time() - started, 1),
        # the final evaluation, per client: the honest figures of any set of attackers
        "clients": [{k: r[k] for k in keys if k in r} for r in rep.clients],
    }
    return {**out, **honest_figures(out, byzantine)}


#: what the backdoor probe adds to a client's evaluation (``pflower.testbed.backdoor``)
PROBE_METRICS = ("backdoor-success", "global-backdoor-success", "backdoor-holds-target")


def honest_figures(run: dict, byzantine: set[int]) -> dict:
    """The honest clients' figures of a run (its final per-client rows, the test sets of
    ``byzantine`` left out): their pooled personalized accuracy, what the defence must
    protect, and the backdoor's mean success on them (all, and the target-class holders)."""
    if "error" in run:
        return {}
    honest = [r for r in run["clients"] if int(r.get("partition-id", -1)) not in byzantine]
    examples = sum(r["num-examples"] for r in honest)
    out = {
        "honest-accuracy": (
            sum(r["personal-accuracy"] * r["num-examples"] for r in honest) / examples
            if examples and all("personal-accuracy" in r for r in honest)
            else None
        )
    }
    for key in ("backdoor-success", "global-backdoor-success"):
        for name, rows in (
            ("", honest),
            ("-target-holders", [r for r in honest if r.get("backdoor-holds-target")]),
        ):
            values = [r[key] for r in rows if key in r]
            if values:
                out[key + name] = float(np.mean(values))
    return out


def parse_attack(spec: str) -> tuple[str, dict]:
    """``name`` or ``name:value``: IPM's epsilon (``ipm:100``), Min-Max / Min-Sum's
    direction (``min-max:unit``); the omniscient node config it implies."""
    name, _, value = spec.partition(":")
    if name == "ipm":
        return name, {"byzantine-epsilon": float(value or 0.1)}
    if name in ("min-max", "min-sum"):
        return name, {"byzantine-direction": value or "std"}
    if value:
        raise ValueError(f"attack {spec!r}: only ipm and min-max / min-sum take a value")
    return name, {}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument(
        "--byzantine",
        nargs="+",
        type=int,
        default=[0],
        help="the attacking partitions (one set)",
    )
    parser.add_argument(
        "--counts",
        nargs="+",
        type=int,
        help="instead of --byzantine: one run per count k, partitions 0 .. k - 1 attacking",
    )
    parser.add_argument("--claim", type=float, default=1.0)
    parser.add_argument(
        "--attack",
        nargs="+",
        default=["adaptive"],
        help="one or more of: adaptive (the honest update turned around at the largest "
        "accepted norm); alie, ipm[:epsilon] (default 0.1), min-max[:direction], "
        "min-sum[:direction] (std, unit or sign; default std): the omniscient attacks, "
        "simulated by the server; label-flip (trains on labels C - 1 - y); backdoor (a 4x4 "
        "trigger relabelled 0 on half its data, boosted to the adaptive size); null (the "
        "honest update x (1 + 1e-3)); random (a random direction at the adaptive attacker's "
        "size); absent (a reply the server drops: what a defence that recognised the "
        "attacker would leave). One clean run per algorithm and seed serves them all",
    )
    parser.add_argument("--set", nargs="*", default=[], help="KEY=VALUE run-config overrides")
    parser.add_argument(
        "--last", type=int, default=5, help="accuracy: the mean of this many last evaluations"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        help="run nothing: the table of the rows of these result files together (seeds "
        "measured apart; a later file's row replaces an earlier file's of the same algorithm, "
        "seed, attack and count)",
    )
    args = parser.parse_args(argv)
    if args.pool:  # a later file's row replaces an earlier file's of the same run
        pooled: dict[tuple, dict] = {}
        for f in args.pool:
            for row in json.loads(f.read_text())["rows"]:
                key = (row["algorithm"], row["seed"], row.get("attack", "adaptive"))
                pooled[(*key, len(row.get("byzantine", [0])))] = row
        print(table(list(pooled.values())))
        return
    torch.set_num_threads(1)  # one process per core: a shared box is not oversubscribed
    logging.getLogger("flwr").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    _watch()
    extra = {}
    for item in args.set:
        key, value = item.split("=", 1)
        extra[key] = json.loads(value) if value[:1] in "0123456789-[{tf" else value
    attacks = [(spec, *parse_attack(spec)) for spec in args.attack]
    for _, name, _ in attacks:
        if name not in ("adaptive", *OMNISCIENT, *DATA_ATTACKS, "null", "random", "absent"):
            parser.error(f"--attack {name!r}: unknown")
    sets = [set(range(k)) for k in args.counts] if args.counts else [set(args.byzantine)]
    probe = "backdoor" if any(name == "backdoor" for _, name, _ in attacks) else "none"
    rows = []
    for algorithm in args.algorithms:
        for seed in args.seeds:
            overrides = {
                **BASE,
                **NEEDS.get(algorithm, {}),
                # the last rounds' mean; evaluation trains nothing (it draws from the sample stream)
                "evaluate-every": 1,
                **extra,
                "algorithm": algorithm,
                "seed": seed,
                # one sample stream for the clean and the attacked run: a paired comparison
                # (the app's default samples in secret, a different sample each run)
                "sample-seed": seed,
            }
            if any(name in OMNISCIENT for _, name, _ in attacks):
                overrides["attack-simulation"] = True  # changes nothing without a tag
            # the backdoor's probe in the clean run too: its success clean -> attacked
            clean = one_run(overrides, set(), 1.0, args.last, probe)
            for spec, name, omniscient in attacks:
                for byzantine in sets:
                    attacked = one_run(
                        overrides,
                        byzantine,
                        args.claim,
                        args.last,
                        name,
                        omniscient=omniscient,
                    )
                    row = {
                        "algorithm": algorithm,
                        "seed": seed,
                        "attack": spec,
                        "byzantine": sorted(byzantine),
                        "clean": {**clean, **honest_figures(clean, byzantine)},
                        "attacked": attacked,
                    }
                    rows.append(row)
                    _print(row)
    print(table(rows))
    if args.out:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "commit": commit,
                    "argv": sys.argv[1:],
                    "machine": platform.platform(),
                    "rows": rows,
                },
                indent=1,
            )
        )


def table(rows: list[dict]) -> str:
    """Markdown: per attack, number of attackers and algorithm, the mean +- std over seeds of
    the clean and attacked accuracies (all clients, and the honest ones) and of the loss, the
    hostile-only rounds and the backdoor's success."""
    lines = [
        "| attack | of 10 | algorithm | seeds | clean | attacked | loss | loss: s.e. | "
        "worst seed | seeds > 5 | final round: loss | honest clean | honest attacked | "
        "honest loss | honest loss per seed | hostile-only rounds (runs with any) | "
        "backdoor success, honest (clean → attacked) | target-class holders | "
        "clipped (attacked / clean) | shared votes (attacked / clean) | "
        "distrusted, far off (attacked / clean) | dropped | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def group(row: dict) -> tuple:
        return row.get("attack", "adaptive"), len(row.get("byzantine", [0])), row["algorithm"]

    for attack, count, algorithm in dict.fromkeys(group(r) for r in rows):
        mine = [r for r in rows if group(r) == (attack, count, algorithm)]

        def stat(values) -> str:
            values = [100 * v for v in values if v is not None]
            if not values:
                return "-"
            return f"{np.mean(values):.2f} ± {np.std(values):.2f}"

        def pair(key, side, mine=mine):
            return [r[side].get(key) for r in mine]

        def loss(key):
            return [
                a - b
                for a, b in zip(pair(key, "clean"), pair(key, "attacked"))
                if a is not None and b is not None
            ]

        dropped: dict[str, int] = {}
        for r in mine:
            for reason, n in r["attacked"].get("dropped", {}).items():
                dropped[reason] = dropped.get(reason, 0) + n
        errors = sum("error" in r["attacked"] or "error" in r["clean"] for r in mine)
        clipped = (
            f"{sum(r['attacked'].get('clipped', 0) for r in mine)} / "
            f"{sum(r['clean'].get('clipped', 0) for r in mine)}"
        )
        # replies counted under a shared vote (copies); "?" where a file predates the count
        shared = " / ".join(
            str(sum(r[side]["shared-votes"] for r in mine))
            if all("shared-votes" in r[side] for r in mine)
            else "?"
            for side in ("attacked", "clean")
        )
        # node history's counts; "?" where a file predates them
        history = " / ".join(
            f"{sum(r[side]['distrusted'] for r in mine)}, {sum(r[side]['far-off'] for r in mine)}"
            if all("far-off" in r[side] for r in mine)
            else "?"
            for side in ("attacked", "clean")
        )
        cells = [
            stat(pair(key, side)) if side else stat(loss(key))
            for key in ("personal-accuracy", "honest-accuracy")
            for side in ("clean", "attacked", None)
        ]
        worst = loss("personal-accuracy")
        # the standard error of the mean loss over seeds (sample std / sqrt(seeds))
        error = 100 * np.std(worst, ddof=1) / math.sqrt(len(worst)) if len(worst) > 1 else None
        cells.insert(3, "-" if error is None else f"{error:.2f}")
        cells.insert(4, f"{100 * max(worst):.2f}" if worst else "-")
        cells.insert(5, f"{sum(100 * x > 5 for x in worst)} of {len(worst)}" if worst else "-")
        cells.insert(6, stat(loss("final-personal-accuracy")))
        cells.append(" ".join(f"{100 * x:.1f}" for x in loss("honest-accuracy")) or "-")
        hostile = [len(r["attacked"].get("hostile-only-rounds", [])) for r in mine]
        cells.append(f"{sum(hostile)} ({sum(h > 0 for h in hostile)} of {len(mine)})")
        for key in ("backdoor-success", "backdoor-success-target-holders"):
            clean, hit = pair(key, "clean"), pair(key, "attacked")
            if all(v is None for v in hit):
                cells.append("-")
                continue
            cells.append(f"{_mean(clean):.2f} → {_mean(hit):.2f}")
        lines.append(
            f"| {attack} | {count} | {algorithm} | {len(mine)} | {' | '.join(cells)} | "
            f"{clipped} | {shared} | {history} | {dropped or '-'} | {errors} |"
        )
    return "\n".join(lines)


def _print(row: dict) -> None:
    clean, attacked = row["clean"], row["attacked"]
    a, b = clean.get("personal-accuracy"), attacked.get("personal-accuracy")
    ha, hb = clean.get("honest-accuracy"), attacked.get("honest-accuracy")
    print(
        f"{row['algorithm']:11s} seed {row['seed']} {row.get('attack', 'adaptive')} x "
        f"{len(row.get('byzantine', [0]))}: clean {_pct(a)} attacked {_pct(b)} loss "
        f"{_diff(a, b)} | honest clients: clean {_pct(ha)} attacked {_pct(hb)} loss "
        f"{_diff(ha, hb)} | dropped {attacked.get('dropped', {})} clipped "
        f"{attacked.get('clipped', 0)} (clean {clean.get('clipped', 0)}) hostile-only rounds "
        f"{attacked.get('hostile-only-rounds', [])} "
        + _success(clean, attacked)
        + f"{attacked.get('error', '')}",
        flush=True,
    )


def _mean(values) -> float:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else math.nan


def _success(clean: dict, attacked: dict) -> str:
    """The backdoor's success on the honest clients (their personalized models), clean ->
    attacked, all and target-class holders; empty without a probe."""
    out = []
    for key in ("backdoor-success", "backdoor-success-target-holders"):
        if key in attacked:
            out.append(f"{key} {clean.get(key, float('nan')):.2f} -> {attacked[key]:.2f}")
    return " ".join(out) + " " if out else ""


def _diff(a, b) -> str:
    return f"{100 * (a - b):+6.2f}" if a is not None and b is not None else "   -  "


def _pct(x) -> str:
    return "   -  " if x is None else f"{100 * x:6.2f}"


if __name__ == "__main__":
    main()
