"""Every mode of the server's reply pipeline, one short run each: a fingerprint of what the
run computed, to tell whether a change of the server code changed any number.

Each case runs on a ``LocalGrid`` (the suite's small offline data set, ``digits``, 6 nodes, a
few rounds, ``sample-seed`` pinned so that the sample is reproducible) and records the SHA-256
of its final shared parameters and of its round log (training and evaluation metrics, drops
by reason; not the seconds or wire timings, which vary). The cases cover each algorithm at
its defaults (pre-training included), each robust rule with and without buckets, the small
rounds of the default defence (1 and 2 replies), central and local DP (Poisson sampling
too), broken and Byzantine clients (NaN, wrong shape, a sign flip at 50x, a claim lie, ALIE
simulated by the server), Scaffold's second record and asynchronous FFGG.

Run it at two checkouts and compare (each checkout's own pflower on ``sys.path`` first):

    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before python benchmarks/pipeline_fingerprints.py --out /tmp/before.json
    python benchmarks/pipeline_fingerprints.py --out /tmp/after.json --compare /tmp/before.json

``--only`` runs the cases whose name contains a string. ``--main-job`` runs the main job
instead (every key of ``[tool.flwr.app.config]``, ``sample-seed`` 0, 10 nodes) on Flower's
simulation engine, in this process, and records its fingerprint the same way. Deterministic
on one machine; another CPU may round floats otherwise (compare on one box).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

BASE = {
    "dataset": "digits",
    "model": "mlp",
    "split": "head",
    "batch-size": 32,
    "finetune-epochs": 1,
    "partitioner": "iid",
    "sample-seed": 0,
    "num-server-rounds": 4,
    "evaluate-every": 2,
}
#: the DP cases' noise is seeded too (by default it comes from OS entropy)
PRE = {"pretrain-rounds": 2}
NODES = 6

#: name -> (run-config overrides, node configs by partition id, number of nodes)
CASES: dict[str, tuple[dict, dict, int]] = {}


def case(name: str, overrides: dict, nodes: dict | None = None, num: int = NODES) -> None:
    CASES[name] = ({**BASE, **overrides}, nodes or {}, num)


for algorithm in (
    "fedavg",
    "fedavg-ft",
    "local",
    "local-gd",
    "fedalt",
    "fedsim",
    "ffgg",
    "local-ffgg",
    "br-ffgg",
    "pflego",
    "apfl",
    "scaffold",
    "l2gd",
):
    extra = {"fraction-train": 1.0} if algorithm == "l2gd" else {}
    case(f"{algorithm} defaults", {"algorithm": algorithm, **PRE, **extra})
    case(f"{algorithm} plain mean", {"algorithm": algorithm, "robust-aggregator": "none", **extra})
for rule in ("median", "trimmed-mean", "krum", "multi-krum", "geometric-median"):
    case(f"fedavg {rule}", {"algorithm": "fedavg", "robust-aggregator": rule, **PRE})
    case(
        f"ffgg {rule} buckets",
        {"algorithm": "ffgg", "robust-aggregator": rule, "robust-bucket-size": 2},
        num=10,
    )
case("fedalt centered-clipping", {"algorithm": "fedalt", "robust-aggregator": "centered-clipping"})
case("fedavg median f=1", {"algorithm": "fedavg", "robust-aggregator": "median",
                           "robust-byzantine": 1, "fraction-train": 1.0})  # fmt: skip
case("fedavg 1 reply a round", {"algorithm": "fedavg", "fraction-train": 0.1}, num=10)
case("fedalt 2 replies a round", {"algorithm": "fedalt", "fraction-train": 0.2}, num=10)
case("ffgg 4 replies a round", {"algorithm": "ffgg", "fraction-train": 0.4}, num=10)
case(
    "fedavg central dp",
    {"algorithm": "fedavg", "dp": "central", "dp-noise": 0.5, "dp-noise-seed": 3, **PRE},
)
DP = {"dp": "central", "dp-noise": 0.5, "dp-noise-seed": 3}
case("ffgg central dp poisson", {"algorithm": "ffgg", **DP, "dp-sampling": "poisson"})
case(
    "scaffold central dp",
    {"algorithm": "scaffold", "dp": "central", "dp-noise": 0.5, "dp-noise-seed": 3},
)
case(
    "fedalt local dp",
    {"algorithm": "fedalt", "dp": "local", "dp-noise": 0.5, "dp-noise-seed": 3, **PRE},
)
case(
    "pflego central dp",
    {"algorithm": "pflego", "dp": "central", "dp-noise": 0.5, "dp-noise-seed": 3},
)
case("pflego global alpha", {"algorithm": "pflego", "pflego-alpha": "global"})
case("async-ffgg", {"algorithm": "async-ffgg"})
BROKEN = {0: {"byzantine": "nan"}, 1: {"byzantine": "wrong-shape"}}
for algorithm in ("fedavg", "ffgg", "scaffold", "pflego"):
    case(f"{algorithm} broken clients", {"algorithm": algorithm, "fraction-train": 1.0}, BROKEN)
    case(
        f"{algorithm} sign flip 50x",
        {"algorithm": algorithm, "fraction-train": 1.0},
        {2: {"byzantine": "sign-flip", "byzantine-scale": 50.0}},
    )
case("async-ffgg broken clients", {"algorithm": "async-ffgg"}, BROKEN)
case(
    "fedavg alie simulated",
    {"algorithm": "fedavg", "attack-simulation": True, "fraction-train": 1.0, **PRE},
    {0: {"byzantine": "alie"}},
)
case(
    "ffgg alie simulated median",
    {
        "algorithm": "ffgg",
        "attack-simulation": True,
        "fraction-train": 1.0,
        "robust-aggregator": "median",
        "robust-byzantine": 1,
    },  # fmt: skip
    {0: {"byzantine": "alie"}},
)
case("fedavg alie without simulation", {"algorithm": "fedavg"}, {0: {"byzantine": "alie"}})


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(report) -> dict:
    """What a run computed: its final shared parameters and its round log, hashed."""
    shared = report.shared or {}
    h = hashlib.sha256()
    for name in sorted(shared):
        array = shared[name].detach().cpu().numpy()
        h.update(name.encode())
        h.update(np.ascontiguousarray(array).tobytes())
    rounds = [
        {"round": e.round, "train": e.train, "evaluate": e.evaluate, "dropped": e.dropped}
        for e in report.rounds
    ]
    last = next((e.evaluate for e in reversed(report.rounds) if e.evaluate), {})
    return {
        "shared": h.hexdigest()[:16],
        "rounds": digest(rounds),
        "personalized": last.get("personal-accuracy"),
        "dropped": sum(sum(e.dropped.values()) for e in report.rounds),
    }


def run_case(name: str) -> dict:
    try:
        from pflower.testbed.client_app import experiment_client_app
        from pflower.testbed.local_grid import run_local
    except ImportError:  # a checkout from before the testbed had its name
        from pflower.experiments.client_app import experiment_client_app
        from pflower.experiments.local_grid import run_local

    overrides, nodes, num = CASES[name]
    with tempfile.TemporaryDirectory() as out:
        overrides = {**overrides, "outputs-dir": out}
        app = experiment_client_app(overrides)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                report = run_local(
                    overrides, num, client_app=app, node_configs=nodes, out=Path(out)
                )
        except Exception as err:  # noqa: BLE001 - a case that fails is a fingerprint too
            return {"error": f"{type(err).__name__}: {str(err)[:200]}"}
    return fingerprint(report)


def main_job() -> dict:
    """The main job of the README on Flower's simulation engine (``run_simulation``), the
    sample pinned: its fingerprint and its last evaluation's accuracies."""
    import tomllib

    from flwr.simulation import run_simulation

    import pflower
    from pflower.client_app import build_client_app
    from pflower.server_app import build_server_app

    pyproject = Path(pflower.__file__).parents[1] / "pyproject.toml"
    cfg = dict(tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"])
    reports: list = []
    with tempfile.TemporaryDirectory() as out:
        cfg.update({"sample-seed": 0, "outputs-dir": out})
        run_simulation(
            server_app=build_server_app(cfg, on_report=reports.append),
            client_app=build_client_app(cfg),
            num_supernodes=10,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
    found = fingerprint(reports[0])
    last = next(e.evaluate for e in reversed(reports[0].rounds) if e.evaluate)
    return {**found, "global": last.get("global-accuracy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="")
    parser.add_argument("--compare", type=Path, help="a file of an earlier run")
    parser.add_argument("--main-job", action="store_true", help="the main job instead")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    import pflower

    print(f"pflower from {Path(pflower.__file__).parent}", file=sys.stderr)
    results, started = {}, time.perf_counter()
    if args.main_job:
        results["main job"] = main_job()
    for name in CASES if not args.main_job else ():
        if args.only and args.only not in name:
            continue
        results[name] = run_case(name)
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"{len(results)} cases in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.compare:
        before = json.loads(args.compare.read_text())
        differ = [n for n in results if n in before and before[n] != results[n]]
        for n in differ:
            print(f"DIFFERS {n}: {before[n]} -> {results[n]}")
        print(f"{len(results) - len(differ)} of {len(results)} cases the same")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
