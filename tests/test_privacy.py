"""Differential privacy of the shared updates (``pflower.strategies.privacy``): the clip bound
for every algorithm and reply kind in both modes, bit-equality at zero noise and a huge clip,
the noise's scale, the accountant against a closed form, budgets, adaptive clipping, robust
rules with DP, checkpoints of the ledger. The reference side computes norms, noise statistics
and RDP by hand: numpy and math, nothing of ``privacy``'s."""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest
from flwr.serverapp.exception import PrivacyBudgetExhausted

from pflower.config import Config
from pflower.settings import ConfigError
from pflower.strategies import privacy
from pflower.strategies.privacy import DPSettings, Mechanism
from pflower.testbed.local_grid import run_local

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
    # two runs compared bit for bit: the same (reproducible) sample, and the plain run's
    # mean the algorithm's own (not the default defence's clipping, which dp replaces)
    run = {
        **BASE,
        **KINDS.get(algorithm, {"algorithm": algorithm}),
        "sample-seed": 0,
        "robust-aggregator": "none",
    }
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
        if mode == "central":  # which releases no norm of an update (FFGG's diagnostic)
            a = {k: v for k, v in a.items() if not k.startswith("grad-norm")}
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


def gdp_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon of mu-GDP (Dong, Roth & Su 2022, Cor. 2.13): the Gaussian mechanism of
    sensitivity 1 and std sigma composed T times is mu = sqrt(T) / sigma;
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), inverted by bisection."""

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    def delta_of(eps: float) -> float:
        return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2)

    low, high = 0.0, 1.0
    while delta_of(high) > delta:
        low, high = high, 2 * high
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if delta_of(mid) > delta else (low, mid)
    return high


@pytest.mark.parametrize("z,rounds", [(1.0, 1), (2.0, 50), (4.0, 200)])
def test_the_accountant_equals_the_closed_form_when_everyone_is_sampled(z, rounds):
    """q = 1: no amplification, each round the Gaussian mechanism on a sum of clipped updates
    whose replace-one sensitivity is 2C, std zC: multiplier z / 2. Central: RDP; the local
    client's reports: the tighter of RDP and PLD, which for an unsampled Gaussian is exact."""
    delta = 1e-5
    eps = privacy.epsilon_of(z, rounds, 10, 10, delta)
    reference = rdp_epsilon(z / 2, rounds, delta)
    # the library minimises over its own orders (a coarser grid): never below the fine grid
    assert reference * (1 - 1e-9) <= eps <= reference * 1.02
    # the local mode's client: the same mechanism, once per participation; its PLD is the
    # exact Gaussian (pessimistic discretization: a hair above, never below)
    exact = gdp_epsilon(2 * math.sqrt(rounds) / z, delta)
    local = privacy.epsilon_of(z, rounds, 1, 1, delta, local=True)
    assert exact * (1 - 1e-6) <= local <= exact * 1.01 + 1e-3
    assert local < reference  # PLD is the tighter here, and it is the one used


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


# --- issue 46: accounting as the run delivers it ---------------------------------------------
def direct(events, relation: str, accountant: str = "rdp", delta: float = 1e-5) -> float:
    """Epsilon of ``events`` ((dp_event, count) pairs) from a dp-accounting accountant built
    here, not through ``privacy``."""
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    rel = getattr(dp_accounting.NeighboringRelation, relation)
    acc = RdpAccountant(neighboring_relation=rel) if accountant == "rdp" else PLDAccountant(rel)
    for event, count in events:
        acc.compose(event, count)
    return acc.get_epsilon(delta)


def wor(z, m, n):
    """m of n without replacement, replace-one: the sum moves by 2C, std zC: z / 2."""
    from dp_accounting import dp_event

    return dp_event.SampledWithoutReplacementDpEvent(n, m, dp_event.GaussianDpEvent(z / 2))


def poisson(z, q):
    """each client with probability q, add/remove: the sum moves by C, std zC: z."""
    from dp_accounting import dp_event

    return dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z))


