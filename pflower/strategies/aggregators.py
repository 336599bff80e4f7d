"""Robust aggregation rules over the clients' update vectors (Byzantine robustness).

Every rule maps a stack ``X`` (N clients x d coordinates, a torch tensor) to one vector of
size d, in torch and vectorised. Coordinate-wise rules (``coordinatewise``) also work tile by
tile (``columns``): a tile holds B coordinates x N inputs, transposed so that each
coordinate's N values are contiguous, and is sorted along them in place (NumPy's SIMD sort of
short contiguous rows is about 6x faster than introselect down strided columns at N = 50);
tiles are about ``TILE`` elements, so memory stays at a tile or two whatever N and d, and
``pflower.strategies.combine.robust_combine`` fills them straight from the replies without
ever stacking them. Distance-based rules need only the N x N distances, accumulated over
column chunks.

Each rule states its breakdown point as ``max_byzantine(N)``, the largest number f of
Byzantine inputs it tolerates, and raises ``ValueError`` when called with more assumed
Byzantines (``f``) than that.

- ``Mean``: breakdown 0.
- ``CoordinateMedian``: coordinate-wise median; f < N/2.
- ``TrimmedMean(beta)``: per coordinate, drop the ceil(beta N) largest and smallest values and
  average the rest; f <= ceil(beta N) < N/2.
- ``Krum(m=1)`` / Multi-Krum (Blanchard et al. 2017): score_i = sum of the squared distances to
  its N - f - 2 nearest neighbours; the mean of the m lowest-scoring inputs; N > 2f + 2.
- ``GeometricMedian(eps, max_iter, tol)``: smoothed Weiszfeld (RFA, Pillutla et al. 2022):
  z <- sum_i x_i / max(eps, ||z - x_i||) / sum_i 1 / max(eps, ||z - x_i||); f < N/2.
- ``CenteredClipping(radius, iterations)`` (Karimireddy et al. 2021): v <- v + mean_i
  clip_radius(x_i - v), ``iterations`` times, starting from the previous call's v (the running
  centre; the coordinate-wise median at the first call: from the mean, outliers of size 1e6
  would leave v 1e5 away, and each iteration moves it by at most ``radius``); f < N/2.
- ``Bucketing(base, s)`` (Karimireddy, He, Jaggi 2022): a fresh random permutation each call,
  means of buckets of s inputs, then ``base`` on the ceil(N/s) bucket means; with s inputs per
  bucket, f Byzantines spoil at most f buckets, so it tolerates ``base.max_byzantine(ceil(N/s))``.

Mishchenko et al. (Def. 2) call a rule (delta, c)-robust if its error to the honest mean is at
most c delta sigma^2; Krum, geometric median and coordinate-wise median alone are not (ALIE
and IPM break them), bucketing + any of them and centered clipping are.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np
import torch

CHUNK = 1 << 20  # columns per chunk of the distance computations (and at most per tile)
TILE = 1 << 22  # elements per tile of the coordinate-wise rules (16 MB of float32)
#: inputs up to which the geometric median iterates on their Gram matrix (O(N^2 d) once)
#: rather than on the vectors (O(N d) per iteration): 3.3 x faster at 128 inputs of 100k,
#: 1.7 x at 256, 0.9 x at 512, with 3 iterations (CPU, one thread)
GRAM_MAX_INPUTS = 256


def _check(name: str, f: int, n: int, tolerated: int) -> None:
    if f < 0:
        raise ValueError(f"{name}: f = {f} Byzantine inputs: must be >= 0")
    if f > tolerated:
        raise ValueError(
            f"{name}: f = {f} assumed Byzantine of N = {n} inputs; this rule tolerates at most "
            f"{tolerated}"
        )


def tile_columns(n: int) -> int:
    """Coordinates per tile of a coordinate-wise rule over ``n`` inputs (about ``TILE``
    elements, at most ``CHUNK`` coordinates)."""
    return max(1, min(CHUNK, TILE // max(1, n)))


def _tiled(reduce, X: torch.Tensor) -> torch.Tensor:
    """``reduce`` (a rule's ``columns``) over the columns of the stack ``X``, one transposed
    tile at a time."""
    x = X.detach().cpu().numpy()
    n, d = x.shape
    step = tile_columns(n)
    tile = np.empty((min(step, d), n), x.dtype)
    out = np.empty(d, x.dtype)
    for lo in range(0, d, step):
        part = tile[: min(step, d - lo)]
        np.copyto(part, x[:, lo : lo + step].T)
        out[lo : lo + len(part)] = reduce(part)
    return torch.from_numpy(out).to(X.device)


def _pair_distances(X: torch.Tensor) -> torch.Tensor:
    """N x N squared Euclidean distances, exact to float64 rounding: the differences
    x_i - x_j themselves, squared and summed in float64 over column chunks (no Gram-matrix
    identity, no centring). Rounding therefore cannot change which rows are close, whatever
    the scale of the others: huge rows cannot hide a moderately bad one (a float32 Gram
    product of rows centred on their mean let 1e6-sized rows do that)."""
    n = X.shape[0]
    d2 = torch.zeros(n, n, dtype=torch.float64, device=X.device)
    for i in range(0, X.shape[1], CHUNK):
        part = X[:, i : i + CHUNK].double()
        d2 += torch.cdist(part, part, compute_mode="donot_use_mm_for_euclid_dist").square()
    return d2


def _row_distances(X: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """||x_i - z|| for every row, over column chunks (an N x d difference of a ResNet-18 at
    N = 100 would be another 4.5 GB); accumulated in float64."""
    chunk = CHUNK
    sq = torch.zeros(X.shape[0], dtype=torch.float64, device=X.device)
    for i in range(0, X.shape[1], chunk):
        sq += (X[:, i : i + chunk] - z[i : i + chunk]).double().pow_(2).sum(1)
    return sq.sqrt()


def _weighted_rows(w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """sum_i w_i x_i as one matrix-vector product (no N x d temporary)."""
    return w.to(X.dtype) @ X


class Aggregator(ABC):
    """A rule ``X (N x d) -> (d,)``; ``f`` is the number of Byzantine inputs assumed."""

    name = "aggregator"
    #: whether the rule treats each coordinate on its own (then ``columns`` gives it)
    coordinatewise = False

    def columns(self, n: int, f: int):
        """A coordinate-wise rule over ``n`` inputs as a function of one tile: a B x n array
        (each coordinate's n values contiguous; the function may reorder them in place) ->
        the rule's B values. Set up once per aggregation (bucketing draws its buckets here)."""
        raise NotImplementedError(f"{self.name} is not coordinate-wise")

    @abstractmethod
    def max_byzantine(self, n: int) -> int:
        """The largest number of Byzantine inputs among ``n`` this rule tolerates."""

    @abstractmethod
    def aggregate(self, X: torch.Tensor, f: int) -> torch.Tensor:
        """The rule itself, on a checked stack."""

    def inputs(self, n: int) -> int:
        """How many values the rule itself combines per coordinate from ``n`` inputs (the
        bucket means with bucketing): below 3 a median or trimmed mean is their mean."""
        return n

    def problem(self, n: int, f: int) -> str:
        """Why this rule cannot combine ``n`` inputs of which ``f`` Byzantine ('' if it
        can): the server refuses a run whose rounds are planned at such a size, and a round
        that ends at one (dropped or failed replies) falls back to the default defence's clip."""
        tolerated = self.max_byzantine(n)
        if tolerated < 0:
            return f"{self.name} cannot combine {n} inputs (too few for its breakdown point)"
        if f > tolerated:
            return f"{self.name} over {n} inputs tolerates at most {tolerated} Byzantine, not {f}"
        return ""

    def __call__(self, X: torch.Tensor, f: int = 0) -> torch.Tensor:
        if X.ndim != 2 or X.shape[0] == 0:
            raise ValueError(
                f"{self.name}: expected an N x d stack with N >= 1, got {tuple(X.shape)}"
            )
        self.check(X.shape[0], f)
        return self.aggregate(X, f)

    def check(self, n: int, f: int) -> None:
        """Raise ``ValueError`` unless the rule can combine ``n`` inputs of which ``f``
        Byzantine: within its breakdown point and its own preconditions (``problem``, e.g.
        Multi-Krum's m <= N - f), checked on every call, not only at start."""
        _check(self.name, f, n, self.max_byzantine(n))
        problem = self.problem(n, f)
        if problem:
            raise ValueError(f"{self.name}: {problem}")


class Mean(Aggregator):
    name = "mean"
    coordinatewise = True

    def max_byzantine(self, n: int) -> int:
        return 0

    def columns(self, n, f):
        return lambda tile: tile.mean(1)

    def aggregate(self, X, f):
        return X.mean(0)


class CoordinateMedian(Aggregator):
    """Coordinate-wise median (the mean of the two middle values for even N)."""

    name = "median"
    coordinatewise = True

    def max_byzantine(self, n: int) -> int:
        return (n - 1) // 2

    def columns(self, n, f):
        low, high = (n - 1) // 2, n // 2  # the middle order statistic(s)

        def median(tile: np.ndarray) -> np.ndarray:
            tile.sort(1)
            return tile[:, low] if low == high else (tile[:, low] + tile[:, high]) / 2

        return median

    def aggregate(self, X, f):
        return _tiled(self.columns(X.shape[0], f), X)


class TrimmedMean(Aggregator):
    """Coordinate-wise mean after dropping the k = ceil(beta N) largest and smallest values."""

    name = "trimmed-mean"
    coordinatewise = True

    def __init__(self, beta: float = 0.1) -> None:
        if not 0 <= beta < 0.5:
            raise ValueError(f"trimmed-mean: beta = {beta}: must be in [0, 0.5)")
        self.beta = beta

    def _k(self, n: int) -> int:
        return math.ceil(self.beta * n)

    def max_byzantine(self, n: int) -> int:
        k = self._k(n)
        return k if 2 * k < n else -1

    def columns(self, n, f):
        k = self._k(n)

        def trimmed(tile: np.ndarray) -> np.ndarray:
            if k:
                tile.sort(1)
            return tile[:, k : n - k].mean(1)

        return trimmed

    def aggregate(self, X, f):
        return _tiled(self.columns(X.shape[0], f), X)


class Krum(Aggregator):
    """Krum (m = 1) and Multi-Krum (mean of the m best-scored inputs)."""

    name = "krum"

    def __init__(self, m: int = 1) -> None:
        if m < 1:
            raise ValueError(f"krum: m = {m}: must be >= 1")
        self.m = m

    def max_byzantine(self, n: int) -> int:
        return max(-1, (n - 3) // 2)  # N > 2f + 2

    def problem(self, n: int, f: int) -> str:
        if not super().problem(n, f) and self.m > n - f:
            return (
                f"multi-krum averages the m = {self.m} best-scored of {n} inputs; with f = {f} "
                f"Byzantine m must be at most N - f = {n - f} (else outliers are averaged in)"
            )
        return super().problem(n, f)

    def scores(self, X: torch.Tensor, f: int) -> torch.Tensor:
        d2 = _pair_distances(X)
        neighbours = X.shape[0] - f - 2
        d2.fill_diagonal_(float("inf"))
        return d2.sort(1).values[:, :neighbours].sum(1)

    def aggregate(self, X, f):
        best = self.scores(X, f).argsort()[: min(self.m, X.shape[0])]
        return X[best].mean(0)


class GeometricMedian(Aggregator):
    """Smoothed Weiszfeld iterations (RFA): ``z <- sum_i x_i / d_i / sum_i 1 / d_i``, ``d_i =
    max(eps, ||x_i - z||)``, from the mean, until z moves by at most ``tol x max(1, ||z||)``
    or ``max_iter`` iterations.

    Every z is a combination ``sum_i w_i x_i``, so the iterations run on the N x N Gram
    matrix of the inputs' differences from a reference input, the one of lower-median norm
    (in float64 over column chunks: a common part does not cancel precision away, and while
    fewer than half the inputs are huge the reference is not one of them: a 1e10 reference
    among inputs of norm 100 lost their differences to rounding), and the inputs are read
    once more for the result: three passes where iterating on the d-vectors took two per
    iteration (FFGG's aggregation of a 10-reply round, 5 bucket means of an MLP's
    gradients: 1709 -> about 800 µs per message, ``benchmarks/results/default-defence.md``).
    Beyond ``GRAM_MAX_INPUTS`` inputs the O(N^2 d) product costs more than the iterations,
    which then run on the vectors."""

    name = "geometric-median"

    def __init__(self, eps: float = 1e-6, max_iter: int = 100, tol: float = 1e-7) -> None:
        self.eps, self.max_iter, self.tol = eps, max_iter, tol
        self.iterations = 0

    def max_byzantine(self, n: int) -> int:
        return (n - 1) // 2

    def aggregate(self, X, f):
        n = X.shape[0]
        if n > GRAM_MAX_INPUTS:  # the N x N product would outweigh the iterations' passes
            return self._over_vectors(X)
        space = Span(_difference_gram(X, _lower_median_norm_row(X)).cpu().numpy())
        w = np.full(n, 1.0 / n)
        self.iterations = 0
        while self.iterations < self.max_iter:
            self.iterations += 1
            new = 1.0 / np.maximum(space.distances(w), self.eps)
            new /= new.sum()
            moved = space.gap(new, w)
            w = new
            if moved <= self.tol * max(1.0, space.norm(w)):
                break
        return _weighted_rows(torch.from_numpy(w).to(X.device), X)

    def _over_vectors(self, X: torch.Tensor) -> torch.Tensor:
        """The same iterations on the d-vectors: two passes over the inputs per iteration."""
        z = X.mean(0)
        self.iterations = 0
        while self.iterations < self.max_iter:
            self.iterations += 1
            w = 1.0 / _row_distances(X, z).clamp_min(self.eps)
            new = _weighted_rows(w / w.sum(), X)
            moved = torch.linalg.vector_norm(new - z)
            z = new
            if moved <= self.tol * max(1.0, float(torch.linalg.vector_norm(z))):
                break
        return z


def _lower_median_norm_row(X: torch.Tensor) -> int:
    """The row whose norm is the lower median (the ceil(N/2)-th smallest) of the rows' norms:
    at most an honest row's while fewer than half of the rows are Byzantine."""
    norms = torch.linalg.vector_norm(X, dim=1)  # in X's dtype: it only orders the rows
    return int(norms.argsort()[(X.shape[0] - 1) // 2])


def _difference_gram(X: torch.Tensor, ref: int = 0, chunk: int = 8192) -> torch.Tensor:
    """The (N+1) x (N+1) Gram matrix of ``y_i = x_i - x_r`` (rows 0..N-1; y_r = 0) and
    ``x_r`` (row N), r = ``ref``, in float64, ``chunk`` columns at a time (N x chunk float64
    in cache)."""
    n = X.shape[0]
    gram = torch.zeros(n + 1, n + 1, dtype=torch.float64, device=X.device)
    rows = torch.empty(n + 1, min(chunk, X.shape[1]), dtype=torch.float64, device=X.device)
    for lo in range(0, X.shape[1], chunk):
        part = X[:, lo : lo + chunk]
        b = rows[:, : part.shape[1]]
        b[:n].copy_(part)
        b[n].copy_(part[ref])
        b[:n] -= b[n]
        gram += b @ b.T
    return gram


class Span:
    """Points ``v = sum_j gamma_j x_j`` (``sum_j gamma_j = 1``) of the inputs' affine span,
    measured through their Gram matrix: ``G`` holds ``y_i = x_i - x_0`` in its first N rows
    and columns and ``x_0`` in its last, so that ``||x_i - v||^2 = ||y_i - Y gamma||^2``; x_0
    a reference input (adaptive clipping's first reply, ``combine._gram``; the geometric
    median's input of lower-median norm, ``_difference_gram``, whose layout is the same)."""

    def __init__(self, gram: np.ndarray) -> None:
        self.Y, self.x0y, self.x0x0 = gram[:-1, :-1], gram[-1, :-1], gram[-1, -1]

    def distances(self, gamma: np.ndarray) -> np.ndarray:
        Yg = self.Y @ gamma
        return np.sqrt(np.maximum(np.diag(self.Y) - 2.0 * Yg + gamma @ Yg, 0.0))

    def gap(self, a: np.ndarray, b: np.ndarray) -> float:
        """||v(a) - v(b)|| = ||Y (a - b)|| (the x_0 parts cancel: both sum to 1)."""
        delta = a - b
        return float(np.sqrt(max(delta @ self.Y @ delta, 0.0)))

    def norm(self, gamma: np.ndarray) -> float:
        """||v|| = ||x_0 + sum_j gamma_j y_j||."""
        return float(np.sqrt(max(self.x0x0 + 2.0 * gamma @ self.x0y + gamma @ self.Y @ gamma, 0.0)))

    def norms(self) -> np.ndarray:
        """||x_i|| for every reply."""
        return np.sqrt(np.maximum(self.x0x0 + 2.0 * self.x0y + np.diag(self.Y), 0.0))

    def geometric_median(
        self, gamma: np.ndarray, rounds: int = 200, weights: np.ndarray | None = None
    ) -> np.ndarray:
        """Weiszfeld's iterations ``v <- sum_i w_i x_i / d_i / sum_i w_i / d_i`` from
        ``gamma`` (``weights`` w_i, 1 unless given), until the weights settle (1e-12) or
        ``rounds``; a distance floor of 1e-12 x the replies' largest spread keeps a reply
        that coincides with v from dividing by 0."""
        # (1e-300 as the floor itself: 1e-12 x 1e-300 is denormal, and 1 / it overflows)
        floor = max(1e-12 * float(np.sqrt(np.diag(self.Y).max(initial=0.0))), 1e-300)
        w = np.ones(len(gamma)) if weights is None else np.asarray(weights, dtype=np.float64)
        for _ in range(rounds):
            inverse = w / np.maximum(self.distances(gamma), floor)
            new = inverse / inverse.sum()
            settled = np.abs(new - gamma).max() < 1e-12
            gamma = new
            if settled:
                break
        return gamma


class CenteredClipping(Aggregator):
    """v <- v + mean_i clip(x_i - v, radius), from the previous call's v (running centre;
    the coordinate-wise median at the first call)."""

    name = "centered-clipping"

    def __init__(self, radius: float = 1.0, iterations: int = 3) -> None:
        if not radius > 0 or iterations < 1:
            raise ValueError(f"centered-clipping: radius = {radius}, iterations = {iterations}")
        self.radius, self.iterations = radius, iterations
        self.center: torch.Tensor | None = None

    def max_byzantine(self, n: int) -> int:
        return (n - 1) // 2

    def aggregate(self, X, f):
        v = self.center
        if v is None or v.shape != X.shape[1:]:  # no running centre yet: a robust start
            v = CoordinateMedian().aggregate(X, f)
        for _ in range(self.iterations):
            # v + mean_i c_i (x_i - v), c_i = min(1, radius / ||x_i - v||), as matrix-vector
            # products: no N x d difference
            scale = (self.radius / _row_distances(X, v).clamp_min(1e-12)).clamp(max=1.0)
            n = X.shape[0]
            v = v + (_weighted_rows(scale, X) - float(scale.sum()) * v) / n
        self.center = v
        return v


class Bucketing(Aggregator):
    """Random buckets of ``s`` inputs, averaged, then ``base`` on the bucket means
    (Karimireddy, He & Jaggi, ICLR 2022: averaging s heterogeneous honest inputs shrinks
    their spread, so a rule that cannot tell an honest outlier from a Byzantine one discards
    less of the honest clients' differences).

    ``min_buckets`` > 1 makes ``s`` a ceiling: a round of n inputs, f of them assumed
    Byzantine, takes the largest size s' <= s that still leaves ``min_buckets`` buckets
    (ceil(n / s') >= min_buckets) over which the rule tolerates f (f Byzantine inputs reach
    at most f buckets); s' = 1, the rule on the inputs themselves, where none does. With
    ``min_buckets = 5`` and s = 2 (FFGG's default defence) a round of 5 to 8 replies is the
    rule's own, from 9 on it sees buckets of 2 while f is at most what their means tolerate
    (the geometric median of 5 bucket means: 2), else the replies themselves: the tolerance
    is the rule's on the inputs (``max_byzantine``), never less."""

    #: a checkpoint written before ``min_buckets`` existed restores an object without it
    min_buckets = 1

    def __init__(self, base: Aggregator, s: int = 2, seed: int = 0, min_buckets: int = 1) -> None:
        if s < 1:
            raise ValueError(f"bucketing: s = {s}: must be >= 1")
        if min_buckets < 1:
            raise ValueError(f"bucketing: min_buckets = {min_buckets}: must be >= 1")
        self.base, self.s, self.min_buckets = base, s, min_buckets
        limit = f" (fewer if under {min_buckets} buckets)" if min_buckets > 1 else ""
        self.name = f"bucketing({base.name}, s={s}{limit})"
        self.generator = torch.Generator().manual_seed(seed)

    def size(self, n: int, f: int = 0) -> int:
        """The bucket size of a round of ``n`` inputs, ``f`` of them Byzantine: ``s``, or
        with ``min_buckets`` the largest size that makes that many buckets over which the
        rule tolerates f (1 where none does)."""
        if self.min_buckets <= 1:
            return self.s
        for s in range(self.s, 1, -1):
            buckets = math.ceil(n / s)
            if buckets >= self.min_buckets and self.base.max_byzantine(buckets) >= f:
                return s
        return 1

    def buckets(self, n: int, f: int = 0) -> int:
        return math.ceil(n / self.size(n, f))

    def max_byzantine(self, n: int) -> int:
        if self.min_buckets > 1:  # buckets shrink, down to the inputs, to tolerate f
            return self.base.max_byzantine(n)
        return self.base.max_byzantine(self.buckets(n))

    @property
    def coordinatewise(self) -> bool:
        return self.base.coordinatewise

    def inputs(self, n: int) -> int:
        return self.base.inputs(self.buckets(n))

    def problem(self, n: int, f: int) -> str:
        buckets = self.buckets(n, f)
        inner = self.base.problem(buckets, f)
        return f"{self.name}: {n} inputs make {buckets} buckets; {inner}" if inner else ""

    def columns(self, n, f):
        s = self.size(n, f)
        if s == 1:  # the rule on the inputs themselves (no permutation: bit for bit)
            return self.base.columns(n, f)
        buckets = [b.numpy() for b in torch.randperm(n, generator=self.generator).split(s)]
        base = self.base.columns(len(buckets), min(f, len(buckets)))

        def bucketed(tile: np.ndarray) -> np.ndarray:
            means = np.empty((len(tile), len(buckets)), tile.dtype)
            for j, idx in enumerate(buckets):
                means[:, j] = tile[:, idx].mean(1)
            return base(means)

        return bucketed

    def aggregate(self, X, f):
        s = self.size(X.shape[0], f)
        if s == 1:
            return self.base.aggregate(X, f)
        if self.coordinatewise:
            return _tiled(self.columns(X.shape[0], f), X)
        order = torch.randperm(X.shape[0], generator=self.generator).to(X.device)
        buckets = order.split(s)
        means = torch.empty((len(buckets), X.shape[1]), dtype=X.dtype, device=X.device)
        for row, idx in zip(means, buckets):  # filled in place: no list of means, then a copy
            torch.mean(X[idx], 0, out=row)
        return self.base.aggregate(means, min(f, means.shape[0]))


def make_aggregator(name: str, **options) -> Aggregator:
    """A rule by name: mean, median, trimmed-mean, krum, multi-krum, geometric-median,
    centered-clipping; ``bucket_size`` > 1 wraps it in bucketing (``min_buckets``: see
    ``Bucketing``)."""
    bucket = int(options.pop("bucket_size", 0))
    seed = int(options.pop("seed", 0))
    min_buckets = int(options.pop("min_buckets", 1))
    rules = {
        "mean": Mean,
        "median": CoordinateMedian,
        "trimmed-mean": TrimmedMean,
        "krum": Krum,
        "multi-krum": Krum,
        "geometric-median": GeometricMedian,
        "centered-clipping": CenteredClipping,
    }
    if name not in rules:
        raise ValueError(f"aggregator {name!r}: must be one of {sorted(rules)}")
    rule = rules[name](**options)
    return Bucketing(rule, bucket, seed, min_buckets) if bucket > 1 else rule


def stack(
    updates: Sequence[Mapping[str, np.ndarray]], center: Mapping[str, np.ndarray] | None = None
) -> tuple[torch.Tensor, list]:
    """Flatten each client's named arrays into one row of an N x d float tensor (filled in
    place: no second copy of the stack), or with ``center`` the differences
    ``center - array`` (one layer at a time, in the layer's dtype); returns the stack and the
    (name, shape, dtype) layout to undo it (float64 if any array is: the synthetic-linear
    experiments go below float32's resolution)."""
    layout = [(k, a.shape, a.dtype) for k, a in updates[0].items()]
    sizes = [int(np.prod(shape)) for _, shape, _ in layout]
    wide = any(np.dtype(dtype) == np.float64 for _, _, dtype in layout)
    out = np.empty((len(updates), sum(sizes)), np.float64 if wide else np.float32)
    for row, u in zip(out, updates):
        i = 0
        for (k, _, _), size in zip(layout, sizes):
            x = np.asarray(u[k]).ravel()
            row[i : i + size] = x if center is None else center[k].ravel() - x
            i += size
    return torch.from_numpy(out), layout


def unstack(vector: torch.Tensor, layout: list) -> dict[str, np.ndarray]:
    out, i = {}, 0
    flat = vector.detach().cpu().numpy()
    for name, shape, dtype in layout:
        size = int(np.prod(shape))
        out[name] = flat[i : i + size].reshape(shape).astype(dtype)
        i += size
    return out
