"""The default defence (``robust-aggregator = "auto"``: ``combine.AdaptiveClipping``), the
robust rules' f counted against the faulty nodes of a round, local DP's bound, and replies
that do not answer the round's messages.

The clipping is checked against a plain NumPy computation of the rule as its docstring and
docs/threat-model.md state it, written here over stacked vectors (no pflower code on the
reference side), and attacked: an adaptive Byzantine reply in any direction at any size."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_bounds import attacking_app, drops

from pflower.config import Config
from pflower.experiments.local_grid import LocalGrid
from pflower.server_app import run as run_on
from pflower.strategies import FedAvg
from pflower.strategies.aggregators import make_aggregator
from pflower.strategies.combine import AdaptiveClipping

FACTOR = 2.0


def reference_clip(X: np.ndarray, factor: float = FACTOR, iterations: int = 3, w=None):
    """The rule on an N x d stack of updates, written from its statement: the plain mean if
    no row is farther than factor x the lower median distance from it (a row weighing w_i
    above the lower median weight w_m: than that x w_m / w_i); else from the coordinate-wise
    median, ``iterations`` centered-clipping steps, then every row clipped into its ball.
    Returns (clipped rows, centre, radius, how many were clipped)."""
    n = len(X)
    w = np.ones(n) if w is None else np.asarray(w, dtype=float)
    share = np.minimum(1.0, np.sort(w)[math.ceil(n / 2) - 1] / w)

    def radius(v):
        d = np.linalg.norm(X - v, axis=1)
        return d, factor * np.sort(d)[math.ceil(n / 2) - 1]

    v = X.mean(0)
    d, tau = radius(v)
    if (d <= tau * share).all():
        return X.copy(), v, tau, 0
    v = np.median(X, axis=0)
    for _ in range(iterations):
        d, tau = radius(v)
        c = np.minimum(1.0, tau / d)
        v = v + (c[:, None] * (X - v)).mean(0)
    d, tau = radius(v)
    c = np.minimum(1.0, tau * share / d)
    return np.where((c < 1)[:, None], v + c[:, None] * (X - v), X), v, tau, int((c < 1).sum())


def as_rows(vectors) -> np.ndarray:
    return np.stack([np.concatenate([np.ravel(v[k]) for k in sorted(v)]) for v in vectors])


def split(row: np.ndarray) -> dict[str, np.ndarray]:
    """A flat row as two named layers (the rule works layer by layer)."""
    return {"a": row[:6].reshape(2, 3).copy(), "b": row[6:].copy()}


def test_honest_rounds_are_aggregated_exactly_as_the_algorithm_would():
    rng = np.random.default_rng(0)
    rule = AdaptiveClipping(FACTOR)
    for n in (3, 5, 10):
        rows = rng.normal(1.0, 0.1, (n, 10))
        vectors = [split(r) for r in rows]
        out, clipped = rule.clip("x", vectors)
        assert clipped == 0 and all(o is v for o, v in zip(out, vectors))


@pytest.mark.parametrize("weights_form", [False, True])
def test_the_clipping_is_the_stated_rule(weights_form):
    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(3, 12))
        f = int(rng.integers(1, (n - 1) // 2 + 1))
        honest = rng.normal(rng.normal(0, 1, 10), rng.uniform(0.05, 2.0), (n - f, 10))
        bad = rng.normal(0, 1, 10) * 10.0 ** rng.uniform(-2, 8)
        X = np.vstack([honest, np.repeat(bad[None], f, 0)])[rng.permutation(n)]
        center = rng.normal(0, 1, 10)
        vectors = [split(center - x if weights_form else x) for x in X]
        rule = AdaptiveClipping(FACTOR)
        out, clipped = rule.clip("x", vectors, split(center) if weights_form else None)
        got = as_rows(out)
        if weights_form:
            got = center - got
        expected, v, tau, count = reference_clip(X)
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9 * (1 + np.abs(X).max()))
        assert clipped == count
        assert rule.rho["x"] == pytest.approx(np.linalg.norm(v) + tau)


def test_a_byzantine_minority_moves_the_mean_by_at_most_its_share_of_the_radius():
    """Whatever f < N/2 colluding replies send (direction, size), every applied update lies
    within tau of the centre, tau at most FACTOR x an honest reply's distance to it, and the
    mean of the applied updates is within (f/N) x 2 tau of the mean the same rule applies
    to the honest replies with the Byzantine ones set to the centre."""
    rng = np.random.default_rng(2)
    for trial in range(200):
        n = int(rng.integers(3, 15))
        f = int(rng.integers(1, (n - 1) // 2 + 1))
        honest = rng.normal(0, 1, (n - f, 8)) * rng.uniform(0.01, 3.0)
        direction = rng.normal(0, 1, 8)
        if trial % 2:  # against the honest mean
            direction = -honest.mean(0)
        bad = direction / np.linalg.norm(direction) * 10.0 ** rng.uniform(-3, 12)
        X = np.vstack([honest, np.repeat(bad[None], f, 0)])
        out, _ = AdaptiveClipping(FACTOR).clip("x", [{"w": x} for x in X])
        applied = np.stack([o["w"] for o in out])
        _, v, tau, _ = reference_clip(X)
        assert (np.linalg.norm(applied - v, axis=1) <= tau * (1 + 1e-9)).all()
        assert tau <= FACTOR * np.linalg.norm(honest - v, axis=1).max() * (1 + 1e-9)
        as_if_honest = np.vstack([applied[: n - f], np.repeat(v[None], f, 0)]).mean(0)
        assert np.linalg.norm(applied.mean(0) - as_if_honest) <= f / n * tau * (1 + 1e-9)


def test_a_claim_buys_no_more_weight_than_the_lower_median_claim():
    """A reply weighing w_i > w_m (the lower median weight) is clipped to radius
    tau x w_m / w_i: in the weighted mean its distance from the centre counts at most as
    much as w_m x tau, whatever it claims."""
    rng = np.random.default_rng(3)
    for _ in range(100):
        n = int(rng.integers(3, 12))
        X = rng.normal(0, 1, (n, 6))
        X[0] = rng.normal(0, 1, 6) * 10.0 ** rng.uniform(0, 6)
        w = rng.integers(50, 150, n).astype(float)
        w[0] = 10.0 ** rng.uniform(0, 5)  # the liar's claim, any size
        out, _ = AdaptiveClipping(FACTOR).clip("x", [{"w": x} for x in X], None, w)
        applied = np.stack([o["w"] for o in out])
        expected, v, tau, _ = reference_clip(X, w=w)
        np.testing.assert_allclose(applied, expected, rtol=1e-9, atol=1e-9 * np.abs(X).max())
        w_m = np.sort(w)[math.ceil(n / 2) - 1]
        assert (w * np.linalg.norm(applied - v, axis=1) <= w_m * tau * (1 + 1e-9)).all()


def test_small_rounds_are_clipped_to_what_a_larger_round_applied():
    rule = AdaptiveClipping(FACTOR, growth=2.0)
    one = [{"w": np.array([1e9, 0.0])}]
    assert rule.clip("x", one)[0][0] is one[0]  # no round of 3 yet: nothing known
    honest = [{"w": np.array([1.0, 0.0])}, {"w": np.array([0.0, 1.0])}, {"w": np.array([1.0, 1.0])}]
    rule.clip("x", honest)
    mean = np.array([2 / 3, 2 / 3])
    tau = FACTOR * sorted(np.linalg.norm(np.array([h["w"] for h in honest]) - mean, axis=1))[1]
    rho = np.linalg.norm(mean) + tau
    assert rule.rho["x"] == pytest.approx(rho)
    out, clipped = rule.clip("x", one + one)
    assert clipped == 2
    assert np.linalg.norm(out[0]["w"]) == pytest.approx(2.0 * rho)
    assert rule.rho["x"] == pytest.approx(rho)  # a small round leaves it
    assert "y" not in rule.rho  # each kind its own


# --- end to end: the default against an adaptive Byzantine client ---------------------------
FAST = {
    "dataset": "digits",
    "partitioner": "iid",
    "pretrain-rounds": 2,
    "num-server-rounds": 6,
    "finetune-epochs": 1,
    "evaluate-every": 100,
}


def flip_to(size):
    """Node 0 sends ``-size x u / ||u||`` (``size`` None: 1e6 x its honest norm)."""

    def attack(pid, rnd, vector, sent):
        if pid != 0:
            return None
        norm = math.sqrt(sum(float(np.square(v.astype(np.float64)).sum()) for v in vector.values()))
        target = size if size is not None else 1e6 * norm
        return {k: -target / norm * v.astype(np.float64) for k, v in vector.items()}

    return attack


@pytest.mark.parametrize("algorithm", ["fedavg", "ffgg", "scaffold"])
def test_one_byzantine_client_in_ten_at_defaults_is_clipped_in_every_phase(algorithm, tmp_path):
    overrides = {**FAST, "algorithm": algorithm}
    cfg = Config.from_run_config(overrides)
    app = attacking_app(overrides, attack=flip_to(None))
    rep = run_on(LocalGrid(app, 10, seed=0), cfg, tmp_path)
    clipped = [e.train.get("clipped", 0) for e in rep.rounds if e.train]
    assert sum(clipped[:2]) >= 1 and sum(clipped[2:]) >= 1  # pre-training and after
    assert drops(rep, "update norm") <= 2  # the 1e6 x reply is dropped until R is seeded
    clean = run_on(LocalGrid(attacking_app(overrides), 10, seed=0), cfg, tmp_path / "c")
    assert rep.final["personal-accuracy"] >= clean.final["personal-accuracy"] - 0.05


# --- tolerated means tolerated --------------------------------------------------------------
def nan_app(overrides, who):
    def attack(pid, rnd, vector, sent):
        return {k: np.full_like(v, np.nan) for k, v in vector.items()} if pid in who else None

    return attacking_app(overrides, attack=attack)


@pytest.mark.parametrize(
    ("nodes", "fraction", "rule", "f", "bad"),
    [(3, 1.0, "median", 1, {0}), (10, 0.5, "median", 2, {0, 1}), (5, 1.0, "krum", 1, {2})],
)
def test_the_byzantines_a_rule_tolerates_cannot_stop_the_run(
    nodes, fraction, rule, f, bad, tmp_path
):
    overrides = {
        **FAST,
        "algorithm": "fedavg",
        "robust-aggregator": rule,
        "robust-byzantine": f,
        "fraction-train": fraction,
    }
    cfg = Config.from_run_config(overrides)
    rep = run_on(LocalGrid(nan_app(overrides, bad), nodes, seed=0), cfg, tmp_path)
    assert not any(e.train.get("skipped") for e in rep.rounds)
    assert drops(rep, "non-finite") >= 1
    assert all(e.train.get("applied", 1) >= 1 for e in rep.rounds if e.train)


def test_f_counts_every_sampled_node_without_a_kept_reply():
    strategy = FedAvg(robust=make_aggregator("median"), byzantine=2)
    strategy._asked = {1, 2, 3, 4, 5}
    assert strategy.byzantine_kept(5) == 2
    assert strategy.byzantine_kept(4) == 1  # one dropped: at most one Byzantine left
    assert strategy.byzantine_kept(2) == 0
    # 2 kept of 5 asked: every kept reply honest, the median over 2 is their mean
    got = strategy.combine([{"w": np.array([1.0])}, {"w": np.array([3.0])}], [1.0, 1.0])
    assert got["w"][0] == 2.0
