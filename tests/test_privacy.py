"""Differential privacy of the shared updates (``pflower.strategies.privacy``): the clip bound
for every algorithm and reply kind in both modes, bit-equality at zero noise and a huge clip,
the noise's scale, the accountant against a closed form, budgets, adaptive clipping, robust
rules with DP, checkpoints of the ledger. The reference side computes norms, noise statistics
and RDP by hand: numpy and math, nothing of ``privacy``'s."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from flwr.serverapp.exception import PrivacyBudgetExhausted

from pflower.config import Config
from pflower.experiments.local_grid import run_local
from pflower.settings import ConfigError
from pflower.strategies import privacy
from pflower.strategies.privacy import DPSettings, Mechanism

BASE = {
    "dataset": "digits",
    "num-server-rounds": 3,
    "pretrain-rounds": 0,
    "fraction-train": 0.5,
    "evaluate-every": 3,
    "finetune-epochs": 1,
    "local-epochs": 1,
}
NODES = 6

#: every reply kind: weights (fedavg, fedalt, apfl, l2gd), gradients (ffgg, pflego), a delta
#: (local-ffgg), a delta with control deltas (scaffold); pre-training rounds (fedalt)
KINDS = {
    "fedavg": {"algorithm": "fedavg"},
    "fedalt+pretrain": {"algorithm": "fedalt", "pretrain-rounds": 1},
    "apfl": {"algorithm": "apfl"},
    "l2gd": {"algorithm": "l2gd", "fraction-train": 1.0},
    "ffgg": {"algorithm": "ffgg"},
    "pflego": {"algorithm": "pflego"},
    "local-ffgg": {"algorithm": "local-ffgg"},
    "scaffold": {"algorithm": "scaffold"},
}


def flat_norm(arrays) -> float:
    return float(np.linalg.norm(np.concatenate([np.ravel(a) for a in arrays.values()])))


@pytest.fixture
def clip_spy(monkeypatch):
    """Every vector the mechanism clips: its norm before and after (computed here)."""
    seen: list[tuple[float, float, int]] = []
    original = privacy.clipped

    def spy(vector, clip, center=None):
        out, norm = original(vector, clip, center)
        raw = (
            {k: np.asarray(v, np.float64) for k, v in vector.items()}
            if center is None
            else {k: np.asarray(c, np.float64) - vector[k] for k, c in center.items()}
        )
        seen.append((flat_norm(raw), flat_norm(out), len(out)))
        return out, norm

    monkeypatch.setattr(privacy, "clipped", spy)
    return seen


# local DP's client side is one function for every reply kind: weights (with pre-training),
# a gradient, a delta with control deltas
@pytest.mark.parametrize(
    "kind,mode",
    [(kind, "central") for kind in KINDS]
    + [(kind, "local") for kind in ("fedalt+pretrain", "ffgg", "scaffold")],
)
def test_every_update_is_clipped_to_the_bound(kind, mode, clip_spy, tmp_path):
    clip = 0.05
    run = {**BASE, **KINDS[kind], "dp": mode, "dp-clip": clip, "dp-noise": 0.0}
    report = run_local({**run, "outputs-dir": str(tmp_path)}, NODES)
    applied = sum(r.train.get("applied", 0) for r in report.rounds)
    assert applied > 0 and len(clip_spy) >= applied
    for before, after, _ in clip_spy:
        assert after <= clip * (1 + 1e-12)
        assert after == pytest.approx(min(before, clip), rel=1e-9)  # clipped, not zeroed
    assert any(before > clip for before, _, _ in clip_spy)  # the bound was binding
    if kind == "scaffold":  # delta and control delta: one vector, clipped together
        sizes = {n for _, _, n in clip_spy}
        assert max(sizes) == 2 * min(sizes) or len(sizes) == 1
    assert all(r.train.get("dropped", 0) == 0 for r in report.rounds)


def shared_after(run, tmp_path):
    report = run_local({**run, "outputs-dir": str(tmp_path)}, NODES)
    return report.shared, [r.train for r in report.rounds]


@pytest.mark.parametrize(
    "algorithm,mode",
    [
        ("ffgg", "central"),
        ("scaffold", "central"),
        ("l2gd", "central"),
        ("ffgg", "local"),
        ("fedalt", "local"),
    ],
)
def test_zero_noise_and_a_huge_clip_equal_the_private_free_run_bit_for_bit(
    algorithm, mode, tmp_path
):
    """Uniform-weight algorithms (FFGG's mean, Scaffold's): the mechanism at z = 0 and
    C = 1e12 computes the same float64 mean in the same order; weights that go through their
    updates (L2GD's mean, a local-DP weights reply) equal it to float32 rounding."""
    # two runs compared bit for bit: the same (reproducible) sample
    run = {**BASE, **KINDS.get(algorithm, {"algorithm": algorithm}), "sample-seed": 0}
    exact = (algorithm, mode) not in (("l2gd", "central"), ("fedalt", "local"))
    plain, plain_rounds = shared_after(run, tmp_path / "a")
    private, private_rounds = shared_after(
        {**run, "dp": mode, "dp-clip": 1e12, "dp-noise": 0.0}, tmp_path / "b"
    )
    assert plain.keys() == private.keys()
    for k in plain:
        # weights through their updates (L2GD's mean of w_i as current - mean(current - w_i),
        # a local-DP reply as sent - (sent - w_i)): equal up to float32 rounding
        if not exact:
            np.testing.assert_allclose(np.asarray(plain[k]), np.asarray(private[k]), atol=1e-6)
        else:
            assert np.array_equal(np.asarray(plain[k]), np.asarray(private[k])), k
    for a, b in zip(plain_rounds, private_rounds):
        b = {k: v for k, v in b.items() if not k.startswith("dp-")}
        assert b == (a if exact else pytest.approx(a, rel=1e-6))


def test_a_planted_error_in_the_central_mean_is_caught():
    """The mean divides by the sampled m, not by the replies kept: 3 of m = 4 replied."""
    mech = Mechanism(DPSettings(mode="central", clip=10.0, noise=0.0))
    vectors = [
        {"w": np.array([1.0, 2.0])},
        {"w": np.array([3.0, 0.0])},
        {"w": np.array([0.0, 4.0])},
    ]
    out = mech.mean(vectors, 4, np.random.default_rng(0))
    assert np.allclose(out["w"], np.array([4.0, 6.0]) / 4)
    # weights replies: the update is center - w
    center = {"w": np.array([1.0, 1.0])}
    out = mech.mean([{"w": np.array([0.0, 1.0])}], 1, np.random.default_rng(0), center)
    assert np.array_equal(out["w"], np.array([1.0, 0.0]))
    # a long update is scaled onto the sphere of radius C, direction kept
    mech = Mechanism(DPSettings(mode="central", clip=1.0, noise=0.0))
    out = mech.mean([{"w": np.array([3.0, 4.0])}], 1, np.random.default_rng(0))
    assert np.allclose(out["w"], [0.6, 0.8])


def test_central_noise_has_the_stated_scale():
    z, clip, m, d = 1.3, 0.7, 5, 200_000
    mech = Mechanism(DPSettings(mode="central", clip=clip, noise=z))
    zeros = [{"w": np.zeros(d)} for _ in range(m)]
    out = mech.mean(zeros, m, np.random.default_rng(7))["w"]
    expected = z * clip / m
    # the sample std of d Gaussians: relative error ~ 1/sqrt(2d) = 0.16 %; 5 sigma
    assert abs(out.std() / expected - 1) < 5 / math.sqrt(2 * d)
    assert abs(out.mean()) < 5 * expected / math.sqrt(d)


def test_central_noise_is_scaled_by_the_sampled_m_when_replies_are_missing():
    """3 of m = 5 replied: the noise std on the mean is still z C / 5 (the divisor must not
    depend on who replied, or the noise would tell)."""
    z, clip, m, d = 2.0, 0.5, 5, 200_000
    mech = Mechanism(DPSettings(mode="central", clip=clip, noise=z))
    out = mech.mean([{"w": np.zeros(d)} for _ in range(3)], m, np.random.default_rng(11))["w"]
    assert abs(out.std() / (z * clip / m) - 1) < 5 / math.sqrt(2 * d)


def test_local_noise_has_the_stated_scale_and_mean():
    z, clip, d = 0.8, 2.0, 200_000
    update = {"w": np.full(d, 1e-4)}  # norm 0.045 < C: kept as is
    out = privacy.local_release(
        update, DPSettings(mode="local", clip=clip, noise=z), np.random.default_rng(3)
    )
    noise = out["w"] - 1e-4
    assert abs(noise.std() / (z * clip) - 1) < 5 / math.sqrt(2 * d)
    assert abs(noise.mean()) < 5 * z * clip / math.sqrt(d)


def test_noise_comes_from_os_entropy_unless_seeded():
    a = privacy.noise_rng(-1, 3).normal(size=4)
    b = privacy.noise_rng(-1, 3).normal(size=4)
    assert not np.array_equal(a, b)
    assert np.array_equal(
        privacy.noise_rng(5, 3).normal(size=4), privacy.noise_rng(5, 3).normal(size=4)
    )


def rdp_epsilon(sigma: float, rounds: int, delta: float) -> float:
    """The Gaussian mechanism (sensitivity 1, std sigma) composed ``rounds`` times: RDP
    ``rounds * a / (2 sigma^2)`` at order a, converted to (eps, delta) by Canonne, Kamath &
    Steinke 2020 (Prop. 12), minimised over a fine grid of orders."""
    best = math.inf
    for a in np.concatenate([np.linspace(1.01, 10, 2000), np.linspace(10, 512, 4000)]):
        rdp = rounds * a / (2 * sigma**2)
        eps = rdp + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
        best = min(best, eps)
    return best


@pytest.mark.parametrize("z,rounds", [(1.0, 1), (2.0, 50), (4.0, 200)])
def test_the_accountant_equals_the_closed_form_when_everyone_is_sampled(z, rounds):
    """q = 1: no amplification, each round the Gaussian mechanism on a sum of clipped updates
    whose replace-one sensitivity is 2C, std zC: multiplier z / 2."""
    delta = 1e-5
    eps = privacy.epsilon_of(z, rounds, 10, 10, delta)
    reference = rdp_epsilon(z / 2, rounds, delta)
    # the library minimises over its own orders (a coarser grid): never below the fine grid
    assert reference * (1 - 1e-9) <= eps <= reference * 1.02
    # the local mode's client: the same mechanism, once per participation
    assert privacy.epsilon_of(z, rounds, 1, 1, delta, local=True) == pytest.approx(
        reference, rel=0.02
    )


def test_sampling_without_replacement_amplifies():
    full = privacy.epsilon_of(2.0, 100, 50, 50, 1e-5)
    tenth = privacy.epsilon_of(2.0, 100, 5, 50, 1e-5)
    assert tenth < full / 3


def test_a_target_epsilon_is_met_by_the_calibrated_noise(tmp_path):
    run = {**BASE, "algorithm": "fedalt", "dp": "central", "dp-epsilon": 8.0}
    report = run_local({**run, "outputs-dir": str(tmp_path)}, NODES)
    spent = [r.train["dp-epsilon"] for r in report.rounds if "dp-epsilon" in r.train]
    assert spent == sorted(spent) and len(spent) == 3
    assert 8.0 * 0.99 <= spent[-1] <= 8.0 * (1 + 1e-9)
    z = report.rounds[-1].train["dp-noise"]
    assert privacy.epsilon_of(z * 0.99, 3, 3, NODES, 1e-5) > 8.0  # the smallest such z


def test_a_plan_over_the_budget_is_refused_before_any_update(tmp_path):
    run = {**BASE, "algorithm": "fedalt", "dp": "central", "dp-epsilon": 1.0, "dp-noise": 0.5}
    with pytest.raises(PrivacyBudgetExhausted, match=r"'dp-epsilon' = 1.0.*allows 0 rounds"):
        run_local({**run, "outputs-dir": str(tmp_path)}, NODES)


def test_a_round_past_the_budget_stops_the_run():
    """The population shrank after the plan (nodes left): the next rounds cost more."""
    mech = Mechanism(DPSettings(mode="central", clip=1.0, noise=2.0, epsilon=3.0))
    mech.start(population=20, sample=2, rounds=2)
    with pytest.raises(PrivacyBudgetExhausted, match="next training round"):
        for _ in range(200):
            mech.check(list(range(10)))
            mech.released(list(range(10)))
    assert mech.epsilon <= 3.0


def test_local_accounting_follows_the_most_sampled_client():
    mech = Mechanism(DPSettings(mode="local", clip=1.0, noise=3.0))
    mech.start(population=4, sample=2, rounds=5)
    for nodes in ([1, 2], [1, 3], [1, 4]):
        mech.released(nodes)
    assert mech.epsilon == pytest.approx(privacy.epsilon_of(3.0, 3, 1, 1, 1e-5, local=True))


def test_adaptive_clipping_moves_toward_the_quantile():
    dp = DPSettings(mode="central", clip=1.0, noise=0.0, adaptive=True, quantile=0.5, clip_lr=0.2)
    mech = Mechanism(dp)
    small = [{"w": np.array([0.1, 0.0])} for _ in range(4)]  # all unclipped: share 1
    mech.mean(small, 4, np.random.default_rng(0))
    assert mech.clip == pytest.approx(math.exp(-0.2 * (1 - 0.5)))
    large = [{"w": np.array([5.0, 0.0])} for _ in range(4)]  # none unclipped: share 0
    before = mech.clip
    mech.mean(large, 4, np.random.default_rng(0))
    assert mech.clip == pytest.approx(before * math.exp(0.2 * 0.5))


def test_the_ledger_survives_a_checkpoint():
    mech = Mechanism(DPSettings(mode="central", clip=1.0, noise=1.5))
    mech.start(population=10, sample=3, rounds=4)
    mech.released([1, 2, 3])
    mech.released([4, 5, 6])
    restored = pickle.loads(pickle.dumps(mech))
    restored.released([7, 8, 9])
    mech.released([7, 8, 9])
    assert restored.epsilon == mech.epsilon > 0


def test_local_dp_with_a_robust_rule_runs_and_lets_noised_updates_through(tmp_path):
    run = {
        **BASE,
        "algorithm": "ffgg",
        "fraction-train": 1.0,
        "dp": "local",
        "dp-clip": 0.5,
        "dp-noise": 1.0,
        "robust-aggregator": "median",
    }
    report = run_local({**run, "outputs-dir": str(tmp_path)}, NODES)
    assert all(r.train["applied"] == NODES and r.train["dropped"] == 0 for r in report.rounds)
    assert report.rounds[-1].train["dp-epsilon"] > 0


@pytest.mark.parametrize(
    "keys,match",
    [
        ({"dp": "central"}, "needs 'dp-noise'"),
        ({"dp": "central", "dp-noise": 1.0, "robust-aggregator": "median"}, "robust rule"),
        ({"dp": "central", "dp-noise": 1.0, "algorithm": "br-ffgg"}, "robust rule"),
        ({"dp": "local", "dp-noise": 1.0, "dp-adaptive-clip": True}, "adaptive clipping"),
        ({"dp": "local", "dp-noise": 1.0, "algorithm": "async-ffgg"}, "one at a time"),
        ({"dp": "central", "dp-noise": -0.5}, "must be -1"),
        ({"dp": "laplace"}, "'dp'"),
    ],
)
def test_bad_dp_configurations_fail_at_start_naming_the_key(keys, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_run_config(keys)


def test_a_noise_that_drowns_the_signal_is_named_at_start():
    """The default run's 5 clients per round at epsilon 8: the noise on the mean is far above
    the clipped signal; 1 000 clients per round at z = 1 on a small model is not."""
    drowning = Mechanism(DPSettings(mode="central", clip=1.0, noise=10.0))
    drowning.start(population=10, sample=5, rounds=20)
    assert "will barely learn" in drowning.signal_problem(200_000)
    fine = Mechanism(DPSettings(mode="central", clip=1.0, noise=1.0))
    fine.start(population=10_000, sample=1000, rounds=20)
    assert fine.signal_problem(10_000) == ""  # 1 x sqrt(1e4) / 1e3 = 0.1 < 10 x C
