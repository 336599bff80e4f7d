"""Combining the clients' update vectors: the (weighted) mean in float64, or the run
config's robust rule (``aggregators``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from pflower.strategies import aggregators
from pflower.strategies.aggregators import Aggregator

if TYPE_CHECKING:
    from pflower.config import Config


def robust_aggregator(cfg: Config) -> Aggregator | None:
    """The run config's robust rule (``robust-*`` keys), or None."""
    name = cfg.robust_aggregator
    if name in ("none", "auto"):
        return None
    options = {
        "trimmed-mean": {"beta": cfg.robust_trim_beta},
        "krum": {"m": 1},
        "multi-krum": {"m": cfg.robust_krum_m},
        "centered-clipping": {
            "radius": cfg.robust_clip_radius,
            "iterations": cfg.robust_clip_iterations,
        },
    }.get(name, {})
    return aggregators.make_aggregator(
        name, bucket_size=cfg.robust_bucket_size, seed=cfg.seed, **options
    )


def weighted_mean(
    arrays: list[Mapping[str, np.ndarray]], weights: Iterable[float]
) -> dict[str, np.ndarray]:
    """Sum_i w_i a_i / Sum_i w_i, name by name, in float64 then cast back by the caller."""
    w = np.asarray(list(weights), dtype=np.float64)
    w = w / w.sum()
    return {k: sum(wi * a[k].astype(np.float64) for wi, a in zip(w, arrays)) for k in arrays[0]}


def weighted_mean_of_updates(
    current: Mapping[str, np.ndarray],
    arrays: list[Mapping[str, np.ndarray]],
    weights: Iterable[float],
) -> dict[str, np.ndarray]:
    """``weighted_mean`` of the updates ``current - a_i``, bit for bit, streamed: one layer
    of one reply in float64 at a time instead of N float64 copies of the model."""
    w = np.asarray(list(weights), dtype=np.float64)
    w = w / w.sum()
    out = {}
    for k, c in current.items():
        c64 = c.astype(np.float64)
        out[k] = sum(wi * (c64 - a[k]) for wi, a in zip(w, arrays))
    return out
