"""The reply pipeline's combine stage: the clients' update vectors combined into one step, by
one of four modes, each a class with one implementation (``Combine``):

- ``Mean``: the algorithm's (weighted) mean, in float64;
- ``ClippedMean``: the default defence, the mean of the updates clipped into a ball around a
  robust centre (``AdaptiveClipping``), rounds of 1 or 2 replies clipped by the small-round
  clip (its state, ``rho``, is the clip's own output of the last larger round);
- ``RobustRule``: a robust rule (``aggregators``) with its f, unweighted, the small-round clip
  in its place where it would combine fewer than ``MIN_RULE_INPUTS`` values;
- ``CentralDP``: the clipped, noised mean over the sampled clients (``privacy.Mechanism``).

Which mode a run takes is decided once, by the pipeline's builder (``pipeline.build``). Every
mode reads the replies in place: never all N updates at once in float64, never a second copy
of the replies for a coordinate-wise rule. An algorithm asks the mode what it preserves
(``weighted``, ``exact_mean``, ``single_release``) where its own formula depends on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pflower.strategies import aggregators
from pflower.strategies.aggregators import Aggregator, Span
from pflower.strategies.bound import RecentNormClip
from pflower.strategies.privacy import noise_rng

if TYPE_CHECKING:
    from pflower.settings import RunSettings


def robust_aggregator(cfg: RunSettings) -> Aggregator | None:
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
    # beside the clip (robust-small-rounds = "clip") buckets shrink before the rule would
    # combine fewer than MIN_RULE_INPUTS values; the clip takes only rounds of fewer replies
    min_buckets = MIN_RULE_INPUTS if cfg.robust_small_rounds == "clip" else 1
    return aggregators.make_aggregator(
        name,
        bucket_size=cfg.robust_bucket_size,
        seed=cfg.seed,
        min_buckets=min_buckets,
        **options,
    )


def adaptive_clipping(cfg: RunSettings) -> AdaptiveClipping | None:
    """The default defence (``AdaptiveClipping``) where the run config asks for it: the
    rule resolved to ``adaptive-clipping`` (``auto`` for every algorithm without a rule of
    its own), or a rule's rounds too small for it (``robust-small-rounds = "clip"``, FFGG's
    default defence), and no differential privacy, whose clipping replaces every statistic
    across clients; else None."""
    wanted = cfg.robust_aggregator in ("auto", AdaptiveClipping.name)
    if not (wanted or cfg.robust_small_rounds == "clip") or cfg.dp != "none":
        return None
    return AdaptiveClipping(
        cfg.robust_clip_factor,
        cfg.robust_clip_iterations,
        cfg.update_norm_growth,
        cfg.robust_copy_votes,
        cfg.robust_node_history,
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
    taken once per layer, not once per reply (two passes over a reply's values instead of
    three)."""
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
    1.2 MB layer on a virtual machine, most of a reply's server cost). The product is
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
#: beside a robust rule (``robust-small-rounds = "clip"``) the clip replaces it where it
#: combines fewer values than this (``PersonalizedStrategy.combine``)
MIN_RULE_INPUTS = 5
#: the largest round size the refusal of a rule's f searches for one that works
MAX_SAMPLE_SEARCHED = 1000
#: columns per chunk of the Gram matrix (N x CHUNK float64: a few hundred kB, in cache)
GRAM_CHUNK = 8192