def test_the_sweeps_calibration_is_what_the_docs_say():
    """docs/privacy.md: 60 of 300 per round, 60 rounds, delta 1e-4: z = 2.48 / 6.75 / 22.5 for
    epsilon 16 / 4 / 1 (checked independently in issue 46: 2.484 / 6.746 / 22.53): each z spends
    its epsilon to 0.2 %, by pflower's accountant and by dp-accounting called here."""
    for eps, z in ((16.0, 2.484), (4.0, 6.746), (1.0, 22.53)):
        found = privacy.epsilon_of(z, 60, 60, 300, 1e-4)
        assert found == pytest.approx(eps, rel=2e-3)
        assert found == pytest.approx(direct([(wor(z, 60, 300), 60)], "REPLACE_ONE", delta=1e-4))


def test_q_follows_the_live_population():
    """100 of 300 nodes leave after 30 rounds: the next 30 sample 60 of 200 (q = 0.3, not 0.2).
    Each round's q is the one it sampled with; composed as dp-accounting composes them."""
    z, delta = 2.484, 1e-4
    mech = Mechanism(DPSettings(mode="central", clip=1.0, noise=z, delta=delta))
    mech.start(population=300, sample=60, rounds=60)
    for r in range(60):
        population = 300 if r < 30 else 200
        nodes = list(range(60))
        mech.check(nodes, population)
        mech.released(nodes)
    right = direct([(wor(z, 60, 300), 30), (wor(z, 60, 200), 30)], "REPLACE_ONE", delta=delta)
    fixed_at_start = direct([(wor(z, 60, 300), 60)], "REPLACE_ONE", delta=delta)
    assert mech.epsilon == pytest.approx(right, rel=1e-9)
    assert mech.epsilon > fixed_at_start * 1.15  # what a population fixed at round 1 reported
    assert mech.ledger == {(0.2, 60, 300): 30, (0.3, 60, 200): 30}
    # nodes that joined later: a larger population, accounted as such (no refusal)
    mech.check(list(range(60)), 400)
    mech.released(list(range(60)))
    assert mech.ledger[(0.15, 60, 400)] == 1


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)


def private_strategy(cls, fraction=0.5, **dp):
    settings = DPSettings(**{"mode": "central", "clip": 1.0, "noise": 2.0, "seed": 5, **dp})
    strategy = cls(fraction_train=fraction, privacy=settings, max_failed_rounds=0)
    strategy.num_rounds = 5
    return strategy


def test_the_server_accounts_each_round_with_the_nodes_it_sampled_from(task_identity):
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from pflower.strategies import FedAvg

    strategy = private_strategy(FedAvg, fraction=0.1)
    arrays = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    for server_round, nodes in ((1, range(100)), (2, range(50)), (3, range(200))):
        msgs = list(strategy.configure_train(server_round, arrays, ConfigRecord(), FakeGrid(nodes)))
        strategy.aggregate_train(server_round, [])  # nobody answered: released all the same
        assert strategy.nodes.sampled_from == len(nodes) and len(msgs) == len(nodes) // 10
    assert strategy.privacy.ledger == {(0.1, 10, 100): 1, (0.1, 5, 50): 1, (0.1, 20, 200): 1}


@pytest.mark.parametrize("algorithm", ["fedavg", "ffgg", "scaffold", "fedalt+pretrain"])
def test_a_round_that_keeps_no_reply_is_released_with_noise_and_counted(
    algorithm, task_identity, monkeypatch
):
    """Every reply dropped (non-finite) or none at all: the mechanism still runs, on zero
    contributions (its mean is noise of std z C / m alone), the shared parameters move by that
    noise through the algorithm's own step, and the accountant counts the round."""
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from pflower.strategies import FFGG, FedAlt, FedAvg, Scaffold
    from pflower.strategies.scaffold import CONTROL_DELTA

    cls = {"fedavg": FedAvg, "ffgg": FFGG, "scaffold": Scaffold, "fedalt+pretrain": FedAlt}
    z, clip, n, d = 2.0, 0.5, 8, 40_000
    strategy = private_strategy(cls[algorithm], clip=clip, noise=z)
    if algorithm == "fedalt+pretrain":
        strategy.pretrain_rounds = 1
        strategy.shared_names = ["w"]
    means = []
    original = Mechanism.mean

    def spy(self, vectors, sampled, rng, center=None):
        out = original(self, vectors, sampled, rng, center)
        means.append((len(vectors), {k: v.copy() for k, v in out.items()}))
        return out

    monkeypatch.setattr(Mechanism, "mean", spy)
    current = {"w": np.zeros(d, np.float32)}
    arrays = ArrayRecord({k: Array(v) for k, v in current.items()})
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid(range(n))))
    m = len(msgs)
    nan = {"w": np.full(d, np.nan, np.float32)}
    key = strategy.reply_key if algorithm != "fedalt+pretrain" else "arrays"
    replies = [
        _reply(msg, {key: nan, **({CONTROL_DELTA: nan} if algorithm == "scaffold" else {})})
        for msg in msgs[:2]
    ]
    new, metrics = strategy.aggregate_train(1, replies)
    assert metrics["applied"] == 0 and metrics["dropped"] == 2
    ((kept, mean),) = means  # the mechanism ran once, on the stand-in that contributes nothing
    assert kept == 1
    noise = np.concatenate([np.ravel(a) for a in mean.values()])
    assert abs(noise.std() / (z * clip / m) - 1) < 5 / math.sqrt(2 * noise.size)
    assert not np.array_equal(new["w"].numpy(), current["w"])  # released: noise, not unchanged
    assert metrics["dp-epsilon"] == pytest.approx(
        direct([(wor(z, m, n), 1)], "REPLACE_ONE"), rel=1e-9
    )
    assert strategy.privacy.ledger == {(m / n, m, n): 1}


