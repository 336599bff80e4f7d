"""Combining the clients' update vectors: the (weighted) mean in float64, or the run
config's robust rule (``aggregators``), read straight from the replies: never all N updates
at once in float64, never a second copy of the replies for a coordinate-wise rule."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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
    w = _normalized(weights)
    out = {}
    for k, first in arrays[0].items():
        acc, term = np.zeros(first.shape), np.empty(first.shape)
        for wi, a in zip(w, arrays):
            _accumulate(acc, term, a[k], wi)
        out[k] = acc
    return out


def weighted_mean_of_updates(
    current: Mapping[str, np.ndarray],
    arrays: list[Mapping[str, np.ndarray]],
    weights: Iterable[float],
) -> dict[str, np.ndarray]:
    """``weighted_mean`` of the updates ``current - a_i``, streamed: one layer of one reply
    in float64 at a time instead of N float64 copies of the model.

    Computed as ``c - sum_i w_i a_i`` (the weights sum to 1): the same value as
    ``sum_i w_i (c - a_i)`` up to float64 rounding (~1e-16 relative), with the difference
    taken once per layer, not once per reply (issue 29: two passes over a reply's values
    instead of three)."""
    out = weighted_mean(arrays, weights)
    for k, c in current.items():
        np.subtract(c.astype(np.float64), out[k], out=out[k])
    return out


def _normalized(weights: Iterable[float]) -> np.ndarray:
    w = np.asarray(list(weights), dtype=np.float64)
    return w / w.sum()


def _accumulate(acc: np.ndarray, term: np.ndarray, value: np.ndarray, weight: float) -> None:
    """``acc += weight * float64(value)``, in place through the float64 buffer ``term``: the
    same float64 products and sums, in the same order, as ``sum(w_i * a_i)``, without a fresh
    array per reply and layer, whose pages the kernel hands out anew each time (~1 ms for a
    1.2 MB layer on a virtual machine: issue 29's per-reply server cost). The product is
    taken in float64 (``dtype``): a float32 reply times a Python float would otherwise be
    multiplied in float32."""
    np.multiply(value, weight, out=term, dtype=np.float64)
    np.add(acc, term, out=acc)


def robust_combine(
    rule: Aggregator,
    arrays: Sequence[Mapping[str, np.ndarray]],
    f: int,
    center: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """``rule`` over the update vectors ``u_i = arrays[i]``, or ``center - arrays[i]`` with
    ``center`` (returned weights), reading the arrays (the replies' bytes) in place.

    A coordinate-wise rule (median, trimmed mean, their bucketing) goes layer by layer, tile
    by tile (``aggregators.tile_columns`` coordinates x N replies, transposed so that each
    coordinate's N values are contiguous): memory stays at two tiles whatever N and d. With
    ``center`` it uses rule(c - x) = c - rule(x) (the rule commutes with the reflection and
    the shift: an order statistic of c - x is c minus the mirrored one of x, and a mean of
    them likewise), so no update is ever formed; for odd N the median is bit for bit that of
    the updates, otherwise equal to float rounding. Any other rule gets one N x d stack
    (float32 unless the model is float64) filled row by row from the replies, the updates
    formed one layer at a time.
    """
    n = len(arrays)
    rule.check(n, f)
    if not rule.coordinatewise:
        X, layout = aggregators.stack(arrays, center)
        return aggregators.unstack(rule.aggregate(X, f), layout)
    reduce = rule.columns(n, f)
    step = aggregators.tile_columns(n)
    out = {}
    for name, first in arrays[0].items():
        size, dtype = first.size, np.promote_types(first.dtype, np.float32)
        flats = [np.asarray(a[name]).reshape(-1) for a in arrays]
        rows = np.empty((n, min(step, size)), dtype)  # filled by contiguous copies, then
        tile = np.empty((min(step, size), n), dtype)  # transposed in one pass
        result = np.empty(size, dtype)
        for lo in range(0, size, step):
            width = min(step, size - lo)
            for row, flat in zip(rows, flats):
                row[:width] = flat[lo : lo + width]
            np.copyto(tile[:width], rows[:, :width].T)
            result[lo : lo + width] = reduce(tile[:width])
        if center is not None:
            result = np.subtract(center[name].reshape(-1), result, dtype=dtype)
        out[name] = result.reshape(first.shape).astype(first.dtype, copy=False)
    return out
