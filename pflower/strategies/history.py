"""Round history and per-client summaries (what results.json and the summary table are
written from): the training metrics of a round, the evaluation statistics of DESIGN.md's
protocol (pooled, mean, p10/p50/p90, worst, clients hurt), drops with their reasons."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pflower.wire import NUM_EXAMPLES


@dataclass
class RoundLog:
    """What happened in one round, for results.json."""

    round: int
    train: dict[str, float] = field(default_factory=dict)
    evaluate: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    server: dict[str, float] = field(default_factory=dict)  # server-side evaluation


def weighted_mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean of the numeric metrics of the replies, weighted by ``num-examples``."""
    weights = np.asarray([r[NUM_EXAMPLES] for r in rows], dtype=float)
    out = {NUM_EXAMPLES: float(weights.sum())}
    keys = {k for r in rows for k, v in r.items() if isinstance(v, (int, float))} - {NUM_EXAMPLES}
    for key in sorted(keys):
        pairs = [(r[key], w) for r, w in zip(rows, weights) if key in r and np.isfinite(r[key])]
        if pairs:
            values, ws = zip(*pairs)
            out[key] = float(np.average(values, weights=ws))
    return out


def summarize_clients(rows: list[dict[str, float]]) -> dict[str, float]:
    """Pooled and per-client statistics of personalized (and global) test accuracy and loss."""
    n = np.asarray([r[NUM_EXAMPLES] for r in rows], dtype=float)
    out: dict[str, float] = {"clients": len(rows), NUM_EXAMPLES: float(n.sum())}
    for which in ("personal", "global", "localized"):
        if not all(f"{which}-loss" in r for r in rows):
            continue
        loss = np.asarray([r[f"{which}-loss"] for r in rows], dtype=float)
        out[f"{which}-loss"] = float((loss * n).sum() / n.sum())
        if all(f"{which}-rmse" in r for r in rows):  # regression: pooled over test examples
            rmse = np.asarray([r[f"{which}-rmse"] for r in rows], dtype=float)
            out[f"{which}-rmse"] = float(np.sqrt((rmse**2 * n).sum() / n.sum()))
            out[f"{which}-rmse-mean"] = float(rmse.mean())
            for q in (10, 50, 90):
                out[f"{which}-rmse-p{q}"] = float(np.percentile(rmse, q))
            out[f"{which}-rmse-worst"] = float(rmse.max())
        if not all(f"{which}-accuracy" in r for r in rows):
            continue
        acc = np.asarray([r[f"{which}-accuracy"] for r in rows], dtype=float)
        out[f"{which}-accuracy"] = float((acc * n).sum() / n.sum())  # pooled over test examples
        out[f"{which}-accuracy-mean"] = float(acc.mean())
        for q in (10, 50, 90):
            out[f"{which}-accuracy-p{q}"] = float(np.percentile(acc, q))
        out[f"{which}-accuracy-worst"] = float(acc.min())
    if "global-accuracy" in out:
        out["clients-hurt"] = int(sum(r["personal-accuracy"] < r["global-accuracy"] for r in rows))
    elif "global-loss" in out:
        out["clients-hurt"] = int(sum(r["personal-loss"] > r["global-loss"] for r in rows))
    return out