class AdaptiveClipping:
    """The default defence of every aggregating strategy (``robust-aggregator = "auto"``):
    each update is clipped into a ball around a robust centre whose radius follows the
    honest replies' spread, and the algorithm's own (weighted) mean then combines the clipped
    updates. Centered clipping (Karimireddy, He & Jaggi, ICML 2021) with an adaptive radius
    instead of a fixed one, applied *before* the algorithm's mean instead of replacing it, so
    that every algorithm keeps its own weights and formula.

    In a round of N >= ``MIN_SPREAD_REPLIES`` replies x_1..x_N (updates: gradients, deltas,
    or ``current - returned weights``) weighing w_1..w_N in the algorithm's mean, with
    ``d_i(v) = ||x_i - v||``, ``tau(v) = factor x`` the lower median of the d_i(v) (the
    ceil(N/2)-th smallest: at most an honest reply's distance while at most floor(N/2)
    replies are Byzantine) and ``s_i = min(1, w_m / w_i)``, w_m the lower median weight:

    1. v = the replies' plain mean. If no reply is farther than ``tau(v) s_i`` from it,
       nothing is clipped: the algorithm aggregates the replies it got, bit for bit.
    2. Otherwise v = their geometric median (Weiszfeld's iterations: robust while fewer
       than half are Byzantine), then ``iterations`` centered-clipping steps
       ``v <- v + mean_i c_i (x_i - v)``, ``c_i = min(1, tau(v) / d_i(v))``; and each reply is
       replaced by ``v + c_i (x_i - v)``, ``c_i = min(1, tau(v) s_i / d_i(v))``.

    Every v is a combination of the replies, so all of it runs on their N x N Gram matrix
    (one pass over the replies, in float64) and the clipped mean is the mean of the replies
    under other weights: ``sum_i w_i x~_i = sum_i beta_i x_i`` (``coefficients``), read
    straight from the replies as the algorithm's own mean is. The server pays one pass more
    per round than the mean, never a copy of the replies.

    **Guarantee.** Every applied update lies within tau of a centre a minority cannot drag,
    tau is at most ``factor`` x an honest reply's distance to it, and a reply's weighted
    distance from it at most ``w_m tau``: f Byzantine replies move the weighted mean by at
    most ``f w_m tau / sum_i w_i`` from where it would be with them at the centre
    (``f tau / N`` with equal weights), whatever they send and claim. In rounds of 1 or 2
    replies there is no majority to measure the spread by: each update is clipped to norm
    ``growth x rho``, rho the largest norm the last round of at least ``MIN_SPREAD_REPLIES``
    replies applied (``||v|| + tau``).

    **Before such a round** (a federation of 3 or more nodes that samples 1 or 2 a round) the
    majority is sought across rounds, one vote per node: each reply is clipped to ``growth`` x the
    lower median of the latest update norm of each of the last ``CLIP_POOL`` distinct nodes that
    replied (its own norm as its node's entry; ``bound.RecentNormClip``, the clip of asynchronous
    FFGG), and while no other node's norm is known nothing is applied (norm 0: the first reply
    cannot be told from a Byzantine one; asynchronous FFGG's provisional 0.05 x ||theta||, turned
    around, took a 10-node digits run from 60% to 6%). While at most half of those nodes are
    Byzantine the bound is at most ``growth`` x an honest node's norm, however often the Byzantine
    ones are sampled. Without it a Byzantine reply in such a federation was accepted at about
    ``||theta||`` (the update-norm bound's scale before a round of 2 seeds it), which wrecked theta
    and stopped the run (``RunFailed``; one Byzantine client in ten, one reply a round:
    docs/threat-model.md). A federation of 1 or 2 nodes has no majority at all: nothing is clipped
    there before rho (the update-norm bound still drops what is beyond it).

    State: ``rho`` and the recent-norm clip per kind of update (``kind``: the
    pre-training updates, the algorithm's, each further record), checkpointed with the
    strategy.
    """

    name = "adaptive-clipping"
    #: a checkpoint written before shared votes existed restores an object without them
    copies = False
    last_shared = 0
    #: the same for node history (``history``)
    history = False
    last_distrusted = last_far = 0
    last_c: np.ndarray | None = None

    def __init__(
        self,
        factor: float = 1.0,
        iterations: int = 3,
        growth: float = 2.0,
        copies: bool = False,
        history: bool = False,
    ) -> None:
        if not factor >= 1:
            raise ValueError(f"adaptive clipping: factor = {factor}: must be >= 1")
        if iterations < 1:
            raise ValueError(f"adaptive clipping: iterations = {iterations}: must be >= 1")
        if not growth >= 1:
            raise ValueError(f"adaptive clipping: growth = {growth}: must be >= 1")
        self.factor, self.iterations, self.growth = factor, iterations, growth
        self.copies = bool(copies)
        self.last_shared = 0  # the replies of the last round that shared a vote
        self.history = bool(history)
        #: per node: the clip factors c_i of its last ``STANDING_ROUNDS`` replies
        self.standing: dict[int, list[float]] = {}
        self.last_distrusted = 0  # the replies of the last round whose node was distrusted
        self.last_c = None  # each reply's clip factor in the last round of >= 3 replies
        self.rho: dict[str, float] = {}  # per kind: the last multi-reply round's ||v|| + tau
        #: per kind, before rho: the nodes' recent norms (rounds of 1 or 2 replies)
        self.recent: dict[str, RecentNormClip] = {}

    def coefficients(
        self,
        kind: str,
        vectors: Sequence[Mapping[str, np.ndarray]],
        weights: Sequence[float],
        center: Mapping[str, np.ndarray] | None = None,
        nodes: Sequence[int] | None = None,
        population: int = 0,
        trust: np.ndarray | None = None,
    ) -> tuple[np.ndarray | None, int]:
        """``beta`` with ``sum_i beta_i x_i = sum_i w^_i x~_i`` (``w^`` the weights
        normalized, ``x~`` the clipped updates; x_i = ``vectors[i]``, or ``center -
        vectors[i]`` for returned weights) and how many replies were clipped; ``None`` where
        none was (the algorithm's own mean applies as it is). For the rounds of 1 or 2 replies
        before any round of 3: ``nodes``, the node of each vector; ``population``, how many
        nodes the round was sampled from; without them nothing is clipped there."""
        n = len(vectors)
        self.last_distrusted, self.last_far, self.last_c = 0, 0, None
        w = np.asarray(list(weights), dtype=np.float64)
        w_hat = w / w.sum()
        share = np.minimum(1.0, lower_median_of(w) / np.maximum(w, 1e-300))
        space = Span(_gram(vectors, center))
        if n < MIN_SPREAD_REPLIES:  # no majority in the round: clipped around 0
            norms = space.norms()
            limits = self._small_round_limits(kind, norms, nodes, population)
            if limits is None:
                return None, 0
            c = np.minimum(1.0, limits / np.maximum(norms, 1e-300))
            return (w_hat * c, int((c < 1).sum())) if (c < 1).any() else (None, 0)
        gamma = np.full(n, 1.0 / n)
        votes = self.votes(vectors)
        self.last_shared = int((votes < 1).sum())
        if trust is not None and (trust < 1).any() and (votes * trust).sum() > 0:
            votes = votes * trust  # a distrusted node's say shrinks with its standing
            self.last_distrusted = int((trust < 1).sum())
        d = space.distances(gamma)
        tau = self.factor * lower_median_of(d, votes)
        if not self.last_shared and not self.last_distrusted and (d <= tau * share).all():
            self.rho[kind] = space.norm(gamma) + tau
            self.last_c = np.ones(n)
            return None, 0
        if self.last_distrusted:  # Weiszfeld from the trusted replies' mean
            gamma = votes / votes.sum()
        gamma = space.geometric_median(gamma, weights=votes)
        total = votes.sum()
        for _ in range(self.iterations):
            d = space.distances(gamma)
            c = np.minimum(1.0, self.factor * lower_median_of(d, votes) / np.maximum(d, 1e-300))
            c = c * votes
            gamma = gamma * (1.0 - c.sum() / total) + c / total
        d = space.distances(gamma)
        tau = self.factor * lower_median_of(d, votes)
        self.rho[kind] = space.norm(gamma) + tau
        c = np.minimum(1.0, tau * share / np.maximum(d, 1e-300))
        # each reply's reach: the share of it the radius keeps, whatever its claim (a node
        # with 4 x the lower-median data is clipped to a quarter of the radius every round:
        # that says nothing about its direction); 1 within the radius, a radius of 0 too
        reach = np.where(d <= tau, 1.0, tau / np.maximum(d, 1e-300))
        self.last_c = reach
        # a new node's reply (its standing shorter than MIN_STANDING) clipped to less than
        # FAR_OFF of its length weighs nothing in this round's mean: its standing cannot
        # judge it yet, and a boosted backdoor's first replies planted it for the run
        far = (reach < FAR_OFF) & self.on_probation(nodes, n)
        if self.history and far.any() and (w_hat * votes * ~far).sum() > 0:
            votes = np.where(far, 0.0, votes)
            self.last_far = int(far.sum())
        if self.last_shared or self.last_distrusted or self.last_far:
            # the algorithm's weights, a vote's replies splitting one's, a distrusted node's
            # shrunk by its standing, a far-off reply's 0
            w_hat = w_hat * votes / float((w_hat * votes).sum())
        # sum_i w^_i (v + c_i (x_i - v)) with v = sum_j gamma_j x_j
        return w_hat * c + float((w_hat * (1.0 - c)).sum()) * gamma, int((c < 1).sum())

    def trust(self, nodes: Sequence[int] | None) -> np.ndarray | None:
        """Each node's trust for a round of its replies: ``min(1, s / TRUST_LEVEL)``, s the
        median clip factor of its last ``STANDING_ROUNDS`` replies, a node with fewer than
        ``MIN_STANDING`` padded with 1s to that many (a new node is trusted; one reply of an
        honest node clipped hard in its first round, as a round the attackers held clips the
        honest ones, does not distrust it: two of its first three must be); None where
        ``history`` is off or the nodes are unknown.

        Why: an attacker that sends a large update in every round it is sampled (the
        adaptive attack: its honest update turned around at the largest accepted norm) is
        clipped to a small fraction of its length in each round it is a minority of, and in
        a round where it and its like are a majority they are the radius's replies and the
        round is theirs (3 of 5 replies at 3 of 10 attackers: 8 % of rounds). Its history of
        clipping is what tells it apart: honest replies are clipped to 0.45-1 of their length
        (the main job, clean and attacked, median per node 0.65-1), its own to below 0.01.
        A distrusted node's vote shrinks in the centre, the radius and the algorithm's mean,
        so that a round of a distrusted majority is placed and sized by the trusted replies,
        and a node that keeps sending what is clipped away keeps losing its say. A node
        clipped to half its length or more in most of its recent rounds keeps its whole say;
        what is clipped less never moved anyone's weight."""
        if not self.history or nodes is None:
            return None
        standing = self.__dict__.setdefault("standing", {})
        out = np.ones(len(nodes))
        for i, node in enumerate(nodes):
            record = standing.get(int(node))
            if record:  # a new node's first replies count beside a clean record
                record = record + [1.0] * (MIN_STANDING - len(record))
                out[i] = min(1.0, float(np.median(record)) / TRUST_LEVEL)
        return out

    def on_probation(self, nodes: Sequence[int] | None, n: int) -> np.ndarray:
        """Which of a round's ``n`` replies come from a node with fewer than
        ``MIN_STANDING`` replies in its standing (all of them where the nodes are unknown)."""
        if nodes is None or len(nodes) != n:
            return np.ones(n, dtype=bool)
        standing = self.__dict__.setdefault("standing", {})
        return np.array([len(standing.get(int(node), ())) < MIN_STANDING for node in nodes])

    def remember(self, nodes: Sequence[int] | None) -> None:
        """Add the last round's clip factors (``last_c``) to its nodes' standing."""
        if not self.history or nodes is None or self.last_c is None:
            return
        if len(nodes) != len(self.last_c):  # a caller's bug must not switch the history off
            raise ValueError(
                f"adaptive clipping: {len(nodes)} nodes for {len(self.last_c)} replies"
            )
        standing = self.__dict__.setdefault("standing", {})
        for node, c in zip(nodes, self.last_c):
            record = standing.setdefault(int(node), [])
            record.append(float(c))
            del record[:-STANDING_ROUNDS]

    def votes(self, vectors: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
        """Each reply's vote: 1 / the number of replies (itself included) that are the same
        vector, bit for bit (all ones where ``copies`` is off, or where every reply is the
        same). Replies that send one vector count as one reply between them: the literature's
        colluding attacks (IPM, ALIE, Min-Max, Min-Sum) send one vector from every attacker,
        which is what lets them outvote the honest replies of a round (a majority of copies is
        the round's centre, radius 0) and push by f tau / N; honest clients' updates differ by
        their data and their SGD noise (FoolsGold's signal, Fung, Yoon & Beschastnikh, RAID
        2020, per round). The replies' bytes are compared, not their Gram
        matrix, whose pairwise distances cancel to noise when one reply is 1e6 times the
        others: a sample of each reply's values first (``_fingerprint``, a few hundred bytes),
        then the whole bytes of the replies whose samples agree, so that a round of distinct
        replies costs no pass over them. An attacker that decorrelates its copies escapes this
        at a small cost to its pull: then the per-reply bound holds."""
        n = len(vectors)
        if not self.copies or n < MIN_SPREAD_REPLIES:
            return np.ones(n)
        same = np.ones(n)  # how many replies each reply is the same vector as, itself included
        by_sample: dict[bytes, list[int]] = {}
        for i, v in enumerate(vectors):
            by_sample.setdefault(_fingerprint(v), []).append(i)
        for members in by_sample.values():
            for i in members:
                same[i] = sum(_same_bytes(vectors[i], vectors[j]) for j in members)
        votes = 1.0 / same
        return np.ones(n) if (votes == votes[0]).all() else votes

    def _small_round_limits(
        self,
        kind: str,
        norms: np.ndarray,
        nodes: Sequence[int] | None,
        population: int,
    ) -> np.ndarray | None:
        """Each reply's clip in a round of 1 or 2: ``growth x rho``; before any round of 3,
        the recent-norm clip (``bound.RecentNormClip``, factor ``growth``; 0 while no other
        node's norm is known); None (nothing clipped) in a federation of fewer than 3 nodes."""
        rho = self.rho.get(kind)
        if rho is not None:
            return np.full(len(norms), self.growth * rho)
        if nodes is None or population < MIN_SPREAD_REPLIES:
            return None
        if len(nodes) != len(norms):  # a caller's bug must not switch the clip off unseen
            raise ValueError(f"adaptive clipping: {len(nodes)} nodes for {len(norms)} updates")
        # a checkpoint written before ``recent`` existed restores an object without it
        clip = self.__dict__.setdefault("recent", {}).get(kind)
        if clip is None:
            clip = self.recent[kind] = RecentNormClip(self.growth)
        pairs = [(int(node), float(norm)) for node, norm in zip(nodes, norms)]
        for node, norm in pairs:  # a round's two replies each count the other's norm
            clip.record(node, norm)
        return np.array([clip.threshold(node, norm, 0.0) for node, norm in pairs])


#: a node's standing: the clip factors of its last this many replies (rounds of >= 3), the
#: median of them below which its trust shrinks, and the record a new node's is padded to
#: with 1s (``AdaptiveClipping.trust``)
STANDING_ROUNDS, TRUST_LEVEL, MIN_STANDING = 8, 0.5, 3
#: a robust rule gives its round to the clip where a node's trust is below this
RULE_DISTRUST = 0.25
#: a reply whose reach (the share of it the radius keeps) is below this weighs nothing in
#: its round's mean (``AdaptiveClipping.coefficients``, with ``history``)
FAR_OFF = 0.25

#: values of each array sampled for a reply's fingerprint (``AdaptiveClipping.votes``)
FINGERPRINT_VALUES = 64


def _fingerprint(vector: Mapping[str, np.ndarray]) -> bytes:
    """Names, shapes, dtypes and up to ``FINGERPRINT_VALUES`` evenly strided values of each
    array: equal for two replies that are the same vector (and, rarely, for two that are
    not: ``_same_bytes`` decides)."""
    parts = []
    for k in sorted(vector):
        a = np.asarray(vector[k]).reshape(-1)
        step = max(1, a.size // FINGERPRINT_VALUES)
        parts.append(f"{k}|{a.shape}|{a.dtype}|".encode() + a[::step].tobytes())
    return b"".join(parts)


def _same_bytes(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    """Whether two replies are the same vector, bit for bit (names, dtypes, shapes, bytes)."""
    if a is b:
        return True
    if sorted(a) != sorted(b):
        return False
    for k in a:
        x, y = np.ascontiguousarray(a[k]), np.ascontiguousarray(b[k])
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)):
            return False
    return True


def _gram(vectors, center) -> np.ndarray:
    """The (N+1) x (N+1) Gram matrix of ``y_i = x_i - x_0`` (i < N) and ``x_0``, in float64
    over column chunks (``GRAM_CHUNK``): the differences first, so that a large common
    part (returned weights, or a shared drift) does not cancel precision away. For returned
    weights x_i = c - a_i, so y_i = a_0 - a_i without forming an update."""
    n = len(vectors)
    gram = np.zeros((n + 1, n + 1))
    for k in vectors[0]:
        flats = [np.asarray(v[k]).reshape(-1) for v in vectors]
        c = None if center is None else np.asarray(center[k]).reshape(-1)
        size = flats[0].size
        buf = np.empty((n + 1, min(GRAM_CHUNK, size)))
        for lo in range(0, size, GRAM_CHUNK):
            hi = min(lo + GRAM_CHUNK, size)
            b, a0 = buf[:, : hi - lo], flats[0][lo:hi]
            for row, f in zip(b, flats):
                if center is None:
                    np.subtract(f[lo:hi], a0, out=row)
                else:
                    np.subtract(a0, f[lo:hi], out=row)
            if center is None:
                np.copyto(b[n], a0)
            else:
                np.subtract(c[lo:hi], a0, out=b[n])
            gram += b @ b.T
    return gram


def linear_update(
    vectors: Sequence[Mapping[str, np.ndarray]],
    beta: Sequence[float],
    center: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """``sum_i beta_i x_i`` (x_i = ``vectors[i]``, or ``center - vectors[i]``), coefficients as
    given (not normalized), in float64, streamed as ``weighted_mean``."""
    beta = np.asarray(list(beta), dtype=np.float64)
    out = {}
    for k, first in vectors[0].items():
        acc, term = np.zeros(np.shape(first)), np.empty(np.shape(first))
        for b, a in zip(beta, vectors):
            _accumulate(acc, term, a[k], float(b))
        if center is not None:  # sum_i b_i (c - a_i) = (sum_i b_i) c - sum_i b_i a_i
            acc = np.subtract(float(beta.sum()) * center[k].astype(np.float64), acc, out=acc)
        out[k] = acc
    return out


def lower_median_of(values: np.ndarray, weights: np.ndarray | None = None) -> float:
    """The ceil(N/2)-th smallest value (``bound.lower_median``, for an array); with
    ``weights``, the smallest value at which the weights of the values up to it reach half
    of their total (the same value where all weights are equal)."""
    values = np.asarray(values, dtype=np.float64)
    if weights is None:
        ordered = np.sort(values)
        return float(ordered[(len(ordered) + 1) // 2 - 1])
    order = np.argsort(values, kind="stable")
    reached = np.cumsum(np.asarray(weights, dtype=np.float64)[order])
    k = int(np.searchsorted(reached, reached[-1] / 2 * (1 - 1e-12)))
    return float(values[order[k]])


# --- the modes ------------------------------------------------------------------------------
#: applied rounds a step bound keeps per kind of update, and how many it needs to judge
STEP_HISTORY, MIN_STEP_HISTORY = 10, 3


class StepBound:
    """A round's combined update bounded by the history of accepted ones (``robust-step-bound``
    c; 0: off): from the ``MIN_STEP_HISTORY``-th round of a kind of update on, the combined
    update u_t of that kind is scaled down to norm ``c x H_t`` where it is longer, H_t the
    median of the last ``STEP_HISTORY`` rounds' applied norms of that kind (the bounded ones),
    and the round counts ``step-bounded``.

    Why: every per-round rule follows a Byzantine majority of its round's replies (with 3 of
    10 attackers and 5 replies a round, about 8 % of the rounds), and all attackers sending one
    vector make the round's spread, hence its clip radius, zero: such a round applied the
    attackers' vector whole (docs/threat-model.md has the measurements). Bounded by history,
    a taken round moves theta by at most ``c`` x a typical step, which the honest rounds after
    it can undo (a step bounded around the history of accepted aggregates, as Karimireddy, He
    & Jaggi bound each step by the momentum of past ones). **Guarantee**: while at most half of
    the last ``STEP_HISTORY`` rounds of a kind were taken, H_t is at most the largest norm a
    round the per-round defence held applied, so no taken round moves theta by more than
    ``c`` times that. The first ``MIN_STEP_HISTORY - 1`` rounds of a kind have no history
    and are not bounded."""

    def __init__(self, factor: float) -> None:
        if factor and factor < 1:
            raise ValueError(f"step bound: factor = {factor}: must be 0 (off) or >= 1")
        self.factor = factor
        self.norms: dict[str, list[float]] = {}  # per kind: the last applied norms

    def __call__(self, kind: str, update: dict[str, np.ndarray]) -> tuple[dict, bool]:
        """``update`` within the bound (a scaled copy where it is longer) and whether it
        was scaled; records the applied norm."""
        size = math.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in update.values()))
        history = self.norms.setdefault(kind, [])
        bounded = False
        if self.factor and len(history) >= MIN_STEP_HISTORY - 1 and math.isfinite(size):
            limit = self.factor * float(np.median(history))
            if size > limit:
                scale = limit / size
                update = {k: v * scale for k, v in update.items()}
                size, bounded = limit, True
        history.append(size)
        del history[:-STEP_HISTORY]
        return update, bounded


class Combine:
    """The combine stage's protocol: ``combine(rnd, vectors, weights, center, kind)`` is the
    mode's ``combined`` update, through the step bound where the run has one (``step``): the
    combined update of ``vectors`` (``center - vectors[i]`` with ``center``: returned weights)
    under ``weights``, in float64.

    What a mode preserves, for an algorithm whose own formula depends on it:
    ``weighted`` (the algorithm's weights are honoured), ``exact_mean`` (the result is the
    plain weighted mean: the algorithm may compute that mean its own way), ``single_release``
    (every call is a release of its own: records combined together must be one call).

    Parameters
    ----------
    byzantine : int (default: 0)
        f, the Byzantine replies per round the mode must tolerate (only a robust rule can).
    """

    name = "mean"
    weighted = True
    exact_mean = True
    single_release = False
    #: the default defence's clip where the mode has one (``AdaptiveClipping``)
    clip: AdaptiveClipping | None = None
    #: the robust rule where the mode has one
    rule: Aggregator | None = None
    #: the bound on each round's combined update by the history of accepted ones
    step: StepBound | None = None

    def __init__(self, byzantine: int = 0) -> None:
        if byzantine < 0:
            raise ValueError(f"byzantine = {byzantine}: must be >= 0")
        self.byzantine = byzantine

    def check_sample(self, num_replies: int) -> None:
        """Refuse, before training starts, a mode that cannot combine a round of
        ``num_replies`` with ``byzantine`` of them Byzantine: only a rule tolerates any."""
        if self.byzantine:
            raise ValueError(
                f"key 'robust-byzantine' = {self.byzantine}: needs a robust aggregator "
                "('robust-aggregator'); the mean tolerates none"
            )

    def __call__(self, rnd, vectors, weights, center=None, kind=None) -> dict[str, np.ndarray]:
        """The mode's combined update (``combined``) through the step bound, if any."""
        out = self.combined(rnd, vectors, weights, center, kind)
        if self.step is None or not self.step.factor:
            return out
        out, scaled = self.step(kind or rnd.kind, out)
        rnd.step_bounded += int(scaled)
        return out

    def combined(self, rnd, vectors, weights, center=None, kind=None) -> dict[str, np.ndarray]:
        return mean(vectors, weights, center)

    def describe(self) -> str:
        return self.name

    def round_metrics(self, rnd) -> dict[str, float]:
        """The replies the mode's clip clipped in the round: ``clipped`` of the replies'
        updates, ``clipped-<record>`` of each further record (none without a clip); with a
        step bound, ``step-bounded``: the round's combined updates it scaled down."""
        out = clip_counts(rnd) if self.clip is not None else {}
        if self.step is not None and self.step.factor:
            out["step-bounded"] = rnd.step_bounded
        return out


def clip_counts(rnd) -> dict[str, float]:
    """``clipped`` (the replies' updates a clip shortened) and ``clipped-<record>``."""
    others = {f"clipped-{k}": n for k, n in sorted(rnd.clipped.items()) if k != rnd.kind}
    shared = {"shared-votes": rnd.shared[rnd.kind]} if rnd.shared.get(rnd.kind) else {}
    if rnd.distrusted.get(rnd.kind):
        shared["distrusted"] = rnd.distrusted[rnd.kind]
    if rnd.far.get(rnd.kind):
        shared["far-off"] = rnd.far[rnd.kind]
    return {"clipped": rnd.clipped.get(rnd.kind, 0), **others, **shared}


def mean(vectors, weights, center=None) -> dict[str, np.ndarray]:
    """The weighted mean of the update vectors (of ``center - vectors[i]``)."""
    if center is not None:
        return weighted_mean_of_updates(center, vectors, weights)
    return weighted_mean(vectors, weights)


class Mean(Combine):
    """The plain mode: the algorithm's own (weighted) mean of the updates, in float64."""


class ClippedMean(Combine):
    """The default defence: the algorithm's mean of the updates clipped by ``clip``
    (``AdaptiveClipping``, its rounds of 1 or 2 replies included); the replies clipped are
    counted by kind (``rnd.clipped``)."""

    name = AdaptiveClipping.name
    exact_mean = False

    def __init__(self, clip: AdaptiveClipping, byzantine: int = 0) -> None:
        super().__init__(byzantine)
        self.clip = clip

    def combined(self, rnd, vectors, weights, center=None, kind=None) -> dict[str, np.ndarray]:
        return clipped_mean(rnd, clip_step(self.clip, rnd, vectors, weights, center, kind))


def clip_step(clip: AdaptiveClipping, rnd, vectors, weights, center, kind) -> tuple:
    """``clip``'s coefficients for the round's vectors (its state moves with every round it
    sees), and what ``clipped_mean`` needs to apply them."""
    kind = kind or rnd.kind
    clip.last_shared = 0
    nodes = rnd.nodes or None
    main = kind == rnd.kind
    # the standing before the round, for each of its records (Scaffold's control delta too)
    if main or rnd.trust is None:
        rnd.trust = clip.trust(nodes)
    beta, clipped = clip.coefficients(
        kind, vectors, weights, center, nodes, rnd.population, rnd.trust
    )
    if clip.last_shared:
        rnd.shared[kind] = clip.last_shared
    if clip.last_distrusted:
        rnd.distrusted[kind] = clip.last_distrusted
    if clip.last_far:
        rnd.far[kind] = clip.last_far
    if main:  # one entry per round: the algorithm's update, not each record
        clip.remember(nodes)
    return kind, beta, clipped, vectors, weights, center


def clipped_mean(rnd, step: tuple) -> dict[str, np.ndarray]:
    """The mean of the clipped updates (``clip_step``'s), the replies clipped counted in
    ``rnd.clipped``: the algorithm's own mean where none was."""
    kind, beta, clipped, vectors, weights, center = step
    rnd.clipped[kind] = clipped
    if beta is not None:
        return linear_update(vectors, beta, center)
    return mean(vectors, weights, center)


class RobustRule(Combine):
    """A robust rule over the updates, unweighted, with f = ``byzantine``; ``clip`` (the
    small-round clip of ``robust-small-rounds = "clip"``, or None) takes the rounds whose rule
    would combine fewer than ``MIN_RULE_INPUTS`` values, those in which replies are copies
    of one vector (``AdaptiveClipping.votes``: the clip counts them as one reply, a rule as
    many) and those with a node the clip distrusts deeply (``AdaptiveClipping.trust`` below
    ``RULE_DISTRUST``: the clip shrinks its say, a rule cannot), and keeps its state in every
    round.

    **f means Byzantine, not absent.** The rule tolerates f Byzantine replies among those the
    round kept, whatever else it lost: a node that failed, fell silent or had its reply
    dropped is not counted as one of the f (counting it let the rule run with a smaller f,
    and Multi-Krum with m = N - f then averaged a Byzantine reply in beside one honest
    device's failure). Where the rule cannot take the kept replies with its f (too few of
    them for its breakdown point, Multi-Krum's m above N - f), the round falls back to the
    default defence's clip (``fallback``: ``clip``, or adaptive clipping of its own) and is
    counted (``rule-fallback``): never a plain mean, never a skipped round, so the f tolerated
    Byzantine clients cannot stop the run by having their replies dropped."""

    weighted = exact_mean = False

    def __init__(
        self,
        rule: Aggregator,
        byzantine: int = 0,
        clip: AdaptiveClipping | None = None,
        fallback: AdaptiveClipping | None = None,
    ) -> None:
        super().__init__(byzantine)
        self.rule, self.clip = rule, clip
        self.fallback = fallback or clip or AdaptiveClipping()

    @property
    def name(self) -> str:  # noqa: D102 - the rule's
        return self.rule.name

    def check_sample(self, num_replies: int) -> None:
        problem = self.sample_problem(num_replies)
        if problem:
            raise ValueError(
                f"keys 'robust-aggregator' / 'robust-byzantine' = {self.byzantine} / "
                f"'robust-krum-m' / 'fraction-train': {problem} (or lower 'robust-byzantine')"
            )

    def sample_problem(self, num_replies: int) -> str:
        """Why rounds of ``num_replies`` cannot take the rule with its f, and the round size
        that would ('' where they can)."""
        problem = self.rule.problem(num_replies, self.byzantine)
        if not problem:
            return ""
        works = self.smallest_sample()
        fix = (
            f"a round of {works} replies or more takes f = {self.byzantine}"
            if works
            else f"no round size up to {MAX_SAMPLE_SEARCHED} takes f = {self.byzantine}"
        )
        return f"{problem}; each round samples {num_replies} nodes, and {fix}"

    def smallest_sample(self) -> int | None:
        """The fewest replies a round of which the rule takes its f, and every larger round
        up to ``MAX_SAMPLE_SEARCHED`` too (None: there is no such size)."""
        works = [not self.rule.problem(n, self.byzantine) for n in range(MAX_SAMPLE_SEARCHED + 1)]
        for n in range(MAX_SAMPLE_SEARCHED, -1, -1):
            if not works[n]:
                return n + 1 if n < MAX_SAMPLE_SEARCHED else None
        return 0

    def combined(self, rnd, vectors, weights, center=None, kind=None) -> dict[str, np.ndarray]:
        step = None
        if self.clip is not None:
            # every round keeps the clip's state (rho: what a round of >= 3 replies applied);
            # a median of 1 or 2 is their mean, which one reply moves by its whole share, and
            # with 4 replies a round the clip held where the geometric median did not
            step = clip_step(self.clip, rnd, vectors, weights, center, kind)
            # and the rounds with copies of one vector: a median counts each copy as an
            # input (a majority of copies is its answer, a minority of them pulls it), the
            # clip counts them as one reply; and those with a node deeply distrusted (its
            # history of being clipped away), whose say the clip shrinks and a median cannot
            # (a node merely clipped often stays the median's: FFGG's honest gradients on
            # 2-class clients reach trusts of 0.4-0.9, and giving those rounds to the clip
            # cost a clean run 14 points)
            clip = self.clip
            if (
                self.rule.inputs(len(vectors)) < MIN_RULE_INPUTS
                or clip.last_shared
                or (rnd.trust is not None and (rnd.trust < RULE_DISTRUST).any())
            ):
                return clipped_mean(rnd, step)
        if not self.rule.problem(len(vectors), self.byzantine):
            return robust_combine(self.rule, vectors, self.byzantine, center)
        rnd.fell_back += 1
        if step is None:
            step = clip_step(self.fallback, rnd, vectors, weights, center, kind)
        return clipped_mean(rnd, step)

    def round_metrics(self, rnd) -> dict[str, float]:
        """The clip's counts (where it ran) and the times the rule fell back to it."""
        if not rnd.fell_back:
            return super().round_metrics(rnd)
        return {**super().round_metrics(rnd), **clip_counts(rnd), "rule-fallback": rnd.fell_back}


class CentralDP(Combine):
    """Central DP: the clipped, noised mean over the sampled clients
    (``privacy.Mechanism.mean``), its noise drawn from ``dp-noise-seed`` and the round.
    Uniform over the planned sample, whatever the claims; every call is a release."""

    name = "central DP"
    weighted = exact_mean = False
    single_release = True

    def __init__(self, mechanism, byzantine: int = 0) -> None:
        super().__init__(byzantine)
        self.mechanism = mechanism

    def combined(self, rnd, vectors, weights, center=None, kind=None) -> dict[str, np.ndarray]:
        rng = noise_rng(self.mechanism.dp.seed, rnd.number)
        return self.mechanism.mean(vectors, len(rnd.asked), rng, center)
