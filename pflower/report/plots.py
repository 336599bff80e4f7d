"""A run's plots: accuracy and losses per round, each client's personalized against its
global accuracy, the label counts per client, FFGG's split diagnostic, and the
convergence of synthetic-linear.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pflower.strategies.history import train_loss

if TYPE_CHECKING:
    from pflower.settings import RunSettings


class RunReport(Protocol):
    """What the plots read of a run's report (``results.RunReport``, which imports this
    module to draw them: named here by what it offers, not imported back)."""

    cfg: RunSettings
    num_nodes: int
    rounds: list  # of RoundLog
    clients: list[dict]


log = logging.getLogger("flwr.pflower")


def _plot_rounds(report: RunReport, path: Path) -> None:
    """``rounds_figure`` saved to ``path``."""
    import matplotlib.pyplot as plt

    fig = rounds_figure(report)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rounds_figure(report: RunReport):
    """Left: pooled personalized and global test accuracy per evaluated round, the band from
    the p10 to the p90 client (RMSE for regression). Right: the clients' training loss every
    round and the pooled test losses: a diverging run shows here even between evaluations.
    With ``pretrain-rounds`` P > 0 a vertical line between rounds P and P + 1 marks where
    FedAvg pre-training ends and the algorithm starts, on both sides: a jump there is the
    switch of algorithm, not an event of training."""
    import matplotlib.pyplot as plt

    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4))
    evaluated = [r for r in report.rounds if r.evaluate]
    regression = not any("personal-accuracy" in r.evaluate for r in evaluated)
    metric, scale = ("rmse", 1.0) if regression else ("accuracy", 100.0)
    for which, style, color in (("personal", "-o", "C0"), ("global", "--s", "C1")):
        rows = [r for r in evaluated if f"{which}-{metric}" in r.evaluate]
        if not rows:
            continue
        xs = [r.round for r in rows]
        acc_ax.plot(
            xs,
            [scale * r.evaluate[f"{which}-{metric}"] for r in rows],
            style,
            color=color,
            ms=3,
            label=f"{which} (pooled)",
        )
        band = [r for r in rows if f"{which}-{metric}-p10" in r.evaluate]
        if band:
            acc_ax.fill_between(
                [r.round for r in band],
                [scale * r.evaluate[f"{which}-{metric}-p10"] for r in band],
                [scale * r.evaluate[f"{which}-{metric}-p90"] for r in band],
                color=color,
                alpha=0.15,
                linewidth=0,
                label=f"{which}: p10..p90 client",
            )
    acc_ax.set_ylabel(f"test {metric}" + ("" if regression else " %"))
    acc_ax.set_title("evaluated rounds")
    _plot_alpha(acc_ax, evaluated)
    losses = [(r.round, train_loss(r.train)) for r in report.rounds]
    losses = [(x, v) for x, v in losses if v is not None and math.isfinite(v)]
    values = [v for _, v in losses]
    if losses:
        loss_ax.plot(*zip(*losses), "-", color="C2", label="training (clients' mean)")
    for which, style, color in (("personal", "o", "C0"), ("global", "s", "C1")):
        points = [
            (r.round, r.evaluate[f"{which}-loss"])
            for r in evaluated
            if f"{which}-loss" in r.evaluate
        ]
        if points:
            loss_ax.plot(*zip(*points), style, color=color, ms=4, label=f"test, {which} (pooled)")
            values += [v for _, v in points]
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 100:  # divergence would flatten the rest
        loss_ax.set_yscale("log")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("every round")
    pretrain = report.cfg.pretrain_rounds
    for ax in (acc_ax, loss_ax):
        if pretrain > 0:
            ax.axvline(
                pretrain + 0.5,
                color="0.4",
                linestyle=":",
                linewidth=1.2,
                label=f"pre-training ends (after round {pretrain})",
            )
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.cfg.algorithm} on {report.cfg.dataset}, seed {report.cfg.seed}")
    fig.tight_layout()
    return fig


def _plot_alpha(ax, evaluated: list) -> None:
    """APFL's alpha on a right-hand axis of ``ax``: the clients' mean per evaluated round and
    the band from the lowest to the highest client (a collapse to 0 shows as the band's
    floor reaching 0)."""
    rows = [r for r in evaluated if "alpha-mean" in r.evaluate]
    if not rows:
        return
    right = ax.twinx()
    xs = [r.round for r in rows]
    right.plot(xs, [r.evaluate["alpha-mean"] for r in rows], "-^", color="C3", ms=3)
    right.fill_between(
        xs,
        [r.evaluate["alpha-min"] for r in rows],
        [r.evaluate["alpha-max"] for r in rows],
        color="C3",
        alpha=0.1,
        linewidth=0,
    )
    right.set_ylim(-0.02, 1.02)
    right.set_ylabel("α: clients' mean (band: min..max)", color="C3")


def _plot_clients(report: RunReport, path: Path) -> None:
    """Each client once: its personalized against its global test accuracy, the diagonal
    (personalization changed nothing) and the clients below it (hurt) marked. A run
    without a global model (local training) shows its clients' accuracies sorted."""
    import matplotlib.pyplot as plt

    rows = report.clients
    regression = not any("personal-accuracy" in r for r in rows)
    metric, scale = ("loss", 1.0) if regression else ("accuracy", 100.0)
    personal, glob = f"personal-{metric}", f"global-{metric}"
    fig, ax = plt.subplots(figsize=(5.5, 5))
    paired = [r for r in rows if personal in r and glob in r]
    if paired:
        xs = [scale * r[glob] for r in paired]
        ys = [scale * r[personal] for r in paired]
        # hurt: worse personalized than global (lower accuracy, higher loss)
        hurt = [(y > x) if regression else (y < x) for x, y in zip(xs, ys)]
        lo, hi = min(xs + ys), max(xs + ys)
        pad = 0.05 * (hi - lo or 1)
        ax.plot(
            [lo - pad, hi + pad], [lo - pad, hi + pad], "k--", lw=1, label="personalized = global"
        )
        ax.scatter(
            [x for x, h in zip(xs, hurt) if not h],
            [y for y, h in zip(ys, hurt) if not h],
            s=18,
            color="C0",
            label="helped or equal",
        )
        ax.scatter(
            [x for x, h in zip(xs, hurt) if h],
            [y for y, h in zip(ys, hurt) if h],
            s=30,
            color="C3",
            marker="x",
            label=f"hurt by personalization ({sum(hurt)})",
        )
        ax.set_xlabel(f"global model: test {metric}" + ("" if regression else " %"))
        ax.set_ylabel(f"personalized: test {metric}" + ("" if regression else " %"))
        ax.set_aspect("equal", adjustable="datalim")
        ax.legend(fontsize=8)
    else:
        vals = sorted(scale * r[personal] for r in rows if personal in r)
        ax.plot(range(1, len(vals) + 1), vals, "-o", ms=3, label="personalized")
        ax.set_xlabel(f"client (sorted by {metric})")
        ax.set_ylabel(f"test {metric}" + ("" if regression else " %"))
    ax.set_title(f"each client, final round ({len(rows)} clients)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


#: label-distribution plots: only up to this many clients (one bar per client)
LABEL_PLOT_MAX_CLIENTS = 200


#: room above a bar chart's tallest bar, as a share of its height
HEADROOM = 0.08


def with_headroom(ax, share: float = HEADROOM) -> None:
    """The y axis up to ``1 + share`` times the tallest bar (stacked bars: their top), so
    that no bar touches the frame (flwr-datasets' label plot ends at the tallest one)."""
    tops = [p.get_y() + p.get_height() for p in ax.patches if p.get_height() > 0]
    if tops:
        ax.set_ylim(0, (1 + share) * max(tops))


def _plot_labels(report: RunReport, path: Path) -> None:
    """The partition's label counts per client, drawn by flwr-datasets'
    ``plot_label_distributions`` from the very partitioner the clients read (built-in and
    ``disk:`` sources; the server process builds it once more if its clients run elsewhere).
    Skipped for hub, node and generated regression data and past
    ``LABEL_PLOT_MAX_CLIENTS`` clients; a failure here never fails the run."""
    cfg = report.cfg
    if (
        cfg.effective_task != "classification"
        or report.num_nodes > LABEL_PLOT_MAX_CLIENTS
        or not (
            cfg.dataset in ("mnist-5k", "digits", "synthetic-leaf")
            or cfg.dataset.startswith("disk:")
        )
    ):
        return
    try:
        import matplotlib.pyplot as plt
        from flwr_datasets.visualization import plot_label_distributions

        from pflower.task import data

        source = data._source(cfg, report.num_nodes)
        fig, ax, _ = plot_label_distributions(
            source.partitioner,
            label_name=cfg.label_column,
            plot_type="bar",
            size_unit="absolute",
            partition_id_axis="x",
            legend=True,
            title=f"labels per client: {cfg.dataset}, {cfg.partitioner}",
            legend_kwargs={"title": "label", "fontsize": 7},
            plot_kwargs={"figsize": (max(6, 0.12 * report.num_nodes + 3), 4)},
        )
        with_headroom(ax)
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
    except Exception as err:  # a picture, not a result: say why and go on
        log.warning("pflower: no labels.png (%s: %s)", type(err).__name__, err)


def _plot_diagnostic(report: RunReport, path: Path) -> None:
    """FFGG's split diagnostic: ||Delta_m|| ~ ||F_m(theta)|| per round (mean and max)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rounds = [r for r in report.rounds if "grad-norm-mean" in r.train]
    xs = [r.round for r in rounds]
    ax.semilogy(xs, [r.train["grad-norm-mean"] for r in rounds], "-o", label="mean over clients")
    ax.semilogy(xs, [r.train["grad-norm-max"] for r in rounds], "--s", label="max over clients")
    ax.set_xlabel("round")
    ax.set_ylabel("||Delta_m|| (theta-gradient after fine-tuning)")
    ax.set_title("split diagnostic: near 0 => personalize fewer parameters")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_convergence(report: RunReport, path: Path) -> None:
    """synthetic-linear: ||theta - theta*||^2 and ||F(theta)||^2 per round (closed form)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rounds = [r for r in report.rounds if "theta-error" in r.server]
    xs = [r.round for r in rounds]
    ax.semilogy(xs, [r.server["theta-error"] for r in rounds], "-", label="||theta - theta*||^2")
    ax.semilogy(xs, [r.server["operator-norm"] for r in rounds], "--", label="||F(theta)||^2")
    ax.set_xlabel("round")
    ax.set_title(f"{report.cfg.algorithm} on synthetic-linear")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
