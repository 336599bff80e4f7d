"""Robust aggregators: invariances, breakdown points, known answers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from helpers import pairings

from pflower.strategies import aggregators
from pflower.strategies.aggregators import (
    Bucketing,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Mean,
    TrimmedMean,
    make_aggregator,
    stack,
    unstack,
)

RULES = {
    "mean": Mean,
    "median": CoordinateMedian,
    "trimmed-mean": lambda: TrimmedMean(0.2),
    "krum": Krum,
    "multi-krum": lambda: Krum(m=3),
    "geometric-median": GeometricMedian,
    "centered-clipping": lambda: CenteredClipping(radius=10.0, iterations=50),
}


def honest(n=10, d=6, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("name", sorted(RULES))
def test_permutation_invariant(name):
    X = honest()
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(1))
    a, b = RULES[name]()(X, f=0), RULES[name]()(X[perm], f=0)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", sorted(RULES))
def test_equal_inputs_give_the_common_value(name):
    X = torch.tensor([1.0, -2.0, 3.5], dtype=torch.float64).repeat(7, 1)
    torch.testing.assert_close(RULES[name]()(X, f=0), X[0])


@pytest.mark.parametrize("name", ["median", "trimmed-mean", "krum", "multi-krum"])
def test_outliers_below_breakdown_stay_in_the_honest_box(name):
    good = honest(n=8)
    bad = torch.full((2, 6), 1e6, dtype=torch.float64)
    out = RULES[name]()(torch.cat([good, bad]), f=2)
    assert torch.all(out >= good.min(0).values - 1e-9)
    assert torch.all(out <= good.max(0).values + 1e-9)


@pytest.mark.parametrize("name", ["geometric-median", "centered-clipping"])
def test_outliers_move_distance_rules_a_bounded_amount(name):
    """f = 2 of 10 at 1e6: the output stays within a few honest radii of the honest mean."""
    good = honest(n=8)
    bad = torch.full((2, 6), 1e6, dtype=torch.float64)
    out = RULES[name]()(torch.cat([good, bad]), f=2)
    spread = torch.linalg.vector_norm(good - good.mean(0), dim=1).max()
    assert torch.linalg.vector_norm(out - good.mean(0)) < 3 * spread


def test_a_huge_first_input_does_not_round_the_geometric_medians_inputs_away():
    """The geometric median iterates on the Gram matrix of its inputs' differences from the
    input of lower-median norm: from the first input instead, a 1e10 Byzantine one in first
    place rounded the honest differences away in float64 (6 honest inputs of 10 000: the
    result 2.6 x farther from their mean than with the same input last; at 1e30 not
    finite). Reference: the same rule with the huge input last, and the honest spread."""
    good = honest(n=6, d=1000).float() + 1.0
    spread = torch.linalg.vector_norm(good - good.mean(0), dim=1).max()
    for scale in (1e10, 1e30, 3e38):
        bad = torch.full((1, 1000), scale)
        first = GeometricMedian()(torch.cat([bad, good]))
        last = GeometricMedian()(torch.cat([good, bad]))
        assert torch.isfinite(first).all()
        torch.testing.assert_close(first, last, rtol=1e-5, atol=1e-5)
        assert torch.linalg.vector_norm(first - good.mean(0)) < spread


def test_the_geometric_medians_gram_and_vector_iterations_agree(monkeypatch):
    """Up to ``GRAM_MAX_INPUTS`` inputs the iterations run on their Gram matrix, beyond it
    on the vectors: the same rule to float rounding, the same iteration count."""
    X = honest(n=12, d=40, seed=7) + torch.linspace(0, 3, 40)
    X[3] *= 40.0
    gram = GeometricMedian(tol=1e-12, max_iter=500)
    vectors = GeometricMedian(tol=1e-12, max_iter=500)
    got = gram(X)
    monkeypatch.setattr(aggregators, "GRAM_MAX_INPUTS", 4)
    want = vectors(X)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert gram.iterations == vectors.iterations


def test_weiszfeld_finds_known_geometric_medians():
    square = torch.tensor([[0.0, 0], [2, 0], [0, 2], [2, 2]], dtype=torch.float64)
    torch.testing.assert_close(
        GeometricMedian(tol=1e-12, max_iter=1000)(square),
        torch.tensor([1.0, 1.0], dtype=torch.float64),
    )
    # three collinear points: the middle one
    line = torch.tensor([[0.0, 0], [1, 0], [5, 0]], dtype=torch.float64)
    out = GeometricMedian(eps=1e-10, tol=1e-12, max_iter=5000)(line)
    torch.testing.assert_close(
        out, torch.tensor([1.0, 0.0], dtype=torch.float64), atol=1e-6, rtol=0
    )
    # a triangle with all angles < 120 degrees: the Fermat point, where unit vectors sum to 0
    tri = torch.tensor([[0.0, 0], [4, 0], [1, 3]], dtype=torch.float64)
    z = GeometricMedian(tol=1e-14, max_iter=5000)(tri)
    units = (tri - z) / torch.linalg.vector_norm(tri - z, dim=1, keepdim=True)
    assert torch.linalg.vector_norm(units.sum(0)) < 1e-6


@pytest.mark.parametrize("name", ["median", "trimmed-mean", "krum", "geometric-median", "mean"])
def test_bucketing_with_size_one_is_the_base_rule(name):
    X = honest()
    torch.testing.assert_close(Bucketing(RULES[name](), s=1)(X, f=0), RULES[name]()(X, f=0))


def test_bucketing_averages_buckets_then_applies_the_base():
    X = honest(n=6)
    rule = Bucketing(Mean(), s=2, seed=3)
    torch.testing.assert_close(rule(X), X.mean(0))  # means of equal buckets: the mean


def test_bucketing_with_min_buckets_shrinks_its_buckets_to_leave_that_many():
    """``min_buckets`` (FFGG's default defence: 5, beside the clip): a round of n inputs
    takes the largest size <= s that leaves ceil(n / s') >= min_buckets buckets; 1 (the
    rule on the inputs themselves, bit for bit) where none does, or where the bucket means
    would not tolerate f. References: the sizes by hand, the geometric median of the inputs,
    and the coordinate median over every way to draw 5 buckets of 2 from 10."""
    rule = Bucketing(GeometricMedian(), s=2, seed=1, min_buckets=5)
    assert [rule.size(n) for n in range(1, 12)] == [1] * 8 + [2] * 3  # ceil(9 / 2) = 5
    three = Bucketing(Mean(), s=3, min_buckets=5)
    assert [three.size(n) for n in (4, 8, 9, 12, 13, 15)] == [1, 1, 2, 2, 3, 3]
    assert Bucketing(Mean(), s=2).size(3) == 2  # min_buckets 1: the paper's fixed s
    assert rule.inputs(8) == 8 and rule.inputs(10) == 5
    # f Byzantine inputs reach f buckets: buckets only while their means tolerate f, so the
    # tolerance is the rule's on the inputs (GM of 10: 4), never the buckets' (GM of 5: 2)
    assert [rule.size(10, f) for f in range(5)] == [2, 2, 2, 1, 1]
    assert rule.max_byzantine(10) == 4 and rule.problem(10, 4) == ""
    X = honest(n=10, seed=6)
    assert torch.equal(rule(X, f=3), GeometricMedian()(X, f=3))
    assert Bucketing(GeometricMedian(), s=2).max_byzantine(10) == 2  # the paper's fixed s
    X = honest(n=7, seed=4)
    assert torch.equal(rule(X, f=1), GeometricMedian()(X, f=1))  # no buckets, no shuffle
    X = honest(n=10, seed=5)
    got = Bucketing(CoordinateMedian(), s=2, seed=2, min_buckets=5)(X, f=1).numpy()
    rows = X.numpy()
    medians = [
        np.median([rows[list(p)].mean(0) for p in ps], 0) for ps in pairings(list(range(10)))
    ]
    assert any(np.allclose(got, m, rtol=1e-12, atol=1e-12) for m in medians)
    assert not np.allclose(got, np.median(rows, 0))  # not the median of the inputs
    with pytest.raises(ValueError, match="min_buckets = 0"):
        Bucketing(Mean(), s=2, min_buckets=0)
    assert isinstance(make_aggregator("median", bucket_size=2, min_buckets=5), Bucketing)
    # a checkpoint written before min_buckets existed restores a Bucketing without it
    old = pickle.loads(pickle.dumps(Bucketing(CoordinateMedian(), s=2)))
    del old.__dict__["min_buckets"]
    assert (old.size(10), old.max_byzantine(10)) == (2, 2)


def test_too_many_byzantines_are_refused_with_the_limit():
    X = honest(n=10)
    with pytest.raises(ValueError, match="at most 4"):
        CoordinateMedian()(X, f=5)
    with pytest.raises(ValueError, match="at most 3"):
        Krum()(X, f=4)
    with pytest.raises(ValueError, match="at most 0"):
        Mean()(X, f=1)
    with pytest.raises(ValueError, match="at most 2"):  # ceil(10 / 2) = 5 buckets: median of 5
        Bucketing(CoordinateMedian(), s=2)(X, f=3)


def test_stack_round_trip_and_factory():
    updates = [
        {"a": np.full((2, 3), i, np.float32), "b": np.arange(4, dtype=np.float32) * i}
        for i in range(5)
    ]
    X, layout = stack(updates)
    assert X.shape == (5, 10)
    back = unstack(make_aggregator("median", bucket_size=1)(X), layout)
    np.testing.assert_array_equal(back["a"], np.full((2, 3), 2, np.float32))
    np.testing.assert_array_equal(back["b"], np.arange(4, dtype=np.float32) * 2)
    assert isinstance(make_aggregator("krum", bucket_size=2), Bucketing)
    with pytest.raises(ValueError, match="must be one of"):
        make_aggregator("medain")


def _attacked_run(robust: dict, tmp_path):
    """FedAvg on digits, 10 clients, 2 of them replying weights of 1e6 every round."""
    from helpers import corrupting_app

    from pflower.testbed.local_grid import run_local

    overrides = {
        "algorithm": "fedavg",
        "dataset": "digits",
        "partitioner": "iid",
        "num-server-rounds": 3,
        "fraction-train": 1.0,
        "evaluate-every": 3,
        "finetune-epochs": 1,
        "local-epochs": 3,
        "lr": 0.1,
        "outputs-dir": str(tmp_path),
        **robust,
    }
    app = corrupting_app(overrides, partitions=(0, 1), value=1e6)  # Byzantine: huge weights
    return run_local(overrides, 10, client_app=app)


def test_robust_option_keeps_fedavg_working_under_attack(tmp_path):
    unbounded = {"max-update-norm": 0}  # the update-norm bound off
    attacked = _attacked_run({**unbounded, "robust-aggregator": "none"}, tmp_path)  # the mean
    robust = _attacked_run(
        {**unbounded, "robust-aggregator": "median", "robust-byzantine": 2}, tmp_path
    )
    assert robust.final["global-accuracy"] > 0.7  # clean run: 0.86
    assert attacked.final["global-accuracy"] < 0.3
    # the default defence alone (adaptive clipping, no bound) keeps the 1e6 replies out too
    defended = _attacked_run(unbounded, tmp_path)
    assert defended.final["global-accuracy"] > 0.5
    # the default bound drops the 1e6 replies before the mean
    bounded = _attacked_run({}, tmp_path)
    assert bounded.final["global-accuracy"] > 0.7
    assert sum(n for r in bounded.rounds for k, n in r.dropped.items() if "norm" in k) == 6


def test_byzantine_beyond_the_rule_is_refused_at_the_first_round(tmp_path):
    with pytest.raises(ValueError, match="robust-byzantine"):
        _attacked_run({"robust-aggregator": "krum", "robust-byzantine": 4}, tmp_path)


@pytest.mark.parametrize("n", [7, 8])
def test_coordinate_rules_equal_numpy_on_random_inputs(n):
    """Median and trimmed mean against NumPy's median and a sort-based trimmed mean, with
    columns split over several chunks (even N: mean of the two middle values)."""
    rng = np.random.default_rng(n)
    X = rng.standard_normal((n, 1000)).astype(np.float32)
    chunked = aggregators.CHUNK
    aggregators.CHUNK = 300
    try:
        median = aggregators.CoordinateMedian()(torch.from_numpy(X)).numpy()
        trimmed = aggregators.TrimmedMean(0.2)(torch.from_numpy(X)).numpy()
    finally:
        aggregators.CHUNK = chunked
    np.testing.assert_allclose(median, np.median(X, axis=0), rtol=1e-6)
    k = int(np.ceil(0.2 * n))
    np.testing.assert_allclose(trimmed, np.sort(X, axis=0)[k : n - k].mean(0), atol=1e-6)


def test_centered_clipping_step_by_hand():
    """One iteration from a known centre: v + mean_i min(1, r/||x_i - v||)(x_i - v)."""
    X = torch.tensor([[3.0, 4.0], [0.0, 0.5], [-6.0, 8.0]])
    rule = aggregators.CenteredClipping(radius=1.0, iterations=1)
    rule.center = torch.zeros(2)
    # clipped: (3,4)/5, (0,0.5) unclipped, (-6,8)/10
    want = (np.array([0.6, 0.8]) + np.array([0.0, 0.5]) + np.array([-0.6, 0.8])) / 3
    np.testing.assert_allclose(rule(X).numpy(), want, atol=1e-6)


STREAMED = {
    **RULES,
    "bucketing(median)": lambda: make_aggregator("median", bucket_size=2, seed=3),
    "bucketing(trimmed-mean)": lambda: make_aggregator("trimmed-mean", bucket_size=3, seed=3),
    "bucketing(krum)": lambda: make_aggregator("krum", bucket_size=2, seed=3),
}


@pytest.mark.parametrize("n", [9, 10])
@pytest.mark.parametrize("weights", [True, False], ids=["center-minus-weights", "deltas"])
@pytest.mark.parametrize("name", sorted(STREAMED))
def test_streamed_rule_equals_the_rule_on_the_stacked_updates(name, weights, n, monkeypatch):
    """``robust_combine`` reads the replies tile by tile (coordinate-wise rules, with
    rule(c - x) = c - rule(x) for returned weights) or into one stack; the result is the rule
    on the stack of the updates, as the server formed it before, to float32 rounding."""
    from pflower.strategies.combine import robust_combine

    monkeypatch.setattr(aggregators, "TILE", 64)  # several tiles per layer
    rng = np.random.default_rng(n)
    center = {"w": rng.normal(size=(37, 11)).astype(np.float32), "b": rng.normal(size=5)}
    center["b"] = center["b"].astype(np.float32)
    arrays = [
        {k: (v + rng.normal(scale=0.1, size=v.shape)).astype(np.float32) for k, v in center.items()}
        for _ in range(n)
    ]
    arrays[0] = {k: v + 50 for k, v in arrays[0].items()}  # one outlier
    updates = [{k: center[k] - a[k] for k in center} if weights else a for a in arrays]
    f = min(1, STREAMED[name]().max_byzantine(n))
    X, layout = stack(updates)
    want = unstack(STREAMED[name]()(X, f=f), layout)
    got = robust_combine(STREAMED[name](), arrays, f, center if weights else None)
    for k in center:
        assert got[k].dtype == np.float32 and got[k].shape == center[k].shape
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
        if name == "median" and n % 2:  # one order statistic: c - x_(m) exactly
            np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize("name", ["median", "trimmed-mean"])
def test_a_coordinate_rule_never_holds_the_updates(name, monkeypatch):
    """Memory NumPy allocates while a coordinate-wise rule combines 20 replies of 2^20
    float32 (80 MB) as returned weights: two tiles and the result, not a stack or a list of
    updates (tiles of 2^16 elements here: at the default 2^22 two tiles are 32 MB, 1.5% of
    50 ResNet-18 replies)."""
    import tracemalloc

    from pflower.strategies.combine import robust_combine

    monkeypatch.setattr(aggregators, "TILE", 1 << 16)

    rng = np.random.default_rng(0)
    center = {"w": rng.normal(size=(1024, 1024)).astype(np.float32)}
    arrays = [{"w": center["w"] + np.float32(i)} for i in range(20)]
    replies = 20 * center["w"].nbytes
    tracemalloc.start()
    try:
        robust_combine(RULES[name](), arrays, 2, center)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.2 * replies, peak / replies
