"""Run outputs: ``outputs/<timestamp>-<algorithm>/`` and the summary table.

- ``config.json``: the run config (flat dashed keys), the split actually used, and what
  produced the run: pflower / flwr / torch / Python versions, the git commit of pflower's
  source tree if it is one, the machine;
- ``results.json``: per round: train aggregates, evaluate aggregates, dropped replies with
  reasons, seconds, array bytes sent and received (``wire``); and the final evaluation;
- ``clients.csv``: final per-client personalized and global metrics;
- ``accuracy.png``: pooled personalized/global test accuracy per evaluated round with the
  p10..p90 band over clients, and the training loss of every round beside the test losses;
- ``clients.png``: each client's personalized against its global accuracy (hurt clients
  marked);
- ``labels.png``: the label counts of every client's partition (flwr-datasets);
- ``split-diagnostic.png`` (FFGG family): mean and max ||Delta_m|| per round.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pflower.strategies.history import RoundLog, train_loss

if TYPE_CHECKING:
    from pflower.config import Config

log = logging.getLogger("flwr.pflower")


@dataclasses.dataclass
class RunReport:
    """What a run produced, in the form the files and the table are written from."""

    cfg: Config
    split: str
    num_nodes: int
    rounds: list  # of RoundLog
    clients: list[dict]
    seconds: float
    #: the final shared parameters (saved as ``final-shared.pt``), if known
    shared: dict | None = None
    #: where ``write`` put the files
    path: Path | None = None

    @property
    def final(self) -> dict:
        evaluated = [r.evaluate for r in self.rounds if r.evaluate]
        return evaluated[-1] if evaluated else {}

    @property
    def dropped(self) -> int:
        return sum(sum(r.dropped.values()) for r in self.rounds)


SHARED_FILE = "final-shared.pt"


def provenance() -> dict:
    """What produced a run: versions, pflower's git commit (None outside a checkout), machine."""
    import platform
    import subprocess
    from importlib import metadata

    import pflower

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(pflower.__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "pflower": pflower.__version__,
        "flwr": metadata.version("flwr"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git-commit": commit,
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
    }


def output_dir(cfg: Config) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(cfg.outputs_dir).expanduser().resolve() / f"{stamp}-{cfg.algorithm}"
    suffix = 1
    while path.exists():
        suffix += 1
        path = path.with_name(f"{stamp}-{cfg.algorithm}-{suffix}")
    path.mkdir(parents=True)
    return path


def write(report: RunReport, out: Path | None = None) -> Path:
    """Write every output file (into ``out``, or a new output directory); return it."""
    out = out or output_dir(report.cfg)
    report.path = out
    if report.shared is not None:  # what a device loads next to its personal layers
        torch.save(report.shared, out / SHARED_FILE)
    (out / "config.json").write_text(
        json.dumps(
            {
                "run-config": report.cfg.to_flat(),
                "seed": report.cfg.seed,
                "split": report.split,
                "num-nodes": report.num_nodes,
                "produced-by": provenance(),
            },
            indent=2,
        )
    )
    (out / "results.json").write_text(
        json.dumps(
            {
                "rounds": [dataclasses.asdict(r) for r in report.rounds],
                "final": report.final,
                "dropped-replies": report.dropped,
                "seconds": report.seconds,
            },
            indent=2,
        )
    )
    if report.clients:
        keys = sorted({k for row in report.clients for k in row}, key=_column_order)
        with open(out / "clients.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            for row in sorted(report.clients, key=lambda r: r.get("partition-id", 0)):
                writer.writerow(row)
    try:  # plots are the one optional output: the extra 'plots' (in 'app') draws them
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        log.warning("pflower: no plots (matplotlib missing: pip install 'pflower[plots]')")
        return out
    _plot_rounds(report, out / "accuracy.png")
    _plot_clients(report, out / "clients.png")
    _plot_labels(report, out / "labels.png")
    if any("grad-norm-mean" in r.train for r in report.rounds):
        _plot_diagnostic(report, out / "split-diagnostic.png")
    if any("theta-error" in r.server for r in report.rounds):
        _plot_convergence(report, out / "convergence.png")
    return out


def _column_order(key: str) -> tuple[int, str]:
    first = ["partition-id", "num-examples", "num-train", "personal-accuracy", "global-accuracy"]
    return (first.index(key), key) if key in first else (len(first), key)


def _plot_rounds(report: RunReport, path: Path) -> None:
    """Left: pooled personalized and global test accuracy per evaluated round, the band from
    the p10 to the p90 client (RMSE for regression). Right: the clients' training loss every
    round and the pooled test losses: a diverging run shows here even between evaluations."""
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
    for ax in (acc_ax, loss_ax):
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.cfg.algorithm} on {report.cfg.dataset}, seed {report.cfg.seed}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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


# --- console ---------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 kB`` (decimal units, as network traffic is counted)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # unreachable: the loop returns at GB


def round_line(entry: RoundLog, num_rounds: int) -> str:
    """One aligned console line per round: seconds, training loss, pooled personalized and
    global test accuracy (RMSE for regression; "–" when the round was not evaluated),
    replies used, dropped, training bytes down / up."""
    width = len(str(num_rounds))
    loss = train_loss(entry.train)
    ev = entry.evaluate
    metric = "rmse" if "personal-rmse" in ev and "personal-accuracy" not in ev else "accuracy"

    def score(which: str) -> str:
        value = ev.get(f"{which}-{metric}")
        if value is None:
            return "     –" if metric == "accuracy" else "       –"
        return f"{100 * value:5.2f}%" if metric == "accuracy" else f"{value:8.4g}"

    wire = entry.wire
    return (
        f"round {entry.round:>{width}}/{num_rounds} | {entry.seconds:6.2f} s | train loss "
        + (f"{loss:8.4f}" if loss is not None else "       –")
        + f" | {metric} personalized {score('personal')} global {score('global')}"
        + f" | {int(entry.train.get('applied', 0)):>4} clients"
        + f" | {sum(entry.dropped.values()):>3} dropped"
        + f" | {human_bytes(wire.get('train-down', 0)):>8} down"
        + f" {human_bytes(wire.get('train-up', 0)):>8} up"
    )


#: Flower's own per-round and final log lines that the compact console replaces: the raw
#: metric dicts (pflower's round line and summary table say it once, rounded), the ``[ROUND]``
#: banner, the empty evaluate_fn result and the final dump of every round's metrics
#: (results.json holds all of it at full precision)
_FLOWER_VERBOSE = {
    "",
    "[ROUND %s/%s]",
    "\t└──> Aggregated MetricRecord: %s",
    "Global evaluation",
    "\t└──> MetricRecord: %s",
    "Initial global evaluation results: %s",
    "Final results:",
    "\t%s",
    "round %d: training on %d nodes",
}


class _Compact(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _FLOWER_VERBOSE


@contextlib.contextmanager
def console(cfg: Config):
    """While a run goes, ``console = "compact"`` keeps Flower's start-up and warnings and
    drops its per-round metric dicts and final dump (the round lines and the summary table
    replace them); ``"flower"`` leaves Flower's output as it is."""
    if cfg.console != "compact":
        yield
        return
    compact = _Compact()
    loggers = [logging.getLogger("flwr"), log]  # a logger's filter sees its own records
    for logger in loggers:
        logger.addFilter(compact)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(compact)


# --- tracking --------------------------------------------------------------------------------


class Tracker:
    """``tracking = "tensorboard"``: every round's training, evaluation, wire and timing
    numbers as TensorBoard scalars (``torch.utils.tensorboard``, event files in
    ``<run>/tensorboard/``; ``tensorboard --logdir outputs`` shows every run side by side).
    Nothing leaves the machine. ``"none"``: does nothing. A context manager: the writer is
    opened before the first round (a missing package fails then, naming the extra) and
    closed after the last."""

    def __init__(self, cfg: Config, out: Path) -> None:
        self.cfg, self.out, self.writer = cfg, out, None

    def __enter__(self) -> Tracker:
        if self.cfg.tracking == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                from pflower.config import ConfigError

                raise ConfigError(
                    "key 'tracking' = 'tensorboard': needs the tensorboard package "
                    f"({err}): pip install 'pflower[tracking]', or tracking 'none'"
                ) from None
            self.writer = SummaryWriter(log_dir=str(self.out / "tensorboard"))
            self.writer.add_text(
                "run-config", "\n".join(f"    {k} = {v!r}" for k, v in self.cfg.to_flat().items())
            )
        return self

    def add_round(self, entry: RoundLog) -> None:
        if self.writer is None:
            return
        groups = {
            "train": entry.train,
            "evaluate": entry.evaluate,
            "server": entry.server,
            "wire": entry.wire,
            "dropped": entry.dropped,
        }
        for group, values in groups.items():
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{group}/{key}", value, entry.round)
        self.writer.add_scalar("round/seconds", entry.seconds, entry.round)

    def __exit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.close()


def _pct(summary: dict, key: str) -> str:
    return f"{100 * summary[key]:6.2f}" if key in summary else "     –"


def _rounds(cfg: Config) -> str:
    if cfg.pretrain_rounds:
        return f"{cfg.pretrain_rounds} FedAvg + {cfg.num_server_rounds} rounds"
    return f"{cfg.num_server_rounds} rounds"


#: rows of the summary table: label, suffix of the statistic's key
_SUMMARY_ROWS = (
    ("pooled over examples", ""),
    ("mean over clients", "-mean"),
    ("p10 client", "-p10"),
    ("p50 client", "-p50"),
    ("p90 client", "-p90"),
    ("worst client", "-worst"),
)


def summary_table(report: RunReport) -> str:
    """A one-screen Markdown table of the final evaluation: test accuracy (%) over clients,
    or for regression runs the test RMSE, then the pooled loss."""
    s, cfg = report.final, report.cfg
    if "personal-rmse" in s and "personal-accuracy" not in s:  # regression
        title, metric, width, hurt_rule = "test RMSE", "rmse", 8, "personalized loss > global"
        cell = lambda key: f"{s[key]:.4g}" if key in s else "–"  # noqa: E731
    else:
        title, metric, width, hurt_rule = (
            "test accuracy (%)",
            "accuracy",
            6,
            "personalized < global",
        )
        cell = lambda key: _pct(s, key)  # noqa: E731
    lines = [
        f"pflower: {cfg.algorithm} | {cfg.model} | split {report.split} | {cfg.dataset} "
        f"({cfg.partitioner}) | {report.num_nodes} clients | {_rounds(cfg)} "
        f"| {report.seconds:.0f} s",
        "",
        f"| {title:<24} | personalized | {'global':>{width}} |",
        f"|{'-' * 26}|{'-' * 14}|{'-' * (width + 2)}|",
    ]
    for label, suffix in _SUMMARY_ROWS:
        personal, glob = cell(f"personal-{metric}{suffix}"), cell(f"global-{metric}{suffix}")
        lines.append(f"| {label:<24} | {personal:>12} | {glob:>{width}} |")
    loss = [f"{s[k]:.4g}" if k in s else "–" for k in ("personal-loss", "global-loss")]
    lines.append(f"| {'pooled loss':<24} | {loss[0]:>12} | {loss[1]:>{width}} |")
    hurt = s.get("clients-hurt")
    lines += [
        "",
        f"clients evaluated: {int(s.get('clients', 0))}; hurt by personalization "
        f"({hurt_rule}): {'–' if hurt is None else int(hurt)}; "
        f"dropped replies: {report.dropped}",
    ]
    if any("train-down" in r.wire for r in report.rounds):
        down, up = wire_per_round(report.rounds)
        lines.append(
            f"on the wire per training round (arrays, mean): {human_bytes(down)} down, "
            f"{human_bytes(up)} up"
        )
    return "\n".join(lines)


def wire_per_round(rounds: list) -> tuple[float, float]:
    """Mean array bytes of a training round sent to the clients and received from them."""
    trained = [r for r in rounds if "train-down" in r.wire]
    if not trained:
        return 0.0, 0.0
    down = sum(r.wire["train-down"] for r in trained) / len(trained)
    return down, sum(r.wire.get("train-up", 0) for r in trained) / len(trained)