def _reply(msg, records: dict, num_examples: int = 10):
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    content = RecordDict(
        {k: ArrayRecord({n: Array(v) for n, v in a.items()}) for k, a in records.items()}
    )
    content["metrics"] = MetricRecord({"num-examples": num_examples})
    return Message(content=content, reply_to=msg)


def test_poisson_sampling_is_what_the_server_does(task_identity):
    """dp-sampling = "poisson": each of N nodes on its own coin (sizes vary, zero possible),
    the mean over the expected size q N whoever came, every round accounted at q."""
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from pflower.strategies import FedAvg

    n, q = 400, 0.05
    strategy = private_strategy(FedAvg, fraction=q, sampling="poisson")
    arrays = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    sizes = []
    for r in range(1, 41):
        msgs = strategy.configure_train(r, arrays, ConfigRecord(), FakeGrid(range(n)))
        sizes.append(len(list(msgs)))
        assert strategy.privacy.divisor == pytest.approx(q * n)
        strategy.aggregate_train(r, [])
    # Binomial(400, 0.05): mean 20, std 4.36; 40 rounds
    assert len(set(sizes)) > 5 and abs(np.mean(sizes) - 20) < 5 * 4.36 / math.sqrt(40)
    assert strategy.privacy.ledger == {(q, 0, 0): 40}
    z, delta = 2.0, 1e-5
    eps_rdp = direct([(poisson(z, q), 40)], "ADD_OR_REMOVE_ONE", "rdp", delta)
    eps_pld = direct([(poisson(z, q), 40)], "ADD_OR_REMOVE_ONE", "pld", delta)
    found = strategy.privacy.accountants()
    assert found["rdp"] == pytest.approx(eps_rdp, rel=1e-9)
    assert found["pld"] == pytest.approx(eps_pld, rel=5e-3)  # 1e-3 vs 1e-4 discretization
    assert strategy.privacy.epsilon == min(found.values()) == found["pld"]


def test_the_poisson_mean_divides_by_the_expected_size():
    mech = Mechanism(DPSettings(mode="central", clip=10.0, noise=0.0, sampling="poisson"))
    mech.start(population=100, sample=0, rounds=3, rate=0.04)
    mech.check([1, 2, 3], 100)  # 3 came, 4 expected
    vectors = [{"w": np.array([1.0, 2.0])}, {"w": np.array([3.0, 0.0])}]
    assert np.allclose(mech.mean(vectors, 3, np.random.default_rng(0))["w"], [4 / 4, 2 / 4])


