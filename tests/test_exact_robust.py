"""Every robust rule against a plain NumPy version written here from its paper: Krum and
Multi-Krum by brute force over neighbour subsets (Blanchard et al. 2017), bucketing replayed
from its seeded permutation with a base rule other than the mean (Karimireddy, He, Jaggi
2022), Weiszfeld's iteration (RFA), centered clipping over several calls (Karimireddy et al.
2021), coordinate median and trimmed mean. Inputs are float64 and spread unevenly, so that
a wrong neighbour count, a skipped bucketing step or a wrong centre changes the answer."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from pflower.strategies.aggregators import (
    Bucketing,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    TrimmedMean,
)


def inputs(n=9, d=5, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * rng.uniform(0.2, 3.0, size=(n, 1))  # uneven spreads
    X[: n // 4] += 4.0  # a cluster of outliers
    return X


def krum_scores(X, f):
    """score_i = min over subsets S of n - f - 2 others of sum_{j in S} ||x_i - x_j||^2."""
    n = len(X)
    scores = []
    for i in range(n):
        others = [j for j in range(n) if j != i]
        scores.append(
            min(
                sum(float(np.sum((X[i] - X[j]) ** 2)) for j in subset)
                for subset in itertools.combinations(others, n - f - 2)
            )
        )
    return np.asarray(scores)


@pytest.mark.parametrize("f", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 3])
def test_krum_and_multi_krum_by_brute_force(f, m):
    X = inputs()
    scores = krum_scores(X, f)
    np.testing.assert_allclose(Krum(m).scores(torch.from_numpy(X), f).numpy(), scores, rtol=1e-9)
    want = X[np.argsort(scores, kind="stable")[:m]].mean(0)
    np.testing.assert_allclose(Krum(m)(torch.from_numpy(X), f=f).numpy(), want, rtol=1e-12)


def test_krum_is_not_fooled_by_huge_rows_through_rounding():
    """Three rows at 1e6 and one moderately bad row among honest ones: the brute-force
    selection (float64, uncentred) and the rule's agree."""
    rng = np.random.default_rng(4)
    X = np.vstack([rng.normal(size=(8, 6)), np.full((3, 6), 1e6), rng.normal(size=(1, 6)) + 5])
    f = 4
    want = int(np.argmin(krum_scores(X, f)))
    got = Krum(1)(torch.from_numpy(X), f=f).numpy()
    np.testing.assert_allclose(got, X[want], rtol=1e-12)


@pytest.mark.parametrize("base", ["median", "trimmed-mean", "krum"])
def test_bucketing_replayed_from_its_permutation(base):
    X = inputs(n=11)
    s, seed, f = 2, 5, 1
    rules = {"median": CoordinateMedian(), "trimmed-mean": TrimmedMean(0.2), "krum": Krum(1)}
    rule = Bucketing(rules[base], s=s, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(2):  # a fresh permutation each call, from one seeded stream
        order = torch.randperm(len(X), generator=generator).numpy()
        means = np.stack([X[order[i : i + s]].mean(0) for i in range(0, len(X), s)])
        if base == "median":
            want = np.median(means, axis=0)
        elif base == "trimmed-mean":
            k = math.ceil(0.2 * len(means))
            want = np.sort(means, axis=0)[k : len(means) - k].mean(0)
        else:
            want = means[int(np.argmin(krum_scores(means, f)))]
        got = rule(torch.from_numpy(X), f=f).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
        outs.append(got)
    assert not np.allclose(outs[0], outs[1])  # the buckets change between calls
    # and bucketing is not the base rule alone on these inputs
    assert not np.allclose(outs[0], rules[base](torch.from_numpy(X), f=f).numpy())


@pytest.mark.parametrize("n", [8, 9])
def test_median_and_trimmed_mean_by_sorting(n):
    X = inputs(n=n)
    s = np.sort(X, axis=0)
    median = s[(n - 1) // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    np.testing.assert_allclose(CoordinateMedian()(torch.from_numpy(X)).numpy(), median)
    k = math.ceil(0.25 * n)
    np.testing.assert_allclose(
        TrimmedMean(0.25)(torch.from_numpy(X)).numpy(), s[k : n - k].mean(0), rtol=1e-12
    )


def test_geometric_median_is_weiszfelds_fixed_point():
    X = inputs(n=10)
    z = X.mean(0)
    for _ in range(5000):  # smoothed Weiszfeld, written here
        w = 1.0 / np.maximum(1e-6, np.linalg.norm(X - z, axis=1))
        z_new = (w[:, None] * X).sum(0) / w.sum()
        if np.linalg.norm(z_new - z) < 1e-15:
            break
        z = z_new
    got = GeometricMedian(tol=1e-14, max_iter=5000)(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(got, z, rtol=1e-9, atol=1e-10)
    # and it is the minimiser of the sum of distances: no coordinate step improves it
    cost = lambda y: np.linalg.norm(X - y, axis=1).sum()  # noqa: E731
    for e in np.eye(X.shape[1]):
        assert cost(got) <= min(cost(got + 1e-4 * e), cost(got - 1e-4 * e))


def test_centered_clipping_over_calls_keeps_its_centre():
    """v starts at the coordinate median (first call), then each call continues from the
    previous v: v <- v + mean_i min(1, r / ||x_i - v||) (x_i - v), L times per call."""
    radius, iterations = 0.8, 4
    rule = CenteredClipping(radius=radius, iterations=iterations)
    v = None
    for call in range(3):
        X = inputs(seed=call)
        if v is None:
            v = np.median(X, axis=0)
        for _ in range(iterations):
            diff = X - v
            scale = np.minimum(1.0, radius / np.linalg.norm(diff, axis=1))
            v = v + (scale[:, None] * diff).mean(0)
        np.testing.assert_allclose(rule(torch.from_numpy(X)).numpy(), v, rtol=1e-12, atol=1e-14)


def test_krum_choice_cannot_be_steered_by_rounding():
    """Three rows at 1e6 beside honest updates of size 1e-3 and one moderately bad row: Krum's
    choice must be the one of exact distances (float64 brute force) on every draw. (The
    float32 Gram product of centred rows disagreed on 34 of these 40 draws.)"""
    for seed in range(40):
        rng = np.random.default_rng(seed)
        honest = rng.normal(0, 1e-3, (8, 2000)).astype(np.float32)
        huge = (1e6 + rng.normal(0, 1e-3, (3, 2000))).astype(np.float32)
        bad = (honest.mean(0) + 0.05).astype(np.float32)[None]
        X = np.concatenate([honest, huge, bad])
        d2 = ((X[:, None, :].astype(np.float64) - X[None, :, :]) ** 2).sum(-1)
        np.fill_diagonal(d2, np.inf)
        exact = int(np.sort(d2, 1)[:, : len(X) - 3 - 2].sum(1).argmin())
        chosen = int(Krum().scores(torch.from_numpy(X), 3).argmin())
        assert chosen == exact, seed
        assert exact < 8  # an honest row
