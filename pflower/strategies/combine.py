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
    """The run config's robust rule (``robust-*`` keys) that replaces the mean, or None."""
    name = cfg.robust_aggregator
    if name in ("none", "auto", AdaptiveClipping.name):
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


def adaptive_clipping(cfg: Config) -> AdaptiveClipping | None:
    """The default defence (``AdaptiveClipping``) where the run config asks for it: the
    rule resolved to ``adaptive-clipping`` (``auto`` for every algorithm without a rule of
    its own) and no differential privacy, whose clipping replaces every statistic across
    clients; else None."""
    if cfg.robust_aggregator not in ("auto", AdaptiveClipping.name) or cfg.dp != "none":
        return None
    return AdaptiveClipping(
        cfg.robust_clip_factor, cfg.robust_clip_iterations, cfg.update_norm_growth
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


#: rounds with fewer replies have no majority to measure the spread by (``AdaptiveClipping``)
MIN_SPREAD_REPLIES = 3


class AdaptiveClipping:
    """The default defence of every aggregating strategy (``robust-aggregator = "auto"``):
    each update is clipped into a ball around a robust centre whose radius follows the
    honest replies' spread; the algorithm's own (weighted) mean then combines the clipped
    updates. Centered clipping (Karimireddy, He & Jaggi, ICML 2021) with an adaptive radius
    instead of a fixed one, and applied *before* the algorithm's aggregation instead of
    replacing it, so that every algorithm keeps its own weights and formula.

    In a round of N >= ``MIN_SPREAD_REPLIES`` replies x_1..x_N (updates: gradients, deltas,
    or ``current - returned weights``), with ``d_i(v) = ||x_i - v||`` and
    ``tau(v) = factor x`` the lower median of the d_i(v) (the ceil(N/2)-th smallest: at most
    an honest reply's distance while at most floor(N/2) replies are Byzantine):

    1. v = the replies' plain mean. If no reply is farther than tau(v) from it, v is a fixed
       point of centered clipping and nothing is clipped: the algorithm aggregates exactly
       the replies it got (bit for bit what it computes without this rule).
    2. Otherwise v = the coordinate-wise median, then ``iterations`` times
       ``v <- v + mean_i c_i (x_i - v)``, ``c_i = min(1, tau(v) / d_i(v))``; each reply
       farther than tau(v) from the final v is replaced by ``v + c_i (x_i - v)``.

    **Guarantee.** Every applied update lies within ``tau`` of a centre that a minority
    cannot drag (a lower median and a coordinate-wise median), so a Byzantine reply moves a
    weighted mean by at most its weight share times ``tau + ||v - honest mean||``, whatever
    it sends: its magnitude beyond the ball buys nothing. In rounds of 1 or 2 replies there
    is no majority to measure the spread by: every update is clipped to norm ``rho``,
    ``growth`` x the largest norm a round of at least ``MIN_SPREAD_REPLIES`` replies applied
    (``||v|| + tau``); until such a round, nothing is clipped there (the update-norm bound
    still drops what is beyond it).

    State: ``rho`` per kind of update (``kind``: the pre-training updates, the algorithm's,
    each further record), checkpointed with the strategy.
    """

    name = "adaptive-clipping"

    def __init__(self, factor: float = 1.0, iterations: int = 3, growth: float = 2.0) -> None:
        if not factor >= 1:
            raise ValueError(f"adaptive clipping: factor = {factor}: must be >= 1")
        if iterations < 1:
            raise ValueError(f"adaptive clipping: iterations = {iterations}: must be >= 1")
        if not growth >= 1:
            raise ValueError(f"adaptive clipping: growth = {growth}: must be >= 1")
        self.factor, self.iterations, self.growth = factor, iterations, growth
        self.rho: dict[str, float] = {}  # per kind: the last multi-reply round's ||v|| + tau

    def clip(
        self,
        kind: str,
        vectors: Sequence[Mapping[str, np.ndarray]],
        center: Mapping[str, np.ndarray] | None = None,
        weights: Sequence[float] | None = None,
    ) -> tuple[list[Mapping[str, np.ndarray]], int]:
        """The replies with their updates clipped (returned weights stay returned weights:
        with ``center`` the update is ``center - vectors[i]``), and how many were clipped.
        An unclipped reply is returned as the same object. ``weights``: what the algorithm
        weighs each reply by (None: equal); a reply weighing more than the round's lower
        median weight w_m has its radius scaled by w_m / w_i, so that no reply's weighted
        distance from the centre exceeds w_m x tau, whatever it claims."""
        vectors = list(vectors)
        if not vectors:
            return vectors, 0
        share = np.ones(len(vectors))
        if weights is not None:  # radius x w_m / w_i above the lower median weight
            w = np.asarray(list(weights), dtype=np.float64)
            share = np.minimum(1.0, lower_median_of(w) / np.maximum(w, 1e-300))
        if center is not None:
            center = {k: np.asarray(c, dtype=np.float64) for k, c in center.items()}
        if len(vectors) < MIN_SPREAD_REPLIES:
            rho = self.rho.get(kind)
            if rho is None:
                return vectors, 0
            zero = {k: np.zeros(np.shape(a), np.float64) for k, a in vectors[0].items()}
            d = np.maximum(_distances(vectors, center, zero), 1e-300)
            return self._apply(vectors, center, zero, np.minimum(1.0, self.growth * rho / d))
        v = _mean(vectors, center)
        d = _distances(vectors, center, v)
        tau = self.factor * lower_median_of(d)
        if (d <= tau * share).all():
            self.rho[kind] = _norm(v) + tau
            return vectors, 0
        median = robust_combine(aggregators.CoordinateMedian(), vectors, 0, None)
        v = {k: m.astype(np.float64) for k, m in median.items()}
        if center is not None:  # the median of c - a_i is c - the median of the a_i
            v = {k: center[k] - m for k, m in v.items()}
        for _ in range(self.iterations):
            d = _distances(vectors, center, v)
            scale = np.minimum(1.0, self.factor * lower_median_of(d) / np.maximum(d, 1e-300))
            v = _step(vectors, center, v, scale)
        d = _distances(vectors, center, v)
        tau = self.factor * lower_median_of(d)
        self.rho[kind] = _norm(v) + tau
        return self._apply(vectors, center, v, np.minimum(1.0, tau * share / np.maximum(d, 1e-300)))

    @staticmethod
    def _apply(vectors, center, v, scale) -> tuple[list[Mapping[str, np.ndarray]], int]:
        """Reply i with its update x_i replaced by ``v + scale_i (x_i - v)`` where
        ``scale_i < 1``."""
        out, clipped = [], 0
        for a, c in zip(vectors, scale):
            if c >= 1.0:
                out.append(a)
                continue
            clipped += 1
            new = {}
            for k, ak in a.items():
                x = (center[k] - ak) if center is not None else ak.astype(np.float64)
                y = v[k] + c * (x - v[k])
                new[k] = np.asarray(center[k] - y if center is not None else y, dtype=ak.dtype)
            out.append(new)
        return out, clipped


def lower_median_of(values: np.ndarray) -> float:
    """The ceil(N/2)-th smallest value (``checks.lower_median``, for an array)."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    return float(ordered[(len(ordered) + 1) // 2 - 1])


def _update(a: np.ndarray, center: Mapping | None, k: str, out: np.ndarray) -> np.ndarray:
    """The update of one reply's layer ``k`` in float64 into ``out``: ``a``, or
    ``center[k] - a``."""
    if center is None:
        np.copyto(out, a, casting="unsafe")
    else:
        np.subtract(center[k], a, out=out, dtype=np.float64)
    return out


def _mean(vectors, center) -> dict[str, np.ndarray]:
    """The plain mean of the updates, in float64."""
    out = {}
    for k, first in vectors[0].items():
        acc, buf = np.zeros(np.shape(first)), np.empty(np.shape(first))
        for a in vectors:
            acc += _update(a[k], center, k, buf)
        out[k] = acc / len(vectors)
    return out


def _distances(vectors, center, v: Mapping[str, np.ndarray]) -> np.ndarray:
    """``||x_i - v||`` for every reply, accumulated layer by layer in float64."""
    sq = np.zeros(len(vectors))
    for k, vk in v.items():
        buf = np.empty(vk.shape)
        for i, a in enumerate(vectors):
            diff = np.subtract(_update(a[k], center, k, buf), vk, out=buf).reshape(-1)
            sq[i] += float(np.dot(diff, diff))
    return np.sqrt(sq)


def _step(vectors, center, v, scale: np.ndarray) -> dict[str, np.ndarray]:
    """One centered-clipping step ``v + mean_i scale_i (x_i - v)``."""
    n = len(vectors)
    out = {}
    for k, vk in v.items():
        acc, buf = vk * (1.0 - float(scale.sum()) / n), np.empty(vk.shape)
        for a, c in zip(vectors, scale):
            acc += (c / n) * _update(a[k], center, k, buf)
        out[k] = acc
    return out


def _norm(v: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.dot(x.reshape(-1), x.reshape(-1))) for x in v.values())))
