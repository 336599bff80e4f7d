"""The step bound (``robust-step-bound``, ``combine.StepBound``): a round's combined update
at most c x the median norm of the last applied ones, so that a round a Byzantine majority
takes (every per-round rule follows it) moves theta by a bounded step."""

from __future__ import annotations

import numpy as np
import pytest

from pflower.config import Config, ConfigError
from pflower.settings import RunSettings
from pflower.strategies import pipeline as pipelines
from pflower.strategies.combine import StepBound
from pflower.strategies.rounds import Round


def norm(v: dict) -> float:
    return float(np.sqrt(sum(np.sum(np.asarray(a, np.float64) ** 2) for a in v.values())))


def test_the_bound_is_c_times_the_median_of_the_applied_norms():
    bound = StepBound(3.0)
    steps = [{"w": np.array([n, 0.0])} for n in (1.0, 2.0)]
    for step in steps:  # the first two rounds have no history to judge by
        out, scaled = bound("arrays", step)
        assert out is step and not scaled
    out, scaled = bound("arrays", {"w": np.array([0.0, 12.0])})  # median(1, 2) = 1.5: <= 4.5
    assert scaled and out["w"].tolist() == [0.0, 4.5]
    out, scaled = bound("arrays", {"w": np.array([3.0, 4.0])})  # median(1, 2, 4.5) = 2: 5 <= 6
    assert not scaled and out["w"].tolist() == [3.0, 4.0]
    assert bound.norms["arrays"] == [1.0, 2.0, 4.5, 5.0]  # what was applied
    out, scaled = bound("pretrain", {"w": np.array([100.0, 0.0])})  # a kind of its own
    assert not scaled
    with pytest.raises(ValueError, match="factor"):
        StepBound(0.5)
    with pytest.raises(ConfigError, match="robust-step-bound"):
        Config.from_run_config({"robust-step-bound": 0.5})


@pytest.mark.parametrize("rule", ["adaptive-clipping", "median"])
def test_a_round_a_byzantine_majority_takes_moves_theta_by_a_bounded_step(rule):
    """Rounds of 5 replies: 4 honest rounds (updates of norm ~1), then one in which 3 of the
    5 send one vector of norm 1000 (IPM's -100 mu). The default defence's centre is theirs
    and its radius 0 (three replies at distance 0), the coordinate median is theirs: the
    round applies their vector whole. With the step bound c = 2 its norm is at most 2 x the
    median applied norm. (At the defaults the default defence counts the three copies as one
    reply, ``robust-copy-votes``, and the round is not taken: shown last; the step bound is
    shown without it, against a majority the copies' rule cannot see.)"""
    rng = np.random.default_rng(0)
    keys = {"robust-aggregator": rule, "robust-byzantine": 2, "robust-clip-factor": 1.0}
    keys["robust-copy-votes"] = False
    settings = RunSettings.model_validate(keys)
    f = 2 if rule == "median" else 0
    honest = [[{"w": rng.normal(size=50) / np.sqrt(50) + 0.3} for _ in range(5)] for _ in range(4)]
    attack = {"w": np.full(50, -1000 / np.sqrt(50))}
    taken = [*[{"w": rng.normal(size=50) / np.sqrt(50)} for _ in range(2)], *[attack] * 3]
    results = {}
    for c in (0.0, 2.0):
        pipe = pipelines.build(settings, {}, seed=0, byzantine=f, step_bound=c)
        applied = []
        for number, vectors in enumerate([*honest, taken], 1):
            rnd = Round(number, kind="arrays", weights=False, current={"w": np.zeros(50)})
            rnd.nodes = list(range(5))
            applied.append(norm(pipe.combine(rnd, vectors, [1.0] * 5)))
        results[c] = applied
    assert results[0.0][-1] > 900  # the attackers' vector, whole
    assert results[2.0][:-1] == results[0.0][:-1]  # honest rounds untouched
    assert results[2.0][-1] == pytest.approx(2 * np.median(results[0.0][:-1]), rel=1e-9)
    if rule == "adaptive-clipping":  # copies counted once: the two honest replies outvote them
        default = RunSettings.model_validate({**keys, "robust-copy-votes": True})
        pipe = pipelines.build(default, {}, seed=0, byzantine=f)
        rnd = Round(5, kind="arrays", weights=False, current={"w": np.zeros(50)})
        rnd.nodes = list(range(5))
        assert norm(pipe.combine(rnd, taken, [1.0] * 5)) < 2 * max(results[0.0][:-1])
        assert rnd.shared["arrays"] == 3