def test_each_accountant_against_a_direct_computation():
    """Fixed-size, replace-one: RDP alone (WBK), Flower's own RdpAccountant agrees; the Poisson
    comparison of the same rounds: RDP and PLD at q = m / N; not amplified (a reproducible
    sample): the Gaussian at z / 2, exact by GDP."""
    from flwr.serverapp import RdpAccountant
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )

    z, m, n, rounds, delta = 2.484, 60, 300, 12, 1e-4
    mech = Mechanism(DPSettings(mode="central", clip=1.0, noise=z, delta=delta))
    mech.start(population=n, sample=m, rounds=rounds)
    for _ in range(rounds):
        mech.check(list(range(m)), n)
        mech.released(list(range(m)))
    found = mech.accountants()
    assert set(found) == {"rdp", "poisson-rdp", "poisson-pld"}  # no PLD bound for this sample
    flower = RdpAccountant(
        PrivacyConfig(delta, n, NeighboringRelation.REPLACE_ONE, SamplingMethod.WITHOUT_REPLACEMENT)
    )
    flower.compose(GaussianPrivacyEvent(z / 2, m, n), rounds)
    assert found["rdp"] == pytest.approx(flower.get_epsilon(delta), rel=1e-9)
    assert found["rdp"] == pytest.approx(
        direct([(wor(z, m, n), rounds)], "REPLACE_ONE", delta=delta)
    )
    q = m / n
    for name in ("rdp", "pld"):
        reference = direct([(poisson(z, q), rounds)], "ADD_OR_REMOVE_ONE", name, delta)
        assert found[f"poisson-{name}"] == pytest.approx(reference, rel=5e-3)
    assert mech.metrics()["dp-amplified"] == 1.0 and mech.epsilon == found["rdp"]
    # a sample anyone can reproduce (a seeded one): no amplification; a client's epsilon is the
    # Gaussian at z / 2 over the rounds it was in, the run's the most sampled client's
    open_ = Mechanism(DPSettings(mode="central", clip=1.0, noise=z, delta=delta))
    open_.start(population=n, sample=m, rounds=rounds, amplified=False)
    schedule = random.Random(0)
    counts: dict[int, int] = {}
    for _ in range(rounds):
        nodes = schedule.sample(range(n), m)
        for node in nodes:
            counts[node] = counts.get(node, 0) + 1
        open_.check(nodes, n)
        open_.released(nodes)
    most = max(counts.values())
    assert 2 < most < rounds
    exact = gdp_epsilon(2 * math.sqrt(most) / z, delta)
    assert exact <= open_.epsilon <= exact * 1.01
    assert open_.metrics()["dp-amplified"] == 0.0
    assert open_.epsilon > mech.epsilon


def test_poisson_epsilon_as_pfl_research_computes_it():
    """Apple's pfl-research accounts DP-FedAvg with dp-accounting's PLD built from the Gaussian
    mechanism (``from_gaussian_mechanism(sigma, sensitivity=1, sampling_prob=q)``, self-composed)
    and RDP of ``PoissonSampledDpEvent``; one of its test cases: 1000 rounds at q = 0.01,
    noise 0.76. pflower's Poisson accounting of the same mechanism equals both."""
    from dp_accounting.pld import privacy_loss_distribution

    z, q, rounds, delta = 0.76, 0.01, 1000, 1e-6
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=z, sensitivity=1, sampling_prob=q
    ).self_compose(rounds)
    ledger = privacy.plan(rounds, 0, 0, "poisson", rate=q)
    found = privacy.epsilons(z, ledger, delta, "poisson")
    assert found["pld"] == pytest.approx(pld.get_epsilon_for_delta(delta), rel=1e-2)
    rdp = direct([(poisson(z, q), rounds)], "ADD_OR_REMOVE_ONE", "rdp", delta)
    assert found["rdp"] == pytest.approx(rdp, rel=1e-9)


def test_calibration_uses_the_tighter_accountant():
    """Poisson at epsilon 4: PLD is the tighter, so the calibrated z spends 4 by PLD (and more
    by RDP); the smallest such z."""
    z = privacy.noise_for_epsilon(4.0, 60, 60, 300, 1e-4, sampling="poisson")
    ledger = privacy.plan(60, 60, 300, "poisson")
    pld = privacy.spent(z, ledger, 1e-4, "poisson", "pld")
    rdp = privacy.spent(z, ledger, 1e-4, "poisson", "rdp")
    assert pld <= 4.0 < rdp
    assert privacy.spent(z * 0.99, ledger, 1e-4, "poisson", "pld") > 4.0


