"""The comparison plots: ``curves.png`` (per round) and ``clients.png`` (per client)."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

from pflower.experiment.rows import clients_of
from pflower.experiment.spec import Experiment


def _curves(rows: list[dict], key: str) -> dict[int, list[float]]:
    """round -> the value of ``key`` in every seed's run (train or evaluate metric)."""
    by_round: dict[int, list[float]] = {}
    for row in rows:
        results = json.loads((Path(row["path"]) / "results.json").read_text())
        for r in results["rounds"]:
            if key == "train-loss":
                from pflower.strategies.history import train_loss

                value = train_loss(r["train"])
            else:
                value = r["evaluate"].get(key)
            if value is not None and math.isfinite(value):
                by_round.setdefault(r["round"], []).append(value)
    return by_round


def plot_curves(experiment: Experiment, rows: list[dict], path: Path) -> None:
    """Personalized test accuracy (evaluated rounds) and training loss per round, one line
    per label: the mean over seeds, the band from the lowest to the highest seed."""
    import matplotlib.pyplot as plt

    regression = all("personal-accuracy" not in r for r in rows)
    metric = "personal-rmse" if regression else "personal-accuracy"
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab10")
    spans = []
    for i, label in enumerate(experiment.labels):
        mine = [r for r in rows if r["label"] == label]
        if not mine:
            continue
        color = colors(i % 10)
        for ax, key, scale in (
            (axes[0], metric, 1 if regression else 100),
            (axes[1], "train-loss", 1),
        ):
            curve = _curves(mine, key)
            if not curve:
                continue
            xs = sorted(curve)
            mean = [scale * statistics.mean(curve[x]) for x in xs]
            lo = [scale * min(curve[x]) for x in xs]
            hi = [scale * max(curve[x]) for x in xs]
            ax.plot(xs, mean, "-o" if len(xs) < 15 else "-", color=color, label=label, ms=3)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
            if key == "train-loss":
                spans += [v for v in lo + hi if v > 0]
    axes[0].set_ylabel(
        "test RMSE (personalized)" if regression else "test accuracy % (personalized, pooled)"
    )
    axes[1].set_ylabel("training loss (clients' mean)")
    if spans and max(spans) / min(spans) > 100:  # a diverging run would flatten the rest
        axes[1].set_yscale("log")
    for ax, title in zip(axes, ("evaluated rounds", "every round")):
        ax.set_xlabel("round")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    if not handles:
        handles, names = axes[1].get_legend_handles_labels()
    fig.legend(handles, names, loc="center right", fontsize=8)
    fig.suptitle(f"{experiment.name}: mean over seeds, band = min..max over seeds")
    for ax in axes:
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout(rect=(0, 0, 0.87, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_clients(experiment: Experiment, rows: list[dict], path: Path) -> None:
    """Final per-client personalized accuracy of every label side by side (all seeds'
    clients), box and points, the global model's as a second box where the run has one."""
    import matplotlib.pyplot as plt

    regression = all("personal-accuracy" not in r for r in rows)
    metric, scale = ("rmse", 1.0) if regression else ("accuracy", 100.0)
    labels = [lab for lab in experiment.labels if any(r["label"] == lab for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels) + 2), 4.8))
    for i, label in enumerate(labels):
        per = {"personal": [], "global": []}
        for row in (r for r in rows if r["label"] == label):
            for c in clients_of(row).values():
                for which in per:
                    if f"{which}-{metric}" in c:
                        per[which].append(scale * c[f"{which}-{metric}"])
        for which, offset, color in (("personal", -0.18, "C0"), ("global", 0.18, "C1")):
            values = per[which]
            if not values:
                continue
            ax.boxplot(
                values,
                positions=[i + offset],
                widths=0.3,
                showfliers=False,
                patch_artist=True,
                boxprops={"facecolor": color, "alpha": 0.35},
                medianprops={"color": color},
            )
            rng = random.Random(i)  # the same jitter on every redraw
            jitter = [rng.uniform(-0.1, 0.1) for _ in values]
            ax.scatter([i + offset + j for j in jitter], values, s=4, color=color, alpha=0.5)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"test {metric}" + (" %" if not regression else "") + " per client")
    ax.plot([], [], "s", color="C0", alpha=0.5, label="personalized")
    ax.plot([], [], "s", color="C1", alpha=0.5, label="own global model")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(f"{experiment.name}: every client of every seed, final round")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
