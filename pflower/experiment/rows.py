"""A finished run's row of ``summary.csv`` and its per-client final metrics."""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path

from pflower.experiment.spec import RUN_FINISHED
from pflower.strategies.history import EXAMPLES_PROCESSED
from pflower.wire import NUM_EXAMPLES


def row_of(directory: Path) -> dict:
    """A finished run's ``summary.csv`` row: who it is, its final evaluation, its cost."""
    meta = json.loads((directory / RUN_FINISHED).read_text())
    results = json.loads((directory / "results.json").read_text())
    config = json.loads((directory / "config.json").read_text())
    run_config = config["run-config"]
    pretrain = run_config.get("pretrain-rounds", 0)
    rounds = [r for r in results["rounds"] if r["round"] > pretrain and r["train"]]
    trained = [r for r in results["rounds"] if "train-down" in r.get("wire", {})]
    row = {
        "label": meta["label"],
        "name": meta["name"],
        "seed": meta["seed"],
        **{f"grid:{k}": v for k, v in meta["grid"].items()},
        "algorithm": run_config["algorithm"],
        "split": config["split"],
        "rounds": len(results["rounds"]),
        **results["final"],
        # median: the first rounds also pay for loading the data
        "seconds-per-round": statistics.median(r["seconds"] for r in rounds) if rounds else None,
        # client compute over the whole run, pre-training included (compute_of)
        **compute_of(results["rounds"], meta["nodes"]),
        **plateau_of(results["rounds"]),
        "train-bytes-down-per-round": _mean(r["wire"]["train-down"] for r in trained),
        "train-bytes-up-per-round": _mean(r["wire"].get("train-up", 0) for r in trained),
        "dropped-replies": results["dropped-replies"],
        "wall-seconds": meta["wall-seconds"],
        "cpu-seconds": meta["cpu-seconds"],
        "path": str(directory),
    }
    clients = clients_of(row)
    if "attack" in meta:  # the honest clients' pooled personalized accuracy
        byzantine = meta["attack"]["byzantine-nodes"]
        row["honest-accuracy"] = _pooled([c for p, c in clients.items() if p >= byzantine])
    holdout = run_config.get("holdout-fraction", 0)
    if holdout:  # held-out partitions: the top fraction of the ids (strategies/nodes.py)
        cutoff = meta["nodes"] - round(holdout * meta["nodes"])
        row["personal-accuracy-trained"] = _pooled([c for p, c in clients.items() if p < cutoff])
        row["personal-accuracy-new"] = _pooled([c for p, c in clients.items() if p >= cutoff])
    return row


def compute_of(rounds: list[dict], nodes: int) -> dict[str, float | None]:
    """A run's client compute from its rounds (results.json, pre-training rounds included):
    ``examples-processed``, every round's total of its replies' ``data-passes`` x
    ``num-examples`` (the examples the clients took through the model in training), and
    ``examples-per-client``, that over the run's ``nodes`` clients. A round without the
    total (results.json of an older pflower) counts ``data-passes`` (the replies' mean,
    weighted by num-examples) x ``num-examples`` (their sum), the same number. None when
    no round says."""
    totals = []
    for r in rounds:
        train = r.get("train", {})
        if EXAMPLES_PROCESSED in train:
            totals.append(train[EXAMPLES_PROCESSED])
        elif "data-passes" in train and NUM_EXAMPLES in train:
            totals.append(train["data-passes"] * train[NUM_EXAMPLES])
    if not totals:
        return {EXAMPLES_PROCESSED: None, "examples-per-client": None}
    return {EXAMPLES_PROCESSED: sum(totals), "examples-per-client": sum(totals) / max(1, nodes)}


#: the plateau rule's window: the last fifth of the run's rounds (pre-training included)
PLATEAU_WINDOW = 0.2
#: the plateau rule: the pooled personalized accuracy moved less than this over the window
#: (percentage points, mean over seeds; experiment/tables.py marks the rows that break it)
PLATEAU_POINTS = 0.5


def plateau_of(rounds: list[dict]) -> dict[str, float | None]:
    """``plateau-delta``: how much the pooled personalized metric (accuracy, or RMSE for
    regression) moved over the last ``PLATEAU_WINDOW`` of the run's rounds: the last
    evaluation minus the latest one at or before round ``(1 - PLATEAU_WINDOW) x R``. A curve
    still rising has a large positive delta. None without an evaluation in both places (evaluate
    at least every fifth of the run to get it)."""
    evaluated = [
        (r["round"], r["evaluate"].get("personal-accuracy", r["evaluate"].get("personal-rmse")))
        for r in rounds
        if r.get("evaluate")
    ]
    evaluated = [(n, v) for n, v in evaluated if v is not None]
    if not rounds or len(evaluated) < 2:
        return {"plateau-delta": None}
    start = max(r["round"] for r in rounds) * (1 - PLATEAU_WINDOW)
    before = [v for n, v in evaluated[:-1] if n <= start + 1e-9]
    if not before:
        return {"plateau-delta": None}
    return {"plateau-delta": evaluated[-1][1] - before[-1]}


def _pooled(clients: list[dict], key: str = "personal-accuracy") -> float | None:
    """``key`` pooled over the clients' test examples (each weighted by its count)."""
    clients = [c for c in clients if key in c]
    total = sum(c["num-test"] for c in clients)
    return sum(c[key] * c["num-test"] for c in clients) / total if total else None


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def clients_of(row: Mapping) -> dict[int, dict]:
    """A run's per-client final metrics (clients.csv), by partition id."""
    path = Path(row["path"]) / "clients.csv"
    if not path.exists():
        return {}
    with open(path) as f:
        return {
            int(float(r["partition-id"])): {k: float(v) for k, v in r.items() if v != ""}
            for r in csv.DictReader(f)
        }


def hurt_vs(rows: list[dict], baseline: str) -> None:
    """Per run: its clients whose personalized accuracy is below the ``baseline`` run's
    global accuracy on the same client and seed (``hurt-vs-baseline``)."""
    base = {r["seed"]: clients_of(r) for r in rows if r["label"] == baseline}
    for row in rows:
        reference = base.get(row["seed"])
        if not reference:
            continue
        mine = clients_of(row)
        row["hurt-vs-baseline"] = sum(
            1
            for pid, m in mine.items()
            if pid in reference
            and "personal-accuracy" in m
            and "global-accuracy" in reference[pid]
            and m["personal-accuracy"] < reference[pid]["global-accuracy"]
        )