def test_ffgg_default_defence_bounds_its_steps_and_nothing_else_does():
    """``robust-step-bound = "auto"``: 2 under FFGG's default defence, off for every other
    algorithm, for FFGG beside a rule the run names or DP (as a named rule keeps its own
    keys), and for BR-FFGG (its paper's rule alone); a set value is taken as set."""
    from pflower.strategies import make_strategy
    from pflower.strategies.aggregators import GeometricMedian
    from pflower.strategies.fedalt import FedAlt
    from pflower.strategies.ffgg import FFGG

    def factor(keys: dict) -> float:
        step = make_strategy(Config.from_run_config(keys)).pipeline.combine.step
        return step.factor if step is not None else 0.0

    assert Config.from_run_config({"algorithm": "ffgg"}).robust_step_bound == 2.0
    assert factor({"algorithm": "ffgg"}) == 2.0
    for keys in (
        {"algorithm": "fedavg"},
        {"algorithm": "pflego"},
        {"algorithm": "local-ffgg"},
        {"algorithm": "br-ffgg"},
        {"algorithm": "ffgg", "robust-aggregator": "adaptive-clipping"},
        {"algorithm": "ffgg", "robust-aggregator": "geometric-median"},
        # under local DP the clip is the defence, as for the others (not FFGG's rule)
        {"algorithm": "ffgg", "dp": "local", "dp-clip": 0.5, "dp-noise": 1.0},
    ):
        assert factor(keys) == 0.0, keys
    assert factor({"algorithm": "fedalt", "robust-step-bound": 3.0}) == 3.0
    assert factor({"algorithm": "ffgg", "robust-step-bound": 0}) == 0.0
    # a strategy built by hand runs what the app runs, and a rule given by hand its own keys
    assert FFGG().pipeline.combine.step.factor == 2.0
    assert FFGG(robust=GeometricMedian()).pipeline.combine.step is None
    assert FedAlt().pipeline.combine.step is None
    from pflower.strategies.privacy import DPSettings

    local = {"algorithm": "ffgg", "dp": "local", "dp-clip": 0.5, "dp-noise": 1.0}
    assert FFGG(privacy=DPSettings.of(Config.from_run_config(local))).pipeline.combine.step is None
    with pytest.raises(ConfigError, match="robust-step-bound"):
        Config.from_run_config({"robust-step-bound": -1})
    with pytest.raises(ConfigError) as refused:  # one line, in words
        Config.from_run_config({"robust-step-bound": "big"})
    assert str(refused.value) == (
        "invalid run config: key 'robust-step-bound' = 'big': must be a number or 'auto'"
    )


def test_ffgg_steps_do_not_run_away_after_a_poisoned_round():
    """What the bound is for, on FFGG's own pipeline at its defaults: rounds of 5 gradients
    of norm ~0.5, then the rounds after θ was moved into a steep region, whose honest
    gradients are 15-40 x larger (the Min-Sum run of seed 0 at 2 of 10: 0.3 -> 3.6 -> 12.7).
    Unbounded the geometric median applies them whole; bounded each applied step is at most
    2 x the median of the last applied ones, by a reference of its own (norms taken by hand),
    and the honest rounds before are untouched."""
    from pflower.strategies.ffgg import FFGG

    rng = np.random.default_rng(3)
    calm = [[{"g": rng.normal(size=40) * 0.08 + 0.02} for _ in range(5)] for _ in range(6)]
    steep = [[{"g": rng.normal(size=40) * s + s / 2} for _ in range(5)] for s in (1.0, 2.5, 0.9)]
    applied = {}
    for bound in (None, 0.0):
        pipe = (FFGG() if bound is None else FFGG(step_bound=bound)).pipeline
        out = []
        for number, vectors in enumerate([*calm, *steep], 1):
            rnd = Round(number, kind="gradient", weights=False, current={"g": np.zeros(40)})
            rnd.nodes = list(range(5))
            out.append(norm(pipe.combine(rnd, vectors, [1.0] * 5)))
        applied[bound] = out
    bounded, free = applied[None], applied[0.0]
    assert min(free[6:]) > 5 * max(free[:6])  # the run-away, unbounded
    expected = []  # the bound by hand: each round's unbounded step, cut to 2 x the median
    for step in free:  # of the last 10 applied (rounds 1-2: no history yet)
        past = expected[-10:]
        expected.append(min(step, 2.0 * float(np.median(past))) if len(past) >= 2 else step)
    assert bounded[:6] == free[:6]  # the calm rounds untouched
    assert bounded == pytest.approx(expected, rel=1e-9)
    assert max(bounded[6:]) <= 2.0 * max(free[:6]) * 1.5
