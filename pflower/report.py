"""Run outputs: ``outputs/<timestamp>-<algorithm>/`` and the summary table.

- ``config.json``: the run config (flat dashed keys), the split actually used, and what
  produced the run: pflower / flwr / torch / Python versions, the git commit of pflower's
  source tree if it is one, the machine;
- ``results.json``: per round: train aggregates, evaluate aggregates, dropped replies with
  reasons, seconds; and the final evaluation;
- ``clients.csv``: final per-client personalized and global metrics;
- ``accuracy.png``: pooled personalized/global test accuracy per evaluated round;
- ``clients.png``: per-client accuracy, personalized vs global, sorted;
- ``split-diagnostic.png`` (FFGG family): mean and max ||Delta_m|| per round.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

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
    if any("grad-norm-mean" in r.train for r in report.rounds):
        _plot_diagnostic(report, out / "split-diagnostic.png")
    if any("theta-error" in r.server for r in report.rounds):
        _plot_convergence(report, out / "convergence.png")
    return out


def _column_order(key: str) -> tuple[int, str]:
    first = ["partition-id", "num-examples", "num-train", "personal-accuracy", "global-accuracy"]
    return (first.index(key), key) if key in first else (len(first), key)


def _plot_rounds(report: RunReport, path: Path) -> None:
    """Test accuracy per evaluated round (test loss for regression problems)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    evaluated = [r for r in report.rounds if r.evaluate]
    metric = "accuracy" if any("personal-accuracy" in r.evaluate for r in evaluated) else "loss"
    for which, style in (("personal", "-o"), ("global", "--s")):
        points = [
            (r.round, r.evaluate[f"{which}-{metric}"])
            for r in evaluated
            if f"{which}-{metric}" in r.evaluate
        ]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, style, label=f"{which} (pooled)")
    ax.set_xlabel("round")
    ax.set_ylabel(f"test {metric}")
    ax.set_title(f"{report.cfg.algorithm} on {report.cfg.dataset}")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_clients(report: RunReport, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    metric = "accuracy" if any("personal-accuracy" in r for r in report.clients) else "loss"
    for which, style in (("personal", "-o"), ("global", "--s")):
        vals = sorted(r[f"{which}-{metric}"] for r in report.clients if f"{which}-{metric}" in r)
        if vals:
            ax.plot(range(1, len(vals) + 1), vals, style, label=which)
    ax.set_xlabel(f"client (sorted by {metric})")
    ax.set_ylabel(f"test {metric}")
    ax.set_title(f"per-client {metric}, final round")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    return "\n".join(lines)