def test_an_old_checkpoints_ledger_is_read_as_the_population_it_was_fixed_to():
    mech = Mechanism(DPSettings(mode="central", clip=1.0, noise=1.5))
    mech.start(population=10, sample=3, rounds=4)
    state = {k: v for k, v in mech.__dict__.items() if k not in ("amplified", "current", "rate")}
    state["ledger"] = {3: 2}  # pflower <= 0.x: rounds by sample size
    old = Mechanism.__new__(Mechanism)
    old.__setstate__(state)
    assert old.ledger == {(0.3, 3, 10): 2} and old.amplified
    old.released([1, 2, 3])
    assert old.epsilon == pytest.approx(privacy.epsilon_of(1.5, 3, 3, 10, 1e-5))


# --- adaptive clipping's constraint (Flower: z < 2 s) ----------------------------------------
def test_adaptive_clipping_with_a_large_noise_runs_with_the_count_noise_it_needs():
    """The sweep's z = 6.75 and 22.5 at m = 60 (Flower's m / 20 = 3 would raise): the count's
    noise becomes z, the updates' multiplier (z^-2 - (2 z)^-2)^-1/2 = 2 z / sqrt(3)."""
    for z in (6.746, 22.53):
        dp = DPSettings(mode="central", clip=1.0, noise=z, adaptive=True, delta=1e-4)
        mech = Mechanism(dp)
        mech.start(population=300, sample=60, rounds=60)
        assert mech.count_std == z
        d = 100_000
        out = mech.mean([{"w": np.zeros(d)}] * 60, 60, np.random.default_rng(3))["w"]
        expected = (2 * z / math.sqrt(3)) * 1.0 / 60
        assert abs(out.std() / expected - 1) < 5 / math.sqrt(2 * d)
    # where Flower's default works, it is Flower's: m / 20
    mech = Mechanism(DPSettings(mode="central", clip=1.0, noise=2.0, adaptive=True))
    mech.start(population=300, sample=60, rounds=60)
    assert mech.count_std == 3.0


def test_adaptive_clipping_that_cannot_run_is_refused_before_any_update():
    from pflower.settings import ConfigError

    keys = {"dp": "central", "dp-noise": 0.6, "dp-adaptive-clip": True}
    with pytest.raises(ConfigError, match=r"'dp-noise' = 0.6, 'dp-clip-count-stddev' = 0.2"):
        Config.from_run_config({**keys, "dp-clip-count-stddev": 0.2})
    Config.from_run_config(keys)  # the count noise chosen so it works
    Config.from_run_config({**keys, "dp-clip-count-stddev": 0.31})
    # a calibrated z is known at the first round only: refused there, naming the values
    dp = DPSettings(mode="central", epsilon=1.0, delta=1e-4, adaptive=True, count_stddev=1.0)
    with pytest.raises(ConfigError, match=r"'dp-clip-count-stddev' = 1: .*\(z < 2 s; 60 clients"):
        Mechanism(dp).start(population=300, sample=60, rounds=60)


def test_adaptive_clipping_at_a_large_noise_completes_a_run(tmp_path):
    """The issue's config (dp-noise 0.6 with m = 3: z >= m / 10) crashed at the first
    aggregation; now it runs."""
    run = {
        **BASE,
        "algorithm": "fedavg",
        "dp": "central",
        "dp-noise": 0.6,
        "dp-adaptive-clip": True,
        "outputs-dir": str(tmp_path),
    }
    report = run_local(run, NODES)
    assert len([r for r in report.rounds if "dp-epsilon" in r.train]) == 3


# --- the empirical check: one-shot canaries (Andrew et al. 2024) -----------------------------
@pytest.mark.parametrize("mu,delta", [(0.5, 1e-5), (2.0, 1e-5), (4.0, 1e-6)])
def test_the_gaussian_pair_epsilon_equals_gdp_for_equal_variances(mu, delta):
    sigma = 0.013
    found = privacy.gaussian_pair_epsilon((mu * sigma, sigma), (0.0, sigma), delta)
    assert found == pytest.approx(gdp_epsilon(mu, delta), rel=1e-3)


