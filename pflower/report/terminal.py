"""What a run prints: one aligned line per round, the summary table at the end, and
Flower's per-round metric dumps left out (``console = "compact"``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING

from pflower.strategies.history import RoundLog, train_loss

if TYPE_CHECKING:
    from pflower.config import Config
    from pflower.report.results import RunReport

log = logging.getLogger("flwr.pflower")


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
    replies used, dropped, training bytes down / up; with differential privacy the run's
    epsilon so far (``dp-epsilon``)."""
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
        + (f" | ε {_epsilon(entry.train['dp-epsilon'])}" if "dp-epsilon" in entry.train else "")
    )


def loss_note(entry: RoundLog, algorithm: str) -> str | None:
    """Why a round that trained shows "train loss –" (None where it shows a loss): said once
    per run, under the first such round line."""
    if train_loss(entry.train) is not None or not entry.train.get("applied"):
        return None
    return (
        f"(train loss –: {algorithm}'s clients report no training loss with their replies, "
        "e.g. FFGG's gradient at the shared parameters; each evaluated round's test loss is "
        "in results.json)"
    )


def _epsilon(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.3g}"


def privacy_line(report) -> str | None:
    """The summary's privacy line: mode, clip, noise and the (epsilon, delta) spent."""
    spent = report.privacy  # results.json's privacy block
    if spent is None:
        return None
    clip = "adaptive, now " if spent["adaptive-clip"] else ""
    eps = "∞" if spent["epsilon"] is None else _epsilon(spent["epsilon"])
    line = (
        f"privacy: dp {spent['mode']} (user-level, shared updates) | clip {clip}"
        f"{spent['clip']:.3g} | noise multiplier {spent['noise-multiplier']:.3g} | ε = {eps} "
        f"at δ = {spent['delta']:g} after {spent['training-rounds']} training rounds"
    )
    line += f" | {spent['sampling']}: " + _by_accountant(spent["epsilon-by-accountant"])
    compared = spent.get("comparison-poisson-add-remove")
    if compared:
        line += " | had it been Poisson, add/remove (a comparison): " + _by_accountant(
            {k: v for k, v in compared.items() if k != "note"}
        )
    if "canary-epsilon" in spent:
        found = spent["canary-epsilon"]
        line += (
            f" | canary estimate ({spent['canaries']} canaries, final model): ε ≈ "
            f"{'∞' if found is None else _epsilon(found)}"
        )
    return line


def _by_accountant(epsilons: dict) -> str:
    """``RDP 8, PLD 7.9``: each accountant's epsilon."""
    return ", ".join(
        f"{name.upper()} {'∞' if eps is None else _epsilon(eps)}" for name, eps in epsilons.items()
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
    if report.refused:
        nodes = len({r["node"] for r in report.refused})
        lines.append(
            f"nodes refused at the start-up handshake, never sampled: {nodes} "
            "(results.json: refused-nodes)"
        )
    privacy = privacy_line(report)
    if privacy:
        lines.append(privacy)
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
