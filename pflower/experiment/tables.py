"""``summary.csv``, ``table.md`` (mean ± std over seeds per label) and the pivot table."""

from __future__ import annotations

import csv
import logging
import math
import statistics
from typing import Any

from pflower.experiment.grid import _show
from pflower.experiment.plots import plot_clients, plot_curves
from pflower.experiment.rows import PLATEAU_POINTS, PLATEAU_WINDOW, hurt_vs
from pflower.experiment.spec import Experiment, Run

log = logging.getLogger("flwr.pflower")


def write_summary(experiment: Experiment, rows: list[dict]) -> str:
    """``summary.csv``, ``table.md`` and the comparison plots; returns the table."""
    if experiment.baseline:
        hurt_vs(rows, experiment.baseline)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(experiment.out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    text = table(experiment, rows)
    (experiment.out / "table.md").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        log.warning("pflower: no plots (matplotlib missing: pip install 'pflower[plots]')")
        return text
    plot_curves(experiment, rows, experiment.out / "curves.png")
    plot_clients(experiment, rows, experiment.out / "clients.png")
    return text


def _cell(values: list, scale: float = 1.0, digits: int = 2) -> str:
    values = [scale * v for v in values if v is not None and not _nan(v)]
    if not values:
        return "–"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {std:.{digits}f}"


def _nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def table(experiment: Experiment, rows: list[dict]) -> str:
    """Mean ± sample std over seeds, one line per label, in the file's order."""
    regression = rows and all("personal-accuracy" not in r for r in rows)
    metric, scale, unit = ("rmse", 1.0, "RMSE") if regression else ("accuracy", 100.0, "%")
    columns = [
        (f"personalized {unit} (pooled)", f"personal-{metric}", scale, 2),
        ("mean over clients", f"personal-{metric}-mean", scale, 2),
        ("p10 client", f"personal-{metric}-p10", scale, 2),
        ("worst client", f"personal-{metric}-worst", scale, 2),
        ("clients hurt", "clients-hurt", 1.0, 1),
    ]
    if experiment.baseline:
        columns.append((f"hurt vs {experiment.baseline}", "hurt-vs-baseline", 1.0, 1))
    columns += [
        (f"own global {unit}", f"global-{metric}", scale, 2),
        # an algorithm's personalized model against its own parts: where it has them
        *[c for c in _parts(metric, unit, scale) if any(c[1] in r for r in rows)],
        *[(_header(key), key, _scale(key), 2) for key in experiment.columns],
        (f"Δ last {PLATEAU_WINDOW:.0%} of rounds", "plateau-delta", scale, 2),
        ("dropped", "dropped-replies", 1.0, 1),
        ("s / round", "seconds-per-round", 1.0, 2),
        ("examples / client", "examples-per-client", 1.0, 0),
        ("MB down / round", "train-bytes-down-per-round", 1e-6, 2),
        ("MB up / round", "train-bytes-up-per-round", 1e-6, 2),
    ]
    seeds = sorted({r["seed"] for r in rows})
    head = (
        f"{experiment.name}: {experiment.nodes} clients, engine {experiment.engine}, "
        f"seeds {seeds}; mean ± std over seeds"
    )
    lines = [head + (f" — {experiment.description}" if experiment.description else ""), ""]
    lines.append("| run | split | seeds | " + " | ".join(c[0] for c in columns) + " |")
    lines.append("|---|---|---|" + "---|" * len(columns))
    for label in experiment.labels:
        mine = [r for r in rows if r["label"] == label]
        if not mine:
            continue
        split = mine[0]["split"].split(" (")[0]
        cells = [_cell([r.get(key) for r in mine], s, d) for _, key, s, d in columns]
        if not regression:  # the plateau rule: mark a curve that still moves
            at = [key for _, key, *_ in columns].index("plateau-delta")
            cells[at] += _plateau_mark([r.get("plateau-delta") for r in mine])
        lines.append(f"| {label} | {split} | {len(mine)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Pooled: over all test examples; p10 / worst: over clients; clients hurt: "
        "personalized below the run's own global model on the same client"
        + (
            f"; hurt vs {experiment.baseline}: personalized below {experiment.baseline}'s "
            "global model on the same client and seed"
            if experiment.baseline
            else ""
        )
        + f"; Δ last {PLATEAU_WINDOW:.0%} of rounds: the pooled personalized "
        + ("RMSE" if regression else "accuracy (points)")
        + f" at the last evaluation minus at the last one before the final {PLATEAU_WINDOW:.0%} "
        "of the run's rounds"
        + (
            ""
            if regression
            else f" (plateau rule: |mean| < {PLATEAU_POINTS} points, ✓; ↑ still rising: more "
            "rounds would raise it; ↓ falling, past its best: more rounds would lower it)"
        )
        + (
            "; local part alone: the algorithm's personal part on its own at the final "
            "evaluation (APFL's v, alpha = 1; a head method's personal head as its training "
            "left it, on the final shared body), where the run has one; α: APFL's mixing "
            "weight, mean / min / max over the clients at the final evaluation"
            if any("local-part-accuracy" in r or "alpha-mean" in r for r in rows)
            else ""
        )
        + "; dropped: replies the server dropped in the whole run (honest clients: 0); "
        "s / round: median wall seconds of a training round after any pre-training; "
        "examples / client: the client compute, the training examples the clients took "
        "through the model over the whole run (pre-training included; a local step on a "
        "minibatch of 32 counts 32; each algorithm's own passes, e.g. 2 per alternating "
        "pair, 2 per Hessian-vector product) over the number of clients, the clients that "
        "were not sampled included; evaluation's fine-tuning not counted; "
        "MB down / up: the arrays of a training round (all its clients) as Flower "
        "serializes them, mean over rounds.",
    ]
    if experiment.pivot:
        lines += ["", *pivot_table(experiment, rows)]
    return "\n".join(lines)


def _parts(metric: str, unit: str, scale: float) -> list[tuple[str, str, float, int]]:
    """The columns of an algorithm's own parts (shown where a row has them): its personal
    part alone (APFL's v, a head method's personal head as trained, ``local-part``) and
    APFL's mixing weight alpha over the clients (``alpha-*``)."""
    return [
        (f"local part alone {unit}", f"local-part-{metric}", scale, 2),
        ("α mean", "alpha-mean", 1.0, 2),
        ("α min", "alpha-min", 1.0, 2),
        ("α max", "alpha-max", 1.0, 2),
    ]


def _plateau_mark(deltas: list) -> str:
    """`` ✓`` when the seeds' mean delta is within the plateau rule, `` ↑`` when the curve
    still rises past it (stopped too early), `` ↓`` when it falls (past its best: a small
    client overfits), ``""`` when no run says."""
    deltas = [d for d in deltas if d is not None and not _nan(d)]
    if not deltas:
        return ""
    points = 100 * statistics.mean(deltas)
    if abs(points) < PLATEAU_POINTS:
        return " ✓"
    return " ↑" if points > 0 else " ↓"


def _scale(key: str) -> float:
    return 100.0 if "accuracy" in key else 1.0


def _header(key: str) -> str:
    return key + (" %" if "accuracy" in key else "")


def pivot_table(experiment: Experiment, rows: list[dict]) -> list[str]:
    """``pivot-metric`` (mean ± std over seeds): one line per label without the pivot keys,
    one column per combination of the pivot keys' values, in the file's order."""
    keys = experiment.pivot

    def split(run: Run) -> tuple[str, tuple]:
        rest = [(k, v) for k, v in run.point if k not in keys and _varies(experiment, k)]
        line = " ".join([run.name] + [_show(k, v) for k, v in rest])
        return line, tuple(_pivot_value(dict(run.point).get(k, "–")) for k in keys)

    places = [split(run) for run in experiment.runs]
    lines_, columns = (
        list(dict.fromkeys(p[0] for p in places)),
        list(dict.fromkeys(p[1] for p in places)),
    )
    values: dict[tuple[str, tuple], list] = {}
    by_label_seed = {(r["label"], r["seed"]): r for r in rows}
    for run, place in zip(experiment.runs, places):
        row = by_label_seed.get((run.label, run.seed))
        if row is not None:
            values.setdefault(place, []).append(row.get(experiment.pivot_metric))
    metric = experiment.pivot_metric
    head = ["run"] + [" ".join(column) for column in columns]
    out = [
        f"{_header(metric)} by {', '.join(keys)} (mean ± std over seeds)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for line in lines_:
        cells = [_cell(values.get((line, c), []), _scale(metric), 2) for c in columns]
        out.append(f"| {line} | " + " | ".join(cells) + " |")
    return out


def _pivot_value(value: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)


def _varies(experiment: Experiment, key: str) -> bool:
    """Whether ``key`` takes more than one value over the experiment's runs."""
    return len({repr(dict(r.point).get(key)) for r in experiment.runs}) > 1