def test_the_gaussian_pair_epsilon_integrates_unequal_variances():
    """delta(eps) = integral of (p - e^eps q)_+, by a fine Riemann sum here, both ways."""
    p, q, delta = (0.3, 1.2), (0.0, 1.0), 1e-4
    eps = privacy.gaussian_pair_epsilon(p, q, delta)
    x = np.linspace(-30, 30, 2_000_001)

    def pdf(x, mean, std):
        return np.exp(-0.5 * ((x - mean) / std) ** 2) / (std * math.sqrt(2 * math.pi))

    def delta_at(e):
        a, b = pdf(x, *p), pdf(x, *q)
        dx = x[1] - x[0]
        return max(
            np.sum(np.maximum(a - math.exp(e) * b, 0)) * dx,
            np.sum(np.maximum(b - math.exp(e) * a, 0)) * dx,
        )

    assert delta_at(eps) == pytest.approx(delta, rel=1e-2)
    assert delta_at(eps * 0.98) > delta
    # both ways: the epsilon of the pair does not depend on its order
    assert privacy.gaussian_pair_epsilon(q, p, delta) == pytest.approx(eps, rel=1e-3)


def canary_run(noise: float, rounds: int = 10, canaries: int = 200, d: int = 10_000):
    """The mechanism alone: m = 10 of N = 40 clients with updates in a fixed direction each
    round, ``canaries`` canaries, the server step theta -= mean; returns (estimate, bound)."""
    dp = DPSettings(mode="central", clip=1.0, noise=noise, seed=3, canaries=canaries)
    mech = Mechanism(dp)
    mech.start(population=40, sample=10, rounds=rounds)
    theta = {"w": np.zeros(d)}
    signal = np.random.default_rng(9).standard_normal(d)
    for r in range(rounds):
        mech.check(list(range(10)), 40)
        mech.observe(theta)
        updates = [{"w": signal * (1 + 0.1 * i)} for i in range(10)]
        mean = mech.mean(updates, 10, privacy.noise_rng(3, r))
        theta = {"w": theta["w"] - mean["w"]}
        mech.released(list(range(10)), theta)
    return mech.canary_epsilon, mech.epsilon


def test_the_canary_estimate_stays_below_the_bound_and_catches_a_missing_noise():
    """z = 2, 10 rounds of 10 of 40: bound 9.7 (replace-one), estimates 2.7-3.6 over seeds;
    without noise the canaries' cosines stand 30 null standard deviations out."""
    estimate, bound = canary_run(noise=2.0)
    assert 0 <= estimate < bound / 2
    planted, _ = canary_run(noise=0.0)  # the noise skipped: the canaries stand out
    assert planted > bound


def test_the_canary_estimate_of_a_small_run(tmp_path, monkeypatch):
    """Through the server: 200 canaries in a run at z = 2: the estimate is reported and below
    the bound; with the noise skipped it exceeds it."""
    run = {
        **BASE,
        "algorithm": "fedavg",
        "num-server-rounds": 4,
        "dp": "central",
        "dp-noise": 2.0,
        "dp-canaries": 200,
        "dp-noise-seed": 4,
    }
    report = run_local({**run, "outputs-dir": str(tmp_path / "a")}, NODES)
    spent = report.privacy
    assert spent["canaries"] == 200 and 0 <= spent["canary-epsilon"] < spent["epsilon"]
    monkeypatch.setattr(privacy, "compute_stdv", lambda *args: 0.0)
    report = run_local({**run, "outputs-dir": str(tmp_path / "b")}, NODES)
    assert report.privacy["canary-epsilon"] > report.privacy["epsilon"]


def test_the_summary_states_every_accountant(tmp_path):
    from pflower.report.terminal import privacy_line

    run = {**BASE, "algorithm": "fedavg", "dp": "central", "dp-noise": 1.0}
    report = run_local({**run, "outputs-dir": str(tmp_path)}, NODES)
    spent = report.privacy
    assert set(spent["epsilon-by-accountant"]) == {"rdp"}
    assert set(spent["comparison-poisson-add-remove"]) == {"rdp", "pld", "note"}
    assert spent["amplified"] is True and "replace-one" in spent["sampling"]
    line = privacy_line(report)
    assert "RDP" in line and "had it been Poisson" in line and "PLD" in line


@pytest.mark.parametrize(
    "keys,match",
    [
        ({"dp": "local", "dp-noise": 1.0, "dp-sampling": "poisson"}, "'dp-sampling'"),
        ({"dp": "local", "dp-noise": 1.0, "dp-canaries": 10}, "'dp-canaries'"),
        ({"dp": "central", "dp-noise": 1.0, "dp-sampling": "uniform"}, "'dp-sampling'"),
    ],
)
def test_new_dp_keys_refuse_what_they_cannot_do(keys, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_run_config(keys)
